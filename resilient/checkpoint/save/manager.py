"""``CheckpointManager``: stage → local → peer → persistent, and restore from the fastest verified tier.

The manager is a façade: saving lives here; the peer ring is in :mod:`resilient.checkpoint.replicate.peer`,
uploads in :mod:`resilient.checkpoint.upload.uploader` and restore in :mod:`resilient.checkpoint.restore.restore`,
each a component over one shared :class:`~resilient.checkpoint.storage.context.Context`, called through its
public methods.

Over 700 lines: the save path (staging hand-off, the save worker's collective sequence, the commit and the
in-memory fallback) is one sequence whose steps every rank must take in the same order; split across files
it would be read out of order.

Threads: ``save()`` runs on the training thread and only stages (or, in overlapped mode, arms the
mutation guard); one *save worker* thread does everything collective for saves in FIFO order on the
manager's own gloo group (``dcp.save``, manifests, commit, peer replication, retention); one *upload*
thread copies committed local steps to the persistent tier on a second group of its own. Every rank
issues the same sequence of saves, so the collective sequences match across ranks.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from resilient import env as _env
from resilient.checkpoint.api import (CKPT_STOP_MARK_DIR, COMMIT_MARKER, CheckpointConfig, CheckpointConfigError,
                                      CheckpointError, CheckpointSavesFailedError, DCP_METADATA,
                                      DEFAULT_BACKGROUND_NICE,
                                      DEFAULT_MAX_FAILED_SAVES, FileEntry, Manifest, RestoreResult, TierName)
from resilient.checkpoint.format import rank_index
from resilient.checkpoint.format.digests import (BLOCK, bytes_blocks, bytes_entry, crc_bytes, file_blocks,
                                                 file_entry)
from resilient.checkpoint.format.layout import manifest_name
from resilient.checkpoint.format.safe import load_metadata
from resilient.checkpoint.format.state import dtensor_type, flatten, leaf_nbytes, local_tensor, plain_state
from resilient.checkpoint.replicate.peer import PeerRing
from resilient.checkpoint.restore.load import FileSource, MemSource, file_layout
from resilient.checkpoint.restore.restore import Restorer
from resilient.checkpoint.save import plan as _plan
from resilient.checkpoint.save.interval import IntervalTuner
from resilient.checkpoint.storage.priority import lower_thread_priority
from resilient.checkpoint.save.stage import MutationGuard, Stager
from resilient.checkpoint.snapshot.ring import SnapshotRing
from resilient.checkpoint.save.writer import MemoryWriter, RecordWriter
from resilient.checkpoint.storage.collective import Ranks
from resilient.checkpoint.storage.context import (Context, FAILURES, one_line as _one_line,
                                                  per_rank_key as _per_rank_key)
from resilient.checkpoint.storage.retention import retain
from resilient.checkpoint.storage.tiers import BoundedTier, DirTier, make_tier
from resilient.checkpoint.upload.uploader import Uploader
from resilient.events.api import EventKind
from resilient.events.ledger import Ledger
from resilient.worker.preemption import preempt_save_due as _preempt_save_due
from resilient.worker.steps import checkpoint_section as _checkpoint_section, restore_section as _restore_section

logger = logging.getLogger(__name__)

_SMALL = 1 << 20  # leaves up to this size are compared across ranks to find per-rank values
DEFAULT_AUTO_FALLBACK = 10


def _blocked_entry(data: bytes) -> FileEntry:
    """A file's entry with its verification blocks (what a manifest lists)."""
    return bytes_blocks(data, BLOCK)


def _close_at_exit(ref: "weakref.ref[CheckpointManager]") -> None:
    ck = ref()
    if ck is not None and not ck._closed:
        try:
            ck.close(timeout=min(120.0, ck.config.collective_timeout_s), at_exit=True)
        except FAILURES as e:  # exit goes on whatever happens here
            logger.warning("finishing checkpoints at exit failed: %s", e)


def _is_dtensor(v: Any) -> bool:
    dt = dtensor_type()  # looked up once: an import statement per leaf per save showed in the save's profile
    return dt is not None and isinstance(v, dt)


def _digest(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        if _is_dtensor(v):
            # a subclass has no .numpy(): this rank's bytes are its local shard (plus where it sits)
            return crc_bytes(f"{v.placements}".encode(), _digest(local_tensor(v)))
        t = v.detach().cpu().contiguous().reshape(-1)
        # no hash(): string hashes differ between processes
        return crc_bytes(memoryview(t.view(torch.uint8).numpy()), crc_bytes(f"{tuple(v.shape)}{v.dtype}".encode()))
    try:
        return crc_bytes(pickle.dumps(v, protocol=4))
    except Exception:  # unpicklable: treat as per-rank, DCP would fail on it anyway
        return id(v)


def _steps_text(steps: list[int], most: int = 12) -> str:
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:most // 2])) + f", … ({len(steps) - most} more) …, " + \
        ", ".join(map(str, steps[-(most // 2):]))


@dataclass
class _AgreeJob:
    """The snapshot cadence agreed on the save worker without a save: queued at the same ``save()`` call on every
    rank (so every rank's worker meets it in the same order among the save jobs), in force from ``start`` or, when a
    rank's training had gone further by the time every worker got to it, that many steps past the furthest rank.
    Queued early in an attempt (``_AGREE_AT_CALL``) and then every ``_REAGREE_CALLS`` calls."""

    start: int
    done: threading.Event = field(default_factory=threading.Event)


# save() calls before the early agreement: the first two take the snapshots that measure the cost
_AGREE_AT_CALL = 3
# steps between that call (or the furthest rank's step when the workers met) and the agreed cadence's first step.
# Training runs in step with its peers, so no rank is that far ahead; one that still passed it before its worker
# installed the cadence misses the snapshots before it (the others' of those steps are never used: a restore takes a
# step every rank holds), and the ones after it are taken by every rank
_AGREE_AHEAD = 4
# save() calls between two agreements after the early one. A disk save agrees the cadence as well, but in force only
# after the next disk save (see _after_next_save): with a long disk interval, a cadence measured on the first steps
# (a warm-up, or steps that later slow down) would hold for two disk intervals. One small gather on the save worker
_REAGREE_CALLS = 50


@dataclass
class _SaveJob:
    step: int
    objects: dict[str, Any]
    tensors: dict[str, Any]  # staged buffers, or live tensors to stage (overlap mode)
    upload: bool
    staged: threading.Event = field(default_factory=threading.Event)  # buffers filled
    written: threading.Event = field(default_factory=threading.Event)  # buffers free again
    decided: threading.Event = field(default_factory=threading.Event)  # interval for the next save known
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    # set by the save worker once known, the same on every rank: True when the step reached a tier (or an upload
    # of its in-memory copy was queued), False for a failed save
    reached: bool | None = None
    via_upload: bool = False  # reached only as a queued upload of its in-memory copy (the local write failed)
    # the save worker's stop verdict as it stood when this job's buffers were released (see _release): every
    # rank reads it at the same save() call, so every rank stops at the same step
    stop: dict[str, Any] | None = None


class _Interval:
    """When to save: a fixed number of steps, or ``auto`` from goodput's IntervalTuner on rank 0."""

    def __init__(self, interval: int | str, persistent_every: int | str, rank: int,
                 tuner_options: dict[str, Any] | None = None):
        self.auto = interval == "auto"
        self.auto_persistent = persistent_every == "auto"
        self.tuner: Any = None
        self.steps = interval if isinstance(interval, int) else DEFAULT_AUTO_FALLBACK
        self.persistent_every = persistent_every if isinstance(persistent_every, int) else 5
        if self.auto or self.auto_persistent:
            try:
                run_dir = os.environ.get(_env.RUN_DIR)
                if run_dir and rank == 0:
                    # remembers earlier attempts (restarts, save and step times) from the run's ledger
                    self.tuner = IntervalTuner.from_run_dir(run_dir, **(tuner_options or {}))
                else:
                    self.tuner = IntervalTuner(**(tuner_options or {}))
                    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
                        self.tuner.observe_interruption()
                if self.auto:
                    self.steps = max(1, int(self.tuner.interval_steps()))
                if self.auto_persistent:
                    self.persistent_every = max(1, int(self.tuner.persistent_every()))
            except Exception as e:  # a tuner bug must not stop training: fixed intervals instead
                if rank == 0:
                    warnings.warn(f"interval='auto' unavailable ({e}); saving every {DEFAULT_AUTO_FALLBACK} steps",
                                  stacklevel=3)
                self.tuner = None
        self.next_save: int | None = None
        self.recorded = False  # whether a decision of this manager's is in the ledger (CKPT_INTERVAL)
        self._last_call: float | None = None
        self.lock = threading.Lock()  # the tuner is fed from the training, save and upload threads

    def observe_restore(self, tier: str | None, covered: bool = False) -> None:
        if self.tuner is not None:
            try:
                with self.lock:
                    self.tuner.observe_restore(tier, covered=covered)
            except Exception as e:  # a tuner bug must not stop training
                logger.debug("tuner.observe_restore failed: %s", e)

    def observe_call(self) -> None:
        now = time.perf_counter()
        if self.tuner is not None and self._last_call is not None:
            try:
                with self.lock:
                    self.tuner.observe_step(now - self._last_call)
            except Exception as e:
                logger.debug("tuner.observe_step failed: %s", e)
        self._last_call = now

    def due(self, step: int) -> bool:
        if not self.auto:
            return (step + 1) % self.steps == 0
        if self.next_save is None:
            self.next_save = step + self.steps - 1
        return step >= self.next_save


class CheckpointManager:
    """Multi-tier asynchronous checkpointing for a training loop (see the issue's public API).

    Construction, ``save`` at a due step, ``restore``, ``wait`` and ``close`` are collective when a
    process group is initialised: every rank calls them in the same order.

    ``local`` may hold ``{node}``/``{rank}``/``{local_rank}`` (one machine standing in for several
    nodes); ``interval``/``persistent_every`` may be ``"auto"`` (goodput's ``IntervalTuner`` on rank 0,
    built with ``tuner_options``, broadcast to all ranks); ``overlap=True`` stages behind the next
    forward/backward; ``snapshot="auto"`` snapshots into node memory as often as keeps their cost within
    ``snapshot_budget`` of the step time. Per-rank values (RNG states, data positions: any small leaf whose value differs
    across ranks at save time) are stored per rank and come back per rank.
    """

    def __init__(self, local: str | os.PathLike[str] | None = None, persistent: str | None = None,
                 interval: int | str = 10, persistent_every: int | str = 5, peer: bool = True, *,
                 overlap: bool = False, keep_local: int = 2, keep_peer: int = 2, keep_persistent: int = 3,
                 storage_options: dict[str, Any] | None = None, upload_retries: int = 6,
                 upload_backoff_s: float = 0.5, upload_backoff_max_s: float = 8.0,
                 collective_timeout_s: float = 600.0, tuner_options: dict[str, Any] | None = None,
                 persistent_timeout_s: float = 30.0, restore_probe_s: float = 5.0,
                 upload_grace_s: float | None = None, max_failed_saves: int | str = DEFAULT_MAX_FAILED_SAVES,
                 background_nice: int | str = DEFAULT_BACKGROUND_NICE, upload_process: bool | str = "auto",
                 snapshot: int | str = "auto",
                 snapshot_dir: str | os.PathLike[str] | None = None,
                 snapshot_budget: float = CheckpointConfig.snapshot_budget):
        if upload_grace_s is None:  # the job's --upload-grace, when resilient-run started this process
            try:
                upload_grace_s = _env.upload_grace_s()
            except ValueError as e:
                raise CheckpointConfigError(f"{e} (resilient-run --upload-grace S)") from None
        self.config = CheckpointConfig(
            local=os.fspath(local) if local is not None else None, persistent=persistent, interval=interval,
            persistent_every=persistent_every, peer=peer, overlap=overlap, keep_local=keep_local,
            keep_peer=keep_peer, keep_persistent=keep_persistent, upload_retries=upload_retries,
            upload_backoff_s=upload_backoff_s, upload_backoff_max_s=upload_backoff_max_s,
            collective_timeout_s=collective_timeout_s, storage_options=dict(storage_options or {}),
            persistent_timeout_s=persistent_timeout_s, restore_probe_s=restore_probe_s,
            upload_grace_s=upload_grace_s, max_failed_saves=max_failed_saves, background_nice=background_nice,
            upload_process=upload_process,
            snapshot=snapshot, snapshot_budget=snapshot_budget,
            # the node's directory in memory, when resilient-run made one (it outlives this process)
            snapshot_dir=snapshot_dir if snapshot_dir is not None else os.environ.get(_env.CKPT_SNAPSHOT_DIR) or None)
        cfg = self.config
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        lws = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size) or self.world_size) if self._dist else 1
        if lws < 1 or self.world_size % lws:
            lws = self.world_size
        self.local_world_size = lws
        self.node = self.rank // lws
        self.nnodes = self.world_size // lws
        self.local_rank = self.rank % lws
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        # groups of our own: async DCP on the user's default group can hang, and the save worker and
        # the uploader must not interleave collectives on one group
        self._pg = dist.new_group(backend="gloo", timeout=timeout) if self._dist else None
        self._pg_up = (dist.new_group(backend="gloo", timeout=timeout)
                       if self._dist and cfg.persistent else None)

        self.local = None
        self.peer = None
        self._replicating = False
        self._scratch: Path
        if cfg.local:
            root = cfg.local.format(node=self.node, rank=self.rank, local_rank=self.local_rank)
            self.local = DirTier(root, name=TierName.LOCAL.value)
            self.local.root.mkdir(parents=True, exist_ok=True)
            self._scratch = self.local.root
            if cfg.peer:
                # restore reads the partner's copy whatever the world is now: a job scaled down to one node
                # still needs the lost node's shards; replication needs a partner to send to
                self.peer = DirTier(self.local.root / "peer", name=TierName.PEER.value)
            self._replicating = self.peer is not None and self.nnodes > 1
            if cfg.peer and self.rank == 0 and self.nnodes == 1 and self._dist:
                logger.info("peer replication off: one node (LOCAL_WORLD_SIZE=%d = WORLD_SIZE)", lws)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="resilient-ckpt-")
            self._scratch = Path(self._tmp.name)
        # every call to the persistent store is bounded: a dead store must cost seconds, not minutes
        self.persistent = (BoundedTier(make_tier(cfg.persistent, TierName.PERSISTENT.value, cfg.storage_options),
                                       cfg.persistent_timeout_s) if cfg.persistent else None)

        self._ledger = Ledger.from_env()
        self._snap = self._snapshot_ring()
        self._ctx = Context(config=cfg, rank=self.rank, world_size=self.world_size, local_world_size=lws,
                            distributed=self._dist, pg=self._pg, pg_up=self._pg_up, local=self.local,
                            peer=self.peer, persistent=self.persistent, scratch=self._scratch, ledger=self._ledger,
                            snapshot=self._snap)
        self._interval = _Interval(cfg.interval, cfg.persistent_every, self.rank, tuner_options)
        if self._interval.auto or self._interval.auto_persistent:
            # every rank must save on the same steps: rank 0's tuner decides
            self._interval.steps, self._interval.persistent_every = self._bcast(
                (self._interval.steps, self._interval.persistent_every), self._pg)
        self._stager = Stager()
        self._guard = MutationGuard(timeout_s=cfg.collective_timeout_s)
        self._last_job: _SaveJob | None = None
        self._saves_since_upload = 0
        self._guard_wait_reported = 0.0
        self._closed = False
        self._error_lock = threading.Lock()
        self.last_restore: RestoreResult | None = None
        # written by the save worker only (see last_saved_step)
        self._saved_step: int | None = None
        self._failed_streak: list[tuple[int, str | None, str | None]] = []  # (step, tier, error) in a row
        self._newest_reached: int | None = None  # the newest step that reached a tier (the streak is after it)
        # steps that reached the persistent tier only as a queued upload of their in-memory copy (their local write
        # failed): counted, as reached or failed, once their upload's outcome is agreed (_count_uploads)
        self._via_upload: set[int] = set()
        # (rank 0) the last step whose .metadata every node holds, with its RecordMemo generation and ids
        self._spread_last: tuple[int, tuple[int, int], tuple[bytes, ...]] | None = None
        self._index_encoder = rank_index.Encoder()  # this rank's index as its manifests carry it
        self.spread_by_ids = 0  # local saves whose .metadata reached the other nodes as ids, not the file
        self._stop: dict[str, Any] | None = None
        self._traceback_written = False
        self._t_created = time.time()

        self._jobs: queue.Queue[_SaveJob | _AgreeJob | None] = queue.Queue()
        # with snapshots on auto, the cadence is agreed early (_AGREE_AT_CALL) instead of at the first disk save, which
        # with a long interval leaves a first attempt without snapshots for two intervals (a restore that carried a
        # cadence over starts with it instead), and again every _REAGREE_CALLS calls. Decided from configuration,
        # save() calls and gathered results only: the same on every rank. None: no agreement outside disk saves
        self._agree_at_call: int | None = _AGREE_AT_CALL if self.config.snapshot == "auto" else None
        self._save_calls = 0
        self._train_step = -1  # the step of the newest save() call (the training thread's; read by the save worker)
        self._agree_job: _AgreeJob | None = None
        self._planners: dict[str, _plan.CachedSavePlanner] = {}  # by writer kind; used by the save thread only
        self._worker = threading.Thread(target=self._save_loop, name="resilient-ckpt-save", daemon=True)
        self._worker.start()
        self._grace_until: float | None = None  # see wait()
        self._ring = PeerRing(self._ctx)
        self._restorer = Restorer(self._ctx)
        self._up = Uploader(self._ctx, self._interval)
        self._uploader: Uploader | None = None
        if self.persistent is not None:
            self._up.start(on_start=self._lower_priority)
            self._uploader = self._up
        # a script that ends right after its last save() must not lose it with the daemon threads
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ construction from env
    @classmethod
    def from_env(cls, **overrides: Any) -> "CheckpointManager":
        """Tiers and intervals from the ``RESILIENT_CKPT_*`` variables ``resilient-run`` exports."""
        kw: dict[str, Any] = {
            "local": os.environ.get(_env.CKPT_LOCAL) or None,
            "persistent": os.environ.get(_env.CKPT_PERSISTENT) or None,
        }
        if os.environ.get(_env.CKPT_INTERVAL):
            kw["interval"] = os.environ[_env.CKPT_INTERVAL]
        if os.environ.get(_env.CKPT_PERSISTENT_EVERY):
            kw["persistent_every"] = os.environ[_env.CKPT_PERSISTENT_EVERY]
        if os.environ.get(_env.CKPT_MAX_FAILED_SAVES):
            kw["max_failed_saves"] = os.environ[_env.CKPT_MAX_FAILED_SAVES]
        if os.environ.get(_env.CKPT_SNAPSHOT):
            kw["snapshot"] = os.environ[_env.CKPT_SNAPSHOT]
        if os.environ.get(_env.CKPT_UPLOAD_PROCESS):
            kw["upload_process"] = os.environ[_env.CKPT_UPLOAD_PROCESS]
        kw.update(overrides)
        if not kw.get("local") and not kw.get("persistent"):
            raise CheckpointError(f"no checkpoint tier configured: set {_env.CKPT_LOCAL} and/or "
                                  f"{_env.CKPT_PERSISTENT} (resilient-run --ckpt-local/--ckpt-persistent)")
        return cls(**kw)

    def _snapshot_ring(self) -> Any:
        """This rank's snapshot ring in the node's memory directory, or None (off, or no directory)."""
        cfg = self.config
        if not cfg.snapshot or not cfg.snapshot_dir:
            return None
        if not os.path.isdir(cfg.snapshot_dir):
            logger.warning("snapshot tier off: its directory %s does not exist", cfg.snapshot_dir)
            self._emit(EventKind.CKPT_TIER_FAILED, step=None, tier="snapshot",
                       error=f"its directory {cfg.snapshot_dir} does not exist")
            return None
        def failed(why: str) -> None:
            self._emit(EventKind.CKPT_TIER_FAILED, step=None, tier="snapshot", error=why)

        def skipped(step: int, why: str) -> None:
            # in the ledger, not only the log: a tier that skips is a tier a restart may not find (no save failed: a
            # snapshot step is no disk save, so the report's failed saves do not count it)
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier="snapshot", error=why, skipped=True)

        return SnapshotRing(cfg.snapshot_dir, self.rank, self.world_size, every=cfg.snapshot,
                            budget=cfg.snapshot_budget, on_failure=failed, on_skipped=skipped)

    def _snap_proposal(self) -> int | None:
        """This rank's snapshot cadence for the agreement at a save (0: none here; None: not measured yet)."""
        return 0 if self._snap is None else self._snap.proposal()

    def _snap_agree(self, proposals: list[int | None], start: int) -> None:
        """On the save worker, every rank with the same ``proposals``: the slowest rank's cadence, or none when a rank
        has none (a snapshot is used only when every rank holds it), in force from step ``start``."""
        if self._snap is None or not self._snap.auto or any(p is None for p in proposals):
            return
        k = 0 if any(p == 0 for p in proposals) else max(int(p) for p in proposals)  # type: ignore[arg-type]
        if self._snap.agree(k, start) and self.rank == 0:
            logger.info("snapshots in node memory: %s", f"every {k} step(s) from step {start} "
                        f"(the slowest rank's cost within {self.config.snapshot_budget:.0%} of its step)"
                        if k else "off (a rank has none)")
            self._emit(EventKind.CKPT_SNAPSHOT_CADENCE, every=k, from_step=start, source="agreed",
                       proposals=list(proposals))

    def _after_next_save(self, job: _SaveJob) -> int:
        # the training thread waits at the next save for this one's write, so no rank is past that step yet
        return job.step + self._interval.steps + 1

    def _agree_early(self, job: _AgreeJob) -> None:
        """On the save worker: the cadence agreed from every rank's measured proposal (see ``_AGREE_AHEAD``)."""
        try:
            got = self._gather((self._snap_proposal(), self._train_step), self._pg)
            start = max(job.start, max(s for _, s in got) + _AGREE_AHEAD)
            self._snap_agree([p for p, _ in got], start)
        except FAILURES as e:
            logger.warning("snapshot cadence not agreed again (%s); the one in force goes on until a checkpoint save "
                           "or the next agreement", _one_line(e))
        finally:
            job.done.set()

    @property
    def snapshot(self) -> Any:
        """This rank's :class:`~resilient.checkpoint.snapshot.ring.SnapshotRing`, None when the tier is off."""
        return self._snap

    # ------------------------------------------------------------------ events
    def _emit(self, kind: EventKind, **details: Any) -> None:
        if self._ledger is not None:
            self._ledger.emit(kind, rank=self.rank, **details)

    # ------------------------------------------------------------------ collectives helpers
    def _ranks(self, group: Any) -> Ranks:
        return Ranks(group, self.rank, self.world_size, self._dist)

    def _gather(self, obj: Any, group: Any) -> list[Any]:
        return self._ranks(group).gather(obj)

    def _bcast(self, obj: Any, group: Any) -> Any:
        return self._ranks(group).broadcast(obj)

    def _all(self, ok: bool) -> bool:
        return all(self._gather(bool(ok), self._pg))

    # ------------------------------------------------------------------ save
    @property
    def interval(self) -> int:
        return self._interval.steps

    def save(self, step: int, state: Mapping[str, Any], force: bool = False) -> bool:
        """Save ``state`` as step ``step`` if the interval says so (or ``force``). Returns whether it did.

        Blocks only to copy the state to host memory (default mode) or not at all (``overlap=True``:
        the copy runs behind the next forward/backward while hooks keep the optimizer from stepping
        before it is done). The state may be changed as soon as this returns.
        """
        if self._closed:
            raise CheckpointError("save() after close()")
        self._interval.observe_call()
        self._train_step = step
        self._grace_until = None  # training went on: a later wait() gets a fresh upload grace
        snap = self._snap
        if snap is not None:
            snap.observe_call()
            if snap.due(step):
                snap.take(step, state)
        if self._agree_at_call is not None:
            self._save_calls += 1
            if self._save_calls >= self._agree_at_call:
                self._agree_at_call = self._save_calls + _REAGREE_CALLS
                self._agree_job = _AgreeJob(start=step + _AGREE_AHEAD)
                self._jobs.put(self._agree_job)
        if not (force or self._interval.due(step) or _preempt_save_due(step)):  # a preempted job's last step
            return False
        # the agent holds the blocking part to the section's own learned timeout, not to the step's
        with _checkpoint_section():
            return self._save_due(step, state)

    def _save_due(self, step: int, state: Mapping[str, Any]) -> bool:
        t0 = time.perf_counter()
        if self._uploader is not None:
            self._up.warm()  # the upload process starts while this save is written, not when its upload waits
        prev = self._last_job
        if prev is not None:
            # one set of staging buffers: the previous step must be on disk before we overwrite them
            self._wait_event(prev.written, "previous checkpoint write")
            if self._interval.auto or self._interval.auto_persistent:
                # the tuner's answer is broadcast in the background; read it only once every rank has it
                self._wait_event(prev.decided, "interval decision")
            if prev.stop is not None:
                self._stop_training(prev.stop)
        if self._interval.auto:
            self._interval.next_save = step + self._interval.steps
        plain = plain_state(state)
        leaves = {fqn: v for fqn, (_, v) in flatten(plain).items()}
        objects = self._stager.stage(leaves, tensors=False)
        tensors_in = {k: v for k, v in leaves.items() if isinstance(v, torch.Tensor)}
        if self.config.overlap:
            self._guard.arm()
            tensors = tensors_in
        else:
            tensors = self._stager.stage(tensors_in, objects=False)
            self._stager.synchronize()
        self._saves_since_upload += 1
        upload = self.persistent is not None and self._saves_since_upload >= self._interval.persistent_every
        if upload:
            self._saves_since_upload = 0
        job = _SaveJob(step=step, objects=objects, tensors=tensors, upload=upload)
        if not self.config.overlap:
            job.staged.set()
        self._last_job = job
        self._jobs.put(job)
        blocking = time.perf_counter() - t0
        hook_wait = self._guard.waited_s - self._guard_wait_reported
        self._guard_wait_reported = self._guard.waited_s
        nbytes = sum(leaf_nbytes(v) for v in tensors_in.values())
        if self._interval.tuner is not None and self.rank == 0:
            try:
                with self._interval.lock:
                    self._interval.tuner.observe_save(blocking + hook_wait)
            except FAILURES as e:
                logger.debug("tuner.observe_save failed: %s", e)
        if self.rank == 0:
            self._emit(EventKind.CKPT_SAVE, step=step, blocking_seconds=blocking + hook_wait, bytes=nbytes,
                       mode="overlap" if self.config.overlap else "default", hook_wait_seconds=hook_wait)
        return True

    def _wait_event(self, ev: threading.Event, what: str) -> None:
        if not ev.wait(self.config.collective_timeout_s):
            raise CheckpointError(f"{what} did not finish within {self.config.collective_timeout_s:.0f} s; "
                                  "is a rank stuck or its disk hung?")

    def _lower_priority(self) -> None:
        """In a background thread, before its first job: yield the CPU to training (``background_nice``)."""
        lower_thread_priority(self.config.background_nice)

    def _save_loop(self) -> None:
        self._lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _AgreeJob):
                self._agree_early(job)
                continue
            try:
                self._do_save(job)
            except BaseException as e:  # fail static: a failed save is reported, training goes on; the
                # worker survives whatever the save raised, or every later save() would wait on it
                tier = self.local.name if self.local is not None else TierName.PERSISTENT.value
                self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=tier, error=_one_line(e))
                self._settle(job, False, tier, _one_line(e), e)
            finally:
                if not job.staged.is_set():
                    job.staged.set()
                    self._guard.release()
                if job.reached is None:  # a path that settled nothing: the step reached no tier
                    self._settle(job, False, None, "the save ended without a result")
                self._release(job)
                job.decided.set()
                job.done.set()

    # ------------------------------------------------------------------ save outcomes (save worker only)
    def _release(self, job: _SaveJob) -> None:
        """The staging buffers are free: the next save() may stage. The stop verdict known now travels with
        the job, so every rank reads the same verdict at the same save() call."""
        if not job.written.is_set():
            job.stop = self._stop
            job.written.set()

    def _settle(self, job: _SaveJob, reached: bool, tier: str | None, error: str | None,
                exc: BaseException | None = None) -> None:
        """Record whether ``job`` reached a tier. Save worker only, on every rank with the same ``reached``
        (each caller decides from a collective result), once per job. A job saved only as a queued upload
        (``job.via_upload``) counts as reached for ``wait()`` until its upload fails, and toward the failed saves
        once its upload's outcome is agreed (:meth:`_count_uploads`)."""
        if job.reached is not None:
            return
        job.reached = reached
        if reached and job.via_upload:
            self._via_upload.add(job.step)
            return
        self._count(job.step, reached, tier, error, exc)

    def _count_uploads(self, known: list[dict[int, tuple[bool, str | None, int | None]]]) -> None:
        """Count the saves that went to the persistent tier only as a queued upload, now that their uploads'
        outcomes are known. ``known`` is every rank's part of a gather (what each rank's uploader already decided,
        the same outcome on every rank but learnt at different times): its union is the same on every rank, so
        every rank counts the same saves at the same save and reads the same stop verdict. Without this, a full
        disk and a dead store together trained on without a checkpoint and never stopped. A save whose upload was
        replaced by a newer step's before it started is reported (it reached no tier) but not counted: the newer
        save's outcome stands for it."""
        merged: dict[int, tuple[bool, str | None, int | None]] = {}
        for part in known:
            for step, (landed, error, by) in (part or {}).items():
                if step not in merged or (not landed and merged[step][1] is None and error is not None):
                    merged[step] = (landed, error, by)
        decided = sorted(s for s in merged if s in self._via_upload)
        for step in decided:
            self._via_upload.discard(step)
            landed, error, by = merged[step]
            if by is not None:
                self._count(step, False, TierName.PERSISTENT.value,
                            f"its upload was dropped before it started, for step {by}'s, after the local write "
                            "failed", superseded_by=by)
                continue
            self._count(step, landed, TierName.PERSISTENT.value,
                        None if landed else f"its upload failed after the local write failed: "
                                            f"{error or 'on another rank'}")
        if decided:
            # steps dropped from the queue with the one being uploaded (asked again meanwhile): a newer save's
            # upload stands for them
            self._via_upload = {s for s in self._via_upload if s > decided[-1]}

    def _uploads_known(self) -> dict[int, tuple[bool, str | None, int | None]]:
        """This rank's part of :meth:`_count_uploads`' gather: the queued uploads of the failed local writes whose
        outcome this rank's uploader decided, as (landed, error, the newer step that replaced it)."""
        out, sup = self._up.outcomes, self._up.superseded
        known: dict[int, tuple[bool, str | None, int | None]] = {}
        for s in self._via_upload:
            if s in out:
                known[s] = (out[s], self._up.errors.get(s), None)
            elif s in sup:
                known[s] = (False, None, sup[s])
        return known

    def _count(self, step: int, reached: bool, tier: str | None, error: str | None,
               exc: BaseException | None = None, superseded_by: int | None = None) -> None:
        """The failed saves in a row are the failed saves newer than the newest save that reached a tier; at
        ``max_failed_saves`` of them the next ``save()`` stops the job. A failed save ``superseded_by`` a newer
        one is reported only: the newer one is counted."""
        if reached:
            self._newest_reached = step if self._newest_reached is None else max(self._newest_reached, step)
            self._failed_streak = [f for f in self._failed_streak if f[0] > step]
            return
        older = self._newest_reached is not None and step < self._newest_reached
        if not older and superseded_by is None:
            self._failed_streak.append((step, tier, error))
        n = self.config.max_failed_saves
        assert isinstance(n, int)
        streak = len(self._failed_streak)
        if exc is not None:
            self._write_traceback(step, exc)
        if self.rank == 0:
            then = (f"step {self._newest_reached} has since reached a tier" if older else
                    f"step {superseded_by}'s save stands for it" if superseded_by is not None else
                    "training goes on without checkpoints (max_failed_saves=0)" if n == 0 else
                    f"the job stops after {n} in a row" if streak < n else "stopping the job")
            where = f"{tier} tier: " if tier else ""
            logger.warning("checkpoint of step %d failed, it reached no tier (%s%s); %d failed save(s) in a row, %s",
                           step, where, error or "failed on another rank", streak, then)
            self._emit(EventKind.CKPT_SAVE_FAILED, step=step, tier=tier, error=error or "failed on another rank",
                       consecutive=streak, max_failed_saves=n)
        if n and streak >= n and self._stop is None and not older and superseded_by is None:
            first = next(((t, e) for _, t, e in self._failed_streak if e), (tier, error))
            steps = [s for s, _, _ in self._failed_streak]
            where = {TierName.LOCAL.value: f"local tier {self.local.root}" if self.local is not None else "local tier",
                     TierName.PERSISTENT.value: f"persistent tier {self.config.persistent}"}.get(first[0] or "",
                                                                                               "every tier")
            self._stop = {"steps": steps, "tier": first[0], "error": first[1], "max_failed_saves": n,
                          "message": f"{len(steps)} checkpoint saves in a row reached no tier (steps "
                                     f"{', '.join(map(str, steps))}; {where}: {first[1] or 'unknown error'}); "
                                     "training stops rather than go on without checkpoints: free or fix the tier, "
                                     "or pass --ckpt-max-failed-saves 0 (max_failed_saves=0) to train on without them"}

    def _write_traceback(self, step: int, exc: BaseException) -> None:
        """The first failed save's traceback, once per process, into the run's log directory (the terminal gets
        one line per save from rank 0); without a run directory, into this module's log at DEBUG."""
        if self._traceback_written:
            return
        self._traceback_written = True
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        run_dir = os.environ.get(_env.RUN_DIR)
        if not run_dir:
            logger.debug("checkpoint of step %d failed:\n%s", step, text)
            return
        try:
            d = Path(run_dir) / "logs"
            d.mkdir(parents=True, exist_ok=True)
            head = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} rank {self.rank} step {step}:\n"
            fd = os.open(d / "checkpoint-errors.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (head + text).encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except OSError as e:
            logger.debug("cannot write the traceback of step %d: %s", step, e)

    def _stop_training(self, stop: dict[str, Any]) -> None:
        """Every rank, at the same save() call: end training after ``max_failed_saves`` failed saves in a row.
        Under resilient-run each rank leaves a mark and exits 0, so the launcher stops the whole job with its own
        exit code (a failing worker would only be restarted into the same failing saves); alone, raise."""
        msg = stop["message"]
        if self.rank == 0:
            logger.error("%s", msg)
            self._emit(EventKind.CKPT_STOP, **stop)
        run_dir = os.environ.get(_env.RUN_DIR)
        marked = False
        if run_dir and os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            try:
                d = Path(run_dir) / CKPT_STOP_MARK_DIR
                d.mkdir(parents=True, exist_ok=True)
                tmp = d / f".attempt{attempt}.rank{self.rank}.tmp"
                tmp.write_text(json.dumps(stop))
                os.replace(tmp, d / f"attempt{attempt}.rank{self.rank}")
                marked = True
            except OSError as e:
                logger.warning("cannot mark the checkpoint stop in %s: %s", run_dir, e)
        if marked:
            raise SystemExit(0)
        raise CheckpointSavesFailedError(msg, stop["steps"], stop["tier"], stop["error"])

    def _do_save(self, job: _SaveJob) -> None:
        t0 = time.perf_counter()
        if not job.staged.is_set():
            try:
                job.tensors = self._stager.stage(job.tensors, objects=False)
                self._stager.synchronize()
            finally:
                job.staged.set()
                self._guard.release()
        if self._interval.auto or self._interval.auto_persistent:
            self._decide_interval(job)
        job.decided.set()
        flat: dict[str, Any] = {**job.objects, **job.tensors}
        per_rank = self._per_rank_keys(flat)
        for k in per_rank:
            if k in flat:  # ranks without the leaf have nothing of theirs to key
                flat[_per_rank_key(self.rank, k)] = flat[k]
        if self.local is None:
            self._save_without_local(job, flat, per_rank, t0)
            return
        tier = self.local
        d = tier.path(job.step)
        error: BaseException | None = None
        try:
            if self.local_rank == 0:
                tier.delete_file(job.step, COMMIT_MARKER)  # a step saved again is not complete until re-committed
            d.mkdir(parents=True, exist_ok=True)
            # the writer hashes the file as it writes it and knows where each tensor's bytes are: the manifest
            # needs no second pass over the file (a file with a tensor written another way is read back)
            writer = RecordWriter(d, sync_files=True, entries=True, block=BLOCK)
            self._dcp_save(flat, writer, "local")
        except FAILURES as e:
            error = e
        ok = error is None
        m = None
        try:
            md_entry = writer.metadata_entry if ok and self.rank == 0 else None
            if ok and self.nnodes > 1:
                md_entry = self._spread_metadata(d, step=job.step, writer=writer)
            if ok:
                m = self._write_manifest(tier, job.step, per_rank, known=writer.entries,
                                         index=self._planners["local"].index, metadata=md_entry)
        except FAILURES as e:
            ok, error = False, e
        try:
            # each rank's error travels with its result: rank 0 alone reports the save, naming the first one
            results = self._gather((ok, self._my_bytes(d) if ok else 0, self._up.upload_floor(),
                                    _one_line(error) if error is not None else None, self._snap_proposal(),
                                    self._uploads_known()),
                                   self._pg)
        except FAILURES as e:
            job.tensors = {}
            self._settle(job, False, tier.name, _one_line(e), e)
            self._release(job)
            raise
        self._snap_agree([r[4] for r in results], self._after_next_save(job))
        self._count_uploads([r[5] for r in results])  # before this save's own outcome: they are older
        all_ok = all(r[0] for r in results)
        if not all_ok:
            first = next((r[3] for r in results if r[3]), None)
            self._local_failed(job, flat, per_rank, error, first)
            return
        job.tensors = {}
        self._saved_step = job.step
        self._settle(job, True, tier.name, None)
        self._release(job)  # staging buffers are free: the next save may stage
        if self.local_rank == 0:
            try:
                self._ctx.commit(tier, job.step, ranks=self._node_ranks(self.node))
            except FAILURES as e:  # the files are there: peers and the persistent tier still get them
                logger.warning("local tier: commit of step %d failed (%s); the step is not complete on this "
                               "node's local tier", job.step, _one_line(e))
                self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=tier.name, error=_one_line(e))
        seconds = time.perf_counter() - t0
        if self.rank == 0:
            self._emit(EventKind.CKPT_TIER_DONE, step=job.step, tier=tier.name, seconds=seconds,
                       bytes=sum(r[1] for r in results))
        if self._replicating and m is not None:
            self._ring.replicate(job.step, m)
        floor = min((r[2] for r in results if r[2] is not None), default=None)
        if self.local_rank == 0:
            retain(tier, self.config.keep_local, pinned_from=floor)
            if self._replicating:
                retain(self.peer, self.config.keep_peer, pinned_from=None)
        job.ok = True
        if job.upload:
            self._up.request(job.step)

    def _local_failed(self, job: _SaveJob, flat: dict[str, Any], per_rank: list[str],
                      error: BaseException | None, first: str | None = None) -> None:
        """Collective (every rank, after agreeing the local write failed somewhere): report it, drop the
        partial step, and still give the persistent tier this step from the staged host copy. ``first``: the
        error of the first rank that failed (every rank has it)."""
        assert self.local is not None
        queued = False
        try:
            if error is not None:
                self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=self.local.name,
                           error=_one_line(error))
                self._write_traceback(job.step, error)
            self._gather(None, self._pg)  # nobody writes into the step any more
            if self.local_rank == 0:
                self.local.delete_step(job.step)  # free the space a partial write took
            if job.upload and self.persistent is not None:
                files = self._save_to_memory(job.step, flat, per_rank)
                if files is not None:
                    self._up.request(job.step, files)
                    queued = True
        finally:
            job.tensors = {}
            if queued:
                # not a failed save: the persistent tier gets the step; one line says the local tier missed it
                if self.rank == 0:
                    logger.warning("local tier: save of step %d failed, skipping the tier for this step (retried "
                                   "at the next save; the persistent tier gets it): %s", job.step,
                                   first or "failed on another rank")
                job.via_upload = True
                self._settle(job, True, TierName.PERSISTENT.value, None)
            else:
                self._settle(job, False, self.local.name, first or (_one_line(error) if error else None), error)
            self._release(job)

    def _save_to_memory(self, step: int, flat: dict[str, Any], per_rank: list[str]) -> dict[str, bytes] | None:
        """Collective: this rank's DCP files of ``step`` (plus its manifest; ``.metadata`` on rank 0) as
        bytes in memory, for an upload that cannot read them from the local tier."""
        files: dict[str, bytes] = {}
        ok, error = True, None
        try:
            writer = MemoryWriter(f"memory-step-{step}")
            self._dcp_save(flat, writer, "memory")
            files = writer.files
        except FAILURES as e:
            ok, error = False, e
        md_entry = self._bcast(_blocked_entry(files[DCP_METADATA]).to_json() if ok and self.rank == 0 else None,
                               self._pg)
        if not self._all(ok and md_entry is not None):
            logger.debug("step %d: in-memory copy for the persistent tier failed too: %s", step,
                         _one_line(error) if error else "on another rank")
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PERSISTENT.value,
                       error=_one_line(error) if error else "in-memory copy failed on another rank")
            return None
        mine = {n: b for n, b in files.items() if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")}
        # only rank 0 holds .metadata in memory: the other ranks' manifests go without a layout (restore then
        # parses their files)
        entries = self._with_layout({n: _blocked_entry(b) for n, b in mine.items()}, files.get(DCP_METADATA),
                                    lambda n: MemSource(mine[n], "memory"))
        m = Manifest(step=step, rank=self.rank, world_size=self.world_size,
                     files=entries,
                     metadata=FileEntry.from_json(md_entry), per_rank_keys=tuple(per_rank), wall=time.time())
        mine[manifest_name(self.rank)] = json.dumps(m.to_json()).encode()
        if self.rank == 0:
            mine[DCP_METADATA] = files[DCP_METADATA]
        return mine

    def _save_without_local(self, job: _SaveJob, flat: dict[str, Any], per_rank: list[str], t0: float) -> None:
        """No local tier: write the persistent tier directly (still in the background)."""
        assert self.persistent is not None
        error = None
        staging = self._scratch / f"direct-{self.rank}"
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            writer = FileSystemWriter(staging, sync_files=False, thread_count=1)
            self._dcp_save(flat, writer, "direct")
        except FAILURES as e:
            error = e
        finally:
            job.tensors = {}
            self._release(job)
        tmp_tier = DirTier(staging.parent, name="staging")
        # DCP wrote into `staging` itself; give it the step layout for the uploader
        step_dir = tmp_tier.path(job.step)
        if error is None:
            shutil.rmtree(step_dir, ignore_errors=True)
            os.replace(staging, step_dir)
        ok = error is None
        try:
            md_entry = None
            if ok and self._dist:
                md_entry = self._spread_metadata(step_dir, shared_by_node=False)
            if ok:
                self._write_manifest(tmp_tier, job.step, per_rank, metadata=md_entry)
        except FAILURES as e:
            ok, error = False, e
        results = self._gather((ok, _one_line(error) if error is not None else None, self._snap_proposal()), self._pg)
        self._snap_agree([r[2] for r in results], self._after_next_save(job))
        if not all(r[0] for r in results):
            self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=TierName.PERSISTENT.value,
                       error=f"{type(error).__name__}: {error}" if error else "another rank failed")
            shutil.rmtree(step_dir, ignore_errors=True)
            self._settle(job, False, TierName.PERSISTENT.value, next((r[1] for r in results if r[1]), None), error)
            return
        landed = self._up.upload_step(job.step, tmp_tier, group=self._pg)
        shutil.rmtree(step_dir, ignore_errors=True)
        if landed:
            self._saved_step = job.step
        self._settle(job, landed, TierName.PERSISTENT.value, None if landed else self._up.last_error)
        job.ok = landed

    def _dcp_save(self, flat: dict[str, Any], writer: Any, kind: str) -> None:
        """Collective: ``dcp.save`` of ``flat`` through ``writer``, with the plan of the last save by this
        kind of writer reused when the state's structure did not change (``save/plan.py``)."""
        planner = self._planners.get(kind)
        if planner is None:
            planner = self._planners[kind] = _plan.CachedSavePlanner(f"rank {self.rank}'s {kind} saves")
        _plan.save(flat, writer, planner, self._pg, no_dist=not self._dist)

    def _node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def _my_files(self, d: Path) -> list[str]:
        pre = f"__{self.rank}_"
        try:
            return sorted(n for n in os.listdir(d) if n.startswith(pre) and n.endswith(".distcp"))
        except FileNotFoundError:
            return []

    def _my_bytes(self, d: Path) -> int:
        return sum((d / n).stat().st_size for n in self._my_files(d))

    def _spread_metadata(self, d: Path, shared_by_node: bool = True, step: int | None = None,
                         writer: RecordWriter | None = None) -> FileEntry:
        """DCP writes ``.metadata`` on rank 0 only; every node's copy of the step needs it. Collective. Into the
        node's shared step directory (``shared_by_node``, with ``step``): where rank 0's file is the last spread
        one with other ids (its record ``writer`` says so), the node leaders make it from their copy of that one,
        writing the new ids where the old ones are, and check it against its size and crc32c; only when one cannot
        is the whole file sent, as to every rank before (at 1,024 ranks x 900 tensors, 129.5 MB to every rank at
        every save). Returns the file's manifest entry, as rank 0 hashed it, to every rank: no rank reads the file
        again to hash it."""
        derived = writer.derived if writer is not None and self.rank == 0 else None
        mine = writer.metadata_entry if writer is not None and self.rank == 0 else None
        if shared_by_node and step is not None:
            last, self._spread_last = self._spread_last, None  # (rank 0) set again once every node holds it
            entry = self._spread_by_ids(d, last, derived, writer)
            if entry is not None:
                self._spread_last = (step, *derived) if derived is not None else None
                return entry
        entry = self._spread_whole(d, shared_by_node, mine)
        if shared_by_node and step is not None and derived is not None:
            self._spread_last = (step, *derived)
        return entry

    def _spread_by_ids(self, d: Path, last: tuple[int, tuple[int, int], tuple[bytes, ...]] | None,
                       derived: tuple[tuple[int, int], tuple[bytes, ...]] | None,
                       writer: RecordWriter | None) -> FileEntry | None:
        """Collective: rank 0 offers, for each id that differs from the last spread step's file (``last``: its step,
        generation, ids) when this one is of the same generation, its place and its old and new bytes; each node
        leader writes them into its copy of that step's file and writes the result if it has this file's size and
        crc32c. The file's manifest entry when every leader did (and so holds it: the agreement comes after the
        writes), else None."""
        offer = None
        if self.rank == 0 and last is not None and derived is not None and writer is not None \
                and last[1] == derived[0] and len(writer.id_offsets) == len(derived[1]):
            try:
                entry = writer.metadata_entry or file_entry(d / DCP_METADATA)
                offer = (last[0], [(at, a, b) for at, a, b in zip(writer.id_offsets, last[2], derived[1]) if a != b],
                         entry)
            except OSError as e:  # the whole file's path reads it again, and fails the save as before
                logger.debug("no ids offered: %s", e)
        offer = self._bcast(offer, self._pg)
        if offer is None:
            return None
        prev_step, ids, entry = offer
        ok = True
        if self.rank != 0 and self.local_rank == 0:
            ok = self._patched_metadata(d, prev_step, ids, entry.size, entry.crc32c)
        if not self._all(ok):
            return None
        self.spread_by_ids += 1
        return entry

    def _patched_metadata(self, d: Path, prev_step: int, ids: list[tuple[int, bytes, bytes]], size: int,
                          crc: int) -> bool:
        """Write ``d``'s ``.metadata`` from this node's copy of ``prev_step``'s with each (place, old, new) of
        ``ids`` written, if the old bytes are there and the result has ``size`` bytes and crc32c ``crc`` (else
        nothing is written, and rank 0 sends the file)."""
        if self.local is None:
            return False
        try:
            p = self.local.path(prev_step) / DCP_METADATA
            with open(p, "rb") as f:
                n = os.fstat(f.fileno()).st_size
                if n != size:
                    return False
                buf = bytearray(n)
                if f.readinto(buf) != n:
                    return False
            for at, a, b in ids:
                if len(a) != len(b) or buf[at:at + len(a)] != a:
                    return False
                buf[at:at + len(b)] = b
            if crc_bytes(buf) != crc:
                logger.info("rank %d: step %s .metadata made from step %d's differs from rank 0's: sent whole",
                            self.rank, d.name, prev_step)
                return False
            tmp = d / ".metadata.tmp"
            tmp.write_bytes(buf)
            os.replace(tmp, d / DCP_METADATA)
            return True
        except OSError as e:
            logger.debug("rank %d: no .metadata from step %d's: %s", self.rank, prev_step, e)
            return False

    def _spread_whole(self, d: Path, shared_by_node: bool, entry: FileEntry | None) -> FileEntry:
        """Collective: rank 0's ``.metadata`` sent to every rank with its manifest entry (``entry``, rank 0's
        writer's, else hashed here from the bytes sent); one rank a node writes it (``shared_by_node``). Returns
        the entry."""
        sent = None
        if self.rank == 0:
            data = (d / DCP_METADATA).read_bytes()
            if entry is None:
                entry = bytes_entry(data)
            sent = (data, entry)
        data, entry = self._bcast(sent, self._pg)
        if self.rank != 0 and (self.local_rank == 0 or not shared_by_node):
            tmp = d / ".metadata.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, d / DCP_METADATA)
        elif self.rank != 0:
            # another rank of this node writes it; wait for it to appear (same dir, same node)
            deadline = time.monotonic() + self.config.collective_timeout_s
            while not (d / DCP_METADATA).exists():
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{d / DCP_METADATA} did not appear")
                time.sleep(0.01)
        return entry

    def _write_manifest(self, tier: DirTier, step: int, per_rank: list[str],
                        known: Mapping[str, FileEntry] | None = None, index: bytes | None = None,
                        metadata: FileEntry | None = None) -> Manifest:
        """``known``: entries the writer computed as it wrote (layout included); other files are read back.
        ``index``: this rank's own entries of the step's ``.metadata`` (``format/rank_index.py``). ``metadata``:
        ``.metadata``'s entry where it is known (hashed as rank 0 wrote it), else the file is read and hashed."""
        d = tier.path(step)
        known = known or {}
        mine = self._my_files(d)
        files = {n: known[n] if n in known else file_blocks(d / n, BLOCK) for n in mine}
        if any(n not in known for n in mine):
            files = self._with_layout(files, (d / DCP_METADATA).read_bytes(),
                                      lambda n: FileSource(d / n, "local", files[n].size))
        metadata = metadata if metadata is not None else file_entry(d / DCP_METADATA)
        m = Manifest(step=step, rank=self.rank, world_size=self.world_size, files=files, metadata=metadata,
                     per_rank_keys=tuple(per_rank), wall=time.time(),
                     index=self._index_encoder(index, metadata.crc32c) if index is not None else None)
        tier.write_bytes(step, manifest_name(self.rank), json.dumps(m.to_json()).encode())
        return m

    def _with_layout(self, files: dict[str, FileEntry], metadata: bytes | None,
                     open_src: Any) -> dict[str, FileEntry]:
        """``files`` with the layout of their plain tensors (where each tensor's bytes are), for restore."""
        if metadata is None:
            return files
        try:
            md = load_metadata(metadata, what=DCP_METADATA)
        except FAILURES as e:  # the manifest is still valid without a layout
            logger.debug("no layout in the manifest: %s", e)
            return files
        per_file: dict[str, list[tuple[int, int]]] = {}
        for info in md.storage_data.values():
            if info.relative_path in files and not info.transform_descriptors:
                per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        out = dict(files)
        for n, items in per_file.items():
            src = None
            try:
                src = open_src(n)
                out[n] = dataclasses.replace(files[n], items=file_layout(src, items))
            except (OSError, ValueError) as e:
                logger.debug("no layout for %s: %s", n, e)
            finally:
                if src is not None:
                    src.close()
        return out

    def _per_rank_keys(self, flat: dict[str, Any]) -> list[str]:
        """Leaves whose values differ across ranks; DCP would keep one rank's value for all of them."""
        if not self._dist or self.world_size == 1:
            return []
        # a DTensor's local shards differ by rank by design; DCP stores them by their placements, so a DTensor
        # is never a per-rank value (and keyed per rank, its shards would be stored twice)
        small = {k: _digest(v) for k, v in flat.items()
                 if not isinstance(v, torch.Tensor) or (not _is_dtensor(v) and leaf_nbytes(v) <= _SMALL)}
        everyone = self._gather(small, self._pg)
        keys = set().union(*(set(g) for g in everyone))
        # a leaf that only some ranks hold (a pipeline stage's layers) is per-rank only where two holders
        # differ: DCP saves a leaf one rank holds from that rank
        return sorted(k for k in keys if len({g[k] for g in everyone if k in g}) > 1)

    def _decide_interval(self, job: _SaveJob) -> None:
        iv = self._interval
        # collective whatever this rank's tuner state: a rank without a tuner must still take part
        proposal = (iv.steps, iv.persistent_every, {})
        if self.rank == 0 and iv.tuner is not None:
            try:
                with iv.lock:
                    proposal = (max(1, int(iv.tuner.interval_steps())) if iv.auto else iv.steps,
                                max(1, int(iv.tuner.persistent_every())) if iv.auto_persistent
                                else iv.persistent_every,
                                iv.tuner.inputs())
            except FAILURES as e:
                logger.warning("interval tuner failed (%s); keeping %d steps", e, iv.steps)
                proposal = (iv.steps, iv.persistent_every, {})
        steps, every, inputs = self._bcast(proposal, self._pg)
        # each attempt's first decision is recorded too, changed or not: what it started from (and what its start
        # read of the ledger cost) is then in the ledger
        changed = (steps, every) != (iv.steps, iv.persistent_every) or not iv.recorded
        iv.steps, iv.persistent_every, iv.recorded = steps, every, True
        if changed and self.rank == 0:
            self._emit(EventKind.CKPT_INTERVAL, interval=steps, persistent_every=every, inputs=inputs)
        if self.rank == 0 and iv.tuner is not None:
            try:
                iv.tuner.write_cache()  # after the answer went out, outside the lock the training thread takes
            except FAILURES as e:
                logger.debug("interval tuner's cache not written: %s", e)

    # ------------------------------------------------------------------ wait / close
    @property
    def last_saved_step(self) -> int | None:
        """The newest step this manager saved to a tier (its save worker is the only writer), else the step
        ``restore()`` loaded (the training thread's), else None."""
        if self._saved_step is not None:
            return self._saved_step
        return self.last_restore.step if self.last_restore is not None else None

    @property
    def last_save_reached_a_tier(self) -> bool | None:
        """Whether the newest save reached a tier: None while it is still being written (or before any save),
        True once it reached one, False when it reached none. After ``wait()`` returned False, this tells a
        failed save (False) from a timeout (None)."""
        job = self._last_job
        if job is None or not job.done.is_set():
            return None
        return self._reached(job)

    def _reached(self, job: _SaveJob) -> bool:
        # a step saved only as a queued upload (its local write failed) is lost if that upload failed
        return bool(job.reached) and not (job.via_upload and self._up.outcomes.get(job.step) is False)

    def wait(self, timeout: float | None = None, upload_timeout: float | None = None) -> bool:
        """Wait for in-flight saves, replication and uploads. Returns True when they finished and the last save
        reached a tier; False on timeout, or when the last save reached no tier (its local write failed and its
        copy for the persistent tier did not land either; :attr:`last_save_reached_a_tier` tells which). It
        never raises for a failed save (training decides
        what to do; the failure is in the log and the ledger, and ``max_failed_saves`` in a row stop the job).
        A step that reached the local tier but not the persistent one is not a failed save: the ledger records
        the upload's failure, and a finished run whose newest step is not there ends with its own exit code.

        Uploads are waited for at most ``upload_timeout`` (default: the upload grace, ``--upload-grace``):
        a dead persistent store must not hold the job; its pending steps stay queued.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        agree = self._agree_job
        # its gather uses the group a restore after this uses from the training thread
        if agree is not None and not agree.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
        job = self._last_job
        if job is not None:
            if not job.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        saved = job is None or bool(job.reached)
        if self._uploader is None:
            return saved
        if upload_timeout is None:
            # one grace for wait() and close() together: the clock starts at the first wait that finds
            # uploads pending and stops when they drain (or training goes on)
            if self._grace_until is None:
                self._grace_until = time.monotonic() + float(self.config.upload_grace_s or 0.0)
            up_deadline = self._grace_until
        else:
            up_deadline = time.monotonic() + upload_timeout
        deadline = up_deadline if deadline is None else min(deadline, up_deadline)
        if not self._up.drain(deadline):
            return False
        self._grace_until = None
        return job is None or self._reached(job)

    def _upload_final(self, timeout: float | None) -> int | None:
        """Queue the newest saved step for the persistent tier unless it is there or on its way (the last step
        of a run, or the step saved for a preemption, is rarely a multiple of ``persistent_every``). Every rank
        does the same: the saves' outcomes are collective. Returns the step queued."""
        job = self._last_job
        if self._uploader is None or self._up.closed:
            return None
        if job is not None and not job.done.wait(self.config.collective_timeout_s if timeout is None else timeout):
            return None
        step = self._saved_step
        if step is None or (self._up.requested_max is not None and self._up.requested_max >= step):
            return None
        if self.rank == 0:
            logger.info("uploading the final step %d to the persistent tier (within the upload grace, %.0f s)",
                        step, float(self.config.upload_grace_s or 0.0))
        self._up.request(step)
        return step

    def close(self, timeout: float | None = None, at_exit: bool = False) -> None:
        """Finish in-flight work and stop the background threads. Saves get up to ``timeout``; uploads get
        at most the upload grace, then the steps still pending are abandoned (and recorded in the ledger)."""
        if self._closed:
            return
        final = self._upload_final(timeout)
        self.wait(timeout)  # False also for a failed save: what is still running is looked at below
        self._closed = True
        if self._via_upload and (self._last_job is None or self._last_job.done.is_set()):
            # saves whose only copy was an upload that failed after the last save: in the ledger and the closing
            # summary too (no collective: the save worker is idle, and only rank 0 reports)
            self._count_uploads([self._uploads_known()])
        saving = self._last_job is not None and not self._last_job.done.is_set()
        uploading = self._uploader is not None and not self._up.drain(time.monotonic())
        finished = not saving and not uploading
        if final is not None and self._up.outcomes.get(final) is not True and self.rank == 0:
            why = (self._up.last_error if self._up.outcomes.get(final) is False
                   else f"not uploaded within the upload grace of {float(self.config.upload_grace_s or 0):.0f} s")
            logger.warning("the final step %d is not on the persistent tier (%s): only node-local tiers hold it",
                           final, why)
        self._up.closed = True
        if not finished:
            abandoned = self._up.abandon()
            saving = self._last_job is not None and not self._last_job.done.is_set()
            logger.warning("close(): %s still running; abandoning %s", "a save" if saving else "uploads",
                           f"uploads of steps {abandoned}" if abandoned else "it")
            for step in abandoned:
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PERSISTENT.value,
                           error="abandoned at exit",
                           upload_grace_s=self.config.upload_grace_s)
        self._jobs.put(None)
        self._up.stop()
        if finished:
            self._worker.join(self.config.collective_timeout_s)
            self._up.join(self.config.collective_timeout_s)
        elif not self._up.settle(5.0):
            # the process would tear its groups down under a thread inside a collective (gloo aborts: SIGABRT)
            logger.debug("close(): the upload thread is still inside a collective")
        self._guard.disarm_hooks()
        self._stager.drop()
        if self._snap is not None:
            self._snap.close()
        if finished:  # a save still running keeps its planner's cache (it is dropped with the process)
            for planner in self._planners.values():
                planner.forget()
        if self._ledger is not None:
            self._ledger.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ restore (restore.py)
    def _say_nothing_restored(self) -> None:
        """Rank 0, when restore found no checkpoint: if this run's ledger shows saves from before this
        process, starting from step 0 loses them; say so (one line and an event) instead of starting silently."""
        run_dir = os.environ.get(_env.RUN_DIR)
        if not run_dir:
            return
        try:
            from resilient.events.ledger import read_events

            kinds = {EventKind.RUN_END, EventKind.CKPT_SAVE, EventKind.CKPT_TIER_DONE, EventKind.CKPT_SAVE_FAILED}
            events = [e for e in read_events(run_dir, kinds=kinds) if e.wall < self._t_created]
        except (OSError, ValueError) as e:
            logger.debug("cannot read the ledger of %s: %s", run_dir, e)
            return
        # saves of a run that finished (exit 0) before this launch are not lost: a finished run's directory
        # reused for a fresh start begins after it; a preempted or failed launch's saves do count
        finished = [i for i, e in enumerate(events) if e.kind is EventKind.RUN_END and e.details.get("exit_code") == 0]
        if finished:
            events = events[finished[-1] + 1:]
        attempted = sorted({int(e.details["step"]) for e in events
                            if e.kind is EventKind.CKPT_SAVE and isinstance(e.details.get("step"), int)})
        if not attempted:
            return
        done: dict[str, list[int]] = {}
        for e in events:
            if e.kind is EventKind.CKPT_TIER_DONE and isinstance(e.details.get("step"), int):
                done.setdefault(str(e.details.get("tier")), []).append(int(e.details["step"]))
        failed = sorted({int(e.details["step"]) for e in events
                         if e.kind is EventKind.CKPT_SAVE_FAILED and isinstance(e.details.get("step"), int)})
        tiers: dict[str, str] = {}
        if self.local is not None:
            tiers[TierName.LOCAL.value] = str(self.local.root)
        if self.peer is not None:
            tiers[TierName.PEER.value] = str(self.peer.root)
        if self.config.persistent:
            tiers[TierName.PERSISTENT.value] = str(self.config.persistent)
        saved = "; ".join(f"{t} recorded steps {_steps_text(sorted(set(s)))}" for t, s in sorted(done.items()))
        logger.warning("restore: no checkpoint found on any tier (%s), although this run saved before (steps %s%s%s); "
                       "starting from step 0. Were the tiers wiped, or do they point somewhere else than before?",
                       ", ".join(f"{t} {w}" for t, w in tiers.items()), _steps_text(attempted),
                       f"; {saved}" if saved else "", f"; failed saves: {_steps_text(failed)}" if failed else "")
        self._emit(EventKind.CKPT_RESTORE_MISSING, attempted_steps=attempted, tiers=tiers,
                   done={t: sorted(set(s)) for t, s in done.items()}, failed_steps=failed)

    def restore(self, state: Mapping[str, Any]) -> int:
        """Load the newest step complete on some tier into ``state``; return the step to run next.

        Each rank reads from the fastest tier holding a verified copy of each file, falling back
        tier by tier (local → partner node over gloo → persistent) on a missing or corrupt file.
        Returns 0 when there is nothing to restore.
        """
        if self._closed:
            raise CheckpointError("restore() after close()")
        # the agent holds a restore to the start-up bound, and learns a later attempt's start-up without it
        with _restore_section():
            self.wait()
            res = self._restorer.restore(state)
        self.last_restore = res
        if self._restorer.cadence_carried_over and self._agree_at_call is not None:
            # the snapshots resume under the cadence they were taken under: agreed again after the usual calls
            self._agree_at_call = self._save_calls + _REAGREE_CALLS
        self._interval.observe_restore(res.tier if res.step is not None else None,
                                       covered=self._restorer.covered_by_snapshot)
        if res.step is None:
            if self.rank == 0:
                self._say_nothing_restored()
            return 0
        if self._interval.auto:
            self._interval.next_save = res.step + self._interval.steps
        return res.step + 1
