"""The default policy as pure decisions: a worker failure is restarted in place, only node-level evidence takes a
node out, and a node taken out while its agent is healthy comes back as a spare after its cool-down. Fed
through a real SupervisorCore (no processes), including the headline benchmark's seeded fault schedule."""

from __future__ import annotations

import random

import pytest

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import Cordon, HotSwap, NodeState, Restart
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.default_policy import DefaultPolicy, bad_luck_chance
from tests._helpers.bench import goodput_bench



def bench_module():
    return goodput_bench()


class Job:
    """A core at --nnodes min:max with nodes a, b (1 worker each) and optional spares, fed by hand."""

    def __init__(self, spares: tuple[str, ...] = ("s",), *, min_nodes: int = 2, max_nodes: int = 2,
                 policy: object | None = None, node_timeout: float = 10.0, **cfg: object) -> None:
        self.core = SupervisorCore(SupervisorConfig(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=1,
                                                    max_restarts=100, node_timeout=node_timeout, **cfg), policy)
        for n in ("a", "b", *spares):
            self.core.join(n, 1, 0.0)
        self.core.form(0.0)
        self.t = 0.0

    def at(self, t: float) -> None:
        """Every live agent reports up to ``t`` (nothing times out unless a test says so)."""
        for n, v in self.core.view(t).nodes.items():
            if v.state is not NodeState.LOST:
                self.core.seen(n, t)
        self.t = t

    def fail(self, node: str, t: float, kind: EventKind = EventKind.WORKER_EXIT, *, wall: float | None = None,
             attempt: int | None = None):
        self.at(t)
        a = self.core.assignment
        details = {"exit_code": -9, "signal": "SIGKILL"} if kind is EventKind.WORKER_EXIT else {}
        if kind is EventKind.AGENT_LOST:
            details = {"reason": "disconnected"}
        elif kind is EventKind.HANG:
            details = {"last_heartbeat_age": 3.0}
        rank = None if kind is EventKind.AGENT_LOST else (a.members.index(node) if node in a.members else 0)
        ev = Event(kind=kind, node=node, rank=rank, details=details, mono=t, wall=t if wall is None else wall,
                   attempt=None if kind is EventKind.AGENT_LOST else (a.attempt if attempt is None else attempt))
        return self.core.handle(ev, t)


# ------------------------------------------------------------------------------------- the bad-luck test
@pytest.mark.parametrize("k,total,share,expected", [
    (3, 3, 0.5, 0.125), (7, 7, 0.5, 0.0078125), (1, 1, 0.5, 0.5), (0, 5, 0.5, 1.0), (4, 3, 0.5, 0.0),
    (3, 3, 1.0, 1.0), (2, 4, 0.25, 1 - 0.75 ** 4 - 4 * 0.25 * 0.75 ** 3),
])
def test_bad_luck_chance_is_the_binomial_tail(k: int, total: int, share: float, expected: float) -> None:
    assert bad_luck_chance(k, total, share) == pytest.approx(expected)


@pytest.mark.parametrize("nodes,counts,bad", [
    # 2 equal nodes: 3 of 3 (12.5%) and 6 of 6 (1.6%) are luck, 7 of 7 (0.8%) is not; 7 of 9 is luck again
    (2, {"n0": 3}, False), (2, {"n0": 6}, False), (2, {"n0": 7}, True), (2, {"n0": 7, "n1": 2}, False),
    # 8 nodes: 3 of 3 on one node is 0.2%; 3 of 10 spread is 12%
    (8, {"n0": 3}, True), (8, {"n0": 3, "n1": 3, "n2": 2, "n3": 2}, False),
    # fewer than failures_to_swap never singles a node out, however lopsided
    (64, {"n0": 2}, False),
    # one node: nothing to compare with
    (1, {"n0": 50}, False),
])
def test_node_is_bad_table(nodes: int, counts: dict[str, int], bad: bool) -> None:
    core = SupervisorCore(SupervisorConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=1, max_restarts=1000))
    names = [f"n{i}" for i in range(nodes)]
    for n in names:
        core.join(n, 1, 0.0)
    core.form(0.0)
    for n, c in counts.items():
        core._nodes[n].failures.extend([1.0] * c)  # the window's count, as the core keeps it
    got, why = DefaultPolicy().node_is_bad("n0", core.view(2.0))
    assert got is bad, why


@pytest.mark.parametrize("kwargs", [{"failures_to_swap": 0}, {"luck": 1.0}, {"luck": 0}, {"cool_down": -1.0},
                                    {"cool_down": float("inf")}, {"failures_to_swap": True}])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DefaultPolicy(**kwargs)


# ------------------------------------------------------------------------------------- event sequences
def _bench_events(attribute_to_peer: set[int]) -> list[tuple[float, EventKind, int]]:
    """The full-mode schedule of bench/goodput.py (seed 0, 10 min, MTBF 60 s) as (time, kind, group rank of the
    reporting node); faults whose index is in ``attribute_to_peer`` are reported by the other node first (the
    survivor of a killed peer fails too, and either report can win)."""
    b = bench_module()
    faults = b.fault_schedule(0, 10, 0.85 * 600.0, 60.0)
    kinds = {"kill-worker": EventKind.WORKER_EXIT, "hang-worker": EventKind.HANG, "kill-node": EventKind.AGENT_LOST}
    out = []
    for i, f in enumerate(faults):
        rank = f.target if f.kind == "kill-node" or i not in attribute_to_peer else 1 - f.target
        out.append((f.at, kinds[f.kind], rank))
    return out


# which node's report comes first decides the blame (a later report of the same attempt is stale): the killed
# rank's own agent, or its peer's (whose rank failed in a collective); any mix short of all 7 pre-loss faults on
# one node stays bad luck (7 of 7 on one of 2 nodes is 0.8%: that node is blamed, see test_node_is_bad_table)
@pytest.mark.parametrize("peer", [set(), set(range(10)), {1, 2}, {0, 3, 6}], ids=["own", "peer", "mixed1", "mixed2"])
def test_bench_schedule_restarts_in_place_and_keeps_the_spare_for_the_node_loss(peer: set[int]) -> None:
    """Last round's default swapped the spare in for node 1's three kills within 30 s, and the node loss at 420 s
    then stopped the job. Now: every worker fault is an in-job restart, the node loss takes the spare, no stop."""
    job = Job()
    actions = []
    for t, kind, rank in _bench_events(peer):
        node = job.core.assignment.members[rank]
        actions += [d.action for d in job.fail(node, t, kind)]
    kinds = [a.kind for a in actions]
    assert kinds == ["restart"] * 7 + ["hot_swap"] + ["restart"] * 2, [a.reason for a in actions]
    swap = actions[7]
    assert isinstance(swap, HotSwap) and swap.node == "b" and swap.spare == "s" and swap.cool_down is None
    assert job.core.stopped is None and job.core.assignment.members == ("a", "s")


def test_the_peer_reporting_first_does_not_take_the_blame() -> None:
    """Every worker fault of the bench's schedule reported first by the survivor (its rank failed in a collective
    0.2 s later, but its agent was quicker to tell), then by the victim's agent: the restart is decided on the
    first report, the blame moves to the victim's node, whose fault came first."""
    job = Job()
    for t, kind, rank in _bench_events(set()):
        victim = job.core.assignment.members[rank]
        if kind is EventKind.AGENT_LOST:
            job.fail(victim, t, kind)
            continue
        peer = job.core.assignment.members[1 - rank]
        attempt = job.core.assignment.attempt
        (d,) = job.fail(peer, t, kind, wall=t + 0.2)
        assert d.action.kind == "restart"
        assert job.fail(victim, t + 0.01, kind, wall=t, attempt=attempt) == []  # stale: decided already
    counts = {n: v.failures for n, v in job.core.view(520.0).nodes.items()}
    assert counts == {"a": 4, "b": 4, "s": 2}, counts  # b: 3 kills and its loss; a: 2 kills, 2 hangs


def test_blame_moves_only_to_an_earlier_fault_of_another_node() -> None:
    job = Job()
    job.fail("a", 1.0, wall=100.0)
    assert job.fail("b", 1.1, wall=100.5, attempt=0) == []  # later: a survivor's report, a keeps the blame
    assert job.fail("a", 1.2, wall=99.0, attempt=0) == []  # the same node again: nothing to move
    job.fail("b", 1.3, EventKind.WORKER_EXIT, wall=50.0, attempt=7)  # an attempt never decided: nothing
    v = job.core.view(2.0).nodes
    assert (v["a"].failures, v["b"].failures) == (1, 0)
    assert job.fail("b", 1.4, EventKind.HANG, wall=101.0, attempt=0) == []  # hung since 98.0: first
    v = job.core.view(2.0).nodes
    assert (v["a"].failures, v["b"].failures) == (0, 1)


def test_bench_schedule_schedule_is_what_the_bench_runs() -> None:
    """The table above and the scenario table use the bench's own generator: same faults as its results."""
    faults = bench_module().fault_schedule(0, 10, 0.85 * 600.0, 60.0)
    assert [(f.kind, f.target, f.at) for f in faults][:8] == [
        ("kill-worker", 0, 20.1), ("kill-worker", 1, 120.7), ("hang-worker", 0, 131.9), ("kill-worker", 0, 138.6),
        ("kill-worker", 1, 145.5), ("kill-worker", 1, 150.0), ("hang-worker", 0, 222.7), ("kill-node", 1, 420.3)]


def test_bad_luck_is_rarely_blamed_and_a_bad_node_is_caught() -> None:
    """Seeded: 400 jobs of 2 nodes with 12 failures at random (equal odds) swap a node out in few of them; a node
    failing 9 times as often as its peer is swapped out within 12 failures in most jobs."""
    rng = random.Random(7)

    def swapped(p_b: float) -> bool:
        job = Job()
        for i in range(12):
            node = "b" if rng.random() < p_b else "a"
            if node not in job.core.assignment.members:
                node = "s"
            for d in job.fail(node, 10.0 + i):
                if d.action.kind == "hot_swap":
                    return True
        return False

    luck = sum(swapped(0.5) for _ in range(400)) / 400
    bad = sum(swapped(0.9) for _ in range(200)) / 200
    assert luck < 0.03, luck
    assert bad > 0.6, bad


def test_worker_failures_on_a_single_node_job_never_swap_it() -> None:
    core = SupervisorCore(SupervisorConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=100))
    core.join("a", 2, 0.0)
    core.join("s", 2, 0.0)
    core.form(0.0)
    for i in range(20):
        core.seen("s", float(i))
        ev = Event(EventKind.WORKER_EXIT, node="a", rank=0, attempt=core.assignment.attempt, details={"exit_code": 1})
        (d,) = core.handle(ev, float(i))
        assert isinstance(d.action, Restart), d.action


@pytest.mark.parametrize("kind,spares,expected", [
    (EventKind.HOST_UNHEALTHY, ("s",), "hot_swap"), (EventKind.GPU_UNHEALTHY, ("s",), "hot_swap"),
    (EventKind.HOST_UNHEALTHY, (), "ignore"), (EventKind.STRAGGLER, ("s",), "ignore"),
    # a preempted member: a spare takes its place once the agreed step is saved; none, at min: ignore (exit 75)
    (EventKind.PREEMPTION_NOTICE, ("s",), "hot_swap"), (EventKind.PREEMPTION_NOTICE, (), "ignore"),
])
def test_node_level_signals(kind: EventKind, spares: tuple[str, ...], expected: str) -> None:
    job = Job(spares)
    ev = Event(kind, node="b", rank=1, attempt=0, details={"check": "memory"})
    (d,) = job.core.handle(ev, 1.0)
    assert d.action.kind == expected, d.action
    if kind is EventKind.PREEMPTION_NOTICE:
        assert d.assignment is None and job.core.preempting == "b"  # carried out after the agreed save
    elif expected == "hot_swap":
        assert d.action.cool_down == 600.0 and job.core.view(1.0).nodes["b"].state is NodeState.CORDONED


# ------------------------------------------------------------------------------------- benched, then back
def swap_b_out(job: Job, policy_cool_down: float = 600.0) -> float:
    """Seven failures of b in a row: it is swapped for s and benched. Returns the swap's time."""
    for i in range(7):
        ds = job.fail("b", 1.0 + i)
    (d,) = ds
    assert isinstance(d.action, HotSwap) and d.action.cool_down == policy_cool_down, d.action
    return 7.0


def test_benched_node_is_a_spare_again_after_the_cool_down_and_replaces_the_next_lost_node() -> None:
    job = Job()
    t = swap_b_out(job)
    assert job.core.view(t).nodes["b"].state is NodeState.CORDONED
    job.at(t + 599.0)
    assert job.core.tick(t + 599.0) == [] and job.core.view(t + 599.0).nodes["b"].state is NodeState.CORDONED
    job.at(t + 600.5)
    (d,) = job.core.tick(t + 600.5)
    assert d.action.kind == "ignore" and d.cause.kind is EventKind.NODE_JOINED
    assert d.cause.details["after"] == "cool_down"
    assert job.core.view(t + 600.5).spares == ("b",)
    (d,) = job.fail("s", t + 601.0, EventKind.AGENT_LOST)
    assert isinstance(d.action, HotSwap) and (d.action.node, d.action.spare) == ("s", "b")
    assert job.core.assignment.members == ("a", "b")


def test_benched_node_grows_the_job_back_when_there_is_room() -> None:
    job = Job(spares=(), min_nodes=1, max_nodes=2)
    for i in range(7):
        ds = job.fail("b", 1.0 + i)
    assert ds[0].action.kind == "scale_down" and job.core.assignment.members == ("a",)
    job.at(700.0)
    (d,) = job.core.tick(700.0)
    assert d.action.kind == "scale_up" and d.pending and d.action.spares == ("b",)


def test_benched_node_that_went_quiet_is_lost_not_a_spare() -> None:
    job = Job()
    t = swap_b_out(job)
    for u in (t + 100.0, t + 300.0, t + 605.0):  # a and s report; b's agent went silent after the swap
        for n in ("a", "s"):
            job.core.seen(n, u)
    assert job.core.tick(t + 605.0) == []
    assert job.core.view(t + 605.0).nodes["b"].state is NodeState.LOST
    # and it comes back by joining again, as any lost node
    job.core.join("b", 1, t + 606.0)
    assert job.core.view(t + 606.0).spares == ("b",)


def test_benched_node_whose_agent_disconnects_is_lost_at_once() -> None:
    job = Job()
    t = swap_b_out(job)
    assert job.fail("b", t + 1.0, EventKind.AGENT_LOST) == []
    job.at(t + 700.0)
    assert job.core.tick(t + 700.0) == [] and job.core.view(t + 700.0).nodes["b"].state is NodeState.LOST


def test_benched_unhealthy_node_stays_out() -> None:
    job = Job()
    (d,) = job.core.handle(Event(EventKind.GPU_UNHEALTHY, node="b", rank=1, attempt=0, details={"check": "xid"}), 1.0)
    assert d.action.kind == "hot_swap"
    job.at(900.0)
    assert job.core.tick(900.0) == [] and job.core.view(900.0).nodes["b"].state is NodeState.CORDONED


def test_cordon_is_for_good_and_cool_down_none_too() -> None:
    class CordonB:
        def decide(self, event, view):
            return Cordon("b", reason="suspect")

    job = Job(policy=CordonB())
    (d,) = job.fail("b", 1.0)
    assert d.action.kind == "hot_swap" and d.fallback is None
    job.at(5000.0)
    assert job.core.tick(5000.0) == [] and job.core.view(5000.0).nodes["b"].state is NodeState.CORDONED

    job = Job(policy=DefaultPolicy(cool_down=None))
    swap_b_out(job, policy_cool_down=None)
    job.at(5000.0)
    assert job.core.tick(5000.0) == [] and job.core.view(5000.0).nodes["b"].state is NodeState.CORDONED


def test_a_bad_cool_down_is_overruled() -> None:
    class Negative:
        def decide(self, event, view):
            return HotSwap(event.node, "s", cool_down=-5.0)

    job = Job(policy=Negative())
    (d,) = job.fail("b", 1.0)
    assert d.fallback is not None and "cool_down" in d.fallback and d.action.kind == "restart"
