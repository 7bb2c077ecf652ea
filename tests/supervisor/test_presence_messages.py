"""Agents' messages over their presence connection: real sockets, a real Signer, a real TCPStore.

What is refused there (forged, another term, replayed, another node's, a line sealed for the store queue, a
stranger without a hello), what is refused across paths (a line taken off the wire and pushed into the queue), and
what a decision costs the supervisor in store round trips at 100 agents: a constant over presence, one per message
over the store queue (the fallback path, which still carries a decision through)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger
from resilient.supervisor import transport as T
from resilient.supervisor import wire
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.loop import LoopConfig, SupervisorLoop, _newest_heartbeats
from tests._helpers.wait import wait_for

SECRET = b"presence-messages-secret-0123456789"
JOB = "presence"
TERM = 7


def _line(signer: T.Signer, **body) -> bytes:
    return signer.seal_line({"type": T.MessageKind.HB, "node": "a", "term": TERM, "via": wire.VIA_PRESENCE, **body})


class Server:
    """A presence server of term ``TERM`` and one agent connected to it with a valid hello."""

    def __init__(self) -> None:
        self.signer = T.Signer(SECRET, JOB)
        self.srv = T.PresenceServer(self.signer, term=TERM)
        self.conn = T.presence_connect(f"127.0.0.1:{self.srv.port}", self.signer, "a", timeout=10.0, term=TERM)
        wait_for(lambda: self.srv.poll()[0] == ["a"], 10, "the hello of a")

    def took(self, raw: bytes, conn: socket.socket | None = None) -> list[dict]:
        """Write ``raw`` and a newline on ``conn`` and return what the server took once it read the line."""
        conn = conn or self.conn
        refused = self.srv.refused
        conn.sendall(raw + b"\n")

        def read() -> list[dict] | None:
            self.srv.poll()
            got = self.srv.messages()
            return [got] if got or self.srv.refused > refused else None

        return wait_for(read, 10, "the server to read the line")[0]

    def close(self) -> None:
        self.conn.close()
        self.srv.close()


def test_presence_refuses_forged_other_term_replayed_and_misaddressed_lines() -> None:
    s = Server()
    try:
        good = _line(s.signer, seq_hint=1)
        assert [m["type"] for m in s.took(good)] == [T.MessageKind.HB]
        assert s.took(good) == [] and s.srv.refused == 1  # the same bytes again: a replay
        assert s.took(_line(T.Signer(b"another-secret-0123456789abcdef", JOB))) == []  # forged
        assert s.took(_line(s.signer, term=TERM - 1)) == []  # an older supervisor's term
        assert s.took(_line(s.signer, node="b")) == []  # another node's message on a's connection
        no_via = s.signer.seal_line({"type": T.MessageKind.HB, "node": "a", "term": TERM})
        assert s.took(no_via) == []  # not sealed for this path
        queue_format = s.signer.seal({"type": T.MessageKind.HB, "node": "a", "term": TERM, "via": wire.VIA_PRESENCE})
        assert s.took(queue_format) == []  # the store queue's framing
        assert s.srv.refused == 6
        assert [m["node"] for m in s.took(_line(s.signer))] == ["a"]  # a fresh one still goes through

        # a stranger's connection without a hello: its lines count for nothing, and it is closed
        stranger = socket.create_connection(("127.0.0.1", s.srv.port), timeout=10)
        try:
            stranger.sendall(_line(s.signer) + b"\n")

            def closed() -> bool:
                s.srv.poll()
                return bool(select.select([stranger], [], [], 0)[0]) and stranger.recv(4096) == b""

            wait_for(closed, 10, "the server to close the stranger's connection")
            assert s.srv.messages() == [] and list(s.srv._nodes.values()) == ["a"]
        finally:
            stranger.close()
    finally:
        s.close()


def test_lines_are_framed_across_reads_and_an_overlong_one_is_dropped_whole() -> None:
    buf = wire.LineBuffer(max_line=8)
    assert buf.feed(b"ab") == [] and buf.feed(b"c\nde") == [b"abc"]
    assert buf.feed(b"fghijklmn") == [] and buf.dropped == 1  # no end yet, past the bound
    assert buf.feed(b"opq\nrs\n") == [b"rs"]  # the rest of the long line is dropped, the next one read


def test_a_presence_line_pushed_into_the_store_queue_is_refused() -> None:
    signer = T.Signer(SECRET, JOB)
    store = T.connect_store("127.0.0.1", 0, 10.0, is_master=True)
    chan = T.SupervisorChannel(store, signer, term=TERM)
    store.queue_push(chan.keys.queue, _line(signer))
    # sealed for presence in the queue's framing (a line re-wrapped by someone holding no secret cannot be made)
    store.queue_push(chan.keys.queue, signer.seal({"type": T.MessageKind.HB, "node": "a", "term": TERM,
                                                   "via": wire.VIA_PRESENCE}))
    assert chan.drain() == [] and chan.refused == 2


def test_only_each_nodes_newest_heartbeat_is_kept() -> None:
    hb = T.MessageKind.HB
    msgs = [{"type": hb, "node": "a", "seq": 1}, {"type": T.MessageKind.ACK, "node": "a", "seq": 2},
            {"type": hb, "node": "b", "seq": 3}, {"type": hb, "node": "a", "seq": 4}]
    assert [m["seq"] for m in _newest_heartbeats(msgs)] == [2, 3, 4]


class Counted:
    """The real store, with its calls counted (the supervisor's round trips)."""

    def __init__(self, store) -> None:
        self._store, self.calls = store, 0

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*a, **kw):
            self.calls += 1
            return attr(*a, **kw)

        return call


AGENTS = 100


@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["presence", "store"])
def test_a_decision_costs_store_round_trips_by_path(tmp_path: Path, via: str) -> None:
    """A worker exit decided and the new round acknowledged by all 100 agents: over presence a handful of store
    calls (the report, the two passes' queue checks, the plan and its pointer), over the store queue (the fallback,
    and every message's path before) at least one per acknowledgement, and the decision still goes through."""
    real = T.connect_store("127.0.0.1", 0, 10.0, is_master=True)
    assert T.claim_job(real, JOB, hosting=True, timeout=10.0) == JOB
    store = Counted(real)
    cfg = SupervisorConfig(min_nodes=AGENTS, max_nodes=AGENTS, nproc_per_node=1, max_restarts=5, node_timeout=600.0)
    ledger = Ledger(tmp_path / "run", node="supervisor")
    loop = SupervisorLoop(LoopConfig(core=cfg, last_call=0.0, advertise_addr="127.0.0.1", linger=0.0),
                          store, T.Signer(SECRET, JOB), ledger, SupervisorCore(cfg))
    client = T.connect_store("127.0.0.1", real.port, 10.0)
    addr = real.get(T.Keys(JOB).presence).decode()
    names = [f"n{i:03d}" for i in range(AGENTS)]
    chans: dict[str, T.AgentChannel] = {}
    conns: list[socket.socket] = []
    try:
        for node in names:
            ch = chans[node] = T.AgentChannel(client, T.Signer(SECRET, JOB), node)
            ch.sync_term(10.0)
            ch.send(T.MessageKind.JOIN, nproc=1, pid=0, host="test")
            conns.append(T.presence_connect(addr, ch.signer, node, timeout=10.0, term=ch.term))
            if via == "presence":
                ch.attach(conns[-1])

        def until(pred, what: str) -> None:
            wait_for(lambda: (loop.step(time.monotonic()), pred())[1], 60, what)

        until(lambda: loop.core.assignment is not None and len(loop.presence._nodes) == AGENTS, "the first round")
        first = loop.core.assignment.round
        for ch in chans.values():
            ch.send(T.MessageKind.ACK, round=first)
        until(lambda: len(loop._acks.get(first, ())) == AGENTS, "every agent's acknowledgement")

        def arrived(n: int) -> None:
            """The messages just sent can be read by the next pass (the queue holds them, or every agent's socket
            at the supervisor's end is readable)."""
            if via == "store":
                wait_for(lambda: real.queue_len(T.Keys(JOB).queue) >= n, 10, f"{n} message(s) queued")
                return
            for end in list(loop.presence._nodes):
                assert select.select([end], [], [], 10)[0], "a message did not arrive"

        victim = chans[names[0]]
        ev = Event(EventKind.WORKER_EXIT, node=names[0], rank=0, attempt=first,
                   details={"pid": 0, "exit_code": 1, "signal": None, "local_rank": 0, "detect_seconds": 0.0})
        victim.send(T.MessageKind.EVENT, event=ev.to_json())  # a report goes through the queue on either path
        wait_for(lambda: real.queue_len(T.Keys(JOB).queue) >= 1, 10, "the report queued")
        store.calls = 0
        loop.step(time.monotonic())  # the decision
        second = loop.core.assignment.round
        assert second > first, [d.action for d in loop.decisions]
        for ch in chans.values():
            ch.send(T.MessageKind.ACK, round=second)
        arrived(AGENTS)
        loop.step(time.monotonic())  # the acknowledgements
        assert len(loop._acks.get(second, ())) == AGENTS
        if via == "presence":
            assert store.calls <= 10, store.calls  # O(1): not one per node
        else:
            assert store.calls >= AGENTS, store.calls  # one round trip per message
    finally:
        for c in conns:
            c.close()
        loop.close()
        ledger.close()
