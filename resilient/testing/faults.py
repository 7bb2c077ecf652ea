"""Fault injection for tests, drills and the launcher's ``--inject``: one vocabulary for every fault.

In the spirit of torchft's ``EventInjector``: a training script declares nothing; the test (or the drill)
says what goes wrong, where and when, and the script calls :func:`maybe_fail` once per step (or uses
:func:`fail_at` directly). Every injected fault is written to the run's ledger as ``fault_injected`` before
it happens, so a goodput report and a test both see what was done.

In-worker faults (``how``):

* ``kill``      SIGKILL this process (a crash that runs no handler);
* ``stop``      SIGSTOP this process (a hang: alive, silent);
* ``raise``     raise :class:`InjectedFault` (a Python error in the training step);
* ``slow``      sleep ``seconds`` every step from then on (a straggler);
* ``wipe-tier`` delete this node's local checkpoint tier (a lost local SSD);
* ``hang-collective`` wait in ``dist.recv`` for a message no peer sends (a deadlock inside communication);
* ``preempt``   a preemption notice (``RUN_DIR/preempt``) after which every rank stops after exactly this step.

Scripts read the plan from ``RESILIENT_FAULTS`` (written by :func:`plan_env`), e.g.
``kill:rank=1:step=30:attempt=0,slow:rank=0:step=5:seconds=0.05``.

Spec strings for ``--inject`` (time- or step-based, node- or worker-level)::

    kill-worker@30s,hang-worker@60s,kill-node@90s,slow-rank:1@0s,raise-worker:0@step12

are parsed by :func:`parse_inject` into :class:`FaultSpec` values; a target left out is drawn from the
seeded generator, so a drill is reproducible from its seed.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from resilient import env as renv

logger = logging.getLogger(__name__)

FAULTS_ENV = renv.FAULTS


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault: a failure of the training step itself."""


class FaultHow(str, enum.Enum):
    KILL = "kill"
    STOP = "stop"
    RAISE = "raise"
    SLOW = "slow"
    WIPE_TIER = "wipe-tier"
    HANG_COLLECTIVE = "hang-collective"  # blocked in dist.recv for a message no peer sends: a deadlock in
    # communication (alive, not stopped; the peers wait in their next collective)
    PREEMPT = "preempt"  # a preemption notice that stops the job after exactly this step (see _preempt_notice)
    # Faults placed in a checkpoint's life; they need the script's CheckpointManager (arm_checkpoint_faults
    # once after it is made, after_save after each save):
    KILL_AFTER_SAVE = "kill-after-save"  # SIGKILL once the save of the step is complete on every tier
    KILL_MID_WRITE = "kill-mid-write"  # SIGKILL with a local file of the step half written (a torn write)
    KILL_MID_UPLOAD = "kill-mid-upload"  # SIGKILL once the first file of the step reached the persistent tier
    LOSE_DISK = "lose-disk"  # once the step is saved everywhere: delete this node's local tier, then SIGKILL


CHECKPOINT_HOWS = frozenset({FaultHow.KILL_AFTER_SAVE, FaultHow.KILL_MID_WRITE, FaultHow.KILL_MID_UPLOAD,
                             FaultHow.LOSE_DISK})


class FaultKind(str, enum.Enum):
    """What an ``--inject`` spec names."""

    KILL_WORKER = "kill-worker"  # SIGKILL one worker
    HANG_WORKER = "hang-worker"  # SIGSTOP one worker
    RAISE_WORKER = "raise-worker"  # an exception in one worker's step
    SLOW_RANK = "slow-rank"  # one rank sleeps every step from then on
    WIPE_TIER = "wipe-tier"  # one node's local checkpoint tier deleted
    KILL_NODE = "kill-node"  # a whole node: its agent and every worker


# the in-worker equivalent of each spec kind (kill-node is carried out by the launcher, not in a worker)
KIND_TO_HOW = {
    FaultKind.KILL_WORKER: FaultHow.KILL, FaultKind.HANG_WORKER: FaultHow.STOP,
    FaultKind.RAISE_WORKER: FaultHow.RAISE, FaultKind.SLOW_RANK: FaultHow.SLOW, FaultKind.WIPE_TIER: FaultHow.WIPE_TIER,
}


class FaultSpecError(ValueError):
    """A spec string that cannot be understood; the message names the bad part and the expected form."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault of a drill: what, to whom (rank, or node index for node faults) and when (seconds after
    the start, or a step)."""

    kind: FaultKind
    target: int | None = None  # rank (node index for kill-node); None: chosen by the seed
    at_seconds: float | None = None
    at_step: int | None = None
    seconds: float = 0.05  # slow-rank: extra seconds per step

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise FaultSpecError(f"fault kind must be a FaultKind, got {self.kind!r}")
        if (self.at_seconds is None) == (self.at_step is None):
            raise FaultSpecError(f"{self.kind.value}: give exactly one of a time (@30s) or a step (@step30)")
        if self.at_seconds is not None and not (self.at_seconds >= 0 and self.at_seconds != float("inf")):
            raise FaultSpecError(f"{self.kind.value}: time must be a finite number of seconds >= 0, got {self.at_seconds}")
        if self.at_step is not None and self.at_step < 0:
            raise FaultSpecError(f"{self.kind.value}: step must be >= 0, got {self.at_step}")
        if self.target is not None and self.target < 0:
            raise FaultSpecError(f"{self.kind.value}: target must be >= 0, got {self.target}")
        if not (self.seconds >= 0 and self.seconds != float("inf")):
            raise FaultSpecError(f"{self.kind.value}: slow-down must be finite seconds >= 0, got {self.seconds}")

    def describe(self) -> str:
        who = "?" if self.target is None else str(self.target)
        when = f"{self.at_seconds:g}s" if self.at_seconds is not None else f"step{self.at_step}"
        return f"{self.kind.value}:{who}@{when}"


_SPEC_RE = re.compile(r"^(?P<kind>[a-z-]+)(?::(?P<target>\d+))?@(?:(?P<secs>\d+(?:\.\d+)?)s|step(?P<step>\d+))$")


def parse_inject(spec: str, seed: int = 0, *, world_size: int | None = None, nnodes: int | None = None) -> list[FaultSpec]:
    """Parse ``kill-worker@30s,hang-worker@60s,kill-node@90s,slow-rank:1@0s,raise-worker:0@step12``.

    A fault without a target gets one drawn from ``random.Random(seed)`` (ranks below ``world_size``, nodes
    below ``nnodes``), so the same seed gives the same drill. Raises :class:`FaultSpecError` naming the bad
    part; the result is sorted by time, then step."""
    if not isinstance(spec, str) or not spec.strip():
        raise FaultSpecError("--inject needs a list like kill-worker@30s,slow-rank:1@0s")
    rng = random.Random(seed)
    out: list[FaultSpec] = []
    for part in (p.strip() for p in spec.split(",")):
        m = _SPEC_RE.match(part)
        if not m:
            raise FaultSpecError(f"--inject: cannot read {part!r}; expected KIND[:TARGET]@Ns or KIND[:TARGET]@stepN "
                                 f"with KIND one of {', '.join(k.value for k in FaultKind)}")
        try:
            kind = FaultKind(m["kind"])
        except ValueError:
            raise FaultSpecError(f"--inject: unknown fault {m['kind']!r} in {part!r}; known: "
                                 f"{', '.join(k.value for k in FaultKind)}") from None
        target = int(m["target"]) if m["target"] is not None else None
        limit = nnodes if kind == FaultKind.KILL_NODE else world_size
        if target is None and limit:
            target = rng.randrange(limit)
        if target is not None and limit is not None and target >= limit:
            raise FaultSpecError(f"--inject: {part!r} targets {target}, but there are only {limit}")
        out.append(FaultSpec(kind, target, at_seconds=float(m["secs"]) if m["secs"] is not None else None,
                             at_step=int(m["step"]) if m["step"] is not None else None))
    return sorted(out, key=lambda f: (f.at_seconds if f.at_seconds is not None else -1.0, f.at_step or 0))


# --------------------------------------------------------------------------------------- in the worker

@dataclass(frozen=True)
class WorkerFault:
    """One in-worker fault: ``how`` at ``step`` on ``rank`` (only in ``attempt`` when given)."""

    how: FaultHow
    rank: int
    step: int
    attempt: int | None = 0  # None: every attempt
    seconds: float = 0.05  # slow: extra seconds per step

    def encode(self) -> str:
        parts = [self.how.value, f"rank={self.rank}", f"step={self.step}"]
        parts.append("attempt=any" if self.attempt is None else f"attempt={self.attempt}")
        if self.how == FaultHow.SLOW:
            parts.append(f"seconds={self.seconds!r}")
        return ":".join(parts)

    @classmethod
    def decode(cls, text: str) -> "WorkerFault":
        how, *kvs = text.split(":")
        try:
            kv = dict(x.split("=", 1) for x in kvs)
            att = kv.get("attempt", "0")
            return cls(FaultHow(how), int(kv["rank"]), int(kv["step"]), None if att == "any" else int(att),
                       float(kv.get("seconds", "0.05")))
        except (KeyError, ValueError) as e:
            raise FaultSpecError(f"{FAULTS_ENV}: cannot read {text!r} ({e}); expected HOW:rank=R:step=S[:attempt=A]") from None


def plan_env(*faults: WorkerFault) -> dict[str, str]:
    """The environment that makes a worker script's :func:`maybe_fail` carry out ``faults``."""
    return {FAULTS_ENV: ",".join(f.encode() for f in faults)}


def _plan() -> list[WorkerFault]:
    raw = os.environ.get(FAULTS_ENV, "")
    return [WorkerFault.decode(p) for p in raw.split(",") if p.strip()]


def _attempt() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _record(fault: str, target: int, at: str, **details: object) -> None:
    """The ledger line comes first: a SIGKILL leaves no chance to write it afterwards."""
    try:
        from resilient.events.api import EventKind
        from resilient.events.ledger import Ledger

        led = Ledger.from_env()
        if led is None:
            return
        try:
            led.emit(EventKind.FAULT_INJECTED, rank=target, fault=fault, target=target, at=at, **details)
        finally:
            led.close()
    except Exception as e:  # noqa: BLE001 - a drill must still run when the ledger cannot be written
        logger.warning("fault %s not recorded in the ledger: %s", fault, e)


def fail_at(rank: int, step: int, how: FaultHow | str, *, current_rank: int | None = None,
            current_step: int | None = None, seconds: float = 0.05, tier_dir: str | None = None) -> None:
    """Carry out fault ``how`` if this process is ``rank`` at ``step`` (``slow``: at and after ``step``).

    ``current_rank`` defaults to ``$RANK``; ``current_step`` must be given by the caller's loop. ``wipe-tier``
    deletes ``tier_dir`` (default ``$RESILIENT_CKPT_LOCAL``)."""
    how = FaultHow(how)
    me = int(os.environ.get("RANK", "0")) if current_rank is None else current_rank
    if me != rank or current_step is None or how in CHECKPOINT_HOWS:
        return
    if how == FaultHow.SLOW:
        if current_step >= step:
            if current_step == step:
                _record(how.value, rank, f"step{step}", seconds=seconds)
            time.sleep(seconds)  # the fault itself is lost time
        return
    if current_step != step:
        return
    _record(how.value, rank, f"step{step}")
    sys.stdout.flush()
    sys.stderr.flush()
    if how == FaultHow.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == FaultHow.STOP:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == FaultHow.RAISE:
        raise InjectedFault(f"injected failure on rank {rank} at step {step}")
    elif how == FaultHow.HANG_COLLECTIVE:
        import torch
        import torch.distributed as dist

        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    elif how == FaultHow.PREEMPT:
        _preempt_notice(step)
    elif how == FaultHow.WIPE_TIER:
        d = tier_dir or os.environ.get("RESILIENT_CKPT_LOCAL")
        if d:
            shutil.rmtree(d, ignore_errors=True)


def _preempt_notice(step: int) -> None:
    """Agree on ``step`` as the preempted attempt's last step, then drop the notice file. Which step the ranks
    agree on for a real notice depends on where each rank is when it first looks (see
    ``resilient.signals.client``); a drill picks it, so a test reproduces each case. Every rank that notices
    the file later reads this agreement from the store; none can be past ``step`` yet (this rank has not
    taken part in the step's collectives)."""
    import torch.distributed as dist

    from resilient.signals import client

    if dist.is_available() and dist.is_initialized():
        c = client._client()
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(f"resilient/preempt_stop/{c.attempt if c is not None else -1}", "", str(step))
    run_dir = os.environ.get(renv.RUN_DIR)
    if run_dir:
        with open(os.path.join(run_dir, client.PREEMPT_NOTICE_FILE), "w"):
            pass


def maybe_fail(step: int) -> None:
    """Call once per step in a test script: carries out the faults planned in ``RESILIENT_FAULTS`` for this
    rank, step and attempt."""
    att = _attempt()
    for f in _plan():
        if f.attempt is None or f.attempt == att:
            fail_at(f.rank, f.step, f.how, current_step=step, seconds=f.seconds)


def _mine(hows: frozenset[FaultHow] | set[FaultHow]) -> list[WorkerFault]:
    me, att = int(os.environ.get("RANK", "0")), _attempt()
    return [f for f in _plan() if f.how in hows and f.rank == me and (f.attempt is None or f.attempt == att)]


def _die(how: FaultHow, rank: int, step: int) -> None:
    _record(how.value, rank, f"step{step}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm_checkpoint_faults(manager: object) -> None:
    """Call once after making the script's ``CheckpointManager``: installs this rank's planned mid-write and
    mid-upload kills for this attempt (hooks on the writer and on the tiers' upload, matched by step: the
    background writer may run while training is already steps ahead)."""
    for f in _mine({FaultHow.KILL_MID_WRITE, FaultHow.KILL_MID_UPLOAD}):
        if f.how == FaultHow.KILL_MID_WRITE:
            _arm_mid_write(f)
        else:
            _arm_mid_upload(f)


def _arm_mid_write(f: WorkerFault) -> None:
    import torch
    import torch.distributed.checkpoint.filesystem as fs

    orig = fs._write_item
    marker = f"step_{f.step:08d}"

    def write_half(transforms, stream, data, write_item, storage_key, fmt):  # type: ignore[no-untyped-def]
        if marker in str(getattr(stream, "name", "")) and isinstance(data, torch.Tensor) and data.numel() > 64:
            raw = data.detach().contiguous().view(torch.uint8).numpy().tobytes()
            stream.write(raw[: len(raw) // 2])
            stream.flush()
            _die(f.how, f.rank, f.step)
        return orig(transforms, stream, data, write_item, storage_key, fmt)

    fs._write_item = write_half


def _arm_mid_upload(f: WorkerFault) -> None:
    from resilient.checkpoint import tiers

    for cls in (tiers.FsspecTier, tiers.DirTier):
        orig_put = cls.put_file

        def put(self, s, name, local_path, _orig=orig_put):  # type: ignore[no-untyped-def]
            _orig(self, s, name, local_path)
            if s == f.step and self.name == "persistent":
                _die(f.how, f.rank, f.step)

        cls.put_file = put  # type: ignore[method-assign]
        orig_write = cls.write_bytes

        def write(self, s, name, data, _orig=orig_write):  # type: ignore[no-untyped-def]
            _orig(self, s, name, data)  # plain files of one part go up in one request each
            if s == f.step and self.name == "persistent":
                _die(f.how, f.rank, f.step)

        cls.write_bytes = write  # type: ignore[method-assign]


_COMMIT_WAIT_S = 60.0


def _wait_committed(manager: object, step: int) -> None:
    """Until ``step`` is complete on every tier that holds any of it. ``wait()`` returns once this rank's part
    is done; the commit marker is written after that by another rank (local rank 0 on its node, rank 0 on
    the persistent tier), and killing this rank first may kill that one before it writes (seen under load:
    a kill-after-save whose step then restored as incomplete). Bounded: a failed upload never commits."""
    tiers = [getattr(manager, "local", None), getattr(manager, "persistent", None)]
    for tier in [t for t in tiers if t is not None]:
        try:
            wait_for(lambda t=tier: t.steps().get(step) is not False, _COMMIT_WAIT_S,
                     f"step {step} committed on the {tier.name} tier", interval=0.01)
        except AssertionError as e:  # the fault still happens: what a test then sees is the real outcome
            logger.warning("fault at step %d: %s", step, e)


def after_save(step: int, manager: object) -> None:
    """Call after each ``manager.save(step, ...)``: carries out this rank's kill-after-save and lose-disk
    faults of ``step`` (once the save is complete), and holds training at a planned mid-upload step until
    the upload (and so the kill) has happened."""
    for f in _mine(CHECKPOINT_HOWS - {FaultHow.KILL_MID_WRITE}):
        if f.step != step:
            continue
        manager.wait()  # type: ignore[attr-defined]
        _wait_committed(manager, step)
        if f.how == FaultHow.LOSE_DISK:
            local = getattr(manager, "local", None)
            if local is not None:
                shutil.rmtree(local.root, ignore_errors=True)
        if f.how in (FaultHow.KILL_AFTER_SAVE, FaultHow.LOSE_DISK):
            _die(f.how, f.rank, f.step)


# --------------------------------------------------------------------------------------- in the test

def wait_for(pred: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None, *,
             interval: float = 0.02) -> object:
    """Poll ``pred`` (a condition on real files or processes) until it returns something truthy, which is
    returned; fails with a message naming ``what`` instead of hanging, and at once if ``proc`` (the process
    expected to bring the condition about) has exited meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}: {err}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def cpu_burners(n: int = 2, *, max_seconds: float = 600.0) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` busy-looping processes beside the code under test (CPU contention), always killed on exit and
    bounded by ``max_seconds`` even if this process dies (they run under ``timeout``)."""
    n = max(0, min(int(n), 2))  # a shared machine: at most two
    code = "import time\nend = time.monotonic() + %r\nwhile time.monotonic() < end: pass\n" % float(max_seconds)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)
