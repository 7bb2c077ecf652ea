"""A supervisor that stalls is not a fleet that died.

Loop-level tests (a real store, a real loop, agents as real channels and presence connections) pin down each
rule on its own: a loop that wakes from a stall gives every node a fresh ``--node-timeout`` before it judges; a
job whose members all reported done is never failed by a loss noticed in the same pass; a stop and a new round
decided in one pass reach the agents as the stop alone, at the round right after the one they read. The
real-process tests stop the standalone supervisor, or the agent that hosts it, with SIGSTOP and let it go with
SIGCONT while a healthy job trains: the job finishes, exit 0 everywhere, with no node lost and no hang declared.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger
from resilient.supervisor import transport as T
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.loop import LoopConfig, SupervisorLoop
from tests._helpers.wait import wait_for

SECRET = b"frozen-test-secret-0123456789abcdef"
JOB = "frozen"


class Job:
    """A supervisor loop on a real store and two agents (channels + presence connections) joined to it; the
    loop is stepped by the test, with the ``now`` it chooses."""

    def __init__(self, tmp: Path, *, max_restarts: int = 5, node_timeout: float = 10.0):
        self.store = T.connect_store("127.0.0.1", 0, 10.0, is_master=True)
        assert T.claim_job(self.store, JOB, hosting=True, timeout=10.0) == JOB
        cfg = SupervisorConfig(min_nodes=2, max_nodes=2, nproc_per_node=1, max_restarts=max_restarts,
                               node_timeout=node_timeout)
        self.ledger = Ledger(tmp / "run", node="supervisor")
        self.loop = SupervisorLoop(LoopConfig(core=cfg, last_call=0.0, advertise_addr="127.0.0.1", linger=0.0),
                                   self.store, T.Signer(SECRET, JOB), self.ledger, SupervisorCore(cfg))
        self.chans: dict[str, T.AgentChannel] = {}
        self.conns: dict[str, socket.socket] = {}
        for node in ("a", "b"):
            ch = T.AgentChannel(T.connect_store("127.0.0.1", self.store.port, 10.0), T.Signer(SECRET, JOB), node)
            ch.sync_term(10.0)
            ch.send(T.MessageKind.JOIN, nproc=1, pid=0, host="test")
            addr = self.store.get(ch.keys.presence).decode()
            self.conns[node] = T.presence_connect(addr, ch.signer, node, timeout=10.0, term=ch.term)
            self.chans[node] = ch
        self.until(lambda: self.loop.core.assignment is not None and len(self.loop.presence._nodes) == 2,
                   "the first assignment and both presence connections")

    def until(self, pred, what: str) -> None:
        def once() -> bool:
            self.loop.step(time.monotonic())
            return bool(pred())

        wait_for(once, 30, what)

    def queued(self, n: int) -> None:
        wait_for(lambda: self.store.queue_len(T.Keys(JOB).queue) >= n, 10, f"{n} message(s) in the queue")

    def drop(self, node: str) -> None:
        """``node``'s agent dies: its presence connection closes; returns once the supervisor's end can read it."""
        srv = next(c for c, n in self.loop.presence._nodes.items() if n == node)
        self.conns.pop(node).close()
        r, _, _ = select.select([srv], [], [], 10)
        assert r, f"the close of {node}'s presence connection did not arrive"

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.loop.close()
        self.ledger.close()


@pytest.fixture
def job(tmp_path: Path):
    j = Job(tmp_path)
    yield j
    j.close()


@pytest.mark.timeout(60)
def test_a_loop_that_wakes_from_a_stall_gives_every_node_a_fresh_node_timeout(job: Job) -> None:
    t0 = time.monotonic()
    job.loop.step(t0)
    # a loaded machine may already have stalled the fixture's passes (a real pause, taken at t0): counted from here
    before = len(job.loop.pauses)
    # the loop's next pass comes three node timeouts later: its own stall, no node's silence
    late = t0 + 3 * job.loop.cfg.core.node_timeout
    job.loop.step(late)
    assert not [d for d in job.loop.decisions if d.cause is not None and d.cause.kind == EventKind.AGENT_LOST]
    assert len(job.loop.pauses) == before + 1 and job.loop.pauses[-1] == pytest.approx(late - t0)
    # the grace is one node timeout, not forever: passes at the loop's pace (no stall), and a node still silent
    # after it is lost
    t = late
    while t < late + 1.5 * job.loop.cfg.core.node_timeout:
        t += 1.0
        job.loop.step(t)
    assert len(job.loop.pauses) == before + 1
    # decided, not carried out: with both nodes silent this supervisor accounts for no majority (never two
    # supervisors), so the decision waits in ``held``
    assert [d.cause.node for d in job.loop.decisions + job.loop.held if d.cause is not None
            and d.cause.kind == EventKind.AGENT_LOST][:1] in (["a"], ["b"])


@pytest.mark.timeout(60)
def test_a_job_whose_members_all_finished_is_not_failed_by_a_loss_in_the_same_pass(job: Job) -> None:
    for node in ("a", "b"):
        job.chans[node].send(T.MessageKind.DONE, round=0)
    job.queued(2)
    job.drop("b")  # b's agent exits right after saying done, before the final plan is out
    job.loop.step(time.monotonic())
    plan = job.chans["a"].plan(1)
    assert plan is not None and plan.get("final") and plan.get("stop") is None, plan
    assert job.loop.result == "succeeded"
    assert not [d for d in job.loop.decisions if d.action.kind != "ignore"]


@pytest.mark.timeout(60)
def test_a_restart_and_a_stop_decided_in_one_pass_reach_the_agents_as_the_stop_alone(tmp_path: Path) -> None:
    # one restart left: a's worker failure spends it, b's loss (no spare, no room to shrink) stops the job
    j = Job(tmp_path, max_restarts=1)
    try:
        ev = Event(EventKind.WORKER_EXIT, node="a", rank=0, attempt=0,
                   details={"pid": 1, "exit_code": 1, "signal": None, "local_rank": 0, "detect_seconds": 0.0})
        j.chans["a"].send(T.MessageKind.EVENT, event=ev.to_json())
        j.queued(1)
        j.drop("b")
        out = j.loop.step(time.monotonic())
        assert sorted(d.action.kind for d in out if d.action.kind != "ignore") == ["restart", "stop"], out
        # agents at round 0 look for round 1: it must be the final plan, the stop, and nothing after it
        plan = j.chans["a"].plan(1)
        assert plan is not None and plan.get("final") and plan.get("stop"), plan
        assert not j.chans["a"].has_round(2)
    finally:
        j.close()


# ---------------------------------------------------------------------------------------------- real processes
def _cluster(tmp_path: Path, flags: list[str]):
    from tests.cluster.conftest import Cluster

    # one worker per node: the point is the supervisor's and the agents' clocks across a stall, not the worker count
    c = Cluster(tmp_path / "c", "2", flags=flags)
    c.tmp.mkdir(parents=True)
    return c


def _let_go(c) -> None:
    for n in c.nodes:  # a stopped process must be let go before it can be killed and reaped
        try:
            os.kill(n.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    c.close()


def _train_args(tmp_path: Path, steps: int) -> tuple[list[str], Path]:
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "go").touch()  # the gate only says where training is: at-<rank> once step 2 is saved
    return ["--steps", str(steps), "--out", str(tmp_path / "out"), "--gate", str(gate), "--gate-step", "2",
            "--step-sleep", "0.3"], gate


def _no_loss_no_hang(c) -> list:
    evs = c.events()
    assert not [e for e in evs if e.kind in (EventKind.AGENT_LOST, EventKind.HANG)], \
        [e for e in evs if e.kind in (EventKind.AGENT_LOST, EventKind.HANG)]
    # one round from start to end (an ignore only records, such as a straggler under this machine's load)
    assert [e.details["action"] for e in evs if e.kind == EventKind.ACTION
            and e.details["action"] != "ignore"] == ["start"]
    return evs


@pytest.mark.timeout(240)
def test_standalone_supervisor_stopped_past_the_node_timeout_and_let_go_fails_nobody(tmp_path: Path) -> None:
    from tests.cluster.test_node_loss import _listening

    secret = {"RESILIENT_JOB_SECRET": "s3cret-for-tests-0123456789abcdef"}
    # agents: store calls give up after 5 s; the supervisor counts a node lost after 4 s of silence
    c = _cluster(tmp_path, ["--heartbeat-timeout", "600", "--node-timeout", "5", "--supervisor-timeout", "120"])
    try:
        sup = c.start_supervisor(["--max-restarts", "3", "--node-timeout", "4", "--last-call-timeout", "0"],
                                 env=secret)
        wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
        assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
        args, gate = _train_args(tmp_path, 40)
        a, b = c.start("a", args, env=secret), c.start("b", args, env=secret)
        wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 120, "training under way")
        os.kill(sup.proc.pid, signal.SIGSTOP)
        # stopped until both agents found it away (their calls gave up after 5 s): every node is silent to it for
        # longer than its node timeout when it runs again
        wait_for(lambda: "store is unreachable" in a.text() and "store is unreachable" in b.text(), 60,
                 "both agents to find the supervisor away")
        os.kill(sup.proc.pid, signal.SIGCONT)
        t_wake = time.monotonic()
        wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to end")
        took = time.monotonic() - t_wake
        assert a.proc.returncode == 0, a.output()
        assert b.proc.returncode == 0, b.output()
        wait_for(lambda: sup.proc.poll() is not None, 30, "the supervisor to exit with the job")
        assert sup.proc.returncode == 0, sup.output()
        evs = _no_loss_no_hang(c)
        assert [e for e in evs if e.kind == EventKind.LOG and "supervisor_paused" in e.details], sup.output()
        print(f"standalone supervisor woken: job ended (exit 0 everywhere) {took:.1f} s after SIGCONT")
    finally:
        _let_go(c)


@pytest.mark.timeout(240)
def test_agent_hosting_the_supervisor_stopped_past_the_timeouts_and_let_go_fails_nobody(tmp_path: Path) -> None:
    # the hang watch would act after 3 s of silence: longer than that is the hosting agent's own stall
    c = _cluster(tmp_path, ["--heartbeat-timeout", "3", "--node-timeout", "4", "--supervisor-timeout", "120",
                            "--rdzv-conf", "last_call_timeout=0"])
    try:
        args, gate = _train_args(tmp_path, 40)
        from tests.cluster.test_node_loss import _listening

        a = c.start("a", args)
        wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "node a to host the store")
        b = c.start("b", args)
        wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 120, "training under way")
        host, other = a, b  # a bound the endpoint first: its agent hosts the store and the supervisor
        os.kill(host.proc.pid, signal.SIGSTOP)  # the agent only: its workers train on
        wait_for(lambda: "store is unreachable" in other.text(), 60, "the other agent to find the supervisor away")
        os.kill(host.proc.pid, signal.SIGCONT)
        t_wake = time.monotonic()
        wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to end")
        took = time.monotonic() - t_wake
        assert a.proc.returncode == 0, a.output()
        assert b.proc.returncode == 0, b.output()
        _no_loss_no_hang(c)
        print(f"hosting agent woken: job ended (exit 0 everywhere) {took:.1f} s after SIGCONT")
    finally:
        _let_go(c)
