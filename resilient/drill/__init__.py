"""Drills (``--inject``): faults carried out for real, each written to the ledger as ``fault_injected`` before
it happens.

* :mod:`resilient.drill.spec` — the vocabulary, pure: ``FaultSpec``/``parse_inject`` for ``--inject``,
  ``WorkerFault``/``plan_env`` for the plan handed to workers in ``env.FAULTS``.
* :mod:`resilient.drill.agent` — time-based faults, carried out by the agent holding the target, for any
  script: SIGKILL or SIGSTOP of a worker, deletion of the node's local tier, SIGKILL of a whole node.
* :mod:`resilient.drill.worker` — step-based and in-step faults, carried out in the worker by
  ``resilient.steps()`` (or a script's own ``maybe_fail``).
* :mod:`resilient.drill.hooks` — checkpoint faults (mid-write, mid-upload, after a save, a lost disk).

The drill may import :mod:`resilient.worker`; the worker runtime never imports the drill (it loads
``drill.worker`` by name only when a plan is in the environment, and that module plugs in as a step hook).
Importing this package imports none of its modules; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FaultHow": "resilient.drill.spec", "FaultKind": "resilient.drill.spec", "FaultSpec": "resilient.drill.spec",
    "FaultSpecError": "resilient.drill.spec", "WorkerFault": "resilient.drill.spec",
    "parse_inject": "resilient.drill.spec", "plan_env": "resilient.drill.spec",
    "InjectedFault": "resilient.drill.worker", "fail_at": "resilient.drill.worker",
    "maybe_fail": "resilient.drill.worker",
    "arm_checkpoint_faults": "resilient.drill.hooks", "after_save": "resilient.drill.hooks",
    "settle": "resilient.drill.hooks",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'resilient.drill' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
