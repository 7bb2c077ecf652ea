"""Multi-tier asynchronous checkpointing: stage → local → peer → persistent, restore from the fastest
verified tier.

Public entry point: :class:`CheckpointManager` (``from resilient.checkpoint import CheckpointManager``, also
``resilient.CheckpointManager``); the contract (layout, errors, the Tier protocol) is in
:mod:`resilient.checkpoint.api`; ``resilient ckpt ls|verify|export`` is :mod:`resilient.checkpoint.cli`.

Sub-packages, each importing only those before it: ``format`` (what a step is at rest) ← ``storage`` (tiers,
parts, bounded store calls) ← ``replicate`` (peer copies), ``upload`` (the persistent tier's upload) ←
``restore`` ← ``save`` (the manager). Nothing is imported here until asked for, so ``import resilient``
stays cheap.
"""

from typing import Any

__all__ = ["CheckpointManager"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from resilient.checkpoint.save.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
