"""Helpers shared by the trainer integrations: whole trainer checkpoints through ``CheckpointManager``.

A trainer's checkpoint is a nested dict whose shape is known only once it exists (optimizer state appears
after the first step, loops and callbacks add keys). Restoring it needs no template: the manager fills an
empty dict from what the checkpoint holds, and a *skeleton* saved beside it puts lists and empty containers
back where they were (DCP flattens lists into numbered keys).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

TREE = "tree"
SKELETON = "skeleton"
_LEAF = "v"
_DICT = "d"
_LIST = "l"


def _descends(v: Any) -> bool:
    """DCP's traversal rule (mirrors ``resilient.checkpoint.stage``): mappings always, lists only when they
    hold tensors or containers; tuples and everything else are leaves."""
    if isinstance(v, Mapping):
        return True
    if not isinstance(v, list):
        return False
    return any(isinstance(e, torch.Tensor) or (isinstance(e, (Mapping, list)) and _descends(e)) for e in v)


def skeleton(v: Any) -> tuple:
    """The container shape of ``v`` as nested tuples (picklable, small, the same on every rank)."""
    if isinstance(v, Mapping):
        return (_DICT, tuple((k, skeleton(x)) for k, x in v.items()))
    if _descends(v):
        return (_LIST, tuple(skeleton(x) for x in v))
    return (_LEAF,)


def _key(k: Any) -> Any:
    # the manager turns numbered keys back into ints; a str key that looks like a number comes back as int
    return int(k) if isinstance(k, str) and k.isdigit() else k


def _get(d: Any, k: Any) -> Any:
    if not isinstance(d, Mapping):
        return None
    for cand in (k, _key(k), str(k)):
        if cand in d:
            return d[cand]
    if isinstance(k, str) and "." in k:
        # a key with dots ("net.0.weight") comes back split into nested dicts
        cur = d
        for part in k.split("."):
            if not isinstance(cur, Mapping):
                return None
            cur = cur.get(_key(part), cur.get(part))
        return cur
    return None


def rebuild(value: Any, skel: tuple) -> Any:
    kind = skel[0]
    if kind == _DICT:
        return {k: rebuild(_get(value, k), s) for k, s in skel[1]}
    if kind == _LIST:
        return [rebuild(_get(value, i), s) for i, s in enumerate(skel[1])]
    return value


def pack(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {TREE: tree, SKELETON: skeleton(tree)}


def unpack(packed: Mapping[str, Any]) -> Any:
    if SKELETON not in packed:
        raise ValueError("this checkpoint has no skeleton entry: it was not written by a resilient integration")
    return rebuild(packed.get(TREE, {}), packed[SKELETON])


def empty_packed() -> dict[str, Any]:
    """A restore target: filled from whatever the checkpoint holds."""
    return {TREE: {}, SKELETON: None}


def rng_state() -> dict[str, Any]:
    """This process's RNG states (per rank: the manager keeps one copy per rank when they differ)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(st: Mapping[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def manager_from(manager: Any, options: Mapping[str, Any]) -> Any:
    """The given manager, or one from the launcher's ``RESILIENT_CKPT_*`` flags (collective when a process
    group exists: every rank calls it at the same point)."""
    if manager is not None:
        return manager
    from resilient.checkpoint.save.manager import CheckpointManager

    return CheckpointManager.from_env(**dict(options))


class LazyState:
    """A Stateful the manager asks for ``state_dict()`` only when a save is due (building a trainer's full
    checkpoint is not free); it is never restored into: ``restore_hint`` says what restores instead."""

    def __init__(self, dump: Callable[[], Mapping[str, Any]], restore_hint: str) -> None:
        self._dump = dump
        self._hint = restore_hint

    def state_dict(self) -> dict[str, Any]:
        return pack(self._dump())

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:  # pragma: no cover - never restored into
        raise RuntimeError(f"restore through {self._hint}")
