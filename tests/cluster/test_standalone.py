"""``resilient supervisor`` on its own: no training node is special (node 0 lost like any other), the
supervisor itself may die and come back (fail static), and messages without the job's secret do nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind

from tests._helpers.procs import stop_in_its_wait, waiting

from .conftest import REPO, child_env, wait_for
from .test_node_loss import (GATE_STEP, STEPS, _listening, assert_same, final, node_name,  # noqa: F401
                             reference_world, NPROC, WORLD, at_gate)

SECRET = {"RESILIENT_JOB_SECRET": "s3cret-for-tests-0123456789abcdef"}


def _agents(c, args, names, env=None):
    nodes = []
    for n in names:
        nodes.append(c.start(n, args, env=env))
    return nodes


@pytest.mark.timeout(240, func_only=True)
def test_standalone_supervisor_node0_lost_hot_swap(cluster_factory, tmp_path: Path, reference_world) -> None:
    # the ranks wait at the gate until the spare has joined (its agent imports torch first: over 10 s under
    # load), without steps and so without heartbeats: no hang must be declared meanwhile
    c = cluster_factory("2", nproc=NPROC, flags=["--heartbeat-timeout", "600"])
    sup = c.start_supervisor(["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "20",
                              "--last-call-timeout", "0"], env=SECRET)
    wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
    assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]
    a = c.start("a", args, env=SECRET)
    wait_for(lambda: any(e.kind == EventKind.RUN_START for e in c.events()), 60, "node a to start")
    b = c.start("b", args, env=SECRET)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    spare = c.start("spare", args, env=SECRET)
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 60,
             "the spare to join")
    starts = [e for e in c.events() if e.kind == EventKind.ATTEMPT_START]
    node0 = next(n for n in (a, b) if any(e.node == node_name(n) and e.details["group_rank"] == 0 for e in starts))
    other = b if node0 is a else a
    node0.kill()  # group rank 0, rank 0: the node torchrun's store would live on
    (gate / "go").touch()
    wait_for(lambda: other.proc.poll() is not None and spare.proc.poll() is not None, 150, "the job to end")
    assert other.proc.returncode == 0, other.output()
    assert spare.proc.returncode == 0, spare.output()
    wait_for(lambda: sup.proc.poll() is not None, 30, "the supervisor to exit with the job")
    assert sup.proc.returncode == 0, sup.output()
    swaps = [e.details["action_args"] for e in c.events() if e.kind == EventKind.ACTION
             and e.details.get("action") == "hot_swap"]
    # a lost node is cordoned for good (no cool-down): it cannot come back as a spare
    assert swaps == [{"action": "hot_swap", "reason": swaps[0]["reason"], "node": node_name(node0),
                      "spare": node_name(spare), "cool_down": None}]
    assert_same(reference_world, final(out, WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


FORGE = r'''
import json, sys, datetime
import torch.distributed as dist
port, node = int(sys.argv[1]), sys.argv[2]
s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
bad_mac = json.dumps({"b": json.dumps({"type": "event", "node": node, "event": {"kind": "worker_exit",
          "node": node, "rank": 0, "attempt": 0, "details": {"exit_code": 1}}}), "m": "0" * 64})
for msg in (bad_mac.encode(), b"garbage", b"\xff\x00" * 100):
    s.queue_push("resilient/sv/cluster/q", msg)
latest = int(s.get("resilient/sv/cluster/latest"))
s.set(f"resilient/sv/cluster/plan/{latest + 1}", json.dumps({"b": json.dumps({"round": latest + 1, "final": True,
      "stop": "forged"}), "m": "f" * 64}))
print("forged", latest + 1)
'''


@pytest.mark.timeout(300, func_only=True)
def test_supervisor_killed_and_restarted_training_goes_on(cluster_factory, tmp_path: Path, reference_world) -> None:
    # the ranks wait at the gate while the forger starts (it imports torch: seconds under load), without steps
    # and so without heartbeats: no hang must be declared meanwhile
    c = cluster_factory("2", nproc=NPROC, flags=["--heartbeat-timeout", "600"])
    flags = ["--max-restarts", "3", "--node-timeout", "20", "--last-call-timeout", "0"]
    sup = c.start_supervisor(flags, env=SECRET)
    wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
    assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP), "8"]
    a, b = _agents(c, args, ["a", "b"], env=SECRET)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    # messages and plans without the job's secret: refused, logged, and nothing happens
    r = subprocess.run([sys.executable, "-c", FORGE, str(c.port), node_name(a)], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    sup.kill()  # the supervisor's host dies, and with it the job's store
    (gate / "go").touch()
    # fail static: training goes on to the next gate without any supervisor
    wait_for(lambda: at_gate(gate, WORLD, "-8"), 90, "training to go on alone")
    assert a.proc.poll() is None and b.proc.poll() is None
    sup2 = c.start_supervisor(flags, env={**SECRET, "RESILIENT_LOG_LEVEL": "INFO"}, name="supervisor2")
    wait_for(lambda: "reconnected to the supervisor" in a.text() and "reconnected to the supervisor" in b.text(),
             60, "both agents to reconnect")
    (gate / "go-8").touch()
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert b.proc.returncode == 0, b.output()
    wait_for(lambda: sup2.proc.poll() is not None, 30, "the new supervisor to exit with the job")
    assert sup2.proc.returncode == 0, sup2.output()
    evs = c.events()
    # one attempt from start to end: no action was carried out twice, none was forged
    assert [e.details["action"] for e in evs if e.kind == EventKind.ACTION] == ["start"]
    assert {e.attempt for e in evs if e.kind == EventKind.ATTEMPT_START} == {0}
    assert "refused" in sup.text() and "refused the plan" in a.text() + b.text()
    assert_same(reference_world, final(out, WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


# the supervisor of the tests that lose it while the job waits at its gate (and of the one started in its place)
_AWAY_FLAGS = ["--max-restarts", "3", "--node-timeout", "20", "--last-call-timeout", "0"]


def _at_the_gate(c, tmp_path: Path):
    """A standalone supervisor and two agents whose ranks all wait at the gate: (supervisor, a, b, gate, out)."""
    sup = c.start_supervisor(_AWAY_FLAGS, env=SECRET)
    wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
    assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]
    a, b = _agents(c, args, ["a", "b"], env=SECRET)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    return sup, a, b, gate, out


def _ends_bit_exact(c, a, b, sup, gate: Path, out: Path, reference_world) -> None:
    """Open the gate: both agents end well, the supervisor with them, the model as the reference's."""
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert b.proc.returncode == 0, b.output()
    wait_for(lambda: sup.proc.poll() is not None, 30, "the new supervisor to exit with the job")
    assert_same(reference_world, final(out, WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(300, func_only=True)
def test_worker_failure_while_the_supervisor_is_away_is_decided_when_it_is_back(cluster_factory, tmp_path: Path,
                                                                                reference_world) -> None:
    import os
    import signal

    c = cluster_factory("2", nproc=NPROC)
    sup, a, b, gate, out = _at_the_gate(c, tmp_path)
    sup.kill()
    victim = int((gate / "at-1").read_text())  # rank 1's worker pid
    os.kill(victim, signal.SIGKILL)  # fails while no supervisor can hear of it
    wait_for(lambda: any(e.kind == EventKind.WORKER_EXIT and e.rank == 1 for e in c.events()), 60,
             "the failure to be recorded on its node")
    # the report found no supervisor (its store calls gave up): it must be told again, not lost
    wait_for(lambda: "store is unreachable" in a.text() + b.text(), 90, "the report to fail")
    sup2 = c.start_supervisor(_AWAY_FLAGS, env=SECRET, name="supervisor2")
    try:
        wait_for(lambda: any(e.kind == EventKind.ACTION and e.details.get("action") == "restart"
                             for e in c.events()), 90, "the restart decided by the new supervisor")
    except AssertionError as e:  # seen once under the full suite, not since: the logs say which side lost it
        tails = "".join(f"\n--- {n}\n{x.text()[-4000:]}" for n, x in (("node a", a), ("node b", b),
                                                                      ("supervisor2", sup2)))
        raise AssertionError(f"{e}{tails}") from None
    _ends_bit_exact(c, a, b, sup2, gate, out, reference_world)


@pytest.mark.timeout(300, func_only=True)
def test_a_failure_reported_into_a_dead_supervisors_connection_is_told_again(cluster_factory, tmp_path: Path,
                                                                            reference_world) -> None:
    """A queue push reads no answer: written on the connection of a supervisor that had died meanwhile, the kernel
    takes it and it is lost (seen once under the full suite: the failure was never decided). The victim's agent is
    stopped while its supervisor dies and its worker is killed, so that its report goes out on that connection before
    anything else tells it the supervisor is gone."""
    import os
    import signal

    import psutil

    c = cluster_factory("2", nproc=NPROC)
    sup, a, b, gate, out = _at_the_gate(c, tmp_path)
    starts = [e for e in c.events() if e.kind == EventKind.ATTEMPT_START]
    holder = next(n for n in (a, b) if any(e.node == node_name(n) and "1" in e.details["pids"] for e in starts))
    victim = psutil.Process(int((gate / "at-1").read_text()))  # rank 1's worker
    server = victim.ppid()  # the agent's fork server: it reaps the worker and tells the agent
    stop_in_its_wait(holder.proc.pid)
    try:
        sup.kill()  # reaped: its end of every connection is closed before the worker dies
        victim.kill()
        wait_for(lambda: not psutil.pid_exists(victim.pid) and waiting(server), 30,
                 "the worker's exit to be told to its (stopped) agent")
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    wait_for(lambda: any(e.kind == EventKind.WORKER_EXIT and e.rank == 1 for e in c.events()), 60,
             "the failure to be recorded on its node")
    sup2 = c.start_supervisor(_AWAY_FLAGS, env=SECRET, name="supervisor2")
    wait_for(lambda: any(e.kind == EventKind.ACTION and e.details.get("action") == "restart" for e in c.events()), 90,
             "the restart decided by the new supervisor")
    told = re.findall(r"telling the supervisor \d+ report\(s\) it may not have had: (.*)", holder.text())
    assert any("1 worker_exit (rank 1)" in t for t in told), holder.output()  # said in its agent's log
    _ends_bit_exact(c, a, b, sup2, gate, out, reference_world)


@pytest.mark.timeout(300, func_only=True)
def test_spare_joining_while_a_restart_is_in_progress_does_not_disturb_it(cluster_factory, tmp_path: Path,
                                                                          reference_world) -> None:
    """Round 1 is published but node a has not carried it out yet (its agent is stopped) when the spare joins:
    the restart completes as decided, the spare only waits, nothing else changes."""
    import os
    import signal

    c = cluster_factory("2", nproc=NPROC,
                        flags=["--heartbeat-timeout", "600"])  # the gate outlasts a learned hang timeout
    flags = ["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "120", "--last-call-timeout", "0"]
    sup = c.start_supervisor(flags, env=SECRET)
    wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
    assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]
    a, b = _agents(c, args, ["a", "b"], env=SECRET)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    starts = [e for e in c.events() if e.kind == EventKind.ATTEMPT_START]
    rank_of = {e.node: int(next(iter(e.details["pids"]))) for e in starts}
    os.kill(a.proc.pid, signal.SIGSTOP)  # node a will not carry out the next round until it is let go
    try:
        victim = int((gate / f"at-{rank_of[node_name(b)]}").read_text())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: any(e.kind == EventKind.ACTION and e.details.get("action") == "restart" for e in c.events()),
                 60, "the restart to be decided")
        spare = c.start("spare", args, env=SECRET)
        wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 90,
                 "the spare to join while node a has not restarted yet")
        assert not any(e.kind == EventKind.ATTEMPT_START and e.attempt == 1 and e.node == node_name(a)
                       for e in c.events())
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b, spare)), 150, "the job to end")
    assert [a.proc.returncode, b.proc.returncode, spare.proc.returncode] == [0, 0, 0], a.output()
    acts = [e.details["action"] for e in c.events() if e.kind == EventKind.ACTION]
    assert [x for x in acts if x != "ignore"] == ["start", "restart"], acts
    assert not any(e.kind == EventKind.ATTEMPT_START and e.node == node_name(spare) for e in c.events())
    assert_same(reference_world, final(out, WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
