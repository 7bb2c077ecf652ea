"""A member's preemption notice in the supervisor's core: decided at once, carried out after the agreed save,
never counted as a failure; with no way to replace the node, the job ends as preempted (every node exits 75)."""

from __future__ import annotations

from resilient.events.api import Event, EventKind
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore


def _core(min_nodes: int, nodes: tuple[str, ...]) -> SupervisorCore:
    core = SupervisorCore(SupervisorConfig(min_nodes=min_nodes, max_nodes=2, nproc_per_node=1))
    for n in nodes:
        core.join(n, 1, 0.0)
    core.form(0.0)
    return core


def _notice(core: SupervisorCore, node: str, at: float):
    ev = Event(EventKind.PREEMPTION_NOTICE, node=node, attempt=core.assignment.attempt,
               details={"source": "SIGTERM", "deadline": 1.7e9 + 30}, mono=at, wall=1.7e9 + at)
    return core.handle(ev, at)


def _left(core: SupervisorCore, node: str, at: float):
    return core.handle(Event(EventKind.AGENT_LOST, node=node, details={"reason": "left"}, mono=at, wall=1.7e9 + at), at)


def test_no_spare_at_min_ends_preempted_after_the_save_not_stopped() -> None:
    core = _core(2, ("a", "b"))
    (d,) = _notice(core, "b", 5.0)
    assert d.action.kind == "ignore" and "exits 75" in d.action.reason, d.action
    assert core.preempting == "b" and core.preempted_end is None
    assert _left(core, "b", 6.0) == [] and core.preempted_end is None  # a's ranks are still saving
    assert core.done("a", 7.0) == []
    assert core.preempted_end is not None and "b was preempted" in core.preempted_end
    assert core.stopped is None and core.view(8.0).nodes["b"].failures == 0  # not a failure of b


def test_swap_waits_for_every_member_and_the_preempted_node_to_go() -> None:
    core = _core(2, ("a", "b", "s"))
    (d,) = _notice(core, "b", 5.0)
    assert d.action.kind == "hot_swap" and d.pending and d.assignment is None
    assert core.done("a", 6.0) == []  # b has not gone yet
    (d2,) = _left(core, "b", 7.0)
    assert d2.action.kind == "hot_swap" and d2.assignment is not None and d2.assignment.members == ("a", "s")
    assert "carried out" in d2.action.reason and core.preempting is None
