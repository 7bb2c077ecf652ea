"""Where checkpoint bytes live: the tiers (a directory, an fsspec store, every store call bounded in time),
part objects and their senders (``parts``), retention, bounded collectives (``collective``) and the
per-manager :class:`~resilient.checkpoint.storage.context.Context` the components share. Imports ``format``."""
