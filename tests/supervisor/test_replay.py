"""Signed messages and plans are bound to the job id, the supervisor's term, their round and a per-sender
sequence number: a real message taken from the store and pushed again later, a message signed with the same
secret for another job, a plan stored under a later round's key or of an older term, and a replayed presence
hello are refused, logged, and change nothing.

Real parts: a real TCPStore, the real supervisor loop (stepped by the test, so that the attacker acts between
two passes), real agent channels with their own store clients, real presence connections over loopback.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger, read_events
from resilient.supervisor import transport as T
from resilient.supervisor.api import NodeState
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.loop import LoopConfig, SupervisorLoop
from tests._helpers.wait import wait_for

SECRET = b"replay-test-secret-0123456789abcdef"
JOB = "jobx"


class Job:
    """A supervisor loop on a real store and two agents (channels + presence connections) joined to it."""

    def __init__(self, tmp: Path):
        self.store = T.connect_store("127.0.0.1", 0, 10.0, is_master=True)
        self.port = self.store.port
        assert T.claim_job(self.store, JOB, hosting=True, timeout=10.0) == JOB
        core_cfg = SupervisorConfig(min_nodes=2, max_nodes=2, nproc_per_node=1, max_restarts=5, node_timeout=600)
        self.ledger = Ledger(tmp / "run", node="supervisor")
        self.loop = SupervisorLoop(LoopConfig(core=core_cfg, last_call=0.0, advertise_addr="127.0.0.1"),
                                   self.store, T.Signer(SECRET, JOB), self.ledger, SupervisorCore(core_cfg))
        self.attacker = T.connect_store("127.0.0.1", self.port, 10.0)  # store access, and the job's secret at most
        self.chans: dict[str, T.AgentChannel] = {}
        self.conns: list[socket.socket] = []
        for node in ("a", "b"):
            ch = T.AgentChannel(T.connect_store("127.0.0.1", self.port, 10.0), T.Signer(SECRET, JOB), node)
            ch.sync_term(10.0)
            ch.send(T.MessageKind.JOIN, nproc=1, pid=0, host="test")
            addr = self.store.get(ch.keys.presence).decode()
            self.conns.append(T.presence_connect(addr, ch.signer, node, timeout=10.0, term=ch.term))
            self.chans[node] = ch
        self.until(lambda: self.loop.core.assignment is not None, "the first assignment")

    def step(self) -> None:
        self.loop.step(time.monotonic())

    def until(self, pred, what: str) -> None:
        def once() -> bool:
            self.step()
            return bool(pred())

        wait_for(once, 30, what)

    def state(self, node: str) -> NodeState:
        return self.loop.core.view(time.monotonic()).nodes[node].state

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.loop.close()
        self.ledger.close()


@pytest.fixture
def job(tmp_path: Path):
    j = Job(tmp_path)
    yield j
    j.close()


def _pop(store) -> bytes:
    import torch.distributed as dist

    try:
        return store.queue_pop(T.Keys(JOB).queue, block=False)
    except dist.QueueEmptyError:
        raise AssertionError("the agent's message is not in the queue") from None


@pytest.mark.timeout(60)
def test_a_leave_taken_from_the_queue_and_pushed_back_later_is_refused(job: Job, caplog) -> None:
    caplog.set_level(logging.WARNING)
    b = job.chans["b"]
    b.send(T.MessageKind.LEAVE, reason="preempted")
    leave = _pop(job.attacker)  # taken before the supervisor saw it
    b.send(T.MessageKind.HB, round=0, active=True)  # node b lives on and reports
    job.until(lambda: job.attacker.queue_len(T.Keys(JOB).queue) == 0, "b's heartbeat to be taken")
    refused = job.loop.chan.refused
    job.attacker.queue_push(T.Keys(JOB).queue, leave)  # the leave, pushed back later
    job.until(lambda: job.loop.chan.refused > refused, "the replayed leave to be refused")
    job.step()
    assert job.state("b") == NodeState.ACTIVE
    assert not any(d.cause is not None and d.cause.kind == EventKind.AGENT_LOST for d in job.loop.decisions)
    assert "a replayed message from b" in caplog.text
    # the same body pushed twice in a row: the first is news, the second a duplicate
    b.send(T.MessageKind.HB, round=0, active=True)
    hb = _pop(job.attacker)
    job.attacker.queue_push(T.Keys(JOB).queue, hb)
    job.attacker.queue_push(T.Keys(JOB).queue, hb)
    refused = job.loop.chan.refused
    job.until(lambda: job.loop.chan.refused == refused + 1, "the duplicate to be refused")


@pytest.mark.timeout(60)
def test_a_report_replayed_does_not_restart_the_job_again(job: Job) -> None:
    a = job.chans["a"]
    ev = Event(EventKind.WORKER_EXIT, node="a", rank=0, attempt=0,
               details={"pid": 1, "exit_code": 1, "signal": None, "local_rank": 0, "detect_seconds": 0.0})
    a.send(T.MessageKind.EVENT, event=ev.to_json())
    report = _pop(job.attacker)
    job.attacker.queue_push(T.Keys(JOB).queue, report)  # delivered ...
    job.until(lambda: job.loop.core.assignment.round == 1, "the restart")
    job.attacker.queue_push(T.Keys(JOB).queue, report)  # ... and replayed
    job.until(lambda: job.loop.chan.refused == 1, "the replayed report to be refused")
    job.step()
    assert job.loop.core.assignment.round == 1
    assert [d.action.kind for d in job.loop.decisions] == ["restart"]


@pytest.mark.timeout(60)
def test_a_report_told_again_by_its_agent_is_taken_once(job: Job) -> None:
    """An agent tells again the reports no store answer confirmed (a push reads no answer: one written to a supervisor
    that stalled meanwhile may have arrived after all). Sealed anew, the copy is no replay; it must still count once:
    a straggler counted twice is nearer to its eviction."""
    a = job.chans["a"]
    ev = Event(EventKind.STRAGGLER, node="a", rank=0, attempt=0, details={"slowdown": 2.0})
    other = Event(EventKind.STRAGGLER, node="a", rank=0, attempt=0, details={"slowdown": 2.0})  # a second one
    for e in (ev, ev, other):
        a.send(T.MessageKind.EVENT, event=e.to_json())
    job.until(lambda: job.attacker.queue_len(T.Keys(JOB).queue) == 0, "the reports to be taken")
    job.step()
    assert job.loop.chan.refused == 0
    assert job.loop.core.view(time.monotonic()).nodes["a"].stragglers == 2


@pytest.mark.timeout(60)
def test_a_message_signed_with_the_same_secret_for_another_job_is_refused(job: Job, caplog) -> None:
    caplog.set_level(logging.WARNING)
    other = T.Signer(SECRET, "joby")  # a job that shares this job's secret
    forged = other.seal({"type": T.MessageKind.LEAVE, "node": "b", "t": time.time(), "term": job.loop.term,
                         "reason": "left"})
    job.attacker.queue_push(T.Keys(JOB).queue, forged)
    job.until(lambda: job.loop.chan.refused == 1, "the other job's message to be refused")
    job.step()
    assert job.state("b") == NodeState.ACTIVE
    assert "a message of job 'joby', this is job 'jobx'" in caplog.text
    # nor does the other job take this job's plans, even carried over into its own keys
    job.attacker.set(T.Keys("joby").plan(0), job.attacker.get(T.Keys(JOB).plan(0)))
    assert T.AgentChannel(job.attacker, other, "b").plan(0) is None
    assert "refused the plan of round 0: a message of job 'jobx', this is job 'joby'" in caplog.text


@pytest.mark.timeout(60)
def test_a_message_of_another_term_is_refused(job: Job) -> None:
    b = job.chans["b"]
    b.term = job.loop.term - 1  # sent to the supervisor before this one
    b.send(T.MessageKind.LEAVE, reason="preempted")
    job.until(lambda: job.loop.chan.refused == 1, "the old term's message to be refused")
    assert job.state("b") == NodeState.ACTIVE


@pytest.mark.timeout(60)
def test_a_plan_of_an_older_round_or_term_is_refused(job: Job, caplog) -> None:
    caplog.set_level(logging.WARNING)
    a = job.chans["a"]
    keys = T.Keys(JOB)
    assert a.plan(0)["round"] == 0
    # a real restart: round 1 published
    ev = Event(EventKind.WORKER_EXIT, node="b", rank=1, attempt=0,
               details={"pid": 1, "exit_code": 1, "signal": None, "local_rank": 0, "detect_seconds": 0.0})
    job.chans["b"].send(T.MessageKind.EVENT, event=ev.to_json())
    job.until(lambda: a.has_round(1), "round 1")
    assert a.plan(1)["round"] == 1
    # round 0's plan, stored as round 2 and announced as the latest: an old decision carried out again
    job.attacker.set(keys.plan(2), job.attacker.get(keys.plan(0)))
    job.attacker.set(keys.latest, "2")
    assert a.plan(2) is None
    assert "refused the plan of round 2: it is the plan of round 0" in caplog.text
    # a plan of a supervisor before this one (an older term), signed and bound to round 3
    old = T.SupervisorChannel(job.attacker, T.Signer(SECRET, JOB), term=job.loop.term - 1)
    old.publish(3, {"final": True, "stop": "replayed", "id": 0})
    assert a.plan(3) is None
    fresh = T.AgentChannel(a.store, a.signer, "a")  # its log line is not held back by the one above
    fresh.term = a.term
    assert fresh.plan(3) is None
    assert f"refused the plan of round 3: it is of term {job.loop.term - 1}, older than the current" in caplog.text


class _Tap:
    """A loopback relay in front of the supervisor's presence listener that keeps what the agent sent first
    (its signed hello), as someone on the path could."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hello = b""
        self.got = threading.Event()
        self._up: socket.socket | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(10)
        buf = b""
        while b"\n" not in buf:
            buf += conn.recv(4096)
        self.hello = buf.split(b"\n", 1)[0] + b"\n"
        self._up = socket.create_connection(self.target, timeout=10)
        self._up.sendall(self.hello)
        self.got.set()
        self._conn = conn  # kept open: the agent's connection lives on

    def close(self) -> None:
        for s in (self._up, getattr(self, "_conn", None), self.sock):
            if s is not None:
                s.close()


@pytest.mark.timeout(60)
def test_a_replayed_presence_hello_cannot_mark_a_live_node_lost(job: Job, caplog) -> None:
    caplog.set_level(logging.WARNING)
    b = job.chans["b"]
    host, port = job.store.get(b.keys.presence).decode().rsplit(":", 1)
    tap = _Tap((host, int(port)))
    try:
        # node b connects again through the tap (as after a reconnect): its real hello, kept on the way
        conn = T.presence_connect(f"127.0.0.1:{tap.port}", b.signer, "b", timeout=10.0, term=b.term)
        job.conns.append(conn)
        assert tap.got.wait(10)
        job.step()
        # the kept hello sent again on a connection of its own, which is then closed: were it taken, b would
        # count as disconnected, i.e. lost
        with socket.create_connection((host, int(port)), timeout=10) as replay:
            replay.sendall(tap.hello)
            job.until(lambda: "refused a presence connection" in caplog.text, "the replayed hello to be refused")
        for _ in range(5):
            job.step()
        assert job.state("b") == NodeState.ACTIVE
        assert not any(d.cause is not None and d.cause.kind == EventKind.AGENT_LOST for d in job.loop.decisions)
        assert "a replayed message from b" in caplog.text
    finally:
        tap.close()


@pytest.mark.timeout(60)
def test_an_agent_of_another_job_is_refused_and_the_ledger_says_so(job: Job, tmp_path: Path) -> None:
    """The serving side of the refusal (the refused agent's side runs in tests/cluster/test_job_ids.py)."""
    other = T.connect_store("127.0.0.1", job.port, 10.0)
    served = T.claim_job(other, "joby", hosting=False, timeout=10.0)
    assert served == JOB  # the claim does not take the store over
    assert job.store.get(T.JOB_KEY).decode() == JOB
    T.knock(other, "joby", "host:123")
    want = T.refused_line(JOB, "joby", "host:123", "this endpoint")
    job.until(lambda: any(e.kind == EventKind.LOG and e.details.get("message") == want
                          for e in read_events(tmp_path / "run")), "the refusal in the ledger")
    assert "'jobx'" in want and "'joby'" in want
