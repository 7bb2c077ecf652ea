"""The state tree as DCP saves it: which leaves are stateful objects, the flattening DCP uses
(``"model.layer.weight"``, so a checkpoint written from our flat dict is read by a plain ``dcp.load`` of the
user's nested dict), and setting a value back at its path."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch


logger = logging.getLogger(__name__)


Path_ = tuple[Any, ...]


_DTENSOR: list[Any] = []


def dtensor_type() -> Any:
    """``torch.distributed.tensor.DTensor``, or None for a torch without it (whose states hold none)."""
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:
            DTensor = None  # type: ignore[assignment,misc]
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def local_tensor(v: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()`` under no_grad), else ``v``: without the autograd function
    ``to_local()`` applies each call (~20 us, paid per tensor per save and restore of an FSDP2 or TP state)."""
    dt = dtensor_type()
    if dt is None or type(v) is torch.Tensor or not isinstance(v, dt):
        return v
    local = getattr(v, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    with torch.no_grad():
        return v.to_local()


def param_like(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Checkpoint key prefix (``optim.state.3``) -> the DTensor or GPU parameter of an optimizer in ``state``.

    A fresh optimizer's state is empty, so a restore makes its targets itself; for a DTensor parameter (FSDP2,
    tensor parallelism) they must be DTensors placed like the parameter, or the first step mixes DTensors with
    plain tensors; for a parameter on a GPU they are made there, so the bytes go to the device once
    (``load_state_dict`` would copy a host target to the device again, from pageable memory). The ids follow
    ``Optimizer.state_dict``: parameters numbered in ``param_groups`` order."""
    dt = dtensor_type()
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if not isinstance(v, torch.optim.Optimizer):
            continue
        params = [p for g in v.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            if (dt is not None and isinstance(p, dt)) or (isinstance(p, torch.Tensor) and p.is_cuda):
                out[f"{k}.state.{i}"] = p
    return out


def is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level Stateful objects replaced by their ``state_dict()`` (as ``dcp.save`` does)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of str -> tensor/Stateful/value, got {type(state).__name__}")
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}


def _terminal(v: Any) -> bool:
    """DCP's rule (``_traverse.traverse_state_dict``): mappings are traversed; a list only when it holds
    tensors, mappings or such lists; tuples and everything else are leaves."""
    if isinstance(v, Mapping):
        return False
    if not isinstance(v, list):
        return True
    return not any(isinstance(e, torch.Tensor) or (isinstance(e, (Mapping, list)) and not _terminal(e))
                   for e in v)


def _descend(v: Any) -> bool:
    return not _terminal(v)


def flatten(obj: Mapping[str, Any]) -> dict[str, tuple[Path_, Any]]:
    """fqn -> (path of original keys, leaf). Leaves are tensors or opaque objects."""
    out: dict[str, tuple[Path_, Any]] = {}

    def rec(v: Any, path: Path_) -> None:
        # a plain dict and a tensor are told apart before the abstract Mapping check (thousands of leaves)
        if type(v) is dict or (not isinstance(v, torch.Tensor) and isinstance(v, Mapping)):
            items = v.items()
        elif path and not isinstance(v, torch.Tensor) and _descend(v):
            items = enumerate(v)  # type: ignore[arg-type]
        else:
            fqn = ".".join(str(p) for p in path)
            if fqn in out:
                raise ValueError(f"two state entries flatten to the same key {fqn!r}; rename one")
            out[fqn] = (path, v)
            return
        if path and not v and isinstance(v, Mapping):
            out[".".join(str(p) for p in path)] = (path, v)  # keep empty dicts (e.g. fresh optimizer state)
            return
        for k, x in items:
            rec(x, path + (k,))

    rec(obj, ())
    return out


def set_path(root: Any, path: Path_, value: Any) -> None:
    cur = root
    for p in path[:-1]:
        cur = cur[p]
    if isinstance(cur, tuple):
        return  # immutable container: tensors inside were loaded in place
    cur[path[-1]] = value


def leaf_nbytes(v: Any) -> int:
    """Bytes of a leaf this rank holds: a DTensor's local shard, not the whole tensor it is part of."""
    if isinstance(v, torch.Tensor):
        v = local_tensor(v)  # no autograd node for a count
        return v.numel() * v.element_size()
    return 0
