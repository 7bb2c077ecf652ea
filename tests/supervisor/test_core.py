"""SupervisorCore without processes: its rules, its effects and, with random event sequences and random
policy answers, its invariants."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import (
    Cordon, HotSwap, Ignore, NodeState, Restart, ScaleDown, ScaleUp, Stop,
)
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import Assignment, Decision, SupervisorCore


def cfg(**kw) -> SupervisorConfig:
    base = {"min_nodes": 1, "max_nodes": 2, "nproc_per_node": 2}
    return SupervisorConfig(**{**base, **kw})


def formed(*names: str, policy=None, **kw) -> SupervisorCore:
    core = SupervisorCore(cfg(**kw), policy)
    for n in names:
        core.join(n, 2, 0.0)
    core.form(0.0)
    return core


def ev(kind: str, node: str, attempt="cur", core: SupervisorCore | None = None, **details) -> Event:
    if attempt == "cur":
        attempt = core.assignment.attempt if core is not None and core.assignment else None
    return Event(kind=EventKind(kind), node=node, attempt=attempt, details=details, mono=0.0, wall=0.0)


class Scripted:
    """Answers with the given actions in order (then Ignore)."""

    def __init__(self, *actions) -> None:
        self.actions = list(actions)

    def decide(self, event, view):
        return self.actions.pop(0) if self.actions else Ignore()


# ------------------------------------------------------------------------------------------ config and records
@pytest.mark.parametrize("field,value", [("min_nodes", 0), ("max_nodes", 0), ("nproc_per_node", -1),
                                         ("max_restarts", -1), ("node_timeout", 0), ("policy_timeout", -1.0),
                                         ("scale_up_wait", "soon"), ("recent_events", 0)])
def test_config_names_the_bad_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


def test_config_max_below_min() -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        cfg(min_nodes=3, max_nodes=2)


def test_assignment_ranks_and_json() -> None:
    a = Assignment(round=2, attempt=2, members=("x", "y", "z"), spares=("s",), nproc={"x": 2, "y": 4, "z": 1},
                   world_size=7, previous_world_size=8)
    assert [a.base_rank(n) for n in a.members] == [0, 2, 6]
    assert a.group_rank("z") == 2 and a.group_rank("s") is None
    with pytest.raises(KeyError):
        a.base_rank("s")
    assert Assignment.from_json(a.to_json()) == a


def test_decision_event_keeps_the_ledger_contract() -> None:
    core = formed("a", "b")
    (d,) = core.handle(ev("worker_exit", "b", core=core, exit_code=1), 5.0)
    e = d.to_event("supervisor")
    assert e.kind is EventKind.ACTION
    assert e.details["action"] == "restart" and e.details["action_args"]["action"] == "restart"
    assert e.details["cause"] == "worker_exit" and e.details["cause_node"] == "b"
    assert e.details["id"] == d.id and e.details["round"] == 1 and e.attempt == 1
    assert Event.from_json(e.to_json()).details == e.details


# ------------------------------------------------------------------------------------------ joining
def test_ready_and_form() -> None:
    core = SupervisorCore(cfg(min_nodes=2, max_nodes=3))
    core.join("a", 2, 0.0)
    assert not core.ready(100.0, last_call=5.0)
    with pytest.raises(RuntimeError, match="min_nodes"):
        core.form(1.0)
    core.join("b", 2, 10.0)
    assert not core.ready(12.0, last_call=5.0)
    assert core.ready(15.0, last_call=5.0)
    core.join("c", 2, 13.0)
    core.join("d", 2, 13.5)
    assert core.ready(13.5, last_call=5.0)
    a = core.form(14.0)
    assert a.members == ("a", "b", "c") and a.spares == ("d",) and a.round == 0 and a.world_size == 6
    assert a.previous_world_size is None
    with pytest.raises(RuntimeError):
        core.form(15.0)


def test_form_orders_members_by_node_rank_then_join_order(caplog: pytest.LogCaptureFixture) -> None:
    # torchrun's static rendezvous: --node-rank orders the group ranks; nodes without one follow in join order, and
    # the highest node ranks are the ones left as spares
    core = SupervisorCore(cfg(min_nodes=3, max_nodes=3))
    for name, rank in (("late0", 2), ("x", None), ("first", 0), ("mid", 1), ("y", None)):
        core.join(name, 2, 0.0, node_rank=rank)
    a = core.form(1.0)
    assert a.members == ("first", "mid", "late0") and a.spares == ("x", "y"), a
    assert a.base_rank("first") == 0 and a.base_rank("late0") == 4 and a.group_rank("mid") == 1
    dup = SupervisorCore(cfg(min_nodes=2, max_nodes=2))
    dup.join("b", 2, 0.0, node_rank=0)
    dup.join("a", 2, 0.0, node_rank=0)
    with caplog.at_level("WARNING", logger="resilient.supervisor.core"):
        assert dup.form(1.0).members == ("b", "a")
    assert "nodes share a --node-rank (b=0, a=0)" in caplog.text
    for bad in (-1, True, "0", 1.0):
        with pytest.raises(ValueError, match="node_rank of z must be an integer >= 0"):
            core.join("z", 2, 2.0, node_rank=bad)


def test_events_before_formation_are_only_recorded() -> None:
    core = SupervisorCore(cfg())
    core.join("a", 2, 0.0)
    assert core.handle(ev("worker_exit", "a", attempt=0, exit_code=1), 1.0) == []
    assert core.tick(100.0) == []
    assert [e.kind for e in core.view(1.0).recent] == [EventKind.NODE_JOINED, EventKind.WORKER_EXIT]


def test_rejoin_lost_becomes_spare_cordoned_stays_out() -> None:
    core = formed("a", "b", "c", max_nodes=3, min_nodes=1, policy=Scripted(ScaleDown(("c",)), Cordon("b")))
    core.seen("a", 9.0)
    core.seen("b", 9.0)
    (d,) = core.tick(11.0)  # c lost → scale down
    assert d.assignment.members == ("a", "b")
    (d,) = core.handle(ev("worker_exit", "a", core=core, exit_code=1), 12.0)  # cordon b: no spare → scale down
    assert isinstance(d.action, ScaleDown) and d.assignment.members == ("a",)
    assert core.view(12.0).nodes["b"].state is NodeState.CORDONED
    assert core.join("b", 2, 13.0) == []
    assert core.view(13.0).nodes["b"].state is NodeState.CORDONED
    ds = core.join("c", 2, 14.0)  # lost node back: a spare, and the (scripted, now exhausted) policy ignores
    assert core.view(14.0).nodes["c"].state is NodeState.SPARE and [d.action.kind for d in ds] == ["ignore"]


# ------------------------------------------------------------------------------------------ rules
def test_nothing_after_stop_or_finish() -> None:
    core = formed("a", "b", policy=Scripted(Stop(reason="enough")))
    (d,) = core.handle(ev("hang", "a", core=core), 1.0)
    assert isinstance(d.action, Stop) and core.stopped == "enough"
    assert core.handle(ev("hang", "a", core=core), 2.0) == [] and core.tick(100.0) == []
    core2 = formed("a", "b")
    core2.finish()
    assert core2.handle(ev("hang", "a", core=core2), 2.0) == [] and core2.join("s", 2, 3.0) == []


def test_restart_with_a_lost_member_is_invalid() -> None:
    core = formed("a", "b", "s", policy=Scripted(Restart()))
    core.seen("a", 9.0)
    core.seen("s", 9.0)
    (d,) = core.tick(11.0)
    assert isinstance(d.action, HotSwap) and d.fallback and "lost" in d.fallback


def test_ignoring_a_lost_member_is_invalid() -> None:
    core = formed("a", "b", policy=Scripted(Ignore()))
    (d,) = core.handle(ev("agent_lost", "b", attempt=None, reason="disconnected"), 1.0)
    assert isinstance(d.action, ScaleDown) and d.fallback


@pytest.mark.parametrize("kind,details", [("worker_exit", {"exit_code": 1}), ("hang", {})])
def test_ignoring_a_failure_whose_workers_are_stopped_is_refused(kind: str, details: dict) -> None:
    """The agent stops a node's workers before it reports an exit or a hang: an Ignore would idle the job."""
    core = formed("a", "b", policy=Scripted(Ignore()))
    (d,) = core.handle(ev(kind, "b", core=core, **details), 1.0)
    assert isinstance(d.action, Restart) and d.assignment is not None, d
    assert "already stopped its workers" in d.fallback, d.fallback


def test_a_policy_is_not_called_while_its_earlier_call_runs() -> None:
    gate, calls = threading.Event(), []

    class Stuck:
        def decide(self, event, view):
            calls.append(event.node)
            if len(calls) == 1:
                gate.wait(30)
            return Restart()

    core = formed("a", "b", policy=Stuck(), policy_timeout=0.2, max_restarts=9)
    (d,) = core.handle(ev("hang", "b", core=core), 1.0)
    assert "did not decide within" in d.fallback and isinstance(d.action, Restart)
    (d,) = core.handle(ev("hang", "a", core=core), 2.0)
    assert "previous call has not returned" in d.fallback and calls == ["b"]  # not called a second time
    gate.set()
    for t in [t for t in threading.enumerate() if t.name == "resilient-policy"]:
        t.join(timeout=10)
        assert not t.is_alive()
    (d,) = core.handle(ev("hang", "a", core=core), 3.0)
    assert d.fallback is None and calls == ["b", "a"]


def test_budget_spent_stops_but_never_for_a_scale_up() -> None:
    core = formed("a", "b", max_restarts=1, policy=Scripted(ScaleDown(("b",)), ScaleUp(("c",)), Restart()))
    (d,) = core.handle(ev("hang", "b", core=core), 1.0)
    assert d.assignment.members == ("a",) and core.restarts_left == 0
    (d,) = core.join("c", 2, 2.0)  # the policy asks to grow with no budget: overruled, the default ignores
    assert isinstance(d.action, Ignore) and d.fallback and "budget" in d.fallback
    assert core.stopped is None
    (d,) = core.handle(ev("hang", "a", core=core), 3.0)
    assert isinstance(d.action, Stop) and "budget" in d.action.reason and core.stopped


def test_pending_scale_up_loses_a_spare_used_by_a_swap() -> None:
    core = formed("a", "b", "c", max_nodes=3, min_nodes=1)
    core.seen("a", 9.0)
    core.seen("b", 9.0)
    core.tick(11.0)  # c lost → scale down to a, b
    (d1,) = core.join("s1", 2, 12.0)
    assert d1.pending and d1.action.spares == ("s1",)
    core.seen("a", 12.0)
    core.seen("s1", 12.0)
    (d2,) = core.tick(20.0)  # b lost (last seen 9) → hot swap to s1, the only spare
    assert isinstance(d2.action, HotSwap) and d2.assignment.members == ("a", "s1")
    assert core.view(20.0).pending_scale_up == ()
    assert core.handle(ev("ckpt_tier_done", "a", step=3, tier="local"), 21.0) == []


def test_scale_up_waits_for_a_newer_local_checkpoint() -> None:
    core = formed("a", "b", "c", max_nodes=3)
    core.handle(ev("ckpt_tier_done", "a", step=7, tier="local"), 1.0)
    core.seen("a", 9.0)
    core.seen("b", 9.0)
    core.tick(11.0)  # c lost
    (d,) = core.join("c", 2, 12.0)
    assert d.pending and core.view(12.0).pending_scale_up == ("c",)
    assert core.handle(ev("ckpt_tier_done", "b", step=7, tier="local"), 13.0) == []
    (d,) = core.handle(ev("ckpt_tier_done", "b", step=8, tier="local"), 14.0)
    assert d.assignment.members == ("a", "b", "c") and d.assignment.previous_world_size == 4
    assert d.assignment.world_size == 6 and core.view(14.0).ckpt_steps == {"local": 8}


def test_checkpoint_reports_do_not_push_failures_out_of_the_policys_history() -> None:
    # a job saving every step to three tiers reports far more boundaries than the history holds: the default
    # policy's "failed the same way K times" compares worker exits of earlier attempts, which must still be there
    core = formed("a", "b", recent_events=8, max_restarts=9, policy=Scripted(Restart()))
    core.handle(ev("worker_exit", "b", core=core, exit_code=1), 1.0)
    for step in range(20):
        for tier in ("local", "peer", "persistent"):
            core.handle(ev("ckpt_tier_done", "a", step=step, tier=tier), 2.0 + step * 0.01)
    v = core.view(3.0)
    assert [e.kind for e in v.recent if e.kind is EventKind.WORKER_EXIT] == [EventKind.WORKER_EXIT], v.recent
    assert v.ckpt_steps["local"] == 19


def test_failures_and_stragglers_counted_in_window() -> None:
    core = formed("a", "b", failure_window=10.0, max_restarts=9, policy=Scripted(*[Restart()] * 3, Ignore()))
    for t in (1.0, 2.0, 12.5):
        core.handle(ev("hang", "b", core=core), t)
    core.handle(ev("straggler", "a", core=core, score=0.2), 13.0)
    v = core.view(13.0)
    assert v.nodes["b"].failures == 1 and v.nodes["a"].stragglers == 1
    assert core.view(30.0).nodes["a"].stragglers == 0


def test_unhealthy_spare_is_not_swapped_in() -> None:
    core = formed("a", "b", "s", policy=Scripted(HotSwap("b", "s")))
    core.handle(ev("host_unhealthy", "s", attempt=None, check="disk"), 1.0)
    assert core.view(1.0).spares == ()
    (d,) = core.handle(ev("hang", "b", core=core), 2.0)
    assert isinstance(d.action, Restart) and "not a healthy spare" in d.fallback


def test_adopt_and_ids_after_a_supervisor_restart() -> None:
    a = Assignment(round=4, attempt=4, members=("a", "b"), spares=("s",), nproc={"a": 2, "b": 2}, world_size=4,
                   previous_world_size=4)
    core = SupervisorCore(cfg())
    core.adopt(a, 0.0)
    core.advance_ids(41)
    (d,) = core.handle(ev("hang", "a", attempt=4), 1.0)
    assert d.id == 42 and d.assignment.round == 5 and d.assignment.spares == ("s",)
    assert core.handle(ev("hang", "a", attempt=4), 1.5) == []  # stale now


# ------------------------------------------------------------------------------------------ invariants
NODES = ["n0", "n1", "n2", "n3", "n4", "n5"]
node_st = st.sampled_from(NODES)
# a policy answer: an action kind and indices into (members + spares + every node name), so that the
# answers are often plausible (current members and spares) and sometimes wrong
action_st = st.tuples(st.sampled_from(["restart", "ignore", "stop", "hot_swap", "cordon", "scale_down", "scale_up",
                                       "nonsense", "none"]), st.lists(st.integers(0, 12), min_size=2, max_size=4))
op_st = st.one_of(
    st.tuples(st.just("join"), node_st, st.integers(1, 4)),
    st.tuples(st.just("seen"), st.lists(node_st, max_size=6)),
    st.tuples(st.just("tick"), st.floats(0.0, 30.0)),
    st.tuples(st.just("event"), st.sampled_from(["worker_exit", "hang", "agent_lost", "straggler", "host_unhealthy",
                                                  "gpu_unhealthy", "preemption_notice", "node_joined"]),
              st.integers(0, 12), st.sampled_from(["cur", "cur", "cur", None, 0, 1, 2])),
    st.tuples(st.just("ckpt"), st.sampled_from(["local", "persistent"]), st.integers(0, 50)),
)


class Random:
    def __init__(self, answers) -> None:
        self.answers = list(answers)

    def decide(self, event, view):
        if not self.answers:
            return Ignore()
        kind, idx = self.answers.pop(0)
        pool = list(view.members) + list(view.spares) + NODES
        names = [pool[i % len(pool)] for i in idx]
        return {"restart": lambda: Restart(), "ignore": lambda: Ignore(), "stop": lambda: Stop(reason="x"),
                "hot_swap": lambda: HotSwap(names[0], names[1]), "cordon": lambda: Cordon(names[0]),
                "scale_down": lambda: ScaleDown(tuple(names[:-1])), "scale_up": lambda: ScaleUp(tuple(names[1:])),
                "nonsense": lambda: "nonsense", "none": lambda: None}[kind]()


def check_assignment(core: SupervisorCore, a: Assignment, c: SupervisorConfig) -> None:
    assert c.min_nodes <= len(a.members) <= c.max_nodes, a
    assert len(set(a.members)) == len(a.members), a
    assert not set(a.members) & set(a.spares), a
    assert set(a.nproc) == set(a.members) and a.world_size == sum(a.nproc.values()), a
    assert a.attempt == a.round


def apply_op(core: SupervisorCore, op: tuple, now: float) -> tuple[float, list[Decision]]:
    """Feed one of ``op_st``'s operations to ``core`` at ``now``: the time after it and the decisions it gave."""
    if op[0] == "join":
        return now, core.join(op[1], op[2], now)
    if op[0] == "seen":
        for n in op[1]:
            core.seen(n, now)
        return now, []
    if op[0] == "tick":
        now += op[1]
        return now, core.tick(now)
    if op[0] == "event":
        _, kind, i, att = op
        v = core.view(now)  # events mostly about members and spares, sometimes about anyone
        pool = list(v.members) + list(v.spares) + NODES
        node = pool[i % len(pool)]
        details = {"exit_code": 1} if kind == "worker_exit" else {"nproc": 2} if kind == "node_joined" else {}
        return now, core.handle(ev(kind, node, attempt=att, core=core, **details), now)
    return now, core.handle(ev("ckpt_tier_done", NODES[0], attempt=None, tier=op[1], step=op[2]), now)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a scale-up waiting for a boundary when the job ended as preempted (its node silent past the timeout in that tick)
@example(n_initial=1, min_nodes=1, extra=1, ops=[("join", "n1", 1), ("event", "preemption_notice", 0, "cur"),
                                                 ("tick", 13.0)], answers=[], use_default=True, max_restarts=1)
@example(n_initial=2, min_nodes=1, extra=1, ops=[("event", "preemption_notice", 0, "cur"),
                                                 ("event", "agent_lost", 0, "cur")], answers=[], use_default=False,
         max_restarts=0)
@given(n_initial=st.integers(1, 4), min_nodes=st.integers(1, 3), extra=st.integers(0, 2),
       ops=st.lists(op_st, max_size=60), answers=st.lists(action_st, max_size=60),
       use_default=st.booleans(), max_restarts=st.integers(0, 6))
def test_random_sequences_keep_the_job_sound(n_initial, min_nodes, extra, ops, answers, use_default,
                                             max_restarts) -> None:
    min_nodes = min(min_nodes, n_initial)
    c = SupervisorConfig(min_nodes=min_nodes, max_nodes=min_nodes + extra, nproc_per_node=2,
                         max_restarts=max_restarts, node_timeout=10.0, scale_up_wait=15.0, failure_window=20.0)
    core = SupervisorCore(c, None if use_default else Random(answers))
    for n in NODES[:n_initial]:
        core.join(n, 2, 0.0)
    first = core.form(0.0)
    check_assignment(core, first, c)
    now, last_id, changes = 0.0, 0, 0
    for op in ops:
        now, ds = apply_op(core, op, now + 1.0)
        for d in ds:
            assert isinstance(d, Decision) and d.id > last_id
            # the agent stopped that node's workers already: ignoring the failure would idle the job for good
            assert not (isinstance(d.action, Ignore) and d.cause is not None
                        and d.cause.kind in (EventKind.WORKER_EXIT, EventKind.HANG)), d
            last_id = d.id
            if d.assignment is not None:
                changes += 1
                check_assignment(core, d.assignment, c)
        view = core.view(now)
        if core.stopped is None and core.preempted_end is None:  # a job ended as preempted is over too
            a = core.assignment
            check_assignment(core, a, c)
            for m in a.members:
                # a preempted member may leave while the others finish the agreed step (bounded by preempt_wait)
                if m != core.preempting:
                    assert view.nodes[m].state is NodeState.ACTIVE, (m, view.nodes[m])
            assert core.preempting is not None or view.world_size == a.world_size
        else:
            assert ds == [] or isinstance(ds[-1].action, Stop)
        assert changes <= max_restarts


def test_agents_forward_only_what_the_core_decides_on() -> None:
    from resilient.supervisor.core import DECIDING_KINDS
    from resilient.supervisor.loop import FORWARDED

    assert FORWARDED <= DECIDING_KINDS, FORWARDED - DECIDING_KINDS
