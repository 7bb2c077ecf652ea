"""Multi-tier asynchronous checkpointing: stage → local → peer → persistent, restore from the fastest
verified tier.

Public entry point: :class:`resilient.checkpoint.manager.CheckpointManager` (also ``resilient.CheckpointManager``);
the contract (layout, errors, the Tier protocol) is in :mod:`resilient.checkpoint.api`; ``resilient ckpt ls|verify``
is :mod:`resilient.checkpoint.cli`. Nothing is imported here, so ``import resilient`` stays cheap.
"""
