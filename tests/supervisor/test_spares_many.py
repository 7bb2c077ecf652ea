"""Spares in numbers: more agents than ``--nnodes MAX`` plus ``--spare-nodes``, spares that come and go every few
seconds, and a hundred spares joining at once never stop the job, restart it or change its members.

A real supervisor loop on a real store, and simulated agents speaking the agents' protocol over it (each its own
signed channel and presence connection, as ``bench/fake_fleet.py`` does; they share one store client to keep
the test's sockets few). The loop is stepped by the test. A pass that took longer than the loop's
``pause_after`` would be taken by the loop for its own stall (``loop.pauses``): that is the bound checked on every
pass, with no clock read by the test.
"""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.events.follow import read_events
from resilient.events.ledger import Ledger
from resilient.supervisor import transport as T
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.loop import LoopConfig, SupervisorLoop
from tests._helpers.wait import wait_for
from tests.cluster.conftest import cluster_factory  # noqa: F401 - the fixture is used by name
from tests.cluster.test_node_loss import _listening, node_name

SECRET = b"spares-many-secret-0123456789abcdef"
JOB = "spares"
CHANGING = {"restart", "hot_swap", "scale_down", "scale_up", "stop", "cordon"}


class Fleet:
    """A supervisor loop and simulated agents; ``members`` join first and make the first assignment."""

    def __init__(self, tmp: Path, *, min_nodes: int, max_nodes: int, members: tuple[str, ...]):
        self.store = T.connect_store("127.0.0.1", 0, 10.0, is_master=True)
        assert T.claim_job(self.store, JOB, hosting=True, timeout=10.0) == JOB
        cfg = SupervisorConfig(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=1, max_restarts=5,
                               node_timeout=600.0)  # the simulated agents send no heartbeats
        self.ledger = Ledger(tmp / "run", node="supervisor")
        self.run_dir = tmp / "run"
        self.loop = SupervisorLoop(LoopConfig(core=cfg, last_call=0.0, advertise_addr="127.0.0.1", linger=0.0),
                                   self.store, T.Signer(SECRET, JOB), self.ledger, SupervisorCore(cfg))
        self.client = T.connect_store("127.0.0.1", self.store.port, 10.0)
        self.chans: dict[str, T.AgentChannel] = {}
        self.conns: dict[str, socket.socket] = {}
        self.addr = self.store.get(T.Keys(JOB).presence).decode()
        self.join(members)
        self.until(lambda: self.loop.core.assignment is not None, "the first assignment")

    def join(self, nodes: list[str] | tuple[str, ...], *, arriving: bool = False) -> None:
        """Each node's agent joins as a real one does: (``ARRIVING`` while it warms up,) ``JOIN``, presence."""
        for node in nodes:
            ch = self.chans.get(node)
            if ch is None:
                ch = self.chans[node] = T.AgentChannel(self.client, T.Signer(SECRET, JOB), node)
                ch.sync_term(10.0)
            if arriving:
                ch.send(T.MessageKind.ARRIVING, nproc=1)
            ch.send(T.MessageKind.JOIN, nproc=1, pid=0, host="test")
            self.conns[node] = T.presence_connect(self.addr, ch.signer, node, timeout=10.0, term=ch.term)

    def drop(self, nodes: list[str]) -> None:
        """These agents die: their presence connections close; returns once the supervisor's ends can read it."""
        ends = {n: c for c, n in self.loop.presence._nodes.items()}
        for node in nodes:
            self.conns.pop(node).close()
        for node in nodes:
            r, _, _ = select.select([ends[node]], [], [], 10)
            assert r, f"the close of {node}'s presence connection did not arrive"

    def step(self) -> list:
        return self.loop.step(time.monotonic())

    def until(self, pred, what: str) -> None:
        def once() -> bool:
            self.step()
            return bool(pred())

        wait_for(once, 60, what)

    def queued(self, n: int) -> None:
        wait_for(lambda: self.store.queue_len(T.Keys(JOB).queue) >= n, 30, f"{n} message(s) in the queue")

    def connected(self) -> set[str]:
        return set(self.loop.presence._nodes.values())

    def changes(self) -> list:
        return [d for d in self.loop.decisions if d.action.kind in CHANGING]

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.loop.close()
        self.ledger.close()


def spares(n: int, prefix: str = "s") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


@pytest.mark.timeout(180)
def test_a_hundred_spares_joining_at_once_and_coming_and_going_leave_the_job_alone(tmp_path: Path) -> None:
    # --nnodes 2:2, and 100 agents more than MAX (a --spare-nodes 1 job would expect one)
    f = Fleet(tmp_path, min_nodes=2, max_nodes=2, members=("a", "b"))
    try:
        first = f.loop.core.assignment
        assert first is not None and first.members == ("a", "b")
        many = spares(100)
        f.join(many, arriving=True)  # all at once: 200 messages and 100 connections before the next pass
        f.queued(200)
        f.until(lambda: f.connected() >= {"a", "b", *many}, "every spare's presence")
        view = f.loop.core.view(time.monotonic())
        assert set(view.spares) == set(many)
        assert not f.changes(), [d.action for d in f.changes()]
        # spares that come and go every few seconds: a third of them (the first to join among them), five times
        flappers = many[::3]
        for _ in range(5):
            f.drop(flappers)
            f.until(lambda: not f.connected() & set(flappers), "the flapping spares' departures")
            f.join(flappers)
            f.until(lambda: f.connected() >= set(flappers), "the flapping spares' return")
            f.until(lambda: f.store.queue_len(T.Keys(JOB).queue) == 0, "every JOIN drained")
        assert not f.changes(), [d.action for d in f.changes()]
        a = f.loop.core.assignment
        assert a is first  # the members, their ranks and the round are untouched; no plan was published for them
        assert not f.chans["a"].has_round(1)
        assert f.loop.core.restarts_left == 5
        assert f.loop.pauses == [], f"a pass outlasted pause_after ({f.loop.cfg.pause_after} s): {f.loop.pauses}"
        lost = [e for e in read_events(f.run_dir) if e.kind == EventKind.SPARE_LOST]
        assert len(lost) == 5 * len(flappers)  # each departure is said once, and decides nothing
        # the job still answers a real loss, with a spare that is there now: a member's node lost
        f.drop(["b"])
        f.until(lambda: f.chans["a"].has_round(1), "the plan that replaces b")
        swaps = f.changes()
        assert [d.action.kind for d in swaps] == ["hot_swap"], [d.action for d in swaps]
        new = f.loop.core.assignment
        assert new.round == 1 and new.members[0] == "a" and new.members[1] in f.connected()
        # the spare there the longest without a break takes the place, not one that just came back
        assert new.members[1] == many[1]
    finally:
        f.close()


@pytest.mark.timeout(180)
def test_a_promised_spare_that_leaves_is_replaced_by_one_still_there(tmp_path: Path) -> None:
    # --nnodes 2:3 running on 2: a joining spare is promised to a scale-up at the next checkpoint boundary
    f = Fleet(tmp_path, min_nodes=2, max_nodes=3, members=("a", "b"))
    try:
        many = spares(100)
        f.join(many, arriving=True)
        f.queued(200)
        f.until(lambda: f.connected() >= set(many), "every spare's presence")
        ups = f.changes()
        assert [d.action.kind for d in ups] == ["scale_up"] and all(d.pending for d in ups), ups
        promised = list(ups[0].action.spares)
        assert len(promised) == 1
        # the promised spare goes before the boundary: 99 others still wait
        f.drop(promised)
        f.until(lambda: not f.connected() & set(promised), "the promised spare's departure")
        ev = Event(EventKind.CKPT_TIER_DONE, node="a", rank=0, attempt=0, details={"tier": "local", "step": 10})
        f.chans["a"].send(T.MessageKind.EVENT, event=ev.to_json())
        f.until(lambda: f.chans["a"].has_round(1), "the scale-up's plan at the checkpoint boundary")
        new = f.loop.core.assignment
        assert new.round == 1 and new.members[:2] == ("a", "b") and len(new.members) == 3, new
        assert new.members[2] in f.connected() and new.members[2] not in promised, new.members
        assert [d.action.kind for d in f.changes() if not d.pending] == ["scale_up"]
        assert f.loop.pauses == []
    finally:
        f.close()


@pytest.mark.timeout(300)
def test_real_agents_beyond_max_and_spares_and_one_that_comes_and_goes(cluster_factory, tmp_path: Path) -> None:
    """Real agents: a 2-node job with --spare-nodes 1, and two agents more than its two members (one more than
    the spares it expects); one of them is SIGKILLed whole and started again while the job trains. The job
    never restarts, finishes, and every agent ends as it did."""
    c = cluster_factory("2", nproc=2, flags=["--spare-nodes", "1", "--node-timeout", "20",
                                             "--heartbeat-timeout", "300"])  # the gate is a wait, not a hang
    out, gate = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate.mkdir()
    args = ["--out", str(out), "--steps", "4", "--gate", str(gate), "--gate-step", "2"]
    a = c.start("a", args)
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 90, "the first agent to host the store")
    b = c.start("b", args)
    wait_for(lambda: len(list(gate.glob("at-*"))) == 4 or a.proc.poll() is not None, 120, "the job at its gate")
    assert a.proc.poll() is None, a.output()

    def joined(n) -> bool:
        return any(e.kind == EventKind.NODE_JOINED and e.node == node_name(n) for e in c.events())

    def spare_lost(n) -> bool:
        return any(e.kind == EventKind.SPARE_LOST and e.node == node_name(n) for e in c.events())

    extra = [c.start("s1", args), c.start("s2", args)]
    flapper = extra[-1]
    wait_for(lambda: all(joined(n) or n.proc.poll() is not None for n in extra), 120, "the extra agents' joins")
    assert flapper.proc.poll() is None, flapper.output()
    flapper.kill()
    wait_for(lambda: spare_lost(flapper) or a.proc.poll() is not None, 60, "the flapping spare's loss")
    flapper = c.start("s2-again", args)
    wait_for(lambda: joined(flapper) or flapper.proc.poll() is not None, 180, "the flapping spare's return")
    assert a.proc.poll() is None and b.proc.poll() is None, a.output()

    (gate / "go").write_text("")
    staying = [a, b, extra[0], flapper]
    wait_for(lambda: all(n.proc.poll() is not None for n in staying), 120, "every agent to exit")
    for n in staying:
        assert n.proc.returncode == 0, (n.name, n.output())
    evs = c.events()
    acts = [e.details["action"] for e in evs if e.kind == EventKind.ACTION]
    assert set(acts) <= {"start", "ignore"}, acts  # no restart, swap, scale or stop because of the spares
    assert sum(e.kind == EventKind.SPARE_LOST for e in evs) == 1
    assert all((out / f"rank{r}.pt").exists() for r in range(4))
    wait_for(lambda: not c.leftovers(), 30, "no process of the job left")


def test_a_joining_spare_that_leaves_is_not_waited_for() -> None:
    # the decision core alone: a member lost with no ready spare waits (--spare-wait) for the one joining; that
    # one leaving before it joined ends the wait at once, rather than after spare_wait
    cfg = SupervisorConfig(min_nodes=2, max_nodes=2, nproc_per_node=1, max_restarts=5, spare_wait=60.0)
    core = SupervisorCore(cfg)
    for n in ("a", "b"):
        core.join(n, 1, 0.0)
    core.form(0.0)
    core.arriving("c", 1.0)
    (wait,) = core.handle(Event(EventKind.AGENT_LOST, node="b", details={"reason": "disconnected"}), 2.0)
    assert wait.action.kind == "ignore" and "c" in wait.action.reason
    out = core.handle(Event(EventKind.AGENT_LOST, node="c", details={"reason": "left"}), 3.0)
    assert [d.action.kind for d in out] == ["stop"], out
    assert core.view(3.0).joining == ()


def test_spares_that_come_and_go_for_hours_do_not_grow_the_view() -> None:
    # every start of an agent is a new node name (host:pid): a spare restarted every few seconds for hours would
    # otherwise leave thousands of lost nodes in every view, and every decision would walk them
    cfg = SupervisorConfig(min_nodes=2, max_nodes=2, nproc_per_node=1, max_restarts=5, failure_window=60.0,
                           node_timeout=10.0)
    core = SupervisorCore(cfg)
    for n in ("a", "b"):
        core.join(n, 1, 0.0)
    core.form(0.0)
    t = 0.0
    for i in range(2000):  # one spare start every 5 s, each gone 3 s later
        t += 5.0
        for m in ("a", "b"):
            core.seen(m, t)
        assert [d.action.kind for d in core.join(f"spare:{i}", 1, t)] == ["ignore"]
        core.handle(Event(EventKind.AGENT_LOST, node=f"spare:{i}", details={"reason": "disconnected"}), t + 3.0)
        assert not [d for d in core.tick(t + 3.0) if d.action.kind != "ignore"]
    view = core.view(t + 3.0)
    assert view.members == ("a", "b") and core.assignment.round == 0
    # what stays is what the failure window can still speak of: the last minute's departures, not the 2,000
    assert len(view.nodes) <= 2 + 60.0 / 5.0 + 1, len(view.nodes)
