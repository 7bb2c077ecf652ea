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
* **Agreement.** Even with plans cached, every save gathers every rank's write results on the coordinator and
  broadcasts the finished metadata back (both pickled, one entry per tensor), under the GIL of the process that trains:
  measured, a third of the checkpoint thread's hold of the GIL a save, which a GPU job's launch-bound training thread
  waits out. When the plan was reused and a rank's writer laid its file out as at the last save (the same write
  results: names, offsets, lengths), the metadata is the last save's: :func:`save` then agrees that in small
  tensor all-reduces (no pickling; gloo waits outside the GIL) and the coordinator writes ``.metadata`` from the
  results it kept (``_save_unchanged``), as DCP's ``finish`` would from gathered ones. Any difference, any rank not
  ready, any failure: DCP's own path, as before (the failures' texts travel as objects, on that path alone).
* **Per-key telemetry.** ``dcp.save`` wraps the ``state_dict()`` call of every top-level key in a logging
  decorator that builds a message dict (a uuid, the group's ranks) even when nothing logs it. Our states are
  flat (one key per leaf, Stateful objects already replaced), so that was one wrapper per tensor; :func:`save`
  calls DCP's planning-and-writing function directly.

The files written are the same DCP files: only how the plan is agreed changes.
"""

from __future__ import annotations

import itertools
import logging
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from resilient.checkpoint.api import CheckpointError
from resilient.checkpoint.format import rank_index
from resilient.checkpoint.format.state import dtensor_type, local_tensor
from resilient.checkpoint.save.writer import RecordMemo

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
        # the last save planned through DCP: this rank's write results, and (coordinator) every rank's
        self._results: list[Any] | None = None
        self._all_results: list[list[Any]] | None = None
        self.short_saves = 0  # saves whose metadata was agreed without DCP's gathers (``_save_unchanged``)
        # the record writer's per-tensor records of the last write of this planner's plan (``save/writer.py``)
        self.records = RecordMemo()
        # this rank's own entries of the last metadata DCP finished (``format/rank_index.py``), pickled; a save that
        # reused the plan and the results keeps it (the same items at the same places)
        self.index: bytes | None = None

    def create_local_plan(self) -> SavePlan:
        # DCP builds every write item again at each save (about 40 us a tensor) only to find the plan equal to the
        # cached one; tensors at the same addresses with the same shapes and dtypes make the same plan
        layout = _layout(self.state_dict)
        if (layout is not None and layout == self._layout
                and self._cached_plans_key in SavePlanner._cached_save_plan):
            self.plan = SavePlanner._cached_save_plan[self._cached_plans_key]
            return SavePlan([], usable=False)
        self._layout = layout
        self.records.clear()  # they hold the tensors of the old layout
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
        self._results = self._all_results = None
        self.index = None
        self.records.clear()
        for attr in _CACHES:
            getattr(SavePlanner, attr).pop(self._cached_plans_key, None)


def _layout(state: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """What a flat state's DCP write items are made of (``create_default_local_save_plan``): per key, for a plain
    tensor its shape, dtype, layout, ``requires_grad`` and whether it is pinned, the last through its address (a
    call to ``is_pinned`` costs more than the item; the same address is the same allocation, pinned or not; an
    empty tensor has no address to go by, so it is asked); for a DTensor also its mesh, placements and global
    shape (its chunk's offsets and sizes follow from them), the rest taken from its local shard; for any other
    value the key alone (one bytes item). None for another tensor subclass: DCP then plans as always."""
    out: list[tuple[Any, ...]] = []
    dt = dtensor_type()
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            if type(v) in (torch.Tensor, torch.nn.Parameter):
                pinned = v.data_ptr() if v.numel() else v.is_pinned()
                out.append((k, pinned, v.dtype, v.shape, v.layout, v.requires_grad))
            elif dt is not None and type(v) is dt:
                local = local_tensor(v)
                if type(local) not in (torch.Tensor, torch.nn.Parameter):
                    return None
                pinned = local.data_ptr() if local.numel() else local.is_pinned()
                out.append((k, pinned, local.dtype, local.shape, local.layout, local.requires_grad, v.requires_grad,
                            v.device_mesh, tuple(v.placements), v.shape))
            else:
                return None
        else:
            out.append((k,))
    return out


def save(state: dict[str, Any], writer: Any, planner: CachedSavePlanner, process_group: Any,
         no_dist: bool) -> None:
    """``dcp.save(state, storage_writer=writer, planner=planner, ...)`` for a flat state (no Stateful
    values): the same files and metadata. Collective over ``process_group``. On any failure the planner forgets
    its cache (every rank's, as every rank raises)."""
    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    try:
        if _save_state_dict is None:  # pragma: no cover
            dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group, no_dist=no_dist)
            return
        # a writer that keeps no results (in-memory, direct) never takes the short path: no collective to ask
        if hasattr(writer, "results") and not _any(not _ready(state, writer, planner, process_group, no_dist),
                                                   process_group, no_dist):
            if _save_unchanged(state, writer, planner, process_group, no_dist):
                planner.short_saves += 1
                return
            planner.forget()  # a rank's file came out otherwise: plan and agree as DCP does, writing again
        md = _save_state_dict(state_dict=state, storage_writer=writer, process_group=process_group,
                              no_dist=no_dist, planner=planner)
        planner.index = _rank_index(md, planner)
        # what the next save compares its own results with (writers that keep them: RecordWriter)
        planner._results = getattr(writer, "results", None)
        planner._all_results = getattr(writer, "all_results", None)
    except BaseException:
        planner.forget()
        raise


def _rank_index(md: Any, planner: CachedSavePlanner) -> bytes | None:
    """This rank's entries of the metadata DCP just finished (every rank receives it), from its local plan before
    DCP's dedup (it names the replicated values this rank loads, whichever rank wrote them). Never fails a save:
    without an index, restores parse the whole ``.metadata``."""
    local = SavePlanner._cached_save_plan.get(planner._cached_plans_key)
    if local is None:
        return None
    try:
        return rank_index.build(md, local.items)
    except Exception as e:  # noqa: BLE001 - an index is an optimisation, the save stands without it
        logger.debug("%s: no rank index: %s", planner.name, e)
        return None


def _coordinator(process_group: Any, no_dist: bool) -> bool:
    return no_dist or dist.get_rank(process_group) == 0


def _ready(state: dict[str, Any], writer: Any, planner: CachedSavePlanner, process_group: Any,
           no_dist: bool) -> bool:
    """This rank can save with the plan and the metadata of the last save: the same layout, DCP's caches in place,
    and the last save's write results kept (on the coordinator, every rank's)."""
    key = planner._cached_plans_key
    if planner._results is None or key not in SavePlanner._cached_final_save_plan:
        return False
    if _coordinator(process_group, no_dist) and (planner._all_results is None
                                                 or key not in SavePlanner._cached_metadata):
        return False
    layout = _layout(state)
    return layout is not None and layout == planner._layout and key in SavePlanner._cached_save_plan


def _max(mine: int, process_group: Any, no_dist: bool) -> int:
    """The largest of every rank's ``mine``: one all-reduce of one number (an object collective pickles and makes
    two transfers, under the GIL of the process that trains; gloo waits for the others outside it)."""
    if no_dist:
        return mine
    t = torch.tensor([mine], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    return int(t.item())


def _any(flag: bool, process_group: Any, no_dist: bool) -> bool:
    """Whether ``flag`` holds on any rank."""
    return _max(int(flag), process_group, no_dist) > 0


def _gather(mine: Any, process_group: Any, no_dist: bool) -> list[Any]:
    """Every rank's ``mine``, in rank order (this rank's alone without a process group)."""
    if no_dist:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    return everyone


# a rank's verdict on its write in :func:`_save_unchanged`; the group's is the largest
_SAME, _DIFFERENT, _FAILED = 0, 1, 2


def _save_unchanged(state: dict[str, Any], writer: Any, planner: CachedSavePlanner, process_group: Any,
                    no_dist: bool) -> bool:
    """Every rank ready (:func:`_ready`): write this rank's file with the cached plan, agree in one all-reduce
    that every rank's write results are the last save's, and have the coordinator write ``.metadata`` from the results
    it kept, as DCP's ``finish`` does from gathered ones. False when a rank's results differ (the caller plans and
    writes again); a failure on any rank raises on every rank, naming each rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    coordinator = _coordinator(process_group, no_dist)
    error: BaseException | None = None
    same = False
    try:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=0 if no_dist else dist.get_rank(process_group),
                                     use_collectives=True)
        # _ready found the state's layout equal to the one the cached plan was made from (taken from the planner's
        # flattened copy: a container's keys come out dotted there, so a state holding one never matches): the cached
        # local plan, without a second look at the layout
        planner.plan = SavePlanner._cached_save_plan[planner._cached_plans_key]
        writer.prepare_local_plan(SavePlan([], usable=False))
        final = planner.finish_plan(SavePlan([], usable=False))  # the cached final plan (with its file prefix)
        fut = writer.write_data(final, planner)
        fut.wait()
        same = fut.value() == planner._results
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = e
    verdict = _max(_FAILED if error is not None else _SAME if same else _DIFFERENT, process_group, no_dist)
    if verdict == _FAILED:  # as DCP raises it: every rank's error, the first failed rank's first
        everyone = _gather(error if no_dist else _portable(error), process_group, no_dist)
        raise CheckpointException("write", {r: (e, None) for r, e in enumerate(everyone) if e is not None})
    if verdict == _DIFFERENT:
        return False
    failed: BaseException | None = None
    if coordinator:
        try:
            writer.finish(metadata=SavePlanner._cached_metadata[planner._cached_plans_key],
                          results=planner._all_results)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            failed = _portable(e)
    if _any(failed is not None, process_group, no_dist):
        done: list[Any] = [failed]
        if not no_dist:
            dist.broadcast_object_list(done, src=dist.get_global_rank(process_group, 0) if process_group is not None
                                       else 0, group=process_group)
        raise CheckpointException("finish", {0: (done[0], None)})
    return True


def _portable(e: BaseException | None) -> BaseException | None:
    """``e`` as it can travel to the other ranks (pickled), or a RuntimeError that names it."""
    if e is None:
        return None
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text travels
        return RuntimeError(f"{type(e).__name__}: {e}")
