"""The scenario table: sequences of joins, events and clock ticks fed to a :class:`SupervisorCore`, with
the decisions each shipped policy must take. The same table runs against every ``policies/*.py`` in the
tests, and through any user policy in ``resilient policy check FILE``.

A scenario's ``expect`` is what the default policy does; ``overrides`` maps a policy's name (its file's
stem) to its own expectation where it differs. ``wrap`` names a deliberately broken policy
(:data:`BROKEN`) put in front of the policy under test: the core must overrule it and let the default
decide, recording why.

This file is longer than 700 lines on purpose: most of it is the table, one list of cases that every shipped
policy is checked against and that reads best whole.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import Cordon, HotSwap, Policy, ScaleDown
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import Decision, SupervisorCore

CURRENT = "current"  # an event of the attempt running when it is fed


# --------------------------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Join:
    node: str
    at: float = 0.0
    nproc: int = 2


@dataclass(frozen=True)
class Arriving:
    """An agent connected and warming up (``arriving``): a joining spare until it joins."""

    node: str
    at: float


@dataclass(frozen=True)
class Form:
    at: float = 0.0


@dataclass(frozen=True)
class On:
    """An event fed to ``handle``."""

    kind: str
    node: str
    at: float
    rank: int | None = None
    attempt: int | str | None = CURRENT
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Seen:
    """Reports (summaries) from these nodes, so that they do not time out."""

    nodes: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class Tick:
    at: float


@dataclass(frozen=True)
class Done:
    """The workers of these nodes all finished the current round (exit 0): the agents' ``done`` message."""

    nodes: tuple[str, ...]
    at: float


Step = Join | Arriving | Form | On | Seen | Tick | Done


@dataclass(frozen=True)
class Expect:
    action: str  # the action kind
    fields: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"node": "b", "spare": "s"}
    members: tuple[str, ...] | None = None  # the new assignment's members (None: no assignment)
    fallback: bool = False  # the policy was overruled
    pending: bool = False  # a ScaleUp recorded, carried out later

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.fields.items())
        mem = f" → {list(self.members)}" if self.members is not None else ""
        return f"{self.action}{extra}{mem}{' (fallback)' if self.fallback else ''}{' (pending)' if self.pending else ''}"


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    cfg: Mapping[str, Any]
    steps: tuple[Step, ...]
    expect: tuple[Expect, ...]
    overrides: Mapping[str, tuple[Expect, ...]] = field(default_factory=dict)
    wrap: str | None = None

    def expected(self, policy_name: str) -> tuple[Expect, ...]:
        return self.overrides.get(policy_name, self.expect)


def joins(*names: str, at: float = 0.0) -> tuple[Step, ...]:
    return tuple(Join(n, at) for n in names) + (Form(at),)


def crash(node: str, at: float, rank: int = 0, attempt: int | str | None = CURRENT, code: int = 1) -> On:
    return On("worker_exit", node, at, rank=rank, attempt=attempt, details={"exit_code": code, "signal": None})


def raised(node: str, at: float, exc: str, message: str = "", frame: str | None = "train.py:5 in step",
           rank: int = 0, **more: Any) -> On:
    """A worker exit whose error file named ``exc`` raised at ``frame`` (what the agent puts in the event)."""
    details = {"exit_code": 1, "signal": None, "exc_type": exc, "message": message, **more}
    if frame is not None:
        details["frame"] = frame
    return On("worker_exit", node, at, rank=rank, details=details)


NO_STEP = ("committed steps [89, 79] exist but none could be assembled from verified files on any tier (local, "
           "peer): step 89: files of rank(s) 2, 3 on no tier (looked at local, peer); the state is undefined: a "
           "persistent tier (--ckpt-persistent) or an older checkpoint directory holding those shards would "
           "restore it")


def restart(*members: str, **kw: Any) -> Expect:
    return Expect("restart", members=members, **kw)


def crashes(node: str, start: float, n: int) -> tuple[On, ...]:
    """``n`` worker crashes of ``node``, one a second from ``start``."""
    return tuple(crash(node, start + i) for i in range(n))


# The headline benchmark's seeded schedule (bench/goodput.py, seed 0, MTBF 60 s) as the supervisor sees it: 2
# nodes x 1 worker at --nnodes 2 and a spare; a kill or hang of rank r is reported by node r (its peer may
# report first in a real run: tests/supervisor/test_default_policy.py tries both), the node loss is b's.
_BENCH_FAULTS = ((20.1, "worker_exit", "a"), (120.7, "worker_exit", "b"), (131.9, "hang", "a"),
                 (138.6, "worker_exit", "a"), (145.5, "worker_exit", "b"), (150.0, "worker_exit", "b"),
                 (222.7, "hang", "a"), (420.3, "agent_lost", "b"), (454.7, "worker_exit", "s"),
                 (510.0, "worker_exit", "s"))


def _bench_steps() -> tuple[Step, ...]:
    out: list[Step] = []
    for at, kind, node in _BENCH_FAULTS:
        out.append(Seen(tuple(n for n in ("a", "b", "s") if not (n == "b" and at >= 420.3)), at - 0.5))
        if kind == "agent_lost":
            out.append(On(kind, node, at, attempt=None, details={"reason": "disconnected"}))
        elif kind == "hang":
            out.append(On(kind, node, at, rank=0, details={"last_heartbeat_age": 5.0}))
        else:
            out.append(crash(node, at))
    return tuple(out)


# --------------------------------------------------------------------------------------------- broken policies
class _Wrapper:
    """Broken on worker exits (and on node loss for ``invalid``); the policy under test decides the rest."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def broken(self, event: Event, view: Any) -> Any:
        raise NotImplementedError

    def decide(self, event: Event, view: Any) -> Any:
        if event.kind in (EventKind.WORKER_EXIT, EventKind.AGENT_LOST):
            return self.broken(event, view)
        return self.inner.decide(event, view)

    def release(self) -> None:
        pass


class Raises(_Wrapper):
    def broken(self, event: Event, view: Any) -> Any:
        raise RuntimeError(f"policy bug on {event.kind.value}")


class Hangs(_Wrapper):
    """Blocks far past ``policy_timeout`` (released when the scenario ends, so no thread outlives it)."""

    def __init__(self, inner: Policy) -> None:
        super().__init__(inner)
        self._gate = threading.Event()

    def broken(self, event: Event, view: Any) -> Any:
        self._gate.wait(60.0)
        return self.inner.decide(event, view)

    def release(self) -> None:
        self._gate.set()


class Nonsense(_Wrapper):
    def broken(self, event: Event, view: Any) -> Any:
        return "restart please"


class Invalid(_Wrapper):
    def broken(self, event: Event, view: Any) -> Any:
        if event.kind is EventKind.AGENT_LOST:
            return ScaleDown((event.node,), reason="below min on purpose")
        return HotSwap(event.node, "no-such-spare")


class Cordons(_Wrapper):
    def broken(self, event: Event, view: Any) -> Any:
        return Cordon(event.node, reason=f"{event.node} is suspect")


class Splits(_Wrapper):
    """Drops one healthy node of another replica than the failed one's (--nodes-per-replica): a split replica."""

    def broken(self, event: Event, view: Any) -> Any:
        other = next(r for r in view.replicas if event.node not in r)
        return ScaleDown((other[0],), reason=f"drop {other[0]} alone")


BROKEN: dict[str, type[_Wrapper]] = {"raises": Raises, "hangs": Hangs, "nonsense": Nonsense, "invalid": Invalid,
                                     "cordons": Cordons, "splits": Splits}


# --------------------------------------------------------------------------------------------- the table
_TWO = {"min_nodes": 1, "max_nodes": 2, "nproc_per_node": 2}
_TWO_AT_MIN = {"min_nodes": 2, "max_nodes": 2, "nproc_per_node": 2}
# --nodes-per-replica 2: replicas (a, b) and (c, d)
_REPLICAS = {"min_nodes": 2, "max_nodes": 4, "nproc_per_node": 2, "nodes_per_replica": 2}

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "worker_crash_restart", "a worker exits with an error: restart in place",
        _TWO, joins("a", "b") + (crash("b", 5, rank=2),),
        (restart("a", "b"),),
        overrides={"hot_swap_first": (restart("a", "b"),)},
    ),
    Scenario(
        "clean_exit_ignored", "a worker exiting with code 0 is not a failure",
        _TWO, joins("a", "b") + (crash("b", 5, rank=2, code=0),),
        (),
    ),
    Scenario(
        "repeated_crash_swap", "7 crashes in a row of one of 2 nodes single it out (bad luck: 0.8%): swapped for "
                               "the spare, benched",
        {**_TWO, "max_restarts": 10}, joins("a", "b", "s") + crashes("b", 5, 7),
        (*(restart("a", "b"),) * 6, Expect("hot_swap", {"node": "b", "spare": "s", "cool_down": 600.0}, ("a", "s"))),
        overrides={
            "hot_swap_first": (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),),
            "scale_down_first": (restart("a", "b"), restart("a", "b"), Expect("scale_down", {"nodes": ["b"]}, ("a",))),
        },
    ),
    Scenario(
        "three_crashes_are_bad_luck", "3 crashes of one of 2 nodes within seconds: bad luck (12.5%), restarts",
        _TWO, joins("a", "b", "s") + crashes("b", 5, 3),
        (restart("a", "b"),) * 3,
        overrides={
            "hot_swap_first": (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),),
            "scale_down_first": (restart("a", "b"), restart("a", "b"), Expect("scale_down", {"nodes": ["b"]}, ("a",))),
        },
    ),
    Scenario(
        "repeated_crash_no_spare", "a node singled out by its crashes, no spare: scale down without it",
        {**_TWO, "max_restarts": 10}, joins("a", "b") + crashes("b", 5, 7),
        (*(restart("a", "b"),) * 6, Expect("scale_down", {"nodes": ["b"]}, ("a",))),
        overrides={
            "scale_down_first": (restart("a", "b"), restart("a", "b"), Expect("scale_down", {"nodes": ["b"]}, ("a",))),
        },
    ),
    Scenario(
        "benched_node_returns", "a node swapped out for its crashes is a spare again after the cool-down, and "
                                "takes the place of the next lost node",
        {**_TWO_AT_MIN, "max_restarts": 10},
        joins("a", "b", "s") + crashes("b", 5, 7) + (Seen(("a", "b", "s"), 300), Seen(("a", "b", "s"), 605),
                                                     Tick(611.5), Seen(("a", "b"), 615), Tick(616.5)),
        (*(restart("a", "b"),) * 6, Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),
         Expect("ignore"), Expect("hot_swap", {"node": "s", "spare": "b"}, ("a", "b"))),
        overrides={
            "hot_swap_first": (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),
                               Expect("stop")),  # b is cordoned for good: nothing replaces s
            "scale_down_first": (restart("a", "b"),) * 7,  # s stays a spare: its loss decides nothing
        },
    ),
    Scenario(
        "bench_schedule", "the headline benchmark's seeded faults (seed 0): in-job restarts, the spare only for "
                          "the node loss",
        {**_TWO_AT_MIN, "nproc_per_node": 1, "max_restarts": 100},
        tuple(Join(n, 0.0, nproc=1) for n in ("a", "b", "s")) + (Form(0.0),) + _bench_steps(),
        (*(restart("a", "b"),) * 7, Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),
         restart("a", "s"), restart("a", "s")),
        overrides={
            # a's later reports come from a node outside the job (the scenario's names are fixed): ignored
            "hot_swap_first": (Expect("hot_swap", {"node": "a", "spare": "s"}, ("s", "b")),
                               *(restart("s", "b"),) * 3, Expect("stop")),
            "scale_down_first": (*(restart("a", "b"),) * 7, Expect("stop")),
        },
    ),
    Scenario(
        "repeated_crash_at_min", "repeated crashes, no spare, at --nnodes min: keep restarting in place",
        _TWO_AT_MIN, joins("a", "b") + (crash("b", 5), crash("b", 6), crash("b", 7)),
        (restart("a", "b"), restart("a", "b"), restart("a", "b")),
    ),
    Scenario(
        "failures_outside_window", "crashes further apart than the failure window never escalate",
        {**_TWO, "failure_window": 10.0, "max_restarts": 5},
        joins("a", "b", "s") + (Seen(("a", "b", "s"), 1), crash("b", 5), Seen(("a", "b", "s"), 12), crash("b", 20),
                                Seen(("a", "b", "s"), 28), crash("b", 35)),
        (restart("a", "b"), restart("a", "b"), restart("a", "b")),
        overrides={"hot_swap_first": (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),)},
    ),
    Scenario(
        "node_lost_with_spare", "a node stops reporting: the spare takes its group rank",
        _TWO, joins("a", "b", "s") + (Seen(("a", "s"), 8), Tick(11)),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),),
        overrides={"scale_down_first": (Expect("scale_down", {"nodes": ["b"]}, ("a",)),)},
    ),
    Scenario(
        "node_lost_no_spare", "a node stops reporting and there is no spare: scale down",
        _TWO, joins("a", "b") + (Seen(("a",), 8), Tick(11)),
        (Expect("scale_down", {"nodes": ["b"]}, ("a",)),),
    ),
    Scenario(
        "node_lost_at_min", "a node is lost, no spare, at --nnodes min: stop with a reason",
        _TWO_AT_MIN, joins("a", "b") + (Seen(("a",), 8), Tick(11)),
        (Expect("stop"),),
    ),
    Scenario(
        "node_lost_reported_twice", "a dropped connection and the timeout of one node decide once",
        _TWO, joins("a", "b", "s") + (On("agent_lost", "b", 3, attempt=None, details={"reason": "disconnected"}),
                                      Seen(("a", "s"), 8), Tick(11), Seen(("a", "s"), 12), Tick(14)),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),),
        overrides={"scale_down_first": (Expect("scale_down", {"nodes": ["b"]}, ("a",)),)},
    ),
    Scenario(
        "scale_down_bounded_by_min", "losing nodes one by one shrinks the job down to min, then stops",
        {"min_nodes": 2, "max_nodes": 3, "nproc_per_node": 2},
        joins("a", "b", "c") + (Seen(("a", "b"), 8), Tick(11), Seen(("a",), 20), Tick(22)),
        (Expect("scale_down", {"nodes": ["c"]}, ("a", "b")), Expect("stop")),
    ),
    Scenario(
        "budget_spent_stop", "the restart budget is spent: stop",
        {**_TWO, "max_restarts": 1}, joins("a", "b") + (crash("b", 5), crash("a", 6)),
        (restart("a", "b"), Expect("stop")),
    ),
    Scenario(
        "spare_lost_no_decision", "a spare that stops reporting is lost without disturbing the job",
        _TWO, joins("a", "b", "s") + (Seen(("a", "b"), 8), Tick(11)),
        (),
    ),
    Scenario(
        "scale_up_at_checkpoint", "a spare joins below max: scale up at the next local checkpoint, not before",
        _TWO,
        joins("a", "b") + (
            On("ckpt_tier_done", "a", 2, rank=0, details={"step": 5, "tier": "local"}),
            Seen(("a",), 8), Tick(11),  # b lost → scale down
            Join("c", 12),
            On("ckpt_tier_done", "a", 13, rank=1, details={"step": 5, "tier": "local"}),  # a late report: not newer
            On("ckpt_tier_done", "a", 14, rank=0, details={"step": 10, "tier": "persistent"}),  # not the local tier
            On("ckpt_tier_done", "a", 15, rank=1, details={"step": 10, "tier": "local"}),
        ),
        (Expect("scale_down", {"nodes": ["b"]}, ("a",)), Expect("scale_up", {"spares": ["c"]}, pending=True),
         Expect("scale_up", {"spares": ["c"]}, ("a", "c"))),
    ),
    Scenario(
        "scale_up_after_wait", "a spare joins below max and no checkpoint comes: scale up after scale_up_wait",
        {**_TWO, "scale_up_wait": 30.0},
        joins("a", "b") + (Seen(("a",), 8), Tick(11), Join("c", 12), Seen(("a", "c"), 20), Tick(21),
                           Seen(("a", "c"), 35), Tick(42)),
        (Expect("scale_down", {"nodes": ["b"]}, ("a",)), Expect("scale_up", {"spares": ["c"]}, pending=True),
         Expect("scale_up", {"spares": ["c"]}, ("a", "c"))),
    ),
    Scenario(
        "lost_node_rejoins", "a lost node that comes back is a spare and grows the job back",
        {**_TWO, "scale_up_wait": 5.0},
        joins("a", "b") + (Seen(("a",), 8), Tick(11), Join("b", 12), Seen(("a", "b"), 16), Tick(17)),
        (Expect("scale_down", {"nodes": ["b"]}, ("a",)), Expect("scale_up", {"spares": ["b"]}, pending=True),
         Expect("scale_up", {"spares": ["b"]}, ("a", "b"))),
    ),
    Scenario(
        "spare_joins_at_max", "a spare joining a full job waits warm, before and after formation",
        _TWO, (Join("a"), Join("b"), Join("s1"), Form(0), Join("s2", 5), crash("a", 6)),
        (Expect("ignore"), restart("a", "b")),
        overrides={"hot_swap_first": (Expect("ignore"), Expect("hot_swap", {"node": "a", "spare": "s1"}, ("s1", "b")))},
    ),
    Scenario(
        "duplicate_reports_decided_once", "one failure reported by several nodes and ranks: one restart",
        _TWO, joins("a", "b") + (crash("b", 5, rank=2, attempt=0), crash("a", 5.1, rank=0, attempt=0),
                                 On("hang", "a", 5.2, rank=1, attempt=0), crash("b", 5.3, rank=3, attempt=0)),
        (restart("a", "b"),),
    ),
    Scenario(
        "stale_attempt_ignored", "events of an older (or unknown) attempt are recorded, not acted on",
        _TWO, joins("a", "b") + (crash("b", 5, attempt=0), crash("a", 6, attempt=0), crash("a", 7, attempt=9),
                                 On("hang", "a", 8, rank=0, attempt=1)),
        (restart("a", "b"), restart("a", "b")),
    ),
    Scenario(
        "straggler_eviction", "a node flagged straggler three times is swapped (evict_stragglers)",
        _TWO, joins("a", "b", "s") + tuple(On("straggler", "b", 5 + i, rank=2, details={"score": 0.3})
                                           for i in range(3)),
        (Expect("ignore"), Expect("ignore"), Expect("ignore")),
        overrides={"evict_stragglers": (Expect("ignore"), Expect("ignore"),
                                        Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")))},
    ),
    Scenario(
        "unhealthy_node", "a GPU reported unhealthy: a free spare takes its place",
        _TWO, joins("a", "b", "s") + (On("gpu_unhealthy", "b", 5, details={"index": 0, "check": "xid"}),),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),),
        overrides={"scale_down_first": (Expect("ignore"),)},
    ),
    Scenario(
        "unhealthy_node_no_spare", "a host check failing and no spare: recorded, the node keeps training",
        _TWO, joins("a", "b") + (On("host_unhealthy", "b", 5, details={"check": "memory", "value": 97.0}),),
        (Expect("ignore"),),
    ),
    Scenario(
        "preemption_swaps_spare", "a member's preemption notice: the spare takes its place once the agreed step is "
                                  "saved (the others done, the preempted node gone), not at the notice",
        _TWO_AT_MIN, joins("a", "b", "s") + (
            On("preemption_notice", "b", 5, details={"source": "SIGTERM", "deadline": 30.0}),
            Seen(("a", "b", "s"), 6), Done(("a",), 7),
            On("agent_lost", "b", 8, attempt=None, details={"reason": "left"})),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, pending=True),
         Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s"))),
        overrides={"scale_down_first": (Expect("ignore"),)},  # at min, spares only grow the job: exits 75
    ),
    Scenario(
        "preemption_scales_down", "a member's preemption notice, no spare, MIN allows: scale down once the agreed "
                                  "step is saved (the preempted node may leave first)",
        _TWO, joins("a", "b") + (
            On("preemption_notice", "b", 5, details={"source": "SIGTERM"}),
            On("agent_lost", "b", 6, attempt=None, details={"reason": "left"}), Seen(("a",), 7), Done(("a",), 8)),
        (Expect("scale_down", {"nodes": ["b"]}, pending=True), Expect("scale_down", {"nodes": ["b"]}, ("a",))),
    ),
    Scenario(
        "preemption_at_min_ends_preempted", "a member's preemption notice, no spare, at MIN: no failure and no "
                                            "stop; every node saves the agreed step and the job ends preempted",
        _TWO_AT_MIN, joins("a", "b") + (
            On("preemption_notice", "a", 5, details={"source": "SIGTERM", "deadline": 30.0}),
            On("preemption_notice", "b", 5.5, details={"source": "SIGTERM"}),  # the second notice decides nothing
            Done(("b",), 7), On("agent_lost", "a", 8, attempt=None, details={"reason": "left"}), Tick(9)),
        (Expect("ignore"),),
    ),
    Scenario(
        "preemption_then_failure", "a rank fails while a preempted node goes: the pending swap is carried out now",
        _TWO_AT_MIN, joins("a", "b", "s") + (
            On("preemption_notice", "b", 5, details={"source": "SIGTERM"}), crash("a", 6)),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, pending=True),
         Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s"))),
        overrides={"scale_down_first": (Expect("ignore"),)},
    ),
    Scenario(
        "preemption_wait_bounded", "the preempted node never goes: the swap is carried out after preempt_wait",
        {**_TWO_AT_MIN, "preempt_wait": 20.0, "node_timeout": 100.0}, joins("a", "b", "s") + (
            On("preemption_notice", "b", 5, details={"source": "SIGTERM"}), Tick(15), Tick(26)),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, pending=True),
         Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s"))),
        overrides={"scale_down_first": (Expect("ignore"),)},
    ),
    Scenario(
        "preemption_of_a_spare", "a spare's preemption notice decides nothing: it just leaves",
        _TWO, joins("a", "b", "s") + (On("preemption_notice", "s", 5, attempt=None, details={"source": "SIGTERM"}),),
        (),
    ),
    Scenario(
        "policy_raises", "a policy that raises: the default decides, the traceback is kept",
        _TWO, joins("a", "b") + (crash("b", 5),),
        (restart("a", "b", fallback=True),), wrap="raises",
    ),
    Scenario(
        "policy_hangs", "a policy that blocks past policy_timeout: abandoned, the default decides",
        {**_TWO, "policy_timeout": 0.2}, joins("a", "b") + (crash("b", 5),),
        (restart("a", "b", fallback=True),), wrap="hangs",
    ),
    Scenario(
        "policy_returns_nonsense", "a policy that returns a string: the default decides",
        _TWO, joins("a", "b") + (crash("b", 5),),
        (restart("a", "b", fallback=True),), wrap="nonsense",
    ),
    Scenario(
        "policy_invalid_action", "a swap to an unknown spare, a scale-down below min: the default decides",
        _TWO_AT_MIN, joins("a", "b", "s") + (crash("b", 5), Seen(("a", "s"), 12), Tick(16)),
        (restart("a", "b", fallback=True), Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s"), fallback=True)),
        wrap="invalid",
    ),
    Scenario(
        "policy_invalid_no_way_out", "an invalid action where the default can only stop: stop, fallback kept",
        _TWO_AT_MIN, joins("a", "b") + (Seen(("a",), 8), Tick(11)),
        (Expect("stop", fallback=True),), wrap="invalid",
    ),
    Scenario(
        "state_unrecoverable_stops", "a worker's restore found no usable step (NoRestorableStepError): stop at once, "
                                     "with budget and spares left, naming what is missing",
        {**_TWO, "max_restarts": 100}, joins("a", "b", "s") + (
            raised("b", 5, "NoRestorableStepError", NO_STEP, frame="restore.py:330 in _restore", rank=2),),
        (Expect("stop"),),
    ),
    Scenario(
        "crash_loop_stops", "the same exception at the same frame in two consecutive attempts: a crash loop, stop "
                            "after the second (whatever the budget)",
        {**_TWO, "max_restarts": 100}, joins("a", "b", "s") + (
            raised("b", 5, "ValueError", "bad batch at step 5", rank=2),
            raised("a", 9, "ValueError", "bad batch at step 5", rank=0)),  # any rank: the same place in the code
        (restart("a", "b"), Expect("stop")),
        overrides={"hot_swap_first": (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s")),
                                      Expect("stop"))},
    ),
    Scenario(
        "software_elsewhere_restarts", "an exception at another frame than the attempt before: not a loop, restart",
        {**_TWO, "max_restarts": 100}, joins("a", "b") + (
            raised("b", 5, "ValueError", "x", frame="train.py:5 in step", rank=2),
            raised("b", 9, "ValueError", "x", frame="train.py:9 in load", rank=2),
            crash("b", 12, rank=2), crash("b", 14, rank=2)),
        (restart("a", "b"),) * 4,  # exit codes without an error file never count as a loop
        overrides={"scale_down_first": (restart("a", "b"), restart("a", "b"),
                                        Expect("scale_down", {"nodes": ["b"]}, ("a",)))},
    ),
    Scenario(
        "hardware_exit_replaces_node", "a worker's CUDA error names an uncorrectable ECC fault: its node is replaced "
                                       "by the spare and cordoned for good",
        {**_TWO, "max_restarts": 10}, joins("a", "b", "s") + (
            raised("b", 5, "RuntimeError", "CUDA error: uncorrectable ECC error encountered", rank=2),),
        (Expect("hot_swap", {"node": "b", "spare": "s", "cool_down": None}, ("a", "s")),),
        overrides={"scale_down_first": (Expect("scale_down", {"nodes": ["b"]}, ("a",)),)},
    ),
    Scenario(
        "peer_consequence_restarts", "a collective failed because a peer died (transient): in-job restart",
        {**_TWO, "max_restarts": 10}, joins("a", "b", "s") + (
            raised("a", 5, "RuntimeError", "[gloo] Connection closed by peer [10.0.0.2]:4000", consequence=True),),
        (restart("a", "b"),),
        overrides={"hot_swap_first": (Expect("hot_swap", {"node": "a", "spare": "s"}, ("s", "b")),)},
    ),
    Scenario(
        "oom_kill_restarts", "the kernel's OOM killer took a worker (resource): in-job restart",
        {**_TWO, "max_restarts": 10}, joins("a", "b") + (
            On("worker_exit", "b", 5, rank=2, details={"exit_code": -9, "signal": "SIGKILL", "oom_kill": True}),),
        (restart("a", "b"),),
    ),
    Scenario(
        "lost_node_waits_for_joining_spare", "a node lost with no ready spare at --nnodes min, while a spare's agent "
                                             "is still warming up: wait for it, then swap it in",
        _TWO_AT_MIN, joins("a", "b") + (
            Arriving("s", 3), On("agent_lost", "b", 5, attempt=None, details={"reason": "disconnected"}),
            crash("a", 5.5), Join("s", 9)),
        (Expect("ignore"), Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s"))),
        overrides={"scale_down_first": (Expect("stop"),)},
    ),
    Scenario(
        "joining_spare_never_ready", "the joining spare does not become ready within --spare-wait: stop then",
        _TWO_AT_MIN, joins("a", "b") + (
            Arriving("s", 3), On("agent_lost", "b", 5, attempt=None, details={"reason": "disconnected"}),
            Seen(("a",), 60), Tick(66)),
        (Expect("ignore"), Expect("stop")),
        overrides={"scale_down_first": (Expect("stop"),)},
    ),
    Scenario(
        "lost_node_waits_for_a_replacement", "a node lost with no spare at --nnodes min, --replacement-wait 300: the "
                                             "job waits; a node started in its place joins and is swapped in",
        {**_TWO_AT_MIN, "replacement_wait": 300.0}, joins("a", "b") + (
            On("agent_lost", "b", 5, attempt=None, details={"reason": "disconnected"}), crash("a", 5.5),
            Seen(("a",), 60), Tick(61), Seen(("a",), 110), Arriving("n", 115), Join("n", 130)),
        (Expect("ignore"), Expect("hot_swap", {"node": "b", "spare": "n"}, ("a", "n"))),
        overrides={"scale_down_first": (Expect("stop"),)},
    ),
    Scenario(
        "replacement_never_comes", "no node joins within --replacement-wait of the loss: stop then, not before",
        {**_TWO_AT_MIN, "replacement_wait": 30.0}, joins("a", "b") + (
            On("agent_lost", "b", 5, attempt=None, details={"reason": "disconnected"}),
            Seen(("a",), 14), Tick(20), Seen(("a",), 28), Tick(34), Seen(("a",), 36), Tick(36)),
        (Expect("ignore"), Expect("stop")),
        overrides={"scale_down_first": (Expect("stop"),)},
    ),
    Scenario(
        "cordon_active_node", "cordoning an active node swaps in a spare, or scales down without one",
        {**_TWO, "max_nodes": 3}, joins("a", "b", "c", "s") + (crash("b", 5), crash("c", 6)),
        (Expect("hot_swap", {"node": "b", "spare": "s"}, ("a", "s", "c")),
         Expect("scale_down", {"nodes": ["c"]}, ("a", "s"))),
        wrap="cordons",
    ),
)


SCENARIOS += (
    Scenario(
        "replica_node_lost_with_spare", "replicas of 2 nodes: a lost node's place goes to the spare, inside its "
                                        "replica; nothing else moves",
        _REPLICAS, joins("a", "b", "c", "d", "s") + (Seen(("a", "b", "c", "s"), 8), Tick(11)),
        (Expect("hot_swap", {"node": "d", "spare": "s"}, ("a", "b", "c", "s")),),
        overrides={"scale_down_first": (Expect("scale_down", {"nodes": ["c", "d"]}, ("a", "b")),)},
    ),
    Scenario(
        "replica_node_lost_no_spare", "replicas of 2 nodes, no spare: the broken replica is dropped whole and its "
                                      "healthy node is a warm spare at once",
        _REPLICAS, joins("a", "b", "c", "d") + (Seen(("a", "b", "c"), 8), Tick(11)),
        (Expect("scale_down", {"nodes": ["c", "d"]}, ("a", "b")),),
    ),
    Scenario(
        "replica_returns", "the lost node of a dropped replica comes back: with the benched node, a replica again, "
                           "grown at the next local checkpoint",
        _REPLICAS, joins("a", "b", "c", "d") + (
            Seen(("a", "b", "c"), 8), Tick(11), Join("d", 12),
            On("ckpt_tier_done", "a", 13, rank=0, details={"step": 10, "tier": "local"})),
        (Expect("scale_down", {"nodes": ["c", "d"]}, ("a", "b")),
         Expect("scale_up", {"spares": ["c", "d"]}, pending=True),
         Expect("scale_up", {"spares": ["c", "d"]}, ("a", "b", "c", "d"))),
    ),
    Scenario(
        "replica_spare_waits_for_its_partner", "one spare is half a replica: it waits warm; a second one makes a "
                                               "replica, grown at the next local checkpoint",
        _REPLICAS, joins("a", "b") + (
            Join("c", 5), Join("d", 6), On("ckpt_tier_done", "a", 7, rank=0, details={"step": 10, "tier": "local"})),
        (Expect("ignore"), Expect("scale_up", {"spares": ["c", "d"]}, pending=True),
         Expect("scale_up", {"spares": ["c", "d"]}, ("a", "b", "c", "d"))),
    ),
    Scenario(
        "replica_lost_at_min", "replicas of 2 nodes at --nnodes min, no spare: a lost node stops the job",
        {**_REPLICAS, "min_nodes": 4}, joins("a", "b", "c", "d") + (Seen(("a", "b", "c"), 8), Tick(11)),
        (Expect("stop"),),
    ),
    Scenario(
        "replica_preempted_scales_down", "a member's preemption notice, no spare: its replica is dropped once the "
                                         "agreed step is saved",
        _REPLICAS, joins("a", "b", "c", "d") + (
            On("preemption_notice", "d", 5, details={"source": "SIGTERM"}),
            On("agent_lost", "d", 6, attempt=None, details={"reason": "left"}), Seen(("a", "b", "c"), 7),
            Done(("a", "b", "c"), 8)),
        (Expect("scale_down", {"nodes": ["c", "d"]}, pending=True),
         Expect("scale_down", {"nodes": ["c", "d"]}, ("a", "b"))),
    ),
    Scenario(
        "replica_split_refused", "a scale-down that would leave part of a replica running is refused: the default "
                                 "decides",
        _REPLICAS, joins("a", "b", "c", "d") + (Seen(("a", "b", "c"), 8), Tick(11)),
        (Expect("scale_down", {"nodes": ["c", "d"]}, ("a", "b"), fallback=True),), wrap="splits",
    ),
)


# --------------------------------------------------------------------------------------------- running
@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    decisions: tuple[tuple[Step, Decision], ...]  # each decision with the step that produced it

    @property
    def actions(self) -> tuple[Decision, ...]:
        return tuple(d for _, d in self.decisions)


def make_event(step: On, core: SupervisorCore) -> Event:
    attempt = step.attempt
    if attempt == CURRENT:
        attempt = core.assignment.attempt if core.assignment is not None else None
    return Event(kind=EventKind(step.kind), node=step.node, rank=step.rank, attempt=attempt,  # type: ignore[arg-type]
                 details=dict(step.details), mono=step.at, wall=1.7e9 + step.at)


def run_scenario(sc: Scenario, policy: Policy | None) -> Outcome:
    """Feed the scenario to a fresh core deciding with ``policy`` (behind ``sc.wrap`` if set)."""
    if sc.wrap is not None:
        from resilient.supervisor.default_policy import DefaultPolicy

        policy = BROKEN[sc.wrap](policy if policy is not None else DefaultPolicy())
    core = SupervisorCore(SupervisorConfig(**sc.cfg), policy)
    out: list[tuple[Step, Decision]] = []
    try:
        for step in sc.steps:
            if isinstance(step, Join):
                ds = core.join(step.node, step.nproc, step.at)
            elif isinstance(step, Form):
                core.form(step.at)
                ds = []
            elif isinstance(step, Arriving):
                core.arriving(step.node, step.at)
                ds = []
            elif isinstance(step, Seen):
                for n in step.nodes:
                    core.seen(n, step.at)
                ds = []
            elif isinstance(step, Tick):
                ds = core.tick(step.at)
            elif isinstance(step, Done):
                ds = [d for n in step.nodes for d in core.done(n, step.at)]
            else:
                ds = core.handle(make_event(step, core), step.at)
            out += [(step, d) for d in ds]
    finally:
        if isinstance(policy, _Wrapper):
            policy.release()
    return Outcome(sc, tuple(out))


def _matches(e: Expect, d: Decision) -> list[str]:
    bad = []
    got = d.action.to_json()
    if d.action.kind != e.action:
        bad.append(f"action {d.action.kind} (expected {e.action})")
    for k, v in e.fields.items():
        if got.get(k) != v:
            bad.append(f"{k}={got.get(k)!r} (expected {v!r})")
    members = d.assignment.members if d.assignment is not None else None
    if members != e.members:
        bad.append(f"members {members} (expected {e.members})")
    if (d.fallback is not None) != e.fallback:
        bad.append(f"fallback {'set' if d.fallback else 'not set'} (expected {'set' if e.fallback else 'none'})")
    if d.pending != e.pending:
        bad.append(f"pending {d.pending} (expected {e.pending})")
    return bad


def check(outcome: Outcome, policy_name: str) -> list[str]:
    """Differences between what happened and what ``policy_name`` should do; empty when it matches."""
    exp = outcome.scenario.expected(policy_name)
    got = outcome.actions
    problems = []
    for i in range(max(len(exp), len(got))):
        if i >= len(got):
            problems.append(f"decision {i + 1}: missing, expected {exp[i].describe()}")
        elif i >= len(exp):
            problems.append(f"decision {i + 1}: unexpected {got[i].action.kind} ({got[i].action.reason})")
        else:
            problems += [f"decision {i + 1}: {p}" for p in _matches(exp[i], got[i])]
    return problems
