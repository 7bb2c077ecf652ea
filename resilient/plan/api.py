"""Contract of the goodput planner: measured figures, the cluster to plan for, and the results.

A plan is a seeded discrete-event simulation (:mod:`resilient.plan.sim`) of a job on ``nodes`` nodes whose
failures are decided by a real policy file through the real :class:`~resilient.supervisor.core.SupervisorCore`.
:class:`Figures` are the costs of one event of each kind (measured from a run's ledger by
:mod:`resilient.plan.inputs`, or given); :class:`ClusterConfig` is what the user wants to decide on.
The result splits wall time into productive time and the badput categories of ``resilient goodput``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from resilient.events.api import EventKind
from resilient.goodput.api import CATEGORIES, PRODUCTIVE, Badput

# Llama 3 405B pre-training (Meta, "The Llama 3 Herd of Models", 2024): 466 job interruptions in 54 days on
# 16,384 GPUs, 78% of the unexpected ones attributed to hardware.
LLAMA3_INTERRUPTIONS = 466
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16384
LLAMA3_HARDWARE_SHARE = 0.78
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_FAILURES_PER_NODE_DAY = LLAMA3_INTERRUPTIONS / LLAMA3_DAYS / (LLAMA3_GPUS / DEFAULT_GPUS_PER_NODE)

TIERS = ("local", "peer", "persistent")
FAULT_KINDS = (EventKind.WORKER_EXIT.value, EventKind.HANG.value, EventKind.AGENT_LOST.value)
RECOVERY_ACTIONS = ("restart", "hot_swap", "scale_down", "scale_up")
# per-step excess categories a run can show (only those the goodput calculator knows are used)
STEP_EXTRA_CATEGORIES = tuple(c for c in ("straggler_slowdown", "step_slowdown", "checkpoint_interference")
                              if c in CATEGORIES)


class PlanInputError(ValueError):
    """A figure, a flag or a run directory the planner cannot use; the message says which and what to do."""


def _seconds(owner: str, name: str, v: Any, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise PlanInputError(f"{owner}.{name} must be a finite number of seconds {'> 0' if positive else '>= 0'}, "
                             f"got {v!r}")
    return float(v)


def _frozen_map(owner: str, name: str, given: Mapping[str, Any], keys: tuple[str, ...]) -> Mapping[str, float]:
    bad = sorted(set(given) - set(keys))
    if bad:
        raise PlanInputError(f"{owner}.{name}: unknown key(s) {bad}; known: {', '.join(keys)}")
    missing = sorted(set(keys) - set(given))
    if missing:
        raise PlanInputError(f"{owner}.{name}: missing {missing}")
    return MappingProxyType({k: _seconds(owner, f"{name}[{k}]", given[k]) for k in keys})


def _defaults(keys: tuple[str, ...], values: tuple[float, ...]) -> dict[str, float]:
    return dict(zip(keys, values))


@dataclass(frozen=True)
class Figures:
    """The cost of each thing that can happen to a job, in seconds. Defaults are round assumptions for a GPU
    job with asynchronous checkpoints; ``resilient plan RUN_DIR`` replaces them with the run's own."""

    step_s: float = 5.0  # one training step (productive)
    step_gap_s: float = 0.0  # between two steps (the goodput report's "other")
    save_stall_s: float = 1.0  # training blocked by one save
    restore_s: Mapping[str, float] = field(default_factory=lambda: _defaults(TIERS, (10.0, 20.0, 120.0)))
    detect_s: Mapping[str, float] = field(default_factory=lambda: _defaults(FAULT_KINDS, (2.0, 120.0, 30.0)))
    recovery_s: Mapping[str, float] = field(  # detection to the next attempt's spawn, by action
        default_factory=lambda: _defaults(RECOVERY_ACTIONS, (5.0, 15.0, 15.0, 15.0)))
    startup_s: float = 60.0  # an attempt's spawn to its first step (restore excluded)
    launch_s: float = 300.0  # a launch (first, or after a stop) to the first step
    teardown_s: float = 0.0  # last step to the end of the job
    step_extra_s: Mapping[str, float] = field(default_factory=dict)  # per step, e.g. straggler_slowdown
    policy: str | None = None  # the policy file the run used, if the ledger says
    # figure name → "ledger" | "flag" | "default", or "ledger:peer" (a default that contradicted the tier order
    # was bounded by that tier's measured figure)
    source: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        o = "Figures"
        for name in ("step_gap_s", "save_stall_s", "startup_s", "launch_s", "teardown_s"):
            object.__setattr__(self, name, _seconds(o, name, getattr(self, name)))
        object.__setattr__(self, "step_s", _seconds(o, "step_s", self.step_s, positive=True))
        object.__setattr__(self, "restore_s", _frozen_map(o, "restore_s", self.restore_s, TIERS))
        object.__setattr__(self, "detect_s", _frozen_map(o, "detect_s", self.detect_s, FAULT_KINDS))
        object.__setattr__(self, "recovery_s", _frozen_map(o, "recovery_s", self.recovery_s, RECOVERY_ACTIONS))
        extra = {k: v for k, v in self.step_extra_s.items() if k in STEP_EXTRA_CATEGORIES or v}
        bad = sorted(set(extra) - set(STEP_EXTRA_CATEGORIES))
        if bad:
            raise PlanInputError(f"Figures.step_extra_s: unknown category {bad}; known: {STEP_EXTRA_CATEGORIES}")
        object.__setattr__(self, "step_extra_s",
                           MappingProxyType({k: _seconds(o, f"step_extra_s[{k}]", v) for k, v in extra.items()}))
        object.__setattr__(self, "source", MappingProxyType(dict(self.source)))

    def to_json(self) -> dict[str, Any]:
        # asdict cannot copy the read-only mappings
        return {k: dict(v) if isinstance(v, Mapping) else v
                for k, v in ((k, getattr(self, k)) for k in self.__dataclass_fields__)}


@dataclass(frozen=True)
class ClusterConfig:
    """What is being planned. ``failures_per_node_day`` counts every interruption a node causes; a share
    ``node_loss_share`` of them loses the node (a restart cannot fix it), the rest a restart fixes, of which
    ``hang_share`` are hangs rather than crashes."""

    nodes: int = 2
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    failures_per_node_day: float = DEFAULT_FAILURES_PER_NODE_DAY
    node_loss_share: float = LLAMA3_HARDWARE_SHARE
    hang_share: float = 0.1
    spares: int = 0
    min_nodes: int | None = None  # --nnodes MIN (None: = nodes, the job never shrinks)
    repair_hours: float = 1.0  # a node taken out of the job is back (repaired or replaced) after this
    ckpt_interval: int | None = 100  # steps between local saves; None: no checkpoints
    tiers: tuple[str, ...] = TIERS
    persistent_every: int = 10  # local saves per persistent upload
    cost_per_node_hour: float = 1.0  # default 1: costs come out in node-hours
    steps: int | None = None  # steps to finish (full-size steps); None: simulate ``days``
    days: float = 30.0
    max_restarts: int = 1_000_000  # --max-restarts of each launch
    failure_window: float = 3600.0
    # --nodes-per-replica: the job grows and shrinks by replicas of this many nodes (None: every rank a replica)
    nodes_per_replica: int | None = None

    def __post_init__(self) -> None:
        o = "ClusterConfig"
        for name in ("nodes", "gpus_per_node", "persistent_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanInputError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("spares", "max_restarts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanInputError(f"{name} must be an integer >= 0, got {v!r}")
        if self.min_nodes is None:
            object.__setattr__(self, "min_nodes", self.nodes)
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int) or not 1 <= self.min_nodes <= self.nodes:
            raise PlanInputError(f"min_nodes must be an integer in [1, nodes={self.nodes}], got {self.min_nodes!r}")
        k = self.nodes_per_replica
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise PlanInputError(f"--nodes-per-replica must be an integer >= 1, got {k!r}")
            bad = [f"{what} {n}" for what, n in (("--min-nodes", self.min_nodes), ("--nodes", self.nodes)) if n % k]
            if bad:
                raise PlanInputError(f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of "
                                     f"--nodes-per-replica {k} (the job grows and shrinks by whole replicas)")
        r = self.failures_per_node_day
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise PlanInputError(f"failure rate must be a finite number of failures per node-day >= 0, got {r!r}")
        for name in ("node_loss_share", "hang_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise PlanInputError(f"{name} is a share in [0, 1], got {v!r}")
        _seconds(o, "repair_hours", self.repair_hours)
        _seconds(o, "cost_per_node_hour", self.cost_per_node_hour)
        _seconds(o, "days", self.days, positive=True)
        _seconds(o, "failure_window", self.failure_window, positive=True)
        if self.ckpt_interval is not None and (isinstance(self.ckpt_interval, bool)
                                               or not isinstance(self.ckpt_interval, int) or self.ckpt_interval < 1):
            raise PlanInputError(f"ckpt_interval must be an integer >= 1 step (or none), got {self.ckpt_interval!r}")
        tiers = tuple(self.tiers)
        bad = [t for t in tiers if t not in TIERS]
        if bad or not tiers or len(set(tiers)) != len(tiers):
            raise PlanInputError(f"tiers must be distinct names among {', '.join(TIERS)}, got {list(tiers)}")
        object.__setattr__(self, "tiers", tuple(t for t in TIERS if t in tiers))
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1):
            raise PlanInputError(f"steps must be an integer >= 1, got {self.steps!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def mtbf_hours(self) -> float:
        """Mean time between interruptions of the whole job (its ``nodes`` active nodes)."""
        rate = self.failures_per_node_day * self.nodes
        return math.inf if rate == 0 else 24.0 / rate


def mtbf_to_rate(mtbf_hours: float, nodes: int) -> float:
    """Job MTBF in hours → failures per node-day."""
    if isinstance(mtbf_hours, bool) or not isinstance(mtbf_hours, (int, float)) or not mtbf_hours > 0 \
            or math.isnan(mtbf_hours):
        raise PlanInputError(f"--mtbf-hours must be a number of hours > 0, got {mtbf_hours!r}")
    return 0.0 if math.isinf(mtbf_hours) else 24.0 / mtbf_hours / nodes


@dataclass(frozen=True)
class PlannedFault:
    """A fault at a given time instead of drawn ones (tests, and replaying a drill's schedule): ``at`` is
    seconds since the launch, ``node`` an index into the job's members in group-rank order."""

    at: float
    kind: str = EventKind.WORKER_EXIT.value
    node: int = 0

    def __post_init__(self) -> None:
        _seconds("PlannedFault", "at", self.at)
        if self.kind not in FAULT_KINDS:
            raise PlanInputError(f"PlannedFault.kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")
        if isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0:
            raise PlanInputError(f"PlannedFault.node must be an index >= 0, got {self.node!r}")


@dataclass
class PlanResult:
    """Expected figures of one configuration, averaged over ``trials`` seeded runs (time sums over trials,
    so goodput is total productive ÷ total wall)."""

    policy: str
    nodes: int
    gpus: int
    spares: int
    ckpt_interval: int | None
    goodput: float
    wall_seconds: float  # per trial
    productive_seconds: float
    badput_seconds: dict[str, float]  # every goodput category
    useful_steps: float  # full-size step equivalents kept, per trial
    time_to_finish_s: float | None  # ``steps`` given: mean wall time to finish them (None: never finished)
    cost_per_useful_step: float  # cost_per_node_hour × (nodes + spares) × hours ÷ useful steps
    failures: float  # per trial
    actions: dict[str, float]  # action kind → count per trial
    stops: float  # launches stopped by the policy, per trial
    trials: int
    seed: int
    finished: float = 1.0  # share of trials that finished ``steps``
    # data-parallel size (replicas with --nodes-per-replica, else ranks) → wall seconds per trial the job trained at it
    dp_size_seconds: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(CATEGORIES) - set(self.badput_seconds)
        if missing:
            raise ValueError(f"badput_seconds lacks categories {sorted(missing)}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["badput_share"] = {c: (v / self.wall_seconds if self.wall_seconds else 0.0)
                             for c, v in self.badput_seconds.items()}
        return d


@dataclass
class SweepResult:
    """The best spares and checkpoint interval found, with every point tried."""

    best: PlanResult
    best_spares: int
    best_interval: int | None
    young_daly_steps: float | None  # √(2·δ·M) in steps, for reference
    points: list[PlanResult]

    def to_json(self) -> dict[str, Any]:
        return {"best_spares": self.best_spares, "best_interval": self.best_interval,
                "young_daly_steps": self.young_daly_steps, "best": self.best.to_json(),
                "points": [{"spares": p.spares, "ckpt_interval": p.ckpt_interval, "goodput": p.goodput,
                            "cost_per_useful_step": p.cost_per_useful_step, "time_to_finish_s": p.time_to_finish_s}
                           for p in self.points]}


__all__ = ["Badput", "CATEGORIES", "PRODUCTIVE", "ClusterConfig", "Figures", "PlanInputError", "PlanResult",
           "PlannedFault", "SweepResult", "DEFAULT_FAILURES_PER_NODE_DAY", "mtbf_to_rate", "TIERS", "FAULT_KINDS"]
