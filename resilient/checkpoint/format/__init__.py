"""What a checkpoint is at rest, with no I/O policy: step and file names (``layout``), checksums of files and
blocks (``digests``), byte ranges (``spans``), the state tree DCP saves (``state``), the item codec
(``codec``) and the restricted unpicklers (``safe``). Imports only :mod:`resilient.checkpoint.api`."""
