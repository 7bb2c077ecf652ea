"""Restore: the newest step complete on some tier, into the caller's state, from the fastest verified copies.

Each rank reads from the fastest tier holding a verified copy of each file (this node's local and partner
copies, another rank's copy over gloo, the persistent tier), falling back file by file and tier by tier.
Plain tensors land straight in the target tensors, each block verified right after it lands (``load.py``);
so do DTensors saved at another layout (another data-parallel size): the runs of each saved chunk their new
local shard needs (``reshard.py``) land in it, and their files are read, sent by peers and fetched from the
persistent tier only in the verification blocks those runs touch. The rest of the state goes through DCP's
reader over verified files.

Over 700 lines: the choice of a step, the agreement on it across ranks and the fetch with its fallbacks are
one collective sequence; which file comes from where is already apart (``plan.py``), as are the block loads
(``load.py``) and the reader (``reader.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import io
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from resilient.checkpoint.api import (CheckpointError, CheckpointMismatchError, CheckpointReshardError,
                                      CorruptFileError, DCP_METADATA, FileEntry, Manifest, NoRestorableStepError,
                                      RestoreResult, StateUndefinedError, TIER_ORDER, TierName, UnsafeCheckpointError)
from resilient.checkpoint.format import rank_index
from resilient.checkpoint.format.digests import map_verified, verify_bytes, verify_file
from resilient.checkpoint.format.safe import find_unsafe, load_metadata, safe_torch_load, unsafe_name
from resilient.checkpoint.format.spans import Span
from resilient.checkpoint.format.state import (dtensor_type, flatten, is_stateful, local_tensor, param_like,
                                               plain_state, set_path)
from resilient.checkpoint.replicate.transfer import Landed, Landing, run_transfers
from resilient.checkpoint.restore.device import is_device
from resilient.checkpoint.restore.load import (PIECE, THREADS, FileLoad, FileSource, Item, MemSource, RangeSource,
                                               Source, load_files, plan_spans, undefined, whole_file)
from resilient.checkpoint.restore.plan import plan_fetch
from resilient.checkpoint.restore.reader import FastReader, SafeLoadPlanner
from resilient.checkpoint.restore.reshard import blocks_touched, chunk_spans, cover
from resilient.checkpoint.storage.collective import RankFailure, RanksFailedError
from resilient.checkpoint.storage.context import (Component, FAILURES, one_line as _one_line,
                                                  per_rank_key as _per_rank_key, quiet as _quiet,
                                                  rmdir_quiet as _rmdir_quiet)
from resilient.checkpoint.storage.tiers import read_manifest, retry
from resilient.events.api import EventKind

logger = logging.getLogger(__name__)


class _Lru:
    """A small least-recently-used cache (thread-safe: restores of several managers in one process)."""

    def __init__(self, size: int):
        self._size, self._d, self._lock = size, collections.OrderedDict(), threading.Lock()  # type: ignore[var-annotated]

    def get(self, key: Any) -> Any:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self._size:
                self._d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


# DCP's parsed .metadata by (size, crc32c) of the verified file: the same bytes parse to the same object,
# whoever asks (it is only read)
_metadata_cache = _Lru(2)
# kept only when the file is at most this large: parsed, a .metadata takes about 13 times its size, and it is global
# (every rank's chunk of every tensor), so a large job's would stay in every training process after its one restore
# (421 MB a rank for 256 ranks of 900 sharded tensors; see bench/metadata_scale.py)
METADATA_CACHE_MAX = 2 << 20


def clear_caches() -> None:
    """Forget parsed metadata (a benchmark measuring what a freshly started process pays)."""
    _metadata_cache.clear()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _memory_budget() -> int:
    """Fetched files are kept in memory up to a quarter of the available RAM, else spilled to disk."""
    # read from the kernel directly where it says: importing psutil costs 60-150 ms, paid by the first restore
    # of every freshly started worker (a hot swap's spare) and more than the reading it decides about
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available * 0.25)
    except Exception:
        return 1 << 30


# (mesh, global shape, placements) -> (local shape, global offsets), with the mesh kept to tell a new mesh
# from an old one at the same address: torch computes them with tensor arithmetic (40 us each, three calls per
# DTensor per restore before) while an FSDP2 or TP state repeats a handful of shapes over thousands of tensors
_geometry: dict[tuple[int, tuple[int, ...], tuple[Any, ...]], tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}
_geometry_lock = threading.Lock()


def _shard_geometry(v: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local shape and the global offsets of its chunk on this rank (a pure function of the
    mesh, this rank's place in it, the global shape and the placements)."""
    mesh, shape, placements = v.device_mesh, tuple(v.shape), tuple(v.placements)
    key = (id(mesh), shape, placements)
    try:
        with _geometry_lock:
            got = _geometry.get(key)
    except TypeError:  # a placement of a kind that cannot be hashed: computed every time
        key, got = None, None
    if got is not None and got[0] is mesh:
        return got[1], got[2]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(v.shape, mesh, v.placements)
    out = (tuple(int(n) for n in local_shape), tuple(int(o) for o in offsets))
    if key is not None:
        with _geometry_lock:
            if len(_geometry) > 4096:
                _geometry.clear()
            _geometry[key] = (mesh, *out)
    return out


def _local_shard(v: Any) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """A DTensor target's local tensor and the global offsets of its chunk (what DCP keys the chunk by), or
    None when ``v`` is not a DTensor. Bytes land in the local tensor: the DTensor is only a wrapper."""
    if type(v) is torch.Tensor or not isinstance(v, torch.Tensor):
        return None
    dt = dtensor_type()
    if dt is None or not isinstance(v, dt):
        return None
    local = local_tensor(v)
    shape, offsets = _shard_geometry(v)
    if shape != tuple(local.shape):
        return None  # a layout this plan does not know (padded shards): DCP's own path
    return local, offsets


def _shards(plan: "_LoadPlan") -> dict[str, tuple[torch.Tensor, tuple[int, ...]] | None]:
    """Every target's local shard (see :func:`_local_shard`), found once per plan: asked for by the items
    read, the layout key and the direct plan."""
    if plan.shards is None:
        plan.shards = {k: _local_shard(v) for k, v in plan.load_sd.items()}
    return plan.shards


def _data_ptr(v: Any, shard: tuple[torch.Tensor, tuple[int, ...]] | None = None) -> int | None:
    if not isinstance(v, torch.Tensor):
        return None
    return (shard[0] if shard is not None else v).data_ptr()


def _items_read(md: Any, plan: "_LoadPlan") -> list[tuple[Any, Any]]:
    """The storage items (index, info) of ``md`` this rank reads to fill ``plan.load_sd``: every item of a
    key, except that a DTensor target reads only the chunks overlapping its local shard (the other ranks'
    shards, and their files, are not this rank's to fetch). Kept in the plan: asked for three times."""
    if plan.items_read is None or plan.items_read[0] is not md:
        plan.items_read = (md, _items_read_of(md, plan.load_sd, _shards(plan)))
    return plan.items_read[1]


def _ints(x: Any) -> tuple[int, ...]:
    """Offsets or sizes as a tuple: DCP's are ``torch.Size`` already (a tuple: hashed and compared as is, no copy);
    metadata written another way may hold lists."""
    return x if isinstance(x, tuple) else tuple(x)


def _items_read_of(md: Any, load_sd: Mapping[str, Any],
                   shards: Mapping[str, tuple[torch.Tensor, tuple[int, ...]] | None]) -> list[tuple[Any, Any]]:
    # the offsets of each DTensor key's saved chunks that miss its local shard, from one walk of the key's chunks: a
    # job of W ranks saves W chunks of every sharded key, so a walk per storage item was W^2 a key (79 s for rank 0 of
    # 1,024 ranks of 900 tensors; see bench/metadata_scale.py); an item is then skipped by one set lookup
    misses: dict[str, set[tuple[int, ...]]] = {}
    for k in load_sd:
        shard = shards[k]
        miss = misses[k] = set()
        if shard is None:
            continue  # loaded whole: every item
        lo, n = shard[1], tuple(shard[0].shape)
        hi = tuple(a + b for a, b in zip(lo, n))
        empty = 0 in n  # an empty local shard overlaps nothing
        lo0, hi0 = (lo[0], hi[0]) if lo else (0, 0)
        seen: set[tuple[int, ...]] = set()
        for c in getattr(md.state_dict_metadata.get(k), "chunks", ()):
            off = _ints(c.offsets)
            if off in seen:
                continue  # the first chunk at an offset decides, as a scan finds it
            seen.add(off)
            # the first dimension alone first: a shard along it (FSDP's Shard(0)) misses all chunks but its own there
            if empty or (off and lo and not (off[0] < hi0 and lo0 < off[0] + c.sizes[0])) or \
                    not all(o < h and a < o + s for o, s, a, h in zip(off[1:], c.sizes[1:], lo[1:], hi[1:])):
                miss.add(off)
    out = []
    for idx, info in md.storage_data.items():
        miss = misses.get(idx.fqn)
        if miss is None or (miss and idx.offset is not None and _ints(idx.offset) in miss):
            continue
        out.append((idx, info))
    return out


@dataclass
class _Unsafe:
    """A restore attempt refused a file as unsafe (see :meth:`Restorer._refused`)."""

    errors: list[str]


def _manifest_problem(m: Manifest) -> str | None:
    for n in m.files:
        problem = unsafe_name(n)
        if problem:
            return problem
    return None


def _checked(m: Manifest) -> Manifest:
    problem = _manifest_problem(m)
    if problem:
        raise UnsafeCheckpointError(f"manifest-rank{m.rank}.json of step {m.step}", None, problem)
    return m


@dataclass
class _LoadPlan:
    plain: dict[str, Any]
    leaves: dict[str, tuple[tuple[Any, ...], Any]]
    load_sd: dict[str, Any]  # checkpoint key -> target (tensor loaded in place, or a placeholder)
    key_of: dict[str, str]  # state fqn -> checkpoint key
    expand: dict[str, list[str]]  # empty containers filled from the checkpoint's keys under them
    reshard: dict[str, str] = field(default_factory=dict)  # state fqn -> why it cannot be resharded here
    items_read: tuple[Any, list[tuple[Any, Any]]] | None = None  # (metadata, its items this rank reads)
    shards: dict[str, tuple[torch.Tensor, tuple[int, ...]] | None] | None = None  # key -> local shard (_shards)


@dataclass
class _Direct:
    """What of a step's data files lands straight in the state: planned from DCP's metadata and the
    manifests' layouts before any data file is fetched (peer transfers land by it)."""

    by_fqn: dict[str, list[Any]]  # checkpoint key -> its storage items
    per_file: dict[str, list[Item]]  # plain tensors per file, targets checked against DCP's metadata
    key_of: dict[int, str]  # id(target) -> checkpoint key
    slow: set[str]  # checkpoint keys left to DCP (or read as objects)
    slow_files: set[str]  # files DCP (or the object path) reads some bytes of
    spans: dict[str, list[Span]]  # files whose manifest gives the layout: spans planned without a read
    items_in: dict[str, int]  # file -> number of storage items in it
    # resharded DTensors (another layout than saved): file -> the verification blocks this rank reads of it
    # (the ones its spans touch); such a file is read, sent and verified by those blocks only
    blocks: dict[str, frozenset[int]] = field(default_factory=dict)
    objects: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> bytes of an object in such a file
    shard_bytes: int = 0  # bytes of the resharded targets (the new local shards)


def _ranged_files(md: Any, plan: "_LoadPlan", need: set[str], files: Mapping[str, FileEntry],
                  per_file: Mapping[str, list[Item]], resharded: Mapping[str, list[Span]], resharded_keys: set[str],
                  by_fqn: Mapping[str, list[Any]]
                  ) -> tuple[dict[str, list[Span]], dict[str, frozenset[int]], dict[str, torch.Tensor]] | None:
    """For each file holding resharded bytes: its spans (the resharded runs, the plain tensors planned
    straight into the state, the objects into small buffers of their own), the blocks they touch, and the
    objects' buffers by key. None when such a file holds an item only DCP's path reads."""
    spans: dict[str, list[Span]] = {}
    blocks: dict[str, frozenset[int]] = {}
    objects: dict[str, torch.Tensor] = {}
    read = {}
    for idx, info in _items_read(md, plan):
        read.setdefault(info.relative_path, []).append((idx, info))
    for name, runs in resharded.items():
        entry = files.get(name)
        if entry is None or name not in need:
            return None
        taking = list(runs)
        known = {off: (start, n) for off, start, n in entry.items}
        planned = set()
        for it in per_file.get(name, []):
            got = known.get(it.offset)
            if got is None or got[1] != it.target.nbytes or not it.target.is_contiguous():
                return None
            taking.append(Span(got[0], got[1], target=it.target))
            planned.add(it.offset)
        for idx, info in read.get(name, []):
            if info.offset in planned or idx.fqn in resharded_keys:
                continue
            m = md.state_dict_metadata.get(idx.fqn)
            if isinstance(m, BytesStorageMetadata) and len(by_fqn.get(idx.fqn, [])) == 1 \
                    and not info.transform_descriptors:
                buf = torch.empty(info.length, dtype=torch.uint8)
                objects[idx.fqn] = buf
                taking.append(Span(info.offset, info.length, target=buf))
                continue
            return None  # something DCP reads from the whole file
        cut = cover(entry.size, taking)
        if cut is None:
            return None
        spans[name] = cut
        blocks[name] = blocks_touched(entry.bounds(), taking)
    return spans, blocks, objects


class Restorer(Component):
    """Restore for one rank (collective on the manager's group: every rank calls :meth:`restore`)."""

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self._plans = _Lru(1)  # (step, metadata, targets) -> _Direct
        # whether the last restore found a snapshot cadence recorded by the attempt before (every rank alike)
        self.cadence_carried_over = False

    def _tiers(self) -> list[Any]:
        return [t for t in (self.ctx.local, self.ctx.peer, self.ctx.persistent) if t is not None]

    def _scan(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for t in self._tiers():
            try:
                if t is self.ctx.persistent:
                    # a bounded probe: a dead store must not hold the start of training
                    steps = t.steps(timeout_s=self.ctx.config.restore_probe_s)
                else:
                    steps = t.steps()
                out[t.name] = sorted(s for s, c in steps.items() if c)
            except FAILURES as e:
                out[t.name] = []
                if t is self.ctx.persistent:
                    others = [x.name for x in self._tiers() if x is not t]
                    msg = (f"unreachable at restore ({_one_line(e)}); restoring from "
                           f"{' and '.join(others) if others else 'nothing'} without it")
                    logger.warning("persistent tier %s: %s", t.url(), msg)
                    self._emit(EventKind.CKPT_TIER_FAILED, step=None, tier=t.name, error=msg)
                else:
                    logger.warning("cannot list %s: %s", t, e)
        return out

    def restore(self, state: Mapping[str, Any]) -> RestoreResult:
        """Load the newest step complete on some tier into ``state`` (see :meth:`_restore`)."""
        # a restore allocates an object per tensor (DCP's metadata, the plan): with a training process's
        # heap, the cyclic collector's full passes it triggers cost more than the reading itself (150-350 ms
        # measured on a 1,680-tensor state against 7 ms for the unpickling); nothing here makes cycles
        self._offers: list[Any] | None = None
        self.covered_by_snapshot = False
        with _gc_paused():
            res = self._restore(state)
        offers = self._offers
        # from the gathered offers: the same on every rank (what ring.resume carries over when every rank has a ring)
        self.cadence_carried_over = bool(offers) and all(o is not None for o in offers) and any(
            o.every is not None for o in offers)
        ring = self.ctx.snapshot
        if ring is not None and self._offers is not None:
            start = 0 if res.step is None else res.step + 1
            k = ring.resume(self._offers, start)
            if k is not None and self.ctx.rank == 0:
                logger.info("snapshots in node memory: every %d step(s) from step %d, as before the restart", k, start)
                self._emit(EventKind.CKPT_SNAPSHOT_CADENCE, every=k, from_step=start, source="resumed")
        return res

    def _restore(self, state: Mapping[str, Any]) -> RestoreResult:
        """Each rank reads from the fastest tier holding a verified copy of each file, falling back
        tier by tier (local → partner node over gloo → persistent) on a missing or corrupt file.
        Returns a result with step None when there is nothing to restore.
        """
        t0 = time.perf_counter()
        ring = self.ctx.snapshot
        offer = ring.offer() if ring is not None else None
        # one gather: every rank's committed steps per tier, its snapshots, and a new lineage for later snapshots
        gathered = self._gather((self._scan(), offer, uuid.uuid4().hex), self.ctx.pg)
        views = [g[0] for g in gathered]
        if ring is not None:
            ring.epoch = gathered[0][2]
            self._offers = [g[1] for g in gathered]
        candidates = sorted({s for v in views for steps in v.values() for s in steps}, reverse=True)
        if self.ctx.local is not None and self.ctx.local_rank == 0:
            # partial steps left by a crash are garbage now (nothing is writing before restore)
            for tier in (self.ctx.local, self.ctx.peer):
                if tier is not None:
                    self._retain(tier, 10**9, pinned_from=None, drop_newer_partial=True)
        snap = _agreed_snapshot([None if g[1] is None else g[1].held for g in gathered])
        # a disk step newer than every rank's snapshot by less than a snapshot interval is not an interruption that
        # needed a disk tier: node memory alone would have lost at most that interval more (what --ckpt-interval
        # auto counts, see IntervalTuner.observe_restore). The same on every rank: from gathered offers and views
        every = max([g[1].every or 1 for g in gathered if g[1] is not None], default=1)
        self.covered_by_snapshot = snap is not None and (not candidates or snap[0] + every >= candidates[0])
        if snap is not None and snap[0] >= (candidates[0] if candidates else -1):
            got = self._try_snapshot(snap[0], snap[1], state, t0)
            if got is not None:
                return got
        if not candidates:
            return RestoreResult(step=None, tier=None, seconds=time.perf_counter() - t0, bytes=0)
        failures = []
        self.resharded: dict[str, int] | None = None  # what a resharded restore read (see _ranged_stats)
        self.ranges_read: dict[str, list[tuple[int, int]]] = {}
        self._excluded: set[tuple[int, str]] = set()  # (step, tier) whose copy was refused as unsafe
        self._lazy: set[str] = set()  # this rank's files taken from this node unverified (verified as they land)
        self._dirty = False  # bytes of a step that then failed landed in the state
        self._remote: set[str] = set()  # this rank's files read by blocks from the persistent tier
        self._landed: dict[str, Landed] = {}  # this rank's files received from a peer straight into the state
        self._pre: dict[str, FileLoad] = {}  # this rank's files on this node, loaded while transfers ran
        self._pre_lost: list[str] = []
        self._pre_opened: list[Source] = []
        unsafe: list[str] = []
        self._why: dict[int, dict[str, Any]] = {}  # step -> what kept it from being assembled (the same on every rank)
        self._views = views  # every rank's committed steps per tier: which tiers a step was looked for on
        for step in candidates:
            res = None
            for _ in TIER_ORDER:  # an unsafe copy on one tier: the same step again from the next tier
                got = self._try_restore(step, state, views, t0)
                if isinstance(got, _Unsafe):
                    unsafe.extend(got.errors)
                    continue
                if got is None and self._persistent_alone(step, views):
                    continue
                res = got
                break
            if res is not None:
                extra = {"resharded": self.resharded} if self.resharded else {}
                self._emit(EventKind.CKPT_RESTORE, step=step, tier=res.tier, seconds=res.seconds, bytes=res.bytes,
                           sources=sorted(set(res.sources.values())), covered_by_snapshot=self.covered_by_snapshot,
                           **extra)
                logger.info("rank %d restored step %d from %s in %.2f s", self.ctx.rank, step, res.tier, res.seconds)
                return res
            failures.append(step)
        extra = f"; refused as unsafe: {'; '.join(sorted(set(unsafe))[:5])}" if unsafe else ""
        if self._dirty:
            msg = (f"committed steps {failures} exist but none could be loaded from verified blocks on any tier; "
                   f"bytes of a checkpoint already landed in the state, which is now undefined{extra}: restore "
                   "from another checkpoint directory or start from a fresh state; see the log for the blocks")
            self._emit(EventKind.CKPT_TIER_FAILED, step=failures[0] if failures else None, tier="all",
                       error=msg, state_undefined=True)
            raise StateUndefinedError(msg)
        details = {"steps": failures, "tiers": [t.name for t in self._tiers()],
                   "why": {str(s): self._why[s] for s in failures if s in self._why}}
        if unsafe:
            details["unsafe"] = sorted(set(unsafe))[:5]
        said = "; ".join(f"step {s}: {_said(self._why[s])}" for s in failures if s in self._why)
        msg = (f"committed steps {failures} exist but none could be assembled from verified files on any tier "
               f"({', '.join(details['tiers']) or 'none'}){': ' + said if said else ''}; the state is "
               f"undefined{extra}: a persistent tier (--ckpt-persistent) or an older checkpoint directory holding "
               "those shards would restore it")
        if self.ctx.rank == 0:
            logger.error("%s", msg)
            self._emit(EventKind.CKPT_TIER_FAILED, step=failures[0] if failures else None, tier="all",
                       error=msg, state_undefined=True, restore=details)
        raise NoRestorableStepError(msg, details=details)

    def _try_snapshot(self, step: int, epoch: str, state: Mapping[str, Any], t0: float) -> RestoreResult | None:
        """Every rank's snapshot of ``step`` (lineage ``epoch``), checked on every rank before any byte lands, then
        loaded on every rank; None (and the disk tiers decide) when some rank cannot."""
        ring = self.ctx.snapshot
        load = ring.prepare(step, epoch, state)
        why = self._gather(load if isinstance(load, str) else None, self.ctx.pg)
        if any(w is not None for w in why):
            if self.ctx.rank == 0:
                logger.warning("snapshot of step %d not used (%s); restoring from the disk tiers", step,
                               "; ".join(f"rank {r}: {w}" for r, w in enumerate(why) if w is not None))
            return None
        try:
            load.apply(state)
            failed = None
        except FAILURES as e:  # the disk tiers' restore below writes every leaf again
            failed = _one_line(e)
        why = self._gather(failed, self.ctx.pg)
        if any(w is not None for w in why):
            if self.ctx.rank == 0:
                logger.warning("snapshot of step %d failed to load (%s); restoring from the disk tiers", step,
                               "; ".join(f"rank {r}: {w}" for r, w in enumerate(why) if w is not None))
            return None
        seconds = time.perf_counter() - t0
        res = RestoreResult(step=step, tier="snapshot", seconds=seconds, bytes=load.nbytes,
                            sources={"snapshot": "snapshot"})
        self._emit(EventKind.CKPT_RESTORE, step=step, tier="snapshot", seconds=seconds, bytes=load.nbytes,
                   sources=["snapshot"])
        logger.info("rank %d restored step %d from its snapshot in node memory in %.3f s", self.ctx.rank, step,
                    seconds)
        return res

    def _persistent_alone(self, step: int, views: list[dict[str, list[int]]]) -> bool:
        """After ``step`` failed from this node's copies mixed with others: try it once more from the persistent
        tier's copy alone (the same on every rank: ``views`` and the exclusions are). Its copy may be encoded
        otherwise (compressed at upload): its files are not blocks of the local copies, and its manifests and
        ``.metadata`` belong together; a bad block of a local copy, or a rank whose copies are only there, is
        then served from it whole."""
        near = [t.name for t in (self.ctx.local, self.ctx.peer) if t is not None]
        if (not near or all((step, n) in self._excluded for n in near)
                or (step, TierName.PERSISTENT.value) in self._excluded
                or not any(step in v.get(TierName.PERSISTENT.value, []) for v in views)):
            return False
        for n in near:
            self._excluded.add((step, n))
        shutil.rmtree(self._fetch_dir(step), ignore_errors=True)
        logger.warning("rank %d: step %d: trying it again from the persistent tier's copy alone", self.ctx.rank, step)
        return True

    def _persistent_range(self, step: int, name: str, entry: FileEntry) -> RangeSource:
        """The persistent tier's copy of ``name`` read by byte ranges of ``entry``'s layout; a copy encoded
        otherwise (compressed at upload) refuses, so that the block is not taken from bytes of another file."""
        tier = self.ctx.persistent
        assert tier is not None

        def read(off: int, n: int) -> bytes:
            owner = self._owner.get(name)
            if owner is not None and owner not in self._from_persistent:
                same = self._persistent_same.get(name)
                if same is None:
                    try:
                        theirs = read_manifest(tier, step, owner).files.get(name)
                    except FAILURES as e:  # told as this block's failure on that tier, like a failed read
                        raise OSError(f"manifest of rank {owner} on the persistent tier: {_one_line(e)}") from None
                    same = theirs is not None and (theirs.size, theirs.crc32c) == (entry.size, entry.crc32c)
                    self._persistent_same[name] = same
                if not same:
                    raise OSError(f"the persistent tier's copy of {name} is encoded otherwise (compressed): "
                                  "read whole from that tier instead")
            return tier.read_range(step, name, off, n)

        return RangeSource(read, TierName.PERSISTENT.value)

    def _local_copies(self, step: int) -> list[tuple[str, Path]]:
        out = []
        for t in (self.ctx.local, self.ctx.peer):
            if t is not None and t.path(step).is_dir() and (step, t.name) not in getattr(self, "_excluded", ()):
                out.append((t.name, t.path(step)))
        fetched = self._fetch_dir(step)
        if fetched.is_dir():
            out.append(("fetched", fetched))
        return out

    def _fetch_dir(self, step: int) -> Path:
        return self.ctx.scratch / ".fetch" / f"rank{self.ctx.rank}" / f"step_{step:08d}"

    def _try_restore(self, step: int, state: Mapping[str, Any], views: list[dict[str, list[int]]],
                     t0: float) -> "RestoreResult | _Unsafe | None":
        in_persistent = (any(step in v.get(TierName.PERSISTENT.value, []) for v in views)
                         and (step, TierName.PERSISTENT.value) not in self._excluded)
        # 1. manifests: each rank contributes those it holds, the persistent tier fills gaps
        mine: dict[int, Manifest] = {}
        where: dict[int, str] = {}  # rank -> the tier of this node its manifest was read from
        for tier_name, d in self._local_copies(step):
            for p in d.glob("manifest-rank*.json"):
                try:
                    m = Manifest.from_json(json.loads(p.read_bytes()))
                    problem = _manifest_problem(m)
                    if problem:
                        logger.warning("manifest %s skipped: unsafe: %s", p, problem)
                        continue
                    if m.step == step and m.rank not in mine:
                        mine[m.rank] = m  # travels pickled: parsed once, not again from JSON
                        where[m.rank] = tier_name if tier_name != "fetched" else TierName.PEER.value
                except (OSError, ValueError, KeyError, TypeError):
                    logger.warning("unreadable manifest %s skipped", p)
        # each rank reads its own index only: the others' stay home (at 1,024 ranks they would be the whole
        # .metadata again, sent to every rank)
        own = mine.get(self.ctx.rank)
        my_index = own.index if own is not None else None
        index_from = where.get(self.ctx.rank)
        stripped = {r: dataclasses.replace(m, index=None) if m.index is not None else m for r, m in mine.items()}
        told_manifests = self._gather((stripped, own is not None), self.ctx.pg)
        manifests: dict[int, Manifest] = {}
        for theirs, _ in told_manifests:
            for r, m in theirs.items():
                manifests.setdefault(r, m)
        world_old = next(iter(manifests.values())).world_size if manifests else None
        if world_old == self.ctx.world_size:
            # a rank whose node holds no copy of its manifest (a hot-swapped node: the lost node's copies are on its
            # partner) gets its index from the first rank that holds one; every rank knows from the gather whether
            # any is homeless, so this second gather runs in such a restore only
            homeless = [r for r, (_, home) in enumerate(told_manifests) if not home and r in manifests]
            if homeless:
                holder = {r: next(i for i, (theirs, _) in enumerate(told_manifests) if r in theirs) for r in homeless}
                give = {r: (mine[r].index, where[r]) for r in homeless
                        if holder[r] == self.ctx.rank and mine[r].index is not None}
                for given in self._gather(give, self.ctx.pg):
                    if self.ctx.rank in given:
                        my_index, index_from = given[self.ctx.rank]
        # every rank holds the same gathered manifests: when they are complete, no rank reads the persistent
        # tier and each decides alike below, so the agreements on them are not collectives (each one is a
        # round trip the raw transfer a peer restore is measured against does not pay)
        gathered = world_old is not None and all(r in manifests for r in range(world_old))
        self._from_persistent: set[int] = set()  # ranks whose manifest in use is the persistent tier's
        self._persistent_same: dict[str, bool] = {}  # name -> is the persistent copy these very bytes
        if in_persistent and (world_old is None or len(manifests) < world_old):
            missing = [r for r in range(world_old or 0) if r not in manifests] if world_old else None
            try:
                if missing is None:
                    m0 = _checked(retry(lambda: read_manifest(self.ctx.persistent, step, 0),  # type: ignore
                                        what="read manifest", retries=2, backoff_s=0.5, backoff_max_s=2))
                    manifests[0] = m0
                    self._from_persistent.add(0)
                    world_old = m0.world_size
                    missing = [r for r in range(world_old) if r not in manifests]
                for r in missing:
                    persistent = self.ctx.persistent
                    manifests[r] = _checked(retry(lambda r=r: read_manifest(persistent, step, r),  # type: ignore
                                                  what="read manifest", retries=2, backoff_s=0.5, backoff_max_s=2))
                    self._from_persistent.add(r)
                    if r == self.ctx.rank:
                        my_index, index_from = manifests[r].index, TierName.PERSISTENT.value
            except FAILURES as e:
                logger.warning("step %d: manifests unavailable on the persistent tier: %s", step, e)
        ok_manifests = world_old is not None and all(r in manifests for r in range(world_old))
        if not (ok_manifests if gathered else self._all(ok_manifests)):
            gone = [r for r in range(world_old) if r not in manifests] if world_old is not None else None
            self._why[step] = {"missing": "manifests", "ranks": gone, "tiers": _tiers_with(step, views)}
            logger.warning("step %d: manifests of rank(s) %s are on no tier (looked at %s); trying an older step",
                           step, "?" if gone is None else ", ".join(map(str, gone)) or "?",
                           ", ".join(self._why[step]["tiers"]) or "none")
            return None
        assert world_old is not None
        # one restore reads one encoding of the step: this node's plain copies and the persistent tier's
        # compressed one have other files and another .metadata (then the step is read from that tier alone)
        mixed = len({(m.metadata.size, m.metadata.crc32c) for m in manifests.values()}) > 1
        if not (not mixed if gathered else self._all(not mixed)):
            logger.warning("step %d: this node's copies and the persistent tier's are encoded differently "
                           "(compressed at upload)", step)
            return None
        self._owner = {n: r for r, m in manifests.items() for n in m.files}
        files: dict[str, FileEntry] = {DCP_METADATA: manifests[0].metadata}
        for m in manifests.values():
            files.update(m.files)
        per_rank_keys = set(manifests[0].per_rank_keys)

        # 2. which files hold the keys this rank loads: its own entries of DCP's .metadata, where it restores the
        # layout it saved (see format/rank_index.py), else the whole file
        phases = {"manifests": time.perf_counter() - t0}
        t_phase = time.perf_counter()
        md: Any = None
        md_key: Any = None
        refused: tuple[str | None, str] | None = None
        plan: _LoadPlan | None = None
        failed: BaseException | None = None
        missing: list[str] = []
        if my_index is not None and world_old == self.ctx.world_size:
            try:
                md = rank_index.decode(my_index, files[DCP_METADATA].crc32c,
                                       what=f"rank {self.ctx.rank}'s manifest of step {step}")
                md_key = ("index", my_index.of, my_index.crc)
            except FAILURES as e:
                if my_index.of == files[DCP_METADATA].crc32c:
                    # an index bound to this very .metadata that does not decode: the manifest's bytes changed
                    # on its tier (a disk rotting), which the restore survives but the ledger must show
                    logger.warning("rank %d: step %d: %s; reading %s whole", self.ctx.rank, step, _one_line(e),
                                   DCP_METADATA)
                    self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=index_from or "unknown",
                               error=f"manifest-rank{self.ctx.rank}.json: {_one_line(e)}")
                else:
                    logger.info("rank %d: step %d: %s; reading %s whole", self.ctx.rank, step, _one_line(e),
                                DCP_METADATA)
        if md is not None:
            # planned before any file moves, so a rank whose index holds everything it loads never reads .metadata
            # (on a hot-swapped node that would be a fetch of the whole file). A target not of the layout this
            # rank saved (or an index missing something) is planned from the whole file, as without an index (its
            # errors are the ones reported). An empty container (a fresh optimizer's state) is filled from the keys
            # this rank saved under it: in a job whose ranks hold the same keys (FSDP, TP, DDP), the whole file's;
            # each filled target must fit like any other
            try:
                plan = self._plan_load(step, state, md.state_dict_metadata, per_rank_keys, world_old)
            except CheckpointError:
                plan = None
            if plan is None or plan.reshard or not rank_index.fits(md, plan.load_sd, _shards(plan)):
                md, md_key, plan = None, None, None
        indexed = md is not None
        got = self._assemble(step, set() if indexed else {DCP_METADATA}, files, in_persistent)
        if got is None:
            return None
        paths, mem, sources = got
        if not indexed:
            key = (files[DCP_METADATA].size, files[DCP_METADATA].crc32c)
            md_key = key
            try:
                md = _metadata_cache.get(key)
                if md is None:
                    md = load_metadata(mem[DCP_METADATA] if DCP_METADATA in mem else paths[DCP_METADATA].read_bytes(),
                                       what=f"{sources.get(DCP_METADATA)} tier, step {step}, {DCP_METADATA}")
                    if files[DCP_METADATA].size <= METADATA_CACHE_MAX:
                        _metadata_cache.put(key, md)
            except UnsafeCheckpointError as e:
                md, refused = None, (sources.get(DCP_METADATA), str(e))
            except FAILURES as e:
                logger.warning("rank %d: step %d: %s", self.ctx.rank, step, _one_line(e))
                md, refused = None, ("", "")
        phases["index" if indexed else "metadata"] = time.perf_counter() - t_phase
        # one agreement on what each rank found before any data file moves: a refused .metadata, a plan that
        # failed, state that cannot follow a world-size change, files no manifest lists (each was a
        # collective of its own: a round trip each that the raw transfer does not pay)
        self._tell_refused(step, refused)
        if md is not None and plan is None:
            try:
                plan = self._plan_load(step, state, md.state_dict_metadata, per_rank_keys, world_old)
            except CheckpointError as e:
                failed = e
        if plan is not None:
            # a rank planned from its index reads no .metadata at all, DCP's reader included (it is handed the index)
            need = ({DCP_METADATA} if not indexed else set()) | {info.relative_path for _, info in _items_read(md, plan)}
            missing = sorted(n for n in need if n not in files)
        told = self._gather((refused, None if failed is None else (type(failed).__name__, str(failed)),
                             plan.reshard if plan is not None else {}, bool(missing)), self.ctx.pg)
        verdict = self._judge_refused(step, [t[0] for t in told])
        if verdict is not None:
            mem.clear()
            return verdict
        # every rank stops here if one cannot plan, none is left waiting in a collective, and every rank's
        # error is told (as Ranks.all_gather tells it)
        failures = [RankFailure(r, t[1][0], t[1][1]) for r, t in enumerate(told) if t[1] is not None]
        if failures:
            err = RanksFailedError(f"planning the restore of step {step}", failures, failed)
            if failed is not None:
                if len(failures) > 1:
                    failed.add_note(str(err))
                raise failed
            raise err
        assert md is not None and plan is not None
        # a world-size change some state cannot follow: every rank learns every rank's findings and all
        # raise the same error, before a single data file is fetched or a byte lands in the state
        reshard: dict[str, str] = {}
        for t in told:
            for k, why in t[2].items():
                reshard.setdefault(k, why)
        if reshard:
            err = CheckpointReshardError(step, world_old, self.ctx.world_size, reshard)
            if self.ctx.rank == 0:
                logger.error("%s", err)
            raise err
        if any(t[3] for t in told):
            self._why[step] = {"missing": "files", "files": missing[:20], "tiers": _tiers_with(step, views)}
            logger.warning("step %d: .metadata names files no manifest lists (%s); trying an older step",
                           step, missing[:5])
            return None

        # 3. the data files: copies on this node are taken as they are (verified block by block as they
        # land in the state); a peer's copy lands straight in the state, verified block by block as it
        # arrives; the persistent tier is read by blocks in step 4
        t_phase = time.perf_counter()
        self._lazy = set()
        self._remote = set()
        self._landed = {}
        # the same checkpoint into the same tensors again (a second restore by this manager): the plan holds
        # views of exactly these tensors (kept alive by the cache, so their ids cannot be reused)
        shards = _shards(plan)
        layout_key = (step, md_key, tuple((k, id(v), _data_ptr(v, shards[k]))
                                          for k, v in plan.load_sd.items()))
        direct = self._plans.get(layout_key)
        if direct is None:
            direct = self._direct_plan(md, plan, need, files)
            self._plans.put(layout_key, direct)
        # a file with a target on a GPU is received whole, then loaded through pinned buffers (gloo receives
        # into host memory only)
        gpu = torch.cuda.is_available()  # else no target is on a GPU: no span's view is made to ask
        land = {n: Landing(direct.spans[n], keep=n in direct.slow_files) for n in direct.spans
                if not (gpu and any(s.takes and s.dst is not None and is_device(s.dst) for s in direct.spans[n]))}
        self._pre, self._pre_lost, self._pre_opened = {}, [], []
        self._ranged_in = [0, 0]  # bytes received from peers into targets, the largest staging of one file
        got = self._assemble(step, need, files, in_persistent, have_already=(paths, mem, sources), lazy=True,
                             land=land, prefetch=lambda: self._prefetch_local(step, direct, files, paths, mem,
                                                                               sources, in_persistent),
                             blocks=direct.blocks)
        if got is None:
            for src in self._pre_opened:
                src.close()
            return None
        paths, mem, sources = got
        phases["fetch"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()

        # 4. plain tensors straight into the state, each block verified right after it lands; a bad block
        # comes again from the next copy into the same place; the rest of the state through DCP
        slow_keys = self._load_direct(step, md, plan, direct, need, files, paths, mem, sources, in_persistent)
        if slow_keys is None:
            mem.clear()
            return None
        phases["direct"] = time.perf_counter() - t_phase
        self.resharded = _ranged_stats(direct, need, files, self._ranged_in) if direct.blocks else None
        # the byte ranges this rank read of each data file (a benchmark reads the same bytes raw)
        self.ranges_read = {n: [b for i, b in enumerate(files[n].bounds())
                                if direct.blocks.get(n) is None or i in direct.blocks[n]]
                            for n in sorted(need - {DCP_METADATA})}
        refused = None
        if slow_keys:
            slow_sd = {k: plan.load_sd[k] for k in slow_keys}
            view = self.ctx.scratch / ".restore" / f"rank{self.ctx.rank}"
            shutil.rmtree(view, ignore_errors=True)
            view.mkdir(parents=True)
            for n, p in paths.items():
                if n not in mem:
                    os.symlink(os.path.abspath(p), view / n)
            try:
                # DCP's reader plans from what this restore parsed (the whole .metadata, or this rank's index), not
                # from the file again (at 1,024 ranks x 900 tensors, 2.4 s and 1.7 GB more)
                reader = FastReader(view, mem, metadata=md)
                try:
                    _quiet(dcp.load, slow_sd, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
                    plan.load_sd.update(slow_sd)
                except FAILURES as e:
                    bad = find_unsafe(e)
                    if bad is None:
                        raise
                    name = bad.path.rsplit("/", 1)[-1]
                    refused = (sources.get(name, sources.get(DCP_METADATA)), str(bad))
            finally:
                shutil.rmtree(view, ignore_errors=True)
                _rmdir_quiet(view.parent)
        mem.clear()
        # every rank takes part (or none: whether some rank had keys for DCP's reader was agreed in _load_direct)
        verdict = self._refused(step, refused) if self._any_slow else None
        if verdict is not None:
            return verdict
        self._finish_load(state, plan)
        phases["load"] = time.perf_counter() - t_phase
        used = {sources[n] for n in need}
        tier = max(used, key=lambda t: [x.value for x in TIER_ORDER].index(t)) if used else None
        nbytes = sum(files[n].size for n in need)
        res = RestoreResult(step=step, tier=tier, seconds=time.perf_counter() - t0, bytes=nbytes,
                            sources={n: sources[n] for n in need}, phases=phases)
        logger.debug("rank %d restore of step %d phases: %s", self.ctx.rank, step, phases)
        shutil.rmtree(self.ctx.scratch / ".fetch" / f"rank{self.ctx.rank}", ignore_errors=True)
        _rmdir_quiet(self.ctx.scratch / ".fetch")
        return res

    def _direct_plan(self, md: Any, plan: "_LoadPlan", need: set[str], files: dict[str, FileEntry]) -> _Direct:
        """Which plain tensors of ``plan`` land straight in their targets, and where in each file (no I/O)."""
        # indexed from the items this rank reads, not from every rank's (the global .metadata lists W chunks of
        # each sharded tensor): every lookup below is of a key loaded whole (all its items are read) or of a chunk
        # overlapping a local shard (read too)
        by_fqn: dict[str, list[Any]] = {}
        items_in: dict[str, int] = {}
        chunk_at: dict[tuple[str, tuple[int, ...]], Any] = {}
        for idx, info in _items_read(md, plan):
            by_fqn.setdefault(idx.fqn, []).append(info)
            if idx.offset is not None:
                chunk_at[(idx.fqn, tuple(idx.offset))] = info  # a torch.Size: ints already
            items_in[info.relative_path] = items_in.get(info.relative_path, 0) + 1
        per_file: dict[str, list[Item]] = {}
        key_of: dict[int, str] = {}
        slow: set[str] = set()
        resharded: dict[str, list[Span]] = {}  # file -> spans of resharded DTensors' runs
        resharded_keys: set[str] = set()
        shard_bytes = 0
        sdm = md.state_dict_metadata
        shards = _shards(plan)
        for key, v in plan.load_sd.items():
            m = sdm.get(key)
            infos = by_fqn.get(key, [])
            shard = shards[key]
            if shard is not None:
                # a DTensor: its local shard lands straight in place when the checkpoint holds a chunk of
                # exactly that shard (same size, same offsets: saved with this layout); any other layout is
                # resharded by DCP's planner
                local, offsets = shard
                info = chunk_at.get((key, offsets)) if isinstance(m, TensorStorageMetadata) else None
                if info is None and isinstance(m, TensorStorageMetadata):
                    info = md.storage_data.get(MetadataIndex(key, offsets))  # an empty shard overlaps nothing
                shape = tuple(local.shape)
                if (info is not None and not info.transform_descriptors and m.properties.dtype == local.dtype
                        and any(_ints(c.offsets) == offsets and _ints(c.sizes) == shape for c in m.chunks)
                        and local.device.type in ("cpu", "cuda") and local.is_contiguous()):
                    per_file.setdefault(info.relative_path, []).append(Item(info.offset, info.length, local))
                    key_of[id(local)] = key
                    continue
                runs = chunk_spans(key, m, local, offsets, chunk_at, files)
                if runs is not None:
                    for name, sp in runs.items():
                        resharded.setdefault(name, []).extend(sp)
                    resharded_keys.add(key)
                    shard_bytes += local.nbytes
                    continue
                slow.add(key)
                continue
            # the layout is trusted only for targets that match DCP's metadata
            if (isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata) and len(m.chunks) == 1
                    and len(infos) == 1 and not infos[0].transform_descriptors
                    and m.properties.dtype == v.dtype
                    and not any(m.chunks[0].offsets) and m.chunks[0].sizes == v.shape):
                per_file.setdefault(infos[0].relative_path, []).append(Item(infos[0].offset, infos[0].length, v))
                key_of[id(v)] = key
            else:
                slow.add(key)
        ranged = _ranged_files(md, plan, need, files, per_file, resharded, resharded_keys, by_fqn)
        if ranged is None:
            # a file with resharded bytes also holds something only DCP's path reads (it needs the file
            # whole): every resharded DTensor takes DCP's path, as before
            slow |= resharded_keys
            resharded, shard_bytes = {}, 0
            ranged = ({}, {}, {})
        ranged_spans, blocks, objects = ranged
        slow -= set(objects)
        slow_files: set[str] = set()
        spans: dict[str, list[Span]] = dict(ranged_spans)
        for name in sorted(need - {DCP_METADATA}):
            entry = files[name]
            if not entry.items or name in ranged_spans:
                continue  # no layout in the manifest: planned from the file itself when it is read
            items = per_file.get(name, [])
            spans[name], left = plan_spans(None, entry.size, items, entry.items)
            for it in left:
                slow.add(key_of[id(it.target)])
            if left or len(items) < items_in.get(name, 0):
                slow_files.add(name)
        return _Direct(by_fqn=by_fqn, per_file=per_file, key_of=key_of, slow=slow, slow_files=slow_files,
                       spans=spans, items_in=items_in, blocks=blocks, objects=objects, shard_bytes=shard_bytes)

    def _on_bad(self, step: int) -> Any:
        def on_bad(f: FileLoad, block: int, tier: str, why: str) -> None:
            logger.warning("rank %d: step %d: %s block %d from the %s tier: %s; trying the next copy",
                           self.ctx.rank, step, f.name, block, tier, why)
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=tier, error=f"{f.name} block {block}: {why}")
        return on_bad

    def _prefetch_local(self, step: int, direct: _Direct, files: dict[str, FileEntry], paths: dict[str, Path],
                        mem: dict[str, Any], sources: dict[str, str], in_persistent: bool) -> None:
        """Load this rank's files found on this node (their layout known) into the state while the transfers
        to and from other ranks run: a rank that sends its partner's shards restores its own meanwhile."""
        self._dirty = True
        loads: list[FileLoad] = []
        opened: list[Source] = []
        try:
            for name in sorted(self._lazy):
                if name not in direct.spans:
                    continue  # planned from the file itself: left to _load_direct
                srcs = self._sources(step, name, files[name], paths, mem, sources, in_persistent, opened)
                if srcs:
                    loads.append(FileLoad(name, files[name], srcs, direct.spans[name],
                                          blocks=direct.blocks.get(name)))
            self._pre_lost = load_files(loads, on_bad=self._on_bad(step))
            self._pre = {f.name: f for f in loads}
            self._pre_opened = opened
        except FAILURES as e:  # _load_direct loads them again, from the start
            logger.warning("rank %d: loading this node's files during the transfers failed: %s", self.ctx.rank, e)
            self._pre, self._pre_lost = {}, []
            for src in opened:
                src.close()

    def _load_direct(self, step: int, md: Any, plan: "_LoadPlan", direct: _Direct, need: set[str],
                     files: dict[str, FileEntry], paths: dict[str, Path], mem: dict[str, Any],
                     sources: dict[str, str], in_persistent: bool) -> set[str] | None:
        """Collective: load the plain tensors of ``plan`` straight into their targets (see ``load.py``).

        Returns the checkpoint keys left to DCP; every file DCP will read is verified whole by then.
        Returns None on every rank when some rank has a block no tier holds a good copy of (after this
        node's other copies, the persistent tier by ranged reads, then other ranks' copies over gloo).
        Files received from a peer (``self._landed``) are in the state already: only their bad blocks are
        read again, from the next copy.
        """
        self._dirty = True  # from here bytes of this step land in the state
        by_fqn, key_of_target = direct.by_fqn, direct.key_of
        slow, slow_files = set(direct.slow), set(direct.slow_files)  # the plan may serve another restore
        loads: list[FileLoad] = []
        opened: list[Source] = list(self._pre_opened)
        lost: list[str] = list(self._pre_lost)
        unsafe: str | None = None  # an object of a file read by ranges refused by the restricted unpickler
        try:
            for name in sorted(need - {DCP_METADATA}):
                pre = self._pre.get(name)
                if pre is not None:
                    pre.blocks = frozenset()  # loaded (and its failures told) while the transfers ran
                    loads.append(pre)
                    continue
                srcs = self._sources(step, name, files[name], paths, mem, sources, in_persistent, opened)
                landed = self._landed.get(name)
                if landed is not None:
                    # in the state already; the blocks that failed come again from the next copy
                    loads.append(FileLoad(name, files[name], srcs, direct.spans[name], served=sources[name],
                                          keep_gaps=landed.keep, blocks=frozenset(landed.bad)))
                    continue
                if not srcs:
                    lost.append(f"{name} (no copy)")
                    continue
                if name in direct.spans:
                    spans = direct.spans[name]
                else:
                    items = direct.per_file.get(name, [])
                    spans, left = plan_spans(srcs[0], files[name].size, items, ())
                    for it in left:
                        slow.add(key_of_target[id(it.target)])
                    if left or len(items) < direct.items_in.get(name, 0):
                        slow_files.add(name)
                loads.append(FileLoad(name, files[name], srcs, spans, blocks=direct.blocks.get(name)))
                if name in slow_files and name in self._remote:
                    # DCP reads the objects from the bytes kept as they passed (pages of tensor bytes
                    # are never touched: not resident)
                    loads[-1].keep_gaps = torch.empty(files[name].size, dtype=torch.uint8).numpy()

            lost += load_files(loads, on_bad=self._on_bad(step), verified=frozenset(n for n in mem if n not in self._lazy))
            for f in loads:
                if f.served is not None:
                    sources[f.name] = f.served
                if f.keep_gaps is not None and f.name not in lost:
                    mem[f.name] = f.keep_gaps
                elif f.name in slow_files and f.name not in lost and f.sources and f.served != f.sources[0].tier:
                    # a block of the first copy was bad: DCP reads the rest from a whole verified copy
                    mem[f.name] = self._whole(f)
            if not lost:
                for key, buf in direct.objects.items():  # objects of files read by ranges, landed verified
                    try:
                        plan.load_sd[key] = safe_torch_load(io.BytesIO(buf.numpy().tobytes()), what=f"item {key!r}")
                    except UnsafeCheckpointError as e:
                        unsafe = unsafe or str(e)  # raised on every rank below, none left in a collective
                # whole objects (a step count, a data position) from the verified bytes, as DCP's load_bytes
                # through the restricted unpickler would, without a DCP pass for them
                for key in sorted(slow):
                    m, infos = md.state_dict_metadata.get(key), by_fqn.get(key, [])
                    if not (isinstance(m, BytesStorageMetadata) and len(infos) == 1
                            and not infos[0].transform_descriptors):
                        continue
                    f = next((x for x in loads if x.name == infos[0].relative_path), None)
                    if f is None or not f.sources:
                        continue
                    src = MemSource(mem[f.name], "memory") if f.name in mem else f.sources[0]
                    data = bytes(src.read(infos[0].offset, infos[0].length))
                    try:
                        plan.load_sd[key] = safe_torch_load(io.BytesIO(data), what=f"item {key!r}")
                    except UnsafeCheckpointError:
                        continue  # DCP's path refuses it and names the file (see _refused)
                    slow.discard(key)
        finally:
            for src in opened:
                src.close()
        lost_files = sorted({x.split(" ")[0] for x in lost})
        told = self._gather((lost_files, unsafe, bool(slow)), self.ctx.pg)
        # no rank leaves keys to DCP's reader: no rank can refuse a file there, nothing to agree on after it
        self._any_slow = any(s for _, _, s in told)
        refused = next((u for _, u, _ in told if u), None)
        if refused:
            raise UnsafeCheckpointError(f"step {step}", None, refused)
        # last resort, collective: files with lost blocks from another rank's copy over gloo
        if any(lost for lost, _, _ in told):
            got = self._assemble(step, set(lost_files), files, in_persistent, have_already=({}, {}, {}),
                                 exclude=frozenset(lost_files))
            again: list[str] = []
            if got is None:
                again = lost
            else:
                _, got_mem, got_sources = got
                for f in loads:
                    if f.name in lost_files and f.name in got_mem:
                        f.sources = [MemSource(got_mem[f.name], got_sources[f.name])]
                        if f.name in self._pre:
                            f.blocks = None  # which of its blocks were lost is not kept: all again
                        again += load_files([f], verified=frozenset({f.name}))
                        sources[f.name] = got_sources[f.name]
                        mem[f.name] = got_mem[f.name]
                    elif f.name in lost_files:
                        again.append(f"{f.name} (no copy on any tier)")
            if again and any(v is False for v in self._persistent_same.values()):
                # not the end: the persistent tier holds the step compressed, read whole next (_persistent_alone)
                logger.warning("rank %d: step %d: no good copy of %s on this node or another rank; reading the "
                               "persistent tier's compressed copy of the step next", self.ctx.rank, step,
                               "; ".join(again[:5]))
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.LOCAL.value,
                           error=f"no good copy of {'; '.join(again[:5])} on this node or another rank; "
                                 "reading the persistent tier's compressed copy next")
            elif again:
                logger.error("rank %d: %s", self.ctx.rank, undefined(again, step))
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier="all",
                           error=f"no good copy of {'; '.join(again[:5])}")
            if not self._all(not again):
                # bytes of this step landed in the state: an older step, fully loaded, may still define it
                self._dirty = True
                return None
        return slow

    def _sources(self, step: int, name: str, entry: FileEntry, paths: dict[str, Path], mem: dict[str, Any],
                 sources: dict[str, str], in_persistent: bool, opened: list[Source]) -> list[Source]:
        """The copies of ``name`` this rank can read without the others, best first."""
        out: list[Source] = []
        seen: set[str] = set()
        if name in self._remote and self.ctx.persistent is not None:
            out.append(self._persistent_range(step, name, entry))
        elif name in mem:
            out.append(MemSource(mem[name], sources.get(name, TierName.PEER.value)))
        elif name in paths:
            try:
                src = FileSource(paths[name], sources.get(name, TierName.LOCAL.value), entry.size)
                opened.append(src)
                out.append(src)
                seen.add(os.path.realpath(paths[name]))
            except OSError as e:
                logger.warning("rank %d: %s: %s", self.ctx.rank, name, e)
        for tier_name, d in self._local_copies(step):
            p = d / name
            if os.path.realpath(p) in seen or not p.exists():
                continue
            try:
                src = FileSource(p, tier_name if tier_name != "fetched" else TierName.PEER.value, entry.size)
            except OSError:
                continue
            opened.append(src)
            out.append(src)
            seen.add(os.path.realpath(p))
        if in_persistent and self.ctx.persistent is not None and name not in self._remote \
                and sources.get(name) != TierName.PERSISTENT.value:
            out.append(self._persistent_range(step, name, entry))
        return out

    def _whole(self, f: FileLoad) -> Any:
        for src in f.sources:
            try:
                return whole_file(src, f.entry)
            except (OSError, ValueError, RuntimeError, TimeoutError) as e:
                logger.warning("rank %d: whole copy of %s from the %s tier: %s", self.ctx.rank, f.name, src.tier, e)
        raise undefined([f"{f.name} (whole file)"])

    def _refused(self, step: int, refused: tuple[str | None, str] | None) -> "_Unsafe | None":
        """Collective: did some rank refuse a file of ``step``? Then the tiers that served refused files
        are excluded for this step (on every rank) and the step is tried again from the next tier."""
        self._tell_refused(step, refused)
        return self._judge_refused(step, self._gather(refused, self.ctx.pg))

    def _tell_refused(self, step: int, refused: tuple[str | None, str] | None) -> None:
        if refused is not None and refused[1]:
            tier, msg = refused
            logger.error("rank %d: %s", self.ctx.rank, msg)
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=tier or "unknown", error=f"unsafe: {msg}")

    def _judge_refused(self, step: int, everyone: list[tuple[str | None, str] | None]) -> "_Unsafe | None":
        """Every rank's refusal (gathered by the caller, the same list on every rank) -> the same verdict."""
        if all(r is None for r in everyone):
            return None
        for r in everyone:
            if r is not None and r[0]:
                self._excluded.add((step, r[0]))
        return _Unsafe([r[1] for r in everyone if r is not None and r[1]])

    def _assemble(self, step: int, need: set[str], files: dict[str, FileEntry], in_persistent: bool,
                  have_already: tuple[dict[str, Path], dict[str, Any], dict[str, str]] | None = None,
                  lazy: bool = False, exclude: frozenset[str] = frozenset(),
                  land: dict[str, Landing] | None = None, prefetch: Callable[[], None] | None = None,
                  blocks: Mapping[str, frozenset[int]] | None = None
                  ) -> tuple[dict[str, Path], dict[str, Any], dict[str, str]] | None:
        """Collective: make every file in ``need`` (this rank's; others pass theirs) available here, verified.

        Sources, fastest first: a verified copy on this node (local dir, partner replica), another rank's
        verified copy over gloo, the persistent tier. Returns (paths on disk, bytes in memory, name ->
        tier), or None on every rank if some rank could not get some file.

        ``lazy``: this rank's own data files found on this node are only size-checked here; they are
        verified block by block as they land in the state (see ``load.py``). ``exclude``: names whose
        copies on this node failed verification (fetched from elsewhere, never offered to others).
        ``land``: with ``lazy``, where this rank's files received from a peer land (the state's tensors):
        a data file whose manifest gives its layout travels cut at its tensors and lands there, each block
        verified as it arrives (``self._landed``); its bad blocks are read again in ``_load_direct``.
        ``prefetch``: run on a thread of its own while this rank takes part in transfers (it loads the
        rank's own files from this node meanwhile). ``blocks``: files this rank reads only in part (a
        resharded restore, with ``lazy``): only those verification blocks travel from a peer.
        """
        paths, mem, sources = ({}, {}, {}) if have_already is None else have_already
        part = {n: tuple(sorted(b)) for n, b in (blocks or {}).items() if n in need} if lazy else {}
        # copies on this node of the step's files, offered in the same gather that tells what each rank needs
        # (one round trip, not two): those this rank needs are verified when it loads them; a copy only sent
        # to others is verified by its receiver (one read instead of two), here only its size is checked
        have: dict[str, tuple[str, Path]] = {}
        torn: dict[str, tuple[str, BaseException]] = {}
        for tier_name, d in self._local_copies(step):
            try:
                present = sorted(n for n in os.listdir(d) if n in files)
            except OSError:
                continue
            for n in present:
                if n in have or n in mem or n in exclude:
                    continue
                try:
                    if n in need and lazy and n != DCP_METADATA:
                        if os.path.getsize(d / n) != files[n].size:
                            raise CorruptFileError(f"{d / n}: size differs from the manifest (torn or "
                                                   "truncated write)")
                        self._lazy.add(n)
                    elif n in need:
                        # verified and loaded from one mapping of the file: one pass over its bytes
                        mem[n] = map_verified(d / n, files[n])
                    elif os.path.getsize(d / n) != files[n].size:
                        raise CorruptFileError(f"{d / n}: size differs from the manifest")
                    have[n] = (tier_name if tier_name != "fetched" else TierName.PEER.value, d / n)
                except (CorruptFileError, OSError) as e:
                    if n in need:
                        logger.warning("rank %d: %s copy of step %d skipped: %s", self.ctx.rank, tier_name, step, e)
                    else:
                        torn.setdefault(n, (tier_name, e))
        for n, p in paths.items():
            have.setdefault(n, (sources.get(n, TierName.LOCAL.value), p))
        asked = self._gather((sorted(need), part, sorted(set(have) | set(mem))), self.ctx.pg)
        needs = [a[0] for a in asked]
        parts = [a[1] for a in asked]
        everyone = [a[2] for a in asked]
        wanted = set().union(*(set(n) for n in needs))
        for n, (tier_name, e) in torn.items():
            if n in wanted and n not in have:
                logger.warning("rank %d: %s copy of step %d skipped: %s", self.ctx.rank, tier_name, step, e)

        fetch_plan = plan_fetch(needs, everyone, {n: files[n].size for n in wanted}, in_persistent, blocks=parts,
                                bounds={n: files[n].bounds() for p in parts for n in p})
        transfers = fetch_plan.transfers
        downloads = list(fetch_plan.downloads.get(self.ctx.rank, []))
        if not fetch_plan.feasible:
            gone = sorted({self._owner.get(n, r) for r, n in fetch_plan.missing})
            files_gone = sorted({n for _, n in fetch_plan.missing})
            self._why[step] = {"missing": "files", "ranks": gone, "files": files_gone[:20],
                               "tiers": _tiers_with(step, self._views)}
            logger.warning("step %d: files of rank(s) %s are on no tier (%s; looked at %s); trying an older step",
                           step, ", ".join(map(str, gone)), ", ".join(files_gone[:5]),
                           ", ".join(self._why[step]["tiers"]) or "none")
            return None
        for n in need:
            if n in have:
                sources.setdefault(n, have[n][0])
                paths.setdefault(n, have[n][1])

        fetch = self._fetch_dir(step)
        ok = True
        # the same on every rank (the sender cuts the file the way the receiver lands it)
        wire = {n: files[n] for n in sorted(wanted) if lazy and files[n].items and n != DCP_METADATA}
        incoming = (sum(t.size for t in transfers if t.dst == self.ctx.rank and t.name not in wire)
                    + sum(files[n].size for n in downloads))
        in_memory = incoming <= _memory_budget()
        try:
            if transfers:
                src_path = {n: str(p) for n, (_, p) in have.items()}
                src_mem = {n: b for n, b in mem.items()}
                bg = None
                if prefetch is not None and any(self.ctx.rank in (t.src, t.dst) for t in transfers):
                    bg = threading.Thread(target=prefetch, name="resilient-restore-local", daemon=True)
                    bg.start()
                try:
                    received = run_transfers(self.ctx.pg, self.ctx.rank, transfers, src_path=src_path, src_mem=src_mem,
                                             out_dir=None if in_memory else fetch, to_memory=in_memory,
                                             wire=wire, land=land)
                finally:
                    if bg is not None:
                        bg.join(self.ctx.config.collective_timeout_s)
                if bg is not None and bg.is_alive():
                    raise CheckpointError(f"loading this node's files did not finish within "
                                          f"{self.ctx.config.collective_timeout_s:.0f} s; is the disk hung?")
                for n, got in received.items():
                    if isinstance(got, Landed):
                        self._landed[n] = got
                        self._ranged_in[0] += got.received
                        self._ranged_in[1] = max(self._ranged_in[1], got.staged)
                        self._dirty = True
                        sources[n] = TierName.PEER.value
                        for b in got.bad:
                            logger.warning("rank %d: step %d: %s block %d from a peer: %s differs from the "
                                           "manifest; %s", self.ctx.rank, step, n, b, files[n].digest,
                                           "falling back to the persistent tier" if in_persistent
                                           else "trying the next copy")
                            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PEER.value,
                                       error=f"{n} block {b}: {files[n].digest} differs from the manifest")
                        continue
                    try:
                        if in_memory:
                            verify_bytes(got.data, files[n], what=f"{n} from a peer", crc=got.crc32c)
                            mem[n] = got.data
                        else:
                            verify_file(got, files[n])
                            paths[n] = got
                        sources[n] = TierName.PEER.value
                    except CorruptFileError as e:
                        if not in_persistent:
                            raise
                        logger.warning("rank %d: %s; falling back to the persistent tier", self.ctx.rank, e)
                        downloads.append(n)
            for n in downloads:
                if lazy and files[n].items and n != DCP_METADATA:
                    # read by blocks from the persistent tier straight into the state (see _load_direct)
                    self._remote.add(n)
                    sources[n] = TierName.PERSISTENT.value
                    continue
                if in_memory:
                    data = retry(lambda n=n: self.ctx.persistent.read_parallel(step, n, files[n].size),  # type: ignore
                                 what=f"download {n} of step {step}", retries=self.ctx.config.upload_retries,
                                 backoff_s=self.ctx.config.upload_backoff_s,
                                 backoff_max_s=self.ctx.config.upload_backoff_max_s)
                    verify_bytes(data, files[n], what=f"{n} from the persistent tier")
                    mem[n] = data
                else:
                    fetch.mkdir(parents=True, exist_ok=True)
                    dst = fetch / n
                    cfg = self.ctx.config
                    retry(lambda n=n, dst=dst: self.ctx.persistent.get_file(step, n, str(dst), files[n].size),  # type: ignore
                          what=f"download {n} of step {step}", retries=cfg.upload_retries,
                          backoff_s=cfg.upload_backoff_s, backoff_max_s=cfg.upload_backoff_max_s)
                    verify_file(dst, files[n])
                    paths[n] = dst
                sources[n] = TierName.PERSISTENT.value
        except FAILURES as e:
            ok = False
            logger.warning("rank %d: assembling step %d failed: %s", self.ctx.rank, step, e)
        if not self._all(ok):
            return None
        return paths, mem, sources

    def _plan_load(self, step: int, state: Mapping[str, Any], md: dict[str, Any], per_rank_keys: set[str],
                   world_old: int) -> "_LoadPlan":
        """What this rank loads, under which checkpoint keys; raises if the state does not fit the checkpoint."""
        plain = plain_state(state)
        leaves = flatten(plain)
        load_sd: dict[str, Any] = {}
        key_of: dict[str, str] = {}
        expand: dict[str, list[str]] = {}
        missing, shape_mismatch = [], {}
        reshard: dict[str, str] = {}
        resized = world_old != self.ctx.world_size
        params = param_like(state)
        for fqn, (path, v) in leaves.items():
            key = fqn
            if fqn in per_rank_keys:
                pk = _per_rank_key(self.ctx.rank, fqn)
                own = pk in md or any(k.startswith(pk + ".") for k in md)
                if resized and self._is_object(v, md, fqn, world_old):
                    # a per-rank object (a data position, a shard index, a counter) cannot be split, merged
                    # or copied: a copy makes two ranks repeat the same data, a dropped one skips data
                    gone = [r for r in range(self.ctx.world_size, world_old) if _per_rank_key(r, fqn) in md]
                    if not own:
                        reshard[fqn] = f"a per-rank object with no value saved for rank {self.ctx.rank}"
                        continue
                    if gone:
                        reshard[fqn] = (f"a per-rank object whose values of ranks {gone[0]}-{gone[-1]} would be "
                                        "dropped" if len(gone) > 1 else
                                        f"a per-rank object whose value of rank {gone[0]} would be dropped")
                        continue
                if own:
                    key = pk
                elif self.ctx.rank == 0 or self.ctx.rank >= world_old:
                    # tensors (RNG states, running statistics): a copy of a saved rank's value is a valid start
                    logger.warning("per-rank value %r has no entry for rank %d (saved with %d ranks); "
                                   "using the shared one", fqn, self.ctx.rank, world_old)
                m = md.get(key)
                if resized and isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata) \
                        and tuple(m.size) != tuple(v.shape):
                    reshard[fqn] = (f"a per-rank tensor saved as {list(m.size)}, here {list(v.shape)} (its size "
                                    "follows the number of ranks)")
                    continue
            key_of[fqn] = key
            if isinstance(v, Mapping) and not v:
                # an empty container (a fresh optimizer's state) is filled from what the checkpoint holds
                sub = [k for k in md if k.startswith(key + ".")]
                expand[fqn] = sub
                for k in sub:
                    m = md[k]
                    like = params.get(k.rsplit(".", 1)[0]) if isinstance(m, TensorStorageMetadata) else None
                    if like is not None and tuple(like.shape) == tuple(m.size):
                        with torch.no_grad():
                            load_sd[k] = torch.empty_like(like, dtype=m.properties.dtype, requires_grad=False)
                    elif isinstance(m, TensorStorageMetadata):
                        load_sd[k] = torch.empty(m.size, dtype=m.properties.dtype)
                    else:
                        load_sd[k] = None
                continue
            if key not in md and not any(k.startswith(key + ".") for k in md):
                missing.append(fqn)
                continue
            m = md.get(key)
            if isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata):
                if tuple(m.size) != tuple(v.shape):
                    shape_mismatch[fqn] = (tuple(m.size), tuple(v.shape))
                    continue
            elif isinstance(v, torch.Tensor) and isinstance(m, BytesStorageMetadata):
                shape_mismatch[fqn] = ((), tuple(v.shape))
                continue
            load_sd[key] = v
        if missing or shape_mismatch:
            known = set(leaves)
            unexpected = sorted(k for k in md if not k.startswith("__rank") and
                                not any(k == f or k.startswith(f + ".") for f in known))
            raise CheckpointMismatchError(step, sorted(missing), unexpected, shape_mismatch)
        return _LoadPlan(plain=plain, leaves=leaves, load_sd=load_sd, key_of=key_of, expand=expand,
                         reshard=reshard)

    @staticmethod
    def _is_object(v: Any, md: dict[str, Any], fqn: str, world_old: int) -> bool:
        """Is the per-rank value ``fqn`` a Python object (in the state, or as saved) rather than a tensor?"""
        if not isinstance(v, torch.Tensor):
            return True
        saved = [md.get(_per_rank_key(r, fqn)) for r in range(world_old)] + [md.get(fqn)]
        return any(isinstance(m, BytesStorageMetadata) for m in saved)

    def _finish_load(self, state: Mapping[str, Any], plan: "_LoadPlan") -> None:
        """Put loaded values back where the state keeps them; hand Stateful objects their state dicts."""
        plain, load_sd = plan.plain, plan.load_sd
        for fqn, (path, v) in plan.leaves.items():
            if fqn in plan.expand:
                prefix = plan.key_of[fqn] + "."
                value: dict[Any, Any] = {}
                for k in plan.expand[fqn]:
                    parts = [int(p) if p.isdigit() else p for p in k[len(prefix):].split(".")]
                    cur = value
                    for p in parts[:-1]:
                        cur = cur.setdefault(p, {})
                    cur[parts[-1]] = load_sd[k]
                new = value
            else:
                new = load_sd[plan.key_of[fqn]]
            if path and new is not v:  # a tensor loaded in place is already there
                set_path(plain, path, new)
        for k, v in state.items():
            if is_stateful(v):
                v.load_state_dict(plain[k])
            elif isinstance(state, dict) and plain[k] is not v:
                state[k] = plain[k]


def _ranged_stats(direct: _Direct, need: set[str], files: Mapping[str, FileEntry],
                  received: list[int]) -> dict[str, int]:
    """What this rank read of the step's data files, against the bytes of its state (its new shard):
    ``shard`` (bytes landing in the state), ``read`` (bytes of the verification blocks read, from any copy),
    ``beyond`` (read - shard: headers and the rest of each block, checked and dropped), ``peer`` (bytes
    received from peers), and ``held``: the most bytes held beside the state at once (a scratch piece per
    loading thread, a received file's staging buffers), all on the first try (a bad block read again adds
    its block)."""
    shard = read = 0
    for name in sorted(need - {DCP_METADATA}):
        spans = direct.spans.get(name)
        if spans is None:
            read += files[name].size  # no layout: read whole (DCP's path)
            continue
        shard += sum(s.n for s in spans if s.takes)
        bounds = files[name].bounds()
        chosen = direct.blocks.get(name)
        read += sum(b - a for i, (a, b) in enumerate(bounds) if chosen is None or i in chosen)
    names = sorted(need - {DCP_METADATA})
    threads = min(THREADS, max(1, sum(len(direct.blocks.get(n) or files[n].bounds()) for n in names)))
    scratch = max((min(PIECE, max(b - a for a, b in files[n].bounds())) for n in names), default=0)
    return {"shard": shard, "read": read, "beyond": read - shard, "peer": received[0],
            "held": threads * scratch + received[1]}


def _agreed_snapshot(offers: list[list[tuple[int, str]] | None]) -> tuple[int, str] | None:
    """The newest (step, lineage) every rank holds a snapshot of; None when some rank holds none."""
    if not offers or any(o is None for o in offers):
        return None
    common = set.intersection(*({(int(s), str(e)) for s, e in o} for o in offers))  # type: ignore[union-attr]
    return max(common) if common else None


def _tiers_with(step: int, views: list[dict[str, list[int]]]) -> list[str]:
    """The tiers some rank saw ``step`` committed on (the ones a restore of it looked at)."""
    return sorted({t for v in views for t, steps in v.items() if step in steps})


def _said(why: Mapping[str, Any]) -> str:
    """A step's reason to fail, in words, for the error's message (its first line is all some readers keep)."""
    ranks = why.get("ranks")
    who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "some ranks"
    what = "manifests" if why.get("missing") == "manifests" else "files"
    files = why.get("files") or []
    names = f" ({', '.join(files[:3])}{' …' if len(files) > 3 else ''})" if files and ranks else ""
    return f"{what} of {who}{names} on no tier (looked at {', '.join(why.get('tiers') or []) or 'none'})"
