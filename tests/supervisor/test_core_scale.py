"""The decision core's cost per pass at rest: a pass looks at every node only when a node's timer (a cool-down, the
node timeout, forgetting a lost node) can be due, and decides exactly what a pass that looks at every node decides."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.events.api import Event, EventKind
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore


class CountingNodes(dict):
    """The core's node table, counting the passes over it (a pass at rest should make none)."""

    walks = 0

    def items(self):
        CountingNodes.walks += 1
        return super().items()

    def values(self):
        CountingNodes.walks += 1
        return super().values()

    def __iter__(self):
        CountingNodes.walks += 1
        return super().__iter__()


def test_a_pass_at_rest_walks_no_node_until_one_can_time_out():
    core = SupervisorCore(SupervisorConfig(min_nodes=1, max_nodes=200, nproc_per_node=8, node_timeout=10.0))
    for i in range(200):
        core.join(f"n{i:03d}", 8, 0.0)
    core.form(0.0)
    core._nodes = CountingNodes(core._nodes)
    core.tick(0.05)  # the first pass after a change looks at every node once
    CountingNodes.walks = 0
    t = 0.05
    last = 0.0  # when n000 last reported
    while t < 9.5:  # every node reports each second; none is silent for 10 s
        t += 0.05
        for i in range(200):
            if int(t * 20) % 20 == i % 20:
                core.seen(f"n{i:03d}", t)
                last = t if i == 0 else last
        assert core.tick(t) == []
    assert CountingNodes.walks <= 2, f"{CountingNodes.walks} walks over the 200 nodes in {int(9.45 / 0.05)} passes"
    # and a node that falls silent is still lost on the first pass past its timeout
    while t < 30.0:
        t += 0.05
        for i in range(1, 200):
            core.seen(f"n{i:03d}", t)
        out = core.tick(t)
        if out:
            assert out[0].cause is not None and out[0].cause.node == "n000"
            assert out[0].cause.kind is EventKind.AGENT_LOST and out[0].cause.details["reason"] == "timeout"
            assert 10.0 < t - last <= 10.05 + 1e-9, (t, last)
            break
    else:
        raise AssertionError("the silent node was never declared lost")


NODES = [f"n{i}" for i in range(8)]
OPS = st.lists(st.tuples(
    st.sampled_from(["seen", "seen", "seen", "tick", "tick", "fail", "lost", "join", "straggler"]),
    st.integers(0, len(NODES) - 1),
    st.floats(0.0, 4.0, allow_nan=False)), min_size=1, max_size=80)


def _decisions(ds) -> list:
    return [(d.id, d.action.to_json(), d.assignment.to_json() if d.assignment else None,
             (d.cause.kind.value, d.cause.node) if d.cause is not None else None, d.pending) for d in ds]


def _state(core: SupervisorCore, now: float) -> dict:
    v = core.view(now)
    return {n: (x.state, x.group_rank, x.last_seen, x.failures, x.stragglers, x.healthy) for n, x in v.nodes.items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_quiet_passes_decide_what_full_passes_decide(ops):
    """Against the same core made to look at every node on every pass (its bound forced to -inf), the same
    decisions and the same view after every step, whatever joins, reports, failures and silences come."""
    cfg = SupervisorConfig(min_nodes=2, max_nodes=5, nproc_per_node=2, max_restarts=40, node_timeout=3.0,
                           failure_window=12.0, scale_up_wait=2.0, spare_wait=1.0)
    fast, full = SupervisorCore(cfg), SupervisorCore(cfg)
    for c in (fast, full):
        for n in NODES[:4]:
            c.join(n, 2, 0.0)
        c.form(0.0)
    now = 0.0
    for kind, i, dt in ops:
        now += dt
        node = NODES[i]
        outs = []
        for c in (fast, full):
            if c is full:
                c._timers_due = float("-inf")
            a = c.assignment
            if kind == "seen":
                c.seen(node, now)
                outs.append([])
            elif kind == "tick":
                outs.append(_decisions(c.tick(now)))
            elif kind == "join":
                outs.append(_decisions(c.join(node, 2, now)))
            else:
                ek = {"fail": EventKind.WORKER_EXIT, "lost": EventKind.AGENT_LOST,
                      "straggler": EventKind.STRAGGLER}[kind]
                details = {"exit_code": 1} if kind == "fail" else ({"reason": "disconnected"} if kind == "lost"
                                                                   else {"score": 0.3})
                e = Event(kind=ek, node=node, attempt=a.attempt if a is not None else None, details=details,
                          mono=now, wall=0.0)
                outs.append(_decisions(c.handle(e, now)))
        assert outs[0] == outs[1], (kind, node, now)
        assert _state(fast, now) == _state(full, now), (kind, node, now)
        assert fast.stopped == full.stopped
        if fast.stopped:
            break
