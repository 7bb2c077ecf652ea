"""resilient: keep large PyTorch training jobs productive through failures.

Importing this package is cheap: the heavy parts load on first use, so a worker that never
checkpoints never imports the checkpointer.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "resilient.checkpoint.manager",
    "steps": "resilient.worker.steps",
    "section": "resilient.worker.steps",
    "on_scale": "resilient.worker.steps",
    "ScaleEvent": "resilient.worker.steps",
    "Event": "resilient.events.api",
    "EventKind": "resilient.events.api",
    "Ledger": "resilient.events.ledger",
    "ElasticBatch": "resilient.data",
}

# imported now, not lazily: the submodule's name is also the function's, and a later first import of the
# submodule would bind the module where the function belongs (the module needs nothing heavy)
from resilient.topology import Topology, topology  # noqa: E402

__all__ = sorted(_LAZY) + ["Topology", "topology"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
