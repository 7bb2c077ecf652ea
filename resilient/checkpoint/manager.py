"""``CheckpointManager``: stage → local → peer → persistent, and restore from the fastest verified tier.

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
import io
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from resilient import env as _env
from resilient.checkpoint.api import (COMMIT_MARKER, DCP_METADATA, PER_RANK_PREFIX, TIER_ORDER, CheckpointConfig,
                                      CheckpointError, CheckpointMismatchError, CheckpointReshardError,
                                      CorruptFileError, FileEntry,
                                      Manifest, NoRestorableStepError, RestoreResult, StateUndefinedError,
                                      TierName,
                                      UnsafeCheckpointError)
from resilient.checkpoint.stage import (MutationGuard, Stager, flatten, is_stateful, leaf_nbytes, plain_state,
                                        set_path)
from resilient.checkpoint.tiers import (BoundedTier, DirTier, crc_bytes, file_entry, make_tier, manifest_name, read_manifest,
                                        map_verified, retry, verify_bytes, verify_file)
from resilient.checkpoint.reader import FastReader, SafeLoadPlanner
from resilient.checkpoint.load import (BLOCK, FileLoad, FileSource, Item, MemSource, RangeSource, Source,
                                       bytes_blocks, file_blocks, file_layout, load_files, plan_spans, undefined,
                                       whole_file)
from resilient.signals.client import preempt_save_due as _preempt_save_due
from resilient.checkpoint.safe import find_unsafe, load_metadata, safe_torch_load, unsafe_name
from resilient.checkpoint.collective import Ranks
from resilient.checkpoint.plan import plan_fetch
from resilient.checkpoint.retention import retain
from resilient.checkpoint.transfer import FileSpec, ring_exchange, run_transfers
from resilient.checkpoint.writer import MemoryWriter
from resilient.events.api import EventKind
from resilient.events.ledger import Ledger

logger = logging.getLogger(__name__)

# DCP raises CheckpointException, a BaseException: `except Exception` alone lets a failed write (a full
# disk) kill the thread that runs it
FAILURES: tuple[type[BaseException], ...] = (Exception, CheckpointException)

_SMALL = 1 << 20  # leaves up to this size are compared across ranks to find per-rank values
DEFAULT_AUTO_FALLBACK = 10


def _quiet(fn: Any, *args: Any, **kw: Any) -> Any:
    """DCP warns on every single-process call that it "assumes" single-process intent; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kw)


def _one_line(e: BaseException) -> str:
    """An error for the ledger and a warning: DCP's CheckpointException carries whole tracebacks; keep the
    underlying error of the first failed rank."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = next(iter(e.failures.items()))
        return f"{type(inner).__name__}: {inner} (rank {rank})"
    return f"{type(e).__name__}: {e}"


def _bytes_entry(data: bytes) -> FileEntry:
    return bytes_blocks(data, BLOCK)


def _close_at_exit(ref: "weakref.ref[CheckpointManager]") -> None:
    ck = ref()
    if ck is not None and not ck._closed:
        try:
            ck.close(timeout=min(120.0, ck.config.collective_timeout_s), at_exit=True)
        except FAILURES as e:  # exit goes on whatever happens here
            logger.warning("finishing checkpoints at exit failed: %s", e)


def _memory_budget() -> int:
    """Fetched files are kept in memory up to a quarter of the available RAM, else spilled to disk."""
    try:
        import psutil

        return int(psutil.virtual_memory().available * 0.25)
    except Exception:
        return 1 << 30


def _rmdir_quiet(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass  # not empty (another rank of this node still uses it) or gone


def _per_rank_key(rank: int, fqn: str) -> str:
    return f"{PER_RANK_PREFIX.format(rank=rank)}.{fqn}"


def _digest(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous().reshape(-1)
        # no hash(): string hashes differ between processes
        return crc_bytes(t.view(torch.uint8).numpy().tobytes(), crc_bytes(f"{tuple(v.shape)}{v.dtype}".encode()))
    try:
        return crc_bytes(pickle.dumps(v, protocol=4))
    except Exception:  # unpicklable: treat as per-rank, DCP would fail on it anyway
        return id(v)


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


@dataclass
class _Unsafe:
    """A restore attempt refused a file as unsafe (see :meth:`CheckpointManager._refused`)."""

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
                from resilient.checkpoint.interval import IntervalTuner

                run_dir = os.environ.get(_env.RUN_DIR)
                if run_dir and rank == 0 and hasattr(IntervalTuner, "from_run_dir"):
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
            except Exception as e:  # ImportError while goodput is not there yet, or a tuner bug
                if rank == 0:
                    warnings.warn(f"interval='auto' unavailable ({e}); saving every {DEFAULT_AUTO_FALLBACK} steps",
                                  stacklevel=3)
                self.tuner = None
        self.next_save: int | None = None
        self._last_call: float | None = None
        self.lock = threading.Lock()  # the tuner is fed from the training, save and upload threads

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
    forward/backward. Per-rank values (RNG states, data positions: any small leaf whose value differs
    across ranks at save time) are stored per rank and come back per rank.
    """

    def __init__(self, local: str | os.PathLike[str] | None = None, persistent: str | None = None,
                 interval: int | str = 10, persistent_every: int | str = 5, peer: bool = True, *,
                 overlap: bool = False, keep_local: int = 2, keep_peer: int = 2, keep_persistent: int = 3,
                 storage_options: dict[str, Any] | None = None, upload_retries: int = 6,
                 upload_backoff_s: float = 0.5, upload_backoff_max_s: float = 8.0,
                 collective_timeout_s: float = 600.0, tuner_options: dict[str, Any] | None = None,
                 persistent_timeout_s: float = 30.0, restore_probe_s: float = 5.0,
                 upload_grace_s: float | None = None):
        self.config = CheckpointConfig(
            local=os.fspath(local) if local is not None else None, persistent=persistent, interval=interval,
            persistent_every=persistent_every, peer=peer, overlap=overlap, keep_local=keep_local,
            keep_peer=keep_peer, keep_persistent=keep_persistent, upload_retries=upload_retries,
            upload_backoff_s=upload_backoff_s, upload_backoff_max_s=upload_backoff_max_s,
            collective_timeout_s=collective_timeout_s, storage_options=dict(storage_options or {}),
            persistent_timeout_s=persistent_timeout_s, restore_probe_s=restore_probe_s,
            upload_grace_s=upload_grace_s)
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
        self.last_saved_step: int | None = None

        self._jobs: queue.Queue[_SaveJob | None] = queue.Queue()
        self._worker = threading.Thread(target=self._save_loop, name="resilient-ckpt-save", daemon=True)
        self._worker.start()
        self._up_cv = threading.Condition()
        self._up_pending: list[int] = []
        self._up_mem: dict[int, dict[str, bytes]] = {}  # steps the local tier could not hold
        self._up_busy = False
        self._up_current: int | None = None  # the step being uploaded
        self._grace_until: float | None = None  # see wait()
        self._up_closing = False
        self._uploader = None
        if self.persistent is not None:
            self._uploader = threading.Thread(target=self._upload_loop, name="resilient-ckpt-upload", daemon=True)
            self._uploader.start()
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
        kw.update(overrides)
        if not kw.get("local") and not kw.get("persistent"):
            raise CheckpointError(f"no checkpoint tier configured: set {_env.CKPT_LOCAL} and/or "
                                  f"{_env.CKPT_PERSISTENT} (resilient-run --ckpt-local/--ckpt-persistent)")
        return cls(**kw)

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
        self._grace_until = None  # training went on: a later wait() gets a fresh upload grace
        if not (force or self._interval.due(step) or _preempt_save_due(step)):  # a preempted job's last step
            return False
        t0 = time.perf_counter()
        prev = self._last_job
        if prev is not None:
            # one set of staging buffers: the previous step must be on disk before we overwrite them
            self._wait_event(prev.written, "previous checkpoint write")
            if self._interval.auto or self._interval.auto_persistent:
                # the tuner's answer is broadcast in the background; read it only once every rank has it
                self._wait_event(prev.decided, "interval decision")
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

    def _save_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._do_save(job)
            except BaseException as e:  # fail static: a failed save is reported, training goes on; the
                # worker survives whatever the save raised, or every later save() would wait on it
                logger.exception("checkpoint of step %d failed", job.step)
                self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=TierName.LOCAL.value,
                           error=f"{type(e).__name__}: {e}")
            finally:
                if not job.staged.is_set():
                    job.staged.set()
                    self._guard.release()
                job.written.set()
                job.decided.set()
                job.done.set()

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
            writer = FileSystemWriter(d, sync_files=True, thread_count=1, overwrite=True)
            _quiet(dcp.save, flat, storage_writer=writer, process_group=self._pg, no_dist=not self._dist)
        except FAILURES as e:
            error = e
        ok = error is None
        m = None
        try:
            if ok and self.nnodes > 1:
                self._spread_metadata(d)
            if ok:
                m = self._write_manifest(tier, job.step, per_rank)
        except FAILURES as e:
            ok, error = False, e
        try:
            results = self._gather((ok, self._my_bytes(d) if ok else 0, self._upload_floor()), self._pg)
        except FAILURES:
            job.tensors = {}
            job.written.set()
            raise
        all_ok = all(r[0] for r in results)
        if not all_ok:
            self._local_failed(job, flat, per_rank, error)
            return
        job.tensors = {}
        job.written.set()  # staging buffers are free: the next save may stage
        if self.local_rank == 0:
            try:
                self._commit(tier, job.step, ranks=self._node_ranks(self.node))
            except FAILURES as e:  # the files are there: peers and the persistent tier still get them
                logger.warning("local tier: commit of step %d failed (%s); the step is not complete on this "
                               "node's local tier", job.step, _one_line(e))
                self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=tier.name, error=_one_line(e))
        self.last_saved_step = job.step
        seconds = time.perf_counter() - t0
        if self.rank == 0:
            self._emit(EventKind.CKPT_TIER_DONE, step=job.step, tier=tier.name, seconds=seconds,
                       bytes=sum(r[1] for r in results))
        if self._replicating and m is not None:
            self._replicate(job.step, m)
        floor = min((r[2] for r in results if r[2] is not None), default=None)
        if self.local_rank == 0:
            self._retain(tier, self.config.keep_local, pinned_from=floor)
            if self._replicating:
                self._retain(self.peer, self.config.keep_peer, pinned_from=None)
        job.ok = True
        if job.upload:
            self._request_upload(job.step)

    def _local_failed(self, job: _SaveJob, flat: dict[str, Any], per_rank: list[str],
                      error: BaseException | None) -> None:
        """Collective (every rank, after agreeing the local write failed somewhere): report it, drop the
        partial step, and still give the persistent tier this step from the staged host copy."""
        assert self.local is not None
        try:
            if error is not None:
                logger.warning("local tier: save of step %d failed, skipping the tier for this step (retried at "
                               "the next save): %s", job.step, _one_line(error))
                self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=self.local.name,
                           error=_one_line(error))
            self._gather(None, self._pg)  # nobody writes into the step any more
            if self.local_rank == 0:
                self.local.delete_step(job.step)  # free the space a partial write took
            if job.upload and self.persistent is not None:
                files = self._save_to_memory(job.step, flat, per_rank)
                if files is not None:
                    self._request_upload(job.step, files)
        finally:
            job.tensors = {}
            job.written.set()

    def _save_to_memory(self, step: int, flat: dict[str, Any], per_rank: list[str]) -> dict[str, bytes] | None:
        """Collective: this rank's DCP files of ``step`` (plus its manifest; ``.metadata`` on rank 0) as
        bytes in memory, for an upload that cannot read them from the local tier."""
        files: dict[str, bytes] = {}
        ok, error = True, None
        try:
            writer = MemoryWriter(f"memory-step-{step}")
            _quiet(dcp.save, flat, storage_writer=writer, process_group=self._pg, no_dist=not self._dist)
            files = writer.files
        except FAILURES as e:
            ok, error = False, e
        md_entry = self._bcast(_bytes_entry(files[DCP_METADATA]).to_json() if ok and self.rank == 0 else None,
                               self._pg)
        if not self._all(ok and md_entry is not None):
            logger.warning("step %d: in-memory copy for the persistent tier failed too: %s", step,
                           _one_line(error) if error else "on another rank")
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PERSISTENT.value,
                       error=_one_line(error) if error else "in-memory copy failed on another rank")
            return None
        mine = {n: b for n, b in files.items() if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")}
        # only rank 0 holds .metadata in memory: the other ranks' manifests go without a layout (restore then
        # parses their files)
        entries = self._with_layout({n: _bytes_entry(b) for n, b in mine.items()}, files.get(DCP_METADATA),
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
            _quiet(dcp.save, flat, storage_writer=writer, process_group=self._pg, no_dist=not self._dist)
        except FAILURES as e:
            error = e
        finally:
            job.tensors = {}
            job.written.set()
        tmp_tier = DirTier(staging.parent, name="staging")
        # DCP wrote into `staging` itself; give it the step layout for the uploader
        step_dir = tmp_tier.path(job.step)
        if error is None:
            shutil.rmtree(step_dir, ignore_errors=True)
            os.replace(staging, step_dir)
        ok = error is None
        try:
            if ok and self._dist:
                self._spread_metadata(step_dir, shared_by_node=False)
            if ok:
                self._write_manifest(tmp_tier, job.step, per_rank)
        except FAILURES as e:
            ok, error = False, e
        results = self._gather(ok, self._pg)
        if not all(results):
            self._emit(EventKind.CKPT_TIER_FAILED, step=job.step, tier=TierName.PERSISTENT.value,
                       error=f"{type(error).__name__}: {error}" if error else "another rank failed")
            shutil.rmtree(step_dir, ignore_errors=True)
            return
        self._upload_step(job.step, tmp_tier, group=self._pg)
        shutil.rmtree(step_dir, ignore_errors=True)
        job.ok = True

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

    def _spread_metadata(self, d: Path, shared_by_node: bool = True) -> None:
        """DCP writes ``.metadata`` on rank 0 only; every node's copy of the step needs it."""
        data = (d / DCP_METADATA).read_bytes() if self.rank == 0 else None
        data = self._bcast(data, self._pg)
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

    def _write_manifest(self, tier: DirTier, step: int, per_rank: list[str]) -> Manifest:
        d = tier.path(step)
        files = {n: file_blocks(d / n, BLOCK) for n in self._my_files(d)}
        files = self._with_layout(files, (d / DCP_METADATA).read_bytes(),
                                  lambda n: FileSource(d / n, "local", files[n].size))
        m = Manifest(step=step, rank=self.rank, world_size=self.world_size, files=files,
                     metadata=file_entry(d / DCP_METADATA), per_rank_keys=tuple(per_rank), wall=time.time())
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

    def _commit(self, tier: Any, step: int, ranks: list[int]) -> None:
        body = {"step": step, "world_size": self.world_size, "ranks": ranks, "wall": time.time()}
        tier.write_bytes(step, COMMIT_MARKER, json.dumps(body).encode())

    def _per_rank_keys(self, flat: dict[str, Any]) -> list[str]:
        """Leaves whose values differ across ranks; DCP would keep one rank's value for all of them."""
        if not self._dist or self.world_size == 1:
            return []
        small = {k: _digest(v) for k, v in flat.items()
                 if not isinstance(v, torch.Tensor) or leaf_nbytes(v) <= _SMALL}
        everyone = self._gather(small, self._pg)
        keys = set().union(*(set(g) for g in everyone))
        return sorted(k for k in keys if len({g.get(k) for g in everyone}) > 1)

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
        changed = (steps, every) != (iv.steps, iv.persistent_every)
        iv.steps, iv.persistent_every = steps, every
        if changed and self.rank == 0:
            self._emit(EventKind.CKPT_INTERVAL, interval=steps, persistent_every=every, inputs=inputs)

    # ------------------------------------------------------------------ peer replication
    def _partner(self, offset: int) -> int:
        return (self.rank + offset * self.local_world_size) % self.world_size

    def _replicate(self, step: int, m: Manifest) -> None:
        """Send this rank's files to the same local rank on the next node; receive the previous node's."""
        assert self.local is not None and self.peer is not None
        t0 = time.perf_counter()
        d = self.local.path(step)
        names = list(m.files) + [manifest_name(self.rank)]
        if self.local_rank == 0:
            names.append(DCP_METADATA)
        specs = [FileSpec(n, (d / n).stat().st_size) for n in names]
        everyone = self._gather(specs, self._pg)
        src, dst = self._partner(-1), self._partner(+1)
        ok, error = True, None
        out = self.peer.path(step)
        try:
            if self.local_rank == 0:
                self.peer.delete_file(step, COMMIT_MARKER)
            ring_exchange(self._pg, send_to=dst, send_paths=[d / n for n in names], send_files=specs,
                          recv_from=src, recv_files=everyone[src], out_dir=out)
            got = read_manifest(self.peer, step, src)
            for n, fe in got.all_files().items():
                if any(s.name == n for s in everyone[src]):
                    verify_file(out / n, fe)
        except FAILURES as e:
            ok, error = False, e
            logger.error("peer replication of step %d from rank %d failed: %s", step, src, e)
        results = self._gather(ok, self._pg)
        if not all(results):
            if error is not None:
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PEER.value,
                           error=f"{type(error).__name__}: {error}")
            return
        if self.local_rank == 0:
            self._commit(self.peer, step, ranks=self._node_ranks((self.node - 1) % self.nnodes))
        if self.rank == 0:
            self._emit(EventKind.CKPT_TIER_DONE, step=step, tier=TierName.PEER.value,
                       seconds=time.perf_counter() - t0, bytes=sum(s.size for s in specs) * self.world_size)

    # ------------------------------------------------------------------ retention
    def _retain(self, tier: Any, keep: int, pinned_from: int | None, drop_newer_partial: bool = False) -> None:
        retain(tier, keep, pinned_from, drop_newer_partial)

    # ------------------------------------------------------------------ persistent upload
    def _upload_floor(self) -> int | None:
        with self._up_cv:
            pend = list(self._up_pending)
            return min(pend) if pend else None

    def _request_upload(self, step: int, files: dict[str, bytes] | None = None) -> None:
        """Queue ``step`` for upload, from the local tier or (``files``) from memory."""
        with self._up_cv:
            self._up_pending.append(step)
            if files is not None:
                self._up_mem[step] = files
            self._up_cv.notify_all()

    def _drop_pending(self, keep: Any) -> None:
        """(under _up_cv) keep only pending steps for which ``keep(step)``; their in-memory copies too."""
        self._up_pending = [s for s in self._up_pending if keep(s)]
        for s in [s for s in self._up_mem if not keep(s)]:
            del self._up_mem[s]

    def _upload_loop(self) -> None:
        while True:
            step: int | None = None
            with self._up_cv:
                while not self._up_pending and not self._up_closing:
                    self._up_cv.wait()
                if not self._up_pending:
                    return
                newest = max(self._up_pending)
                self._up_busy = True
            try:
                # ranks may have seen different numbers of requests: agree on one every rank has
                step = min(self._gather(newest, self._pg_up))
                with self._up_cv:
                    self._drop_pending(lambda s: s >= step)
                    mem = self._up_mem.get(step)
                    self._up_current = step
                assert self.local is not None
                self._upload_step(step, self.local, group=self._pg_up, mem=mem)
            except BaseException as e:  # the uploader must outlive any one upload
                logger.exception("upload loop error: %s", e)
            finally:
                with self._up_cv:
                    if step is not None:
                        self._drop_pending(lambda s: s > step)
                    self._up_busy = False
                    self._up_current = None
                    self._up_cv.notify_all()

    def _upload_step(self, step: int, src: DirTier, group: Any, mem: dict[str, bytes] | None = None) -> None:
        """Copy this rank's files of ``step`` from ``src`` (or from ``mem``: name -> bytes) to the
        persistent tier; rank 0 commits."""
        assert self.persistent is not None
        from resilient.checkpoint import compress

        cfg = self.config
        t0 = time.perf_counter()
        # collective, so before any call to the store (a rank stuck on a dead store must not hold others in it)
        coded = compress.prepare_upload(self, step, src, group) if mem is None else None
        ok, error, nbytes = True, None, 0
        try:
            # a step uploaded again (a job restored from an older step saves this number anew) must not stay
            # visible as complete while its files are replaced: each rank removes the marker before its own
            # first write (no collective for it: a rank must never wait in one while another is stuck on a
            # dead store), and only rank 0 writes it back, after every rank's files are in
            retry(lambda: self.persistent.delete_file(step, COMMIT_MARKER),  # type: ignore[union-attr]
                  what=f"uncommit step {step}", retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                  backoff_max_s=cfg.upload_backoff_max_s, should_stop=lambda: self._give_up(step))
            if mem is not None:
                m = Manifest.from_json(json.loads(mem[manifest_name(self.rank)]))
            else:
                m = read_manifest(src, step, self.rank)
            d = src.path(step)
            if coded is not None:
                d, m = coded  # the same step with every item compressed, and its manifest
            t_put = time.perf_counter()
            names = list(m.files) + [manifest_name(self.rank)]
            if self.rank == 0:
                names.append(DCP_METADATA)
            for n in names:
                fe = m.all_files().get(n)
                if mem is not None:
                    data = mem[n]
                    if fe is not None:
                        verify_bytes(data, fe, what=f"{n} of step {step} in memory")
                    put = (lambda n=n, data=data: self.persistent.write_bytes(step, n, data))  # type: ignore
                    size = len(data)
                else:
                    if fe is not None:
                        verify_file(d / n, fe)  # never upload a copy that rotted on the local disk
                    put = (lambda n=n: self.persistent.put_file(step, n, str(d / n)))  # type: ignore
                    size = (d / n).stat().st_size
                retry(put, what=f"upload {n} of step {step}", retries=cfg.upload_retries,
                      backoff_s=cfg.upload_backoff_s, backoff_max_s=cfg.upload_backoff_max_s,
                      should_stop=lambda: self._give_up(step))
                nbytes += size
            compress.observe_upload(self, nbytes, time.perf_counter() - t_put)
        except FAILURES as e:
            ok, error = False, e
            newer = self._newer_pending(step)
            if newer is not None and not isinstance(e, CorruptFileError):
                # retrying an old step against a store that is down only delays the newer one
                error = CheckpointError(f"gave up: step {newer} is waiting ({_one_line(e)})")
            logger.error("upload of step %d failed: %s", step, _one_line(error))
        if coded is not None:
            compress.clear(coded[0])
        results = self._gather((ok, nbytes), group)
        if all(r[0] for r in results) and self.rank == 0:
            try:
                retry(lambda: self._commit(self.persistent, step, ranks=list(range(self.world_size))),
                      what=f"commit step {step}", retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                      backoff_max_s=cfg.upload_backoff_max_s)
                seconds = time.perf_counter() - t0
                self._emit(EventKind.CKPT_TIER_DONE, step=step, tier=TierName.PERSISTENT.value,
                           seconds=seconds, bytes=sum(r[1] for r in results))
                tuner = self._interval.tuner
                if tuner is not None and hasattr(tuner, "observe_upload"):
                    try:
                        with self._interval.lock:
                            tuner.observe_upload(seconds)
                    except FAILURES as e:
                        logger.debug("tuner.observe_upload failed: %s", e)
                self._retain(self.persistent, cfg.keep_persistent, pinned_from=None)
            except FAILURES as e:
                ok, error = False, e
        if not ok:
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PERSISTENT.value,
                       error=_one_line(error) if not isinstance(error, CheckpointError) else str(error))

    _up_abandon = False

    def _newer_pending(self, step: int) -> int | None:
        """A later step queued for upload on this rank, if any."""
        with self._up_cv:
            newer = [s for s in self._up_pending if s > step]
        return max(newer) if newer else None

    def _give_up(self, step: int) -> bool:
        """Stop retrying the upload of ``step``: exit abandons it, or a newer step waits behind it (each rank
        decides alone; the upload's closing gather makes every rank drop the step if one did)."""
        return (self._closed and self._up_abandon) or self._newer_pending(step) is not None

    # ------------------------------------------------------------------ wait / close
    def wait(self, timeout: float | None = None, upload_timeout: float | None = None) -> bool:
        """Wait for in-flight saves, replication and uploads. Returns False on timeout.

        Uploads are waited for at most ``upload_timeout`` (default: the upload grace, ``--upload-grace``):
        a dead persistent store must not hold the job; its pending steps stay queued.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._last_job
        if job is not None:
            if not job.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        if self._uploader is None:
            return True
        if upload_timeout is None:
            # one grace for wait() and close() together: the clock starts at the first wait that finds
            # uploads pending and stops when they drain (or training goes on)
            if self._grace_until is None:
                self._grace_until = time.monotonic() + float(self.config.upload_grace_s or 0.0)
            up_deadline = self._grace_until
        else:
            up_deadline = time.monotonic() + upload_timeout
        deadline = up_deadline if deadline is None else min(deadline, up_deadline)
        with self._up_cv:
            while self._up_pending or self._up_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._up_cv.wait(left)
        self._grace_until = None
        return True

    def close(self, timeout: float | None = None, at_exit: bool = False) -> None:
        """Finish in-flight work and stop the background threads. Saves get up to ``timeout``; uploads get
        at most the upload grace, then the steps still pending are abandoned (and recorded in the ledger)."""
        if self._closed:
            return
        finished = self.wait(timeout)
        self._closed = True
        if not finished:
            self._up_abandon = True
            with self._up_cv:
                abandoned = sorted(set(self._up_pending) | ({self._up_current} if self._up_current is not None
                                                             else set()))
            saving = self._last_job is not None and not self._last_job.done.is_set()
            logger.warning("close(): %s still running; abandoning %s", "a save" if saving else "uploads",
                           f"uploads of steps {abandoned}" if abandoned else "it")
            for step in abandoned:
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PERSISTENT.value,
                           error="abandoned at exit",
                           upload_grace_s=self.config.upload_grace_s)
        self._jobs.put(None)
        with self._up_cv:
            self._up_closing = True
            self._up_cv.notify_all()
        if finished:
            self._worker.join(self.config.collective_timeout_s)
            if self._uploader is not None:
                self._uploader.join(self.config.collective_timeout_s)
        self._guard.disarm_hooks()
        self._stager.drop()
        if self._ledger is not None:
            self._ledger.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ restore
    def _tiers(self) -> list[Any]:
        return [t for t in (self.local, self.peer, self.persistent) if t is not None]

    def _scan(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for t in self._tiers():
            try:
                if t is self.persistent:
                    # a bounded probe: a dead store must not hold the start of training
                    steps = t.steps(timeout_s=self.config.restore_probe_s)
                else:
                    steps = t.steps()
                out[t.name] = sorted(s for s, c in steps.items() if c)
            except FAILURES as e:
                out[t.name] = []
                if t is self.persistent:
                    others = [x.name for x in self._tiers() if x is not t]
                    msg = (f"unreachable at restore ({_one_line(e)}); restoring from "
                           f"{' and '.join(others) if others else 'nothing'} without it")
                    logger.warning("persistent tier %s: %s", t.url(), msg)
                    self._emit(EventKind.CKPT_TIER_FAILED, step=None, tier=t.name, error=msg)
                else:
                    logger.warning("cannot list %s: %s", t, e)
        return out

    def restore(self, state: Mapping[str, Any]) -> int:
        """Load the newest step complete on some tier into ``state``; return the step to run next.

        Each rank reads from the fastest tier holding a verified copy of each file, falling back
        tier by tier (local → partner node over gloo → persistent) on a missing or corrupt file.
        Returns 0 when there is nothing to restore.
        """
        if self._closed:
            raise CheckpointError("restore() after close()")
        self.wait()
        t0 = time.perf_counter()
        views = self._gather(self._scan(), self._pg)
        candidates = sorted({s for v in views for steps in v.values() for s in steps}, reverse=True)
        if self.local is not None and self.local_rank == 0:
            # partial steps left by a crash are garbage now (nothing is writing before restore)
            for tier in (self.local, self.peer):
                if tier is not None:
                    self._retain(tier, 10**9, pinned_from=None, drop_newer_partial=True)
        if not candidates:
            self.last_restore = RestoreResult(step=None, tier=None, seconds=time.perf_counter() - t0, bytes=0)
            return 0
        failures = []
        self._excluded: set[tuple[int, str]] = set()  # (step, tier) whose copy was refused as unsafe
        self._lazy: set[str] = set()  # this rank's files taken from this node unverified (verified as they land)
        self._dirty = False  # bytes of a step that then failed landed in the state
        self._remote: set[str] = set()  # this rank's files read by blocks from the persistent tier
        unsafe: list[str] = []
        for step in candidates:
            res = None
            for _ in TIER_ORDER:  # an unsafe copy on one tier: the same step again from the next tier
                got = self._try_restore(step, state, views, t0)
                if isinstance(got, _Unsafe):
                    unsafe.extend(got.errors)
                    continue
                res = got
                break
            if res is not None:
                self.last_restore = res
                self.last_saved_step = step
                self._emit(EventKind.CKPT_RESTORE, step=step, tier=res.tier, seconds=res.seconds, bytes=res.bytes,
                           sources=sorted(set(res.sources.values())))
                logger.info("rank %d restored step %d from %s in %.2f s", self.rank, step, res.tier, res.seconds)
                if self._interval.auto:
                    self._interval.next_save = step + self._interval.steps
                return step + 1
            failures.append(step)
        extra = f"; refused as unsafe: {'; '.join(sorted(set(unsafe))[:5])}" if unsafe else ""
        if self._dirty:
            msg = (f"committed steps {failures} exist but none could be loaded from verified blocks on any tier; "
                   f"bytes of a checkpoint already landed in the state, which is now undefined{extra}: restore "
                   "from another checkpoint directory or start from a fresh state; see the log for the blocks")
            self._emit(EventKind.CKPT_TIER_FAILED, step=failures[0] if failures else None, tier="all",
                       error=msg, state_undefined=True)
            raise StateUndefinedError(msg)
        raise NoRestorableStepError(f"committed steps {failures} exist but none could be assembled from verified "
                                    f"files on any tier; the state is undefined{extra}; see the log for the "
                                    "corrupt or missing files")

    def _local_copies(self, step: int) -> list[tuple[str, Path]]:
        out = []
        for t in (self.local, self.peer):
            if t is not None and t.path(step).is_dir() and (step, t.name) not in getattr(self, "_excluded", ()):
                out.append((t.name, t.path(step)))
        fetched = self._fetch_dir(step)
        if fetched.is_dir():
            out.append(("fetched", fetched))
        return out

    def _fetch_dir(self, step: int) -> Path:
        return self._scratch / ".fetch" / f"rank{self.rank}" / f"step_{step:08d}"

    def _try_restore(self, step: int, state: Mapping[str, Any], views: list[dict[str, list[int]]],
                     t0: float) -> "RestoreResult | _Unsafe | None":
        in_persistent = (any(step in v.get(TierName.PERSISTENT.value, []) for v in views)
                         and (step, TierName.PERSISTENT.value) not in self._excluded)
        # 1. manifests: each rank contributes those it holds, the persistent tier fills gaps
        mine: dict[int, dict[str, Any]] = {}
        for _, d in self._local_copies(step):
            for p in d.glob("manifest-rank*.json"):
                try:
                    m = Manifest.from_json(json.loads(p.read_bytes()))
                    problem = _manifest_problem(m)
                    if problem:
                        logger.warning("manifest %s skipped: unsafe: %s", p, problem)
                        continue
                    if m.step == step:
                        mine.setdefault(m.rank, m.to_json())
                except (OSError, ValueError, KeyError, TypeError):
                    logger.warning("unreadable manifest %s skipped", p)
        manifests: dict[int, Manifest] = {}
        for theirs in self._gather(mine, self._pg):
            for r, mj in theirs.items():
                manifests.setdefault(r, Manifest.from_json(mj))
        world_old = next(iter(manifests.values())).world_size if manifests else None
        if in_persistent and (world_old is None or len(manifests) < world_old):
            missing = [r for r in range(world_old or 0) if r not in manifests] if world_old else None
            try:
                if missing is None:
                    m0 = _checked(retry(lambda: read_manifest(self.persistent, step, 0),  # type: ignore
                                        what="read manifest", retries=2, backoff_s=0.5, backoff_max_s=2))
                    manifests[0] = m0
                    world_old = m0.world_size
                    missing = [r for r in range(world_old) if r not in manifests]
                for r in missing:
                    manifests[r] = _checked(retry(lambda r=r: read_manifest(self.persistent, step, r),  # type: ignore
                                                  what="read manifest", retries=2, backoff_s=0.5, backoff_max_s=2))
            except FAILURES as e:
                logger.warning("step %d: manifests unavailable on the persistent tier: %s", step, e)
        ok_manifests = world_old is not None and all(r in manifests for r in range(world_old))
        if not self._all(ok_manifests):
            logger.warning("step %d: manifests of some ranks are on no tier; trying an older step", step)
            return None
        assert world_old is not None
        files: dict[str, FileEntry] = {DCP_METADATA: manifests[0].metadata}
        for m in manifests.values():
            files.update(m.files)
        per_rank_keys = set(manifests[0].per_rank_keys)

        # 2. DCP's .metadata first: it says which files hold the keys this rank loads
        phases = {"manifests": time.perf_counter() - t0}
        t_phase = time.perf_counter()
        got = self._assemble(step, {DCP_METADATA}, files, in_persistent)
        if got is None:
            return None
        paths, mem, sources = got
        md, refused = None, None
        try:
            md = load_metadata(mem[DCP_METADATA] if DCP_METADATA in mem else paths[DCP_METADATA].read_bytes(),
                               what=f"{sources.get(DCP_METADATA)} tier, step {step}, {DCP_METADATA}")
        except UnsafeCheckpointError as e:
            refused = (sources.get(DCP_METADATA), str(e))
        except FAILURES as e:
            logger.warning("rank %d: step %d: %s", self.rank, step, _one_line(e))
            refused = ("", "")
        verdict = self._refused(step, refused)
        if verdict is not None:
            mem.clear()
            return verdict
        assert md is not None
        phases["metadata"] = time.perf_counter() - t_phase
        # every rank stops here if one cannot plan, none is left waiting in a collective, and every rank's
        # error is told
        plan = self._ranks(self._pg).run(
            f"planning the restore of step {step}",
            lambda: self._plan_load(step, state, md.state_dict_metadata, per_rank_keys, world_old),
            catch=(CheckpointError,))
        # a world-size change some state cannot follow: every rank learns every rank's findings and all
        # raise the same error, before a single data file is fetched or a byte lands in the state
        reshard: dict[str, str] = {}
        for theirs in self._gather(plan.reshard, self._pg):
            for k, why in theirs.items():
                reshard.setdefault(k, why)
        if reshard:
            err = CheckpointReshardError(step, world_old, self.world_size, reshard)
            if self.rank == 0:
                logger.error("%s", err)
            raise err
        keys = set(plan.load_sd)
        need = {DCP_METADATA} | {info.relative_path for idx, info in md.storage_data.items() if idx.fqn in keys}
        missing = sorted(n for n in need if n not in files)
        if not self._all(not missing):
            logger.warning("step %d: .metadata names files no manifest lists (%s); trying an older step",
                           step, missing[:5])
            return None

        # 3. the data files: copies on this node are taken as they are (verified block by block as they
        # land in the state); the rest is fetched from a peer or the persistent tier, verified in memory
        t_phase = time.perf_counter()
        self._lazy = set()
        self._remote = set()
        got = self._assemble(step, need, files, in_persistent, have_already=(paths, mem, sources), lazy=True)
        if got is None:
            return None
        paths, mem, sources = got
        phases["fetch"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()

        # 4. plain tensors straight into the state, each block verified right after it lands; a bad block
        # comes again from the next copy into the same place; the rest of the state through DCP
        slow_keys = self._load_direct(step, md, plan, need, files, paths, mem, sources, in_persistent)
        if slow_keys is None:
            mem.clear()
            return None
        phases["direct"] = time.perf_counter() - t_phase
        refused = None
        if slow_keys:
            slow_sd = {k: plan.load_sd[k] for k in slow_keys}
            view = self._scratch / ".restore" / f"rank{self.rank}"
            shutil.rmtree(view, ignore_errors=True)
            view.mkdir(parents=True)
            for n, p in paths.items():
                if n not in mem:
                    os.symlink(os.path.abspath(p), view / n)
            try:
                reader = FastReader(view, mem)
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
        verdict = self._refused(step, refused)  # every rank takes part: the agreement point after loading
        if verdict is not None:
            return verdict
        self._finish_load(state, plan)
        phases["load"] = time.perf_counter() - t_phase
        used = {sources[n] for n in need}
        tier = max(used, key=lambda t: [x.value for x in TIER_ORDER].index(t)) if used else None
        nbytes = sum(files[n].size for n in need)
        res = RestoreResult(step=step, tier=tier, seconds=time.perf_counter() - t0, bytes=nbytes,
                            sources={n: sources[n] for n in need}, phases=phases)
        logger.debug("rank %d restore of step %d phases: %s", self.rank, step, phases)
        shutil.rmtree(self._scratch / ".fetch" / f"rank{self.rank}", ignore_errors=True)
        _rmdir_quiet(self._scratch / ".fetch")
        return res

    def _load_direct(self, step: int, md: Any, plan: "_LoadPlan", need: set[str], files: dict[str, FileEntry],
                     paths: dict[str, Path], mem: dict[str, Any], sources: dict[str, str],
                     in_persistent: bool) -> set[str] | None:
        """Collective: load the plain tensors of ``plan`` straight into their targets (see ``load.py``).

        Returns the checkpoint keys left to DCP; every file DCP will read is verified whole by then.
        Returns None on every rank when some rank has a block no tier holds a good copy of (after this
        node's other copies, the persistent tier by ranged reads, then other ranks' copies over gloo).
        """
        by_fqn: dict[str, list[Any]] = {}
        for idx, info in md.storage_data.items():
            by_fqn.setdefault(idx.fqn, []).append(info)
        per_file: dict[str, list[Item]] = {}
        slow: set[str] = set()
        for key, v in plan.load_sd.items():
            m = md.state_dict_metadata.get(key)
            infos = by_fqn.get(key, [])
            if (isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata) and len(m.chunks) == 1
                    and len(infos) == 1 and not infos[0].transform_descriptors
                    and all(o == 0 for o in m.chunks[0].offsets) and tuple(m.chunks[0].sizes) == tuple(v.shape)):
                per_file.setdefault(infos[0].relative_path, []).append(Item(infos[0].offset, infos[0].length, v))
            else:
                slow.add(key)
        loads: list[FileLoad] = []
        opened: list[Source] = []
        key_of_target = {id(v): k for k, v in plan.load_sd.items() if isinstance(v, torch.Tensor)}
        slow_files: set[str] = set()
        lost: list[str] = []
        try:
            for name in sorted(need - {DCP_METADATA}):
                srcs = self._sources(step, name, files[name], paths, mem, sources, in_persistent, opened)
                items = per_file.get(name, [])
                if not srcs:
                    lost.append(f"{name} (no copy)")
                    continue
                for it in items:  # the layout is trusted only for targets that match DCP's metadata
                    m = md.state_dict_metadata[key_of_target[id(it.target)]]
                    if m.properties.dtype != it.target.dtype:
                        slow.add(key_of_target[id(it.target)])
                items = [it for it in items if key_of_target[id(it.target)] not in slow]
                spans, left = plan_spans(srcs[0], files[name].size, items, files[name].items)
                for it in left:
                    slow.add(key_of_target[id(it.target)])
                if left or len(items) < self._items_in(md, name):
                    slow_files.add(name)
                loads.append(FileLoad(name, files[name], srcs, spans))
                if name in slow_files and name in self._remote:
                    # DCP reads the objects from the bytes kept as they passed (pages of tensor bytes
                    # are never touched: not resident)
                    loads[-1].keep_gaps = torch.empty(files[name].size, dtype=torch.uint8).numpy()

            def on_bad(f: FileLoad, block: int, tier: str, why: str) -> None:
                logger.warning("rank %d: step %d: %s block %d from the %s tier: %s; trying the next copy",
                               self.rank, step, f.name, block, tier, why)
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=tier,
                           error=f"{f.name} block {block}: {why}")

            lost += load_files(loads, on_bad=on_bad, verified=frozenset(n for n in mem if n not in self._lazy))
            for f in loads:
                if f.served is not None:
                    sources[f.name] = f.served
                if f.keep_gaps is not None and f.name not in lost:
                    mem[f.name] = f.keep_gaps
                elif f.name in slow_files and f.name not in lost and f.sources and f.served != f.sources[0].tier:
                    # a block of the first copy was bad: DCP reads the rest from a whole verified copy
                    mem[f.name] = self._whole(f)
            if not lost:
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
        # last resort, collective: files with lost blocks from another rank's copy over gloo
        if any(self._gather(lost_files, self._pg)):
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
                        again += load_files([f], verified=frozenset({f.name}))
                        sources[f.name] = got_sources[f.name]
                        mem[f.name] = got_mem[f.name]
                    elif f.name in lost_files:
                        again.append(f"{f.name} (no copy on any tier)")
            if again:
                logger.error("rank %d: %s", self.rank, undefined(again, step))
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier="all",
                           error=f"no good copy of {'; '.join(again[:5])}")
            if not self._all(not again):
                # bytes of this step landed in the state: an older step, fully loaded, may still define it
                self._dirty = True
                return None
        return slow

    @staticmethod
    def _items_in(md: Any, name: str) -> int:
        return sum(1 for info in md.storage_data.values() if info.relative_path == name)

    def _sources(self, step: int, name: str, entry: FileEntry, paths: dict[str, Path], mem: dict[str, Any],
                 sources: dict[str, str], in_persistent: bool, opened: list[Source]) -> list[Source]:
        """The copies of ``name`` this rank can read without the others, best first."""
        out: list[Source] = []
        seen: set[str] = set()
        if name in self._remote and self.persistent is not None:
            tier = self.persistent
            out.append(RangeSource(lambda off, n, tier=tier: tier.read_range(step, name, off, n),
                                   TierName.PERSISTENT.value))
        elif name in mem:
            out.append(MemSource(mem[name], sources.get(name, TierName.PEER.value)))
        elif name in paths:
            try:
                src = FileSource(paths[name], sources.get(name, TierName.LOCAL.value), entry.size)
                opened.append(src)
                out.append(src)
                seen.add(os.path.realpath(paths[name]))
            except OSError as e:
                logger.warning("rank %d: %s: %s", self.rank, name, e)
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
        if in_persistent and self.persistent is not None and name not in self._remote \
                and sources.get(name) != TierName.PERSISTENT.value:
            tier = self.persistent
            out.append(RangeSource(lambda off, n, tier=tier: tier.read_range(step, name, off, n),
                                   TierName.PERSISTENT.value))
        return out

    def _whole(self, f: FileLoad) -> Any:
        for src in f.sources:
            try:
                return whole_file(src, f.entry)
            except (OSError, ValueError, RuntimeError, TimeoutError) as e:
                logger.warning("rank %d: whole copy of %s from the %s tier: %s", self.rank, f.name, src.tier, e)
        raise undefined([f"{f.name} (whole file)"])

    def _refused(self, step: int, refused: tuple[str | None, str] | None) -> "_Unsafe | None":
        """Collective: did some rank refuse a file of ``step``? Then the tiers that served refused files
        are excluded for this step (on every rank) and the step is tried again from the next tier."""
        if refused is not None and refused[1]:
            tier, msg = refused
            logger.error("rank %d: %s", self.rank, msg)
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=tier or "unknown", error=f"unsafe: {msg}")
        everyone = self._gather(refused, self._pg)
        if all(r is None for r in everyone):
            return None
        for r in everyone:
            if r is not None and r[0]:
                self._excluded.add((step, r[0]))
        return _Unsafe([r[1] for r in everyone if r is not None and r[1]])

    def _assemble(self, step: int, need: set[str], files: dict[str, FileEntry], in_persistent: bool,
                  have_already: tuple[dict[str, Path], dict[str, Any], dict[str, str]] | None = None,
                  lazy: bool = False, exclude: frozenset[str] = frozenset()
                  ) -> tuple[dict[str, Path], dict[str, Any], dict[str, str]] | None:
        """Collective: make every file in ``need`` (this rank's; others pass theirs) available here, verified.

        Sources, fastest first: a verified copy on this node (local dir, partner replica), another rank's
        verified copy over gloo, the persistent tier. Returns (paths on disk, bytes in memory, name ->
        tier), or None on every rank if some rank could not get some file.

        ``lazy``: this rank's own data files found on this node are only size-checked here; they are
        verified block by block as they land in the state (see ``load.py``). ``exclude``: names whose
        copies on this node failed verification (fetched from elsewhere, never offered to others).
        """
        paths, mem, sources = ({}, {}, {}) if have_already is None else have_already
        needs = self._gather(sorted(need), self._pg)
        wanted = set().union(*(set(n) for n in needs))
        # copies on this node of anything some rank needs: verified when this rank loads them; a copy
        # only sent to others is verified by its receiver (one read instead of two)
        have: dict[str, tuple[str, Path]] = {}
        for tier_name, d in self._local_copies(step):
            for n in sorted(wanted):
                if n in have or n in mem or n in exclude or not (d / n).exists():
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
                    logger.warning("rank %d: %s copy of step %d skipped: %s", self.rank, tier_name, step, e)
        for n, p in paths.items():
            have.setdefault(n, (sources.get(n, TierName.LOCAL.value), p))
        everyone = self._gather(sorted(set(have) | set(mem)), self._pg)

        fetch_plan = plan_fetch(needs, everyone, {n: files[n].size for n in wanted}, in_persistent)
        transfers = fetch_plan.transfers
        downloads = list(fetch_plan.downloads.get(self.rank, []))
        if not fetch_plan.feasible:
            logger.warning("step %d: some files are on no tier; trying an older step", step)
            return None
        for n in need:
            if n in have:
                sources.setdefault(n, have[n][0])
                paths.setdefault(n, have[n][1])

        fetch = self._fetch_dir(step)
        ok = True
        incoming = sum(t.size for t in transfers if t.dst == self.rank) + sum(files[n].size for n in downloads)
        in_memory = incoming <= _memory_budget()
        try:
            if transfers:
                src_path = {n: str(p) for n, (_, p) in have.items()}
                src_mem = {n: b for n, b in mem.items()}
                received = run_transfers(self._pg, self.rank, transfers, src_path=src_path, src_mem=src_mem,
                                         out_dir=None if in_memory else fetch, to_memory=in_memory)
                for n, got in received.items():
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
                        logger.warning("rank %d: %s; falling back to the persistent tier", self.rank, e)
                        downloads.append(n)
            for n in downloads:
                if lazy and files[n].items and n != DCP_METADATA:
                    # read by blocks from the persistent tier straight into the state (see _load_direct)
                    self._remote.add(n)
                    sources[n] = TierName.PERSISTENT.value
                    continue
                if in_memory:
                    data = retry(lambda n=n: self.persistent.read_parallel(step, n, files[n].size),  # type: ignore
                                 what=f"download {n} of step {step}", retries=self.config.upload_retries,
                                 backoff_s=self.config.upload_backoff_s,
                                 backoff_max_s=self.config.upload_backoff_max_s)
                    verify_bytes(data, files[n], what=f"{n} from the persistent tier")
                    mem[n] = data
                else:
                    fetch.mkdir(parents=True, exist_ok=True)
                    dst = fetch / n
                    retry(lambda n=n, dst=dst: self.persistent.get_file(step, n, str(dst), files[n].size),  # type: ignore
                          what=f"download {n} of step {step}", retries=self.config.upload_retries,
                          backoff_s=self.config.upload_backoff_s, backoff_max_s=self.config.upload_backoff_max_s)
                    verify_file(dst, files[n])
                    paths[n] = dst
                sources[n] = TierName.PERSISTENT.value
        except FAILURES as e:
            ok = False
            logger.warning("rank %d: assembling step %d failed: %s", self.rank, step, e)
        if not self._all(ok):
            return None
        return paths, mem, sources

    def _all(self, ok: bool) -> bool:
        return all(self._gather(bool(ok), self._pg))

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
        resized = world_old != self.world_size
        for fqn, (path, v) in leaves.items():
            key = fqn
            if fqn in per_rank_keys:
                pk = _per_rank_key(self.rank, fqn)
                own = pk in md or any(k.startswith(pk + ".") for k in md)
                if resized and self._is_object(v, md, fqn, world_old):
                    # a per-rank object (a data position, a shard index, a counter) cannot be split, merged
                    # or copied: a copy makes two ranks repeat the same data, a dropped one skips data
                    gone = [r for r in range(self.world_size, world_old) if _per_rank_key(r, fqn) in md]
                    if not own:
                        reshard[fqn] = f"a per-rank object with no value saved for rank {self.rank}"
                        continue
                    if gone:
                        reshard[fqn] = (f"a per-rank object whose values of ranks {gone[0]}-{gone[-1]} would be "
                                        "dropped" if len(gone) > 1 else
                                        f"a per-rank object whose value of rank {gone[0]} would be dropped")
                        continue
                if own:
                    key = pk
                elif self.rank == 0 or self.rank >= world_old:
                    # tensors (RNG states, running statistics): a copy of a saved rank's value is a valid start
                    logger.warning("per-rank value %r has no entry for rank %d (saved with %d ranks); "
                                   "using the shared one", fqn, self.rank, world_old)
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
                    if isinstance(m, TensorStorageMetadata):
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
            if path:
                set_path(plain, path, new)
        for k, v in state.items():
            if is_stateful(v):
                v.load_state_dict(plain[k])
            elif isinstance(state, dict) and plain[k] is not v:
                state[k] = plain[k]
