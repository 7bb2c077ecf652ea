"""``dcp.save`` for a checkpointer that saves the same state again and again, without two per-save costs.

* **Planning.** DCP gathers every rank's plan (one item per tensor, pickled) on the coordinator, which builds
  the global plan and the metadata and scatters the plans back, at every save. The state's structure rarely
  changes between saves, so :class:`CachedSavePlanner` turns DCP's own plan caching on
  (``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose plan did not change sends an empty one and
  the coordinator reuses the global plan and metadata it cached. DCP keys that cache by planner *class name*
  in class-level dicts, so two managers in a process (or two writers of one manager) would share it; each
  planner here has a key of its own, and :meth:`CachedSavePlanner.forget` drops it. DCP still builds every
  rank's local plan again at each save only to compare it with the cached one (about 40 us a tensor); the planner
  skips that while the state's layout (keys, shapes, dtypes, addresses) is the one the cached plan was made from.
* **Per-key telemetry.** ``dcp.save`` wraps the ``state_dict()`` call of every top-level key in a logging
  decorator that builds a message dict (a uuid, the group's ranks) even when nothing logs it. Our states are
  flat (one key per leaf, Stateful objects already replaced), so that was one wrapper per tensor; :func:`save`
  calls DCP's planning-and-writing function directly.

The files written are the same DCP files: only how the plan is agreed changes.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from resilient.checkpoint.api import CheckpointError

logger = logging.getLogger(__name__)

_KEYS = itertools.count()
# DCP's class-level caches, all keyed by the planner's cache key
_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
           "_cached_metadata")

try:  # a private function of DCP: fall back to the public call where a torch lacks it
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
except ImportError:  # pragma: no cover - torch 2.13 has it
    _save_state_dict = None


class CachedSavePlanner(DefaultSavePlanner):
    """DCP's default planner with plan caching under a key of its own (``name``: what it saves, for errors)."""

    def __init__(self, name: str) -> None:
        super().__init__(enable_plan_caching=True)
        self.name = name
        self._cached_plans_key = f"resilient:{name}:{next(_KEYS)}"
        self._layout: list[tuple[Any, ...]] | None = None  # what the cached local plan was made from

    def create_local_plan(self) -> SavePlan:
        # DCP builds every write item again at each save (about 40 us a tensor) only to find the plan equal to the
        # cached one; tensors at the same addresses with the same shapes and dtypes make the same plan
        layout = _layout(self.state_dict)
        if (layout is not None and layout == self._layout
                and self._cached_plans_key in SavePlanner._cached_save_plan):
            self.plan = SavePlanner._cached_save_plan[self._cached_plans_key]
            return SavePlan([], usable=False)
        self._layout = layout
        return super().create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        # a rank that kept its cache while the coordinator lost its own (a failed save on one side) sends an
        # empty plan that DCP would take as "this rank saves nothing": the metadata would miss its tensors
        if self._cached_plans_key not in SavePlanner._cached_all_plans and not all(p.usable for p in all_plans):
            raise CheckpointError(f"{self.name}: ranks {[i for i, p in enumerate(all_plans) if not p.usable]} "
                                  "sent a cached save plan the coordinator does not hold; the next save plans "
                                  "afresh on every rank")
        return super().create_global_plan(all_plans)

    def forget(self) -> None:
        """Drop this planner's cached plans (after a failed save, so every rank plans afresh; at close)."""
        self._layout = None
        for attr in _CACHES:
            getattr(SavePlanner, attr).pop(self._cached_plans_key, None)


def _layout(state: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """What a flat state's DCP write items are made of (``create_default_local_save_plan``): per key, for a plain
    tensor its shape, dtype, layout, ``requires_grad`` and whether it is pinned, the last through its address (a
    call to ``is_pinned`` costs more than the item; the same address is the same allocation, pinned or not; an
    empty tensor has no address to go by, so it is asked); for any other value the key alone (one bytes item).
    None when a value is a tensor subclass (DTensor: its chunks depend on its mesh): DCP then plans as always."""
    out: list[tuple[Any, ...]] = []
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                return None
            pinned = v.data_ptr() if v.numel() else v.is_pinned()
            out.append((k, pinned, v.dtype, v.shape, v.layout, v.requires_grad))
        else:
            out.append((k,))
    return out


def save(state: dict[str, Any], writer: Any, planner: CachedSavePlanner, process_group: Any,
         no_dist: bool) -> Any:
    """``dcp.save(state, storage_writer=writer, planner=planner, ...)`` for a flat state (no Stateful
    values): the same files and metadata. On any failure the planner forgets its cache."""
    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    try:
        if _save_state_dict is None:  # pragma: no cover
            return dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group,
                            no_dist=no_dist)
        return _save_state_dict(state_dict=state, storage_writer=writer, process_group=process_group,
                                no_dist=no_dist, planner=planner)
    except BaseException:
        planner.forget()
        raise
