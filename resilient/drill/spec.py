"""The drill vocabulary: what ``--inject`` and a worker plan (``env.FAULTS``) can name. Pure: no process is
touched here.

Spec strings for ``--inject`` (time- or step-based, node- or worker-level)::

    kill-worker@30s,hang-worker@60s,kill-node@90s,slow-rank:1@0s,raise-worker:0@step12

are parsed by :func:`parse_inject` into :class:`FaultSpec` values; a target left out is drawn from the
seeded generator, so a drill is reproducible from its seed.

In-worker faults (:class:`FaultHow`) travel to workers as :class:`WorkerFault` values in ``env.FAULTS``
(written by :func:`plan_env`, read by :func:`read_plan`), e.g.
``kill:rank=1:step=30:attempt=0,slow:rank=0:step=5:seconds=0.05``; :mod:`resilient.drill.worker` carries
them out:

* ``kill``      SIGKILL this process (a crash that runs no handler);
* ``stop``      SIGSTOP this process (a hang: alive, silent);
* ``raise``     raise ``InjectedFault`` (a Python error in the training step);
* ``slow``      sleep ``seconds`` every step from then on (a straggler);
* ``wipe-tier`` delete this node's local checkpoint tier (a lost local SSD);
* ``hang-collective`` wait in ``dist.recv`` for a message no peer sends (a deadlock inside communication);
* ``preempt``   a preemption notice (``RUN_DIR/preempt``) after which every rank stops after exactly this step;
* the checkpoint faults of :data:`CHECKPOINT_HOWS`, carried out by :mod:`resilient.drill.hooks`.
"""

from __future__ import annotations

import enum
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

from resilient import env as renv

FAULTS_ENV = renv.FAULTS


class FaultHow(str, enum.Enum):
    KILL = "kill"
    STOP = "stop"
    RAISE = "raise"
    SLOW = "slow"
    WIPE_TIER = "wipe-tier"
    HANG_COLLECTIVE = "hang-collective"  # blocked in dist.recv for a message no peer sends: a deadlock in
    # communication (alive, not stopped; the peers wait in their next collective)
    PREEMPT = "preempt"  # a preemption notice that stops the job after exactly this step (see drill.worker)
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
    """The environment that makes a worker carry out ``faults`` (``steps()``, or ``drill.worker.maybe_fail``)."""
    return {FAULTS_ENV: ",".join(f.encode() for f in faults)}



def read_plan(environ: Mapping[str, str] = os.environ) -> list[WorkerFault]:
    """The worker faults planned in ``environ`` (see :func:`plan_env`)."""
    raw = environ.get(FAULTS_ENV, "")
    return [WorkerFault.decode(p) for p in raw.split(",") if p.strip()]
