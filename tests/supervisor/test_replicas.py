"""Replicas as the unit of elasticity (``--nodes-per-replica K``): the flag, the records, the view, and the core's
actions in replica units, without processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from resilient import env
from resilient.events.api import Event, EventKind
from resilient.launcher.api import LaunchError
from resilient.launcher.args import parse
from resilient.supervisor.api import HotSwap, Ignore, NodeState, ScaleDown, ScaleUp
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import Assignment, SupervisorCore
from tests.launcher.conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "dump_env.py")


# ------------------------------------------------------------------------------------------ the flag
def test_flag_and_environment_default(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(env.NODES_PER_REPLICA, raising=False)
    cfg = parse(["--nnodes", "2:4", "--run-dir", str(tmp_path / "r"), SCRIPT])
    assert cfg.supervisor.nodes_per_replica is None
    for spelling in ("--nodes-per-replica", "--nodes_per_replica"):
        cfg = parse(["--nnodes", "2:4", spelling, "2", "--run-dir", str(tmp_path / "r"), SCRIPT])
        assert cfg.supervisor.nodes_per_replica == 2
    monkeypatch.setenv(env.NODES_PER_REPLICA, "2")
    assert parse(["--nnodes", "4", "--run-dir", str(tmp_path / "r"), SCRIPT]).supervisor.nodes_per_replica == 2
    # the flag wins over the environment
    assert parse(["--nnodes", "3", "--nodes-per-replica", "3", "--run-dir", str(tmp_path / "r"),
                  SCRIPT]).supervisor.nodes_per_replica == 3


@pytest.mark.parametrize("nnodes,k,words", [
    ("3:4", "2", "--nnodes 3:4: MIN 3 is not a multiple of --nodes-per-replica 2"),
    ("2:5", "2", "--nnodes 2:5: MAX 5 is not a multiple of --nodes-per-replica 2"),
    ("3:5", "2", "--nnodes 3:5: MIN 3 and MAX 5 are not a multiple of --nodes-per-replica 2"),
    ("1", "2", "--nnodes 1:1: MIN 1 and MAX 1 are not a multiple of --nodes-per-replica 2"),
    ("2:4", "0", "must be a whole number of nodes >= 1, got 0"),
    ("2:4", "two", "must be a whole number of nodes >= 1, got 'two'"),
])
def test_bad_inputs_name_the_numbers(tmp_path, nnodes, k, words) -> None:
    with pytest.raises(LaunchError) as e:
        parse(["--nnodes", nnodes, "--nodes-per-replica", k, "--run-dir", str(tmp_path / "r"), SCRIPT])
    assert words in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_bad_environment_value_names_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(env.NODES_PER_REPLICA, "-1")
    with pytest.raises(LaunchError, match=env.NODES_PER_REPLICA):
        parse(["--nnodes", "2:4", "--run-dir", str(tmp_path / "r"), SCRIPT])


@pytest.mark.timeout(60)
def test_resilient_run_exits_2_with_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--nnodes", "3:4", "--nodes-per-replica", "2",
                        "--run-dir", str(tmp_path / "r"), SCRIPT], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "MIN 3 is not a multiple of --nodes-per-replica 2" in r.stderr
    assert not (tmp_path / "r").exists()  # refused before anything starts


def test_standalone_supervisor_takes_the_flag(tmp_path) -> None:
    from resilient.supervisor.standalone import parse as parse_standalone

    base = ["--rdzv-endpoint", "127.0.0.1:1", "--run-dir", str(tmp_path / "s")]
    assert parse_standalone([*base, "--nnodes", "2:4", "--nodes-per-replica", "2"]).supervisor.nodes_per_replica == 2
    r = subprocess.run([sys.executable, "-m", "resilient.supervisor.standalone", *base, "--nnodes", "3:4",
                        "--nodes-per-replica", "2"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "MIN 3 is not a multiple of --nodes-per-replica 2" in r.stderr


def test_config_validates_k() -> None:
    with pytest.raises(ValueError, match="nodes-per-replica"):
        SupervisorConfig(min_nodes=2, max_nodes=4, nproc_per_node=1, nodes_per_replica=0)
    with pytest.raises(ValueError, match="MAX 3 is not a multiple"):
        SupervisorConfig(min_nodes=2, max_nodes=3, nproc_per_node=1, nodes_per_replica=2)
    assert SupervisorConfig(min_nodes=2, max_nodes=4, nproc_per_node=1, nodes_per_replica=2).nodes_per_replica == 2


# ------------------------------------------------------------------------------------------ records and view
def test_assignment_json_round_trip_and_old_plans() -> None:
    a = Assignment(round=3, attempt=3, members=("a", "b", "c", "d"), spares=("s",), nproc=dict.fromkeys("abcd", 2),
                   world_size=8, previous_world_size=4, nodes_per_replica=2, previous_dp_size=1)
    assert a.dp_size == 2 and a.replicas == (("a", "b"), ("c", "d"))
    d = a.to_json()
    assert d["nodes_per_replica"] == 2 and d["previous_dp_size"] == 1
    assert Assignment.from_json(d) == a
    old = {k: v for k, v in d.items() if k not in ("nodes_per_replica", "previous_dp_size")}
    b = Assignment.from_json(old)
    assert b.nodes_per_replica is None and b.previous_dp_size is None and b.dp_size == 8
    with pytest.raises(ValueError, match="does not divide"):
        Assignment(round=0, attempt=0, members=("a", "b", "c"), spares=(), nproc=dict.fromkeys("abc", 1),
                   world_size=3, previous_world_size=None, nodes_per_replica=2)


def core_of(n: int, *, k: int | None = 2, lo: int = 2, hi: int = 4, policy=None, nproc: int = 1,
            **kw) -> SupervisorCore:
    core = SupervisorCore(SupervisorConfig(min_nodes=lo, max_nodes=hi, nproc_per_node=nproc, max_restarts=10,
                                           nodes_per_replica=k, **kw), policy)
    for i in range(n):
        core.join(f"n{i}", nproc, 0.0)
    core.form(0.0)
    return core


def lost(node: str) -> Event:
    return Event(kind=EventKind.AGENT_LOST, node=node, attempt=None, details={"reason": "timeout"}, mono=1.0, wall=1.0)


def test_form_takes_whole_replicas_and_the_view_reports_them() -> None:
    core = core_of(5, nproc=2)
    a = core.assignment
    assert a.members == ("n0", "n1", "n2", "n3") and a.spares == ("n4",)
    assert (a.nodes_per_replica, a.dp_size, a.world_size, a.previous_dp_size) == (2, 2, 8, None)
    v = core.view(0.0)
    assert v.nodes_per_replica == 2 and v.replicas == (("n0", "n1"), ("n2", "n3")) and v.dp_size == 2
    assert v.replica_of("n3") == ("n2", "n3") and v.replica_of("n4") == ()
    three = core_of(3, hi=4)  # 3 joined: one replica runs, the third node waits as a spare
    assert three.assignment.members == ("n0", "n1") and three.assignment.spares == ("n2",)


def test_without_k_every_rank_is_a_replica() -> None:
    core = core_of(3, k=None, lo=1, hi=3, nproc=2)
    v = core.view(0.0)
    assert v.nodes_per_replica is None and v.dp_size == v.world_size == 6
    assert v.replicas == (("n0",), ("n1",), ("n2",))
    assert core.assignment.dp_size == 6 and core.assignment.to_json()["nodes_per_replica"] is None


# ------------------------------------------------------------------------------------------ actions in replica units
class Scripted:
    def __init__(self, *actions) -> None:
        self.actions = list(actions)

    def decide(self, event, view):
        return self.actions.pop(0) if self.actions else Ignore()


def ckpt(step: int, node: str = "n0") -> Event:
    return Event(kind=EventKind.CKPT_TIER_DONE, node=node, attempt=None, details={"tier": "local", "step": step},
                 mono=1.0, wall=1.0)


def test_loss_with_a_spare_swaps_inside_the_replica() -> None:
    core = core_of(5)
    [d] = core.handle(lost("n1"), 1.0)
    assert isinstance(d.action, HotSwap) and (d.action.node, d.action.spare) == ("n1", "n4")
    assert d.assignment.members == ("n0", "n4", "n2", "n3") and d.assignment.dp_size == 2
    assert d.assignment.previous_dp_size == 2


def test_loss_without_a_spare_drops_the_replica_and_benches_its_healthy_node_then_grows_back() -> None:
    core = core_of(4)
    [d] = core.handle(lost("n1"), 1.0)
    assert isinstance(d.action, ScaleDown) and set(d.action.nodes) == {"n0", "n1"}
    a = d.assignment
    assert (a.members, a.spares, a.dp_size, a.previous_dp_size, a.world_size) == (("n2", "n3"), ("n0",), 1, 2, 2)
    v = core.view(1.0)
    assert v.nodes["n0"].state is NodeState.SPARE and v.nodes["n1"].state is NodeState.LOST
    [note] = [e for e in core.take_notes() if e.kind is EventKind.NODE_BENCHED]
    assert note.node == "n0" and note.details["node"] == "n0" and note.details["replica"] == 0
    assert note.details["replica_nodes"] == ["n0", "n1"] and "n1 lost" in note.details["reason"]
    # the lost node comes back: with the benched one, a replica again, grown at the next checkpoint boundary
    [d] = core.join("n1", 1, 2.0)
    assert isinstance(d.action, ScaleUp) and d.pending and set(d.action.spares) == {"n0", "n1"}
    [d] = core.handle(ckpt(10), 3.0)
    a = d.assignment
    assert a.members[:2] == ("n2", "n3") and set(a.members[2:]) == {"n0", "n1"}
    assert (a.dp_size, a.previous_dp_size, a.world_size) == (2, 1, 4)


def test_a_scale_down_naming_the_lost_node_drops_its_replica() -> None:
    core = core_of(4, policy=Scripted(ScaleDown(("n2",), reason="mine")))
    [d] = core.handle(lost("n2"), 1.0)
    assert d.fallback is None and d.action.nodes == ("n2", "n3")
    assert d.action.reason.startswith("mine; dropping the whole replica of n2 (also n3)")
    assert d.assignment.members == ("n0", "n1") and core.view(1.0).nodes["n3"].state is NodeState.SPARE


def test_a_scale_down_that_would_split_a_replica_is_refused() -> None:
    core = core_of(4, policy=Scripted(ScaleDown(("n2",), reason="split")))
    straggler = Event(kind=EventKind.STRAGGLER, node="n0", attempt=0, details={}, mono=1.0, wall=1.0)
    [d] = core.handle(straggler, 1.0)
    assert "would split replica 1 (n2, n3)" in d.fallback
    assert isinstance(d.action, Ignore) and core.assignment.members == ("n0", "n1", "n2", "n3")


def test_a_scale_up_of_part_of_a_replica_is_refused() -> None:
    core = core_of(2, policy=Scripted(ScaleUp(("n2",))))
    [d] = core.join("n2", 1, 1.0)
    assert "whole replicas of 2" in d.fallback and isinstance(d.action, Ignore)
    assert "1 free of the 2 a replica needs" in d.action.reason
    core = core_of(2)  # the default policy: one spare waits, two make a replica
    [d] = core.join("n2", 1, 1.0)
    assert isinstance(d.action, Ignore)
    [d] = core.join("n3", 1, 2.0)
    assert isinstance(d.action, ScaleUp) and d.action.spares == ("n2", "n3")


def test_at_min_a_lost_node_stops_the_job() -> None:
    core = core_of(4, lo=4)
    [d] = core.handle(lost("n3"), 1.0)
    assert d.action.kind == "stop" and "--nnodes min 4 forbids scaling down" in d.action.reason


def test_cordon_of_a_member_drops_its_replica_and_benches_the_other() -> None:
    from resilient.supervisor.api import Cordon

    core = core_of(4, policy=Scripted(Cordon("n3", reason="bad")))
    straggler = Event(kind=EventKind.STRAGGLER, node="n3", attempt=0, details={}, mono=1.0, wall=1.0)
    [d] = core.handle(straggler, 1.0)
    assert d.assignment.members == ("n0", "n1")
    v = core.view(1.0)
    assert v.nodes["n3"].state is NodeState.CORDONED and v.nodes["n2"].state is NodeState.SPARE


def test_a_ledger_replay_keeps_the_runs_replicas() -> None:
    from resilient.supervisor.cli import replay
    from resilient.supervisor.default_policy import DefaultPolicy

    names = ("n0", "n1", "n2", "n3")
    start = Assignment(round=0, attempt=0, members=names, spares=(), nproc=dict.fromkeys(names, 1), world_size=4,
                       previous_world_size=None, nodes_per_replica=2)
    evs = [Event(kind=EventKind.RUN_START, node="n0", details={"nnodes": "2:4"}, wall=0.0, mono=0.0),
           *(Event(kind=EventKind.NODE_JOINED, node=n, details={"nproc": 1}, wall=0.1 + i, mono=0.0)
             for i, n in enumerate(names)),
           Event(kind=EventKind.ACTION, node="sv", attempt=0, wall=5.0, mono=0.0,
                 details={"action": "start", "id": 0, "round": 0, "assignment": start.to_json()}),
           Event(kind=EventKind.AGENT_LOST, node="n1", details={"reason": "disconnected"}, wall=9.0, mono=0.0)]
    [row] = replay(DefaultPolicy(), evs)
    assert row["action"] == "scale_down" and "dropping replica 0 (n0, n1)" in row["reason"], row


from hypothesis import HealthCheck, given, settings  # noqa: E402 - the property test's own imports
from hypothesis import strategies as st  # noqa: E402

from tests.supervisor.test_core import NODES, Random, action_st, apply_op, op_st  # noqa: E402


def moved_only_whole_replicas(old: Assignment, new: Assignment, kind: str) -> None:
    if kind == "hot_swap":  # one node replaced in place: every other group rank stays
        assert len(old.members) == len(new.members)
        assert sum(a != b for a, b in zip(old.members, new.members)) == 1, (old.members, new.members)
    elif kind in ("scale_down", "cordon"):  # whole replicas removed, the rest in their order
        it = iter(old.replicas)
        assert all(r in it for r in new.replicas), (old.replicas, new.replicas)
    elif kind == "scale_up":  # whole replicas appended
        assert new.replicas[:len(old.replicas)] == old.replicas, (old.replicas, new.replicas)
    else:
        assert new.members == old.members, (kind, old.members, new.members)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_initial=st.integers(2, 7), ops=st.lists(op_st, max_size=50), answers=st.lists(action_st, max_size=50),
       use_default=st.booleans(), max_restarts=st.integers(0, 6))
def test_random_sequences_keep_whole_replicas(n_initial, ops, answers, use_default, max_restarts) -> None:
    c = SupervisorConfig(min_nodes=2, max_nodes=6, nproc_per_node=2, max_restarts=max_restarts, node_timeout=10.0,
                         scale_up_wait=15.0, failure_window=20.0, nodes_per_replica=2)
    core = SupervisorCore(c, None if use_default else Random(answers))
    for n in NODES[:n_initial]:
        core.join(n, 2, 0.0)
    a = core.form(0.0)
    assert len(a.members) == min(6, n_initial - n_initial % 2) and a.dp_size == len(a.members) // 2
    now = 0.0
    for op in ops:
        now, ds = apply_op(core, op, now + 1.0)
        for d in ds:
            if d.assignment is None:
                continue
            new = d.assignment
            assert len(new.members) % 2 == 0 and 2 <= len(new.members) <= 6, new
            assert new.nodes_per_replica == 2 and new.dp_size == len(new.members) // 2
            assert (new.previous_dp_size, new.previous_world_size) == (a.dp_size, a.world_size)
            moved_only_whole_replicas(a, new, d.action.kind)
            a = new
        if core.stopped is None and core.preempted_end is None:
            v = core.view(now)
            assert v.replicas == core.assignment.replicas
            if all(v.nodes[m].state is NodeState.ACTIVE for m in v.members):  # a lost member's replica is broken
                assert v.dp_size == core.assignment.dp_size
