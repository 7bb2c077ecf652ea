"""The supervisor's control loop: the only part that executes decisions.

It drains the agents' messages, folds them into :class:`~resilient.supervisor.core.SupervisorCore` (which
decides, purely), and carries decisions out by publishing assignments: a new round with its members, their
group ranks, a fresh per-round TCPStore for the workers (hosted here, so no training node is special when
this loop runs on its own host), or a stop. Agents execute and acknowledge.

It runs as a thread inside the agent that hosts the rendezvous store (the default), or as its own process
(``resilient supervisor``, see :mod:`resilient.supervisor.cli`).

Never two supervisors: it carries decisions out only while it accounts for a majority of the nodes of the last
assignment it published (:mod:`.quorum`); without one it holds them (recorded once it has one again). A loop run by
an agent (plans with a succession) that had a majority and lost it stands down for good: the majority's side may
have a successor by then, and whatever reaches this loop afterwards (a heartbeat sent before the cut and delivered
after the heal) must not make it act again. Its agent stops its workers and leaves (see ``control.Superseded``).
A standalone supervisor has no successor: it holds its decisions until it accounts for a majority again.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger
from resilient.supervisor.api import NodeState
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import Assignment, Decision, SupervisorCore
from resilient.supervisor.quorum import Count, Quorum, Reach, reach
from resilient.logs import RateLimitedLog
from resilient.supervisor.transport import (
    MessageKind, PresenceServer, Signer, SupervisorChannel, connect_store, refused_line,
)

logger = logging.getLogger(__name__)

# A node's detector events that an agent forwards for a decision; the rest stay in the node's ledger. (Worker
# exits are reported by the agent itself; checkpoint boundaries are forwarded from the node's ledger files by its
# agent, see resilient.launcher.forward: this loop reads no ledger.)
FORWARDED = frozenset({
    EventKind.HANG, EventKind.STRAGGLER, EventKind.HOST_UNHEALTHY, EventKind.GPU_UNHEALTHY,
    EventKind.PREEMPTION_NOTICE,
})


@dataclass
class LoopConfig:
    """How the loop runs; what it decides is in :class:`SupervisorConfig`."""

    core: SupervisorConfig
    #: host name or address the agents' workers use to reach the per-round stores hosted here
    advertise_addr: str = "127.0.0.1"
    #: seconds between two passes (message drain, timers); the latency floor of every decision
    tick: float = 0.05
    #: once ``--nnodes`` MIN have joined, wait this long for more (up to MAX) before the first assignment
    last_call: float = 1.0
    #: seconds from this loop's start for ``--nnodes`` MIN nodes to join before the job's first start; then the job
    #: stops with an error that says who is missing (torchrun's rendezvous ``join_timeout``, same default): a job
    #: whose nodes never all arrive must not hold its allocation silently forever
    join_timeout: float = 600.0
    #: seconds between the lines that say the job is still forming (the first after this long too): a node that
    #: waits for its peers must not look hung for the whole ``join_timeout``
    say_forming_every: float = 15.0
    #: bound on every store call of the loop
    store_timeout: float = 30.0
    #: seconds the loop keeps serving after the job ended, for agents to read the final plan
    linger: float = 10.0
    #: a gap between two passes longer than this is the loop's own stall (its process stopped, its host frozen,
    #: a swap storm), not the nodes' silence: every node then gets a fresh ``node_timeout`` before it can count
    #: as lost. Far above a pass's normal length (``tick`` plus bounded store and policy calls under load)
    pause_after: float = 2.0
    name: str = field(default_factory=lambda: f"supervisor@{socket.gethostname()}")
    #: the agent whose thread this loop is (the default set-up), None for ``resilient supervisor``: plans then
    #: carry the succession (who takes over if that agent's node is lost, see :mod:`resilient.launcher.succession`)
    host_node: str | None = None
    #: the term this loop must exceed: a successor's term is above every term it saw
    min_term: int = 0

    def __post_init__(self) -> None:
        for f in ("tick", "last_call", "join_timeout", "say_forming_every", "store_timeout", "linger", "pause_after"):
            v = getattr(self, f)
            if not (v == v and 0 <= v < float("inf")):
                raise ValueError(f"LoopConfig.{f} must be a finite number >= 0, got {v}")
        if self.tick <= 0 or self.join_timeout <= 0 or self.say_forming_every <= 0:
            raise ValueError(f"LoopConfig.tick, join_timeout and say_forming_every must be > 0, got {self.tick}, "
                             f"{self.join_timeout} and {self.say_forming_every}")
        if self.pause_after <= self.tick:
            raise ValueError(f"LoopConfig.pause_after ({self.pause_after}) must be longer than tick ({self.tick})")


# reports remembered for telling a repeat: far more than an agent re-sends after one loss of the store (those pushed
# between two of its store calls, a second or so of reports)
_TAKEN_KEPT = 4096


def _newest_heartbeats(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``msgs`` in order, less every heartbeat of a node but its newest (a heartbeat only says the node was heard:
    a backlog after a stall costs one per node)."""
    last = {m.get("node"): i for i, m in enumerate(msgs) if m.get("type") == MessageKind.HB}
    if len(last) == sum(1 for m in msgs if m.get("type") == MessageKind.HB):
        return msgs
    return [m for i, m in enumerate(msgs) if m.get("type") != MessageKind.HB or last[m.get("node")] == i]


class SupervisorLoop:
    def __init__(self, cfg: LoopConfig, store: Any, signer: Signer, ledger: Ledger | None,
                 core: SupervisorCore):
        self.cfg, self.core, self.ledger = cfg, core, ledger
        # a new term per supervisor start: what agents sent to an earlier one is not taken by this one
        self.term = max(time.time_ns() // 1_000_000, cfg.min_term + 1)
        self.chan = SupervisorChannel(store, signer, term=self.term)
        self.chan.announce()
        self.presence = PresenceServer(signer, term=self.term)
        self._refused_log = RateLimitedLog(logger)
        self._refused_seen: set[tuple[str, str]] = set()  # (job, node) already in the ledger
        self._refusals_due = 0.0
        store.set(self.chan.keys.presence, f"{cfg.advertise_addr}:{self.presence.port}")
        self._round_stores: dict[int, Any] = {}
        self._spare_store: Any = None  # the next round's store, made ahead of time
        self._spare_lock = threading.Lock()
        self._done: set[str] = set()
        # the newest reports taken, by identity: an agent tells again the reports no store answer confirmed (it
        # cannot know whether a push reached a supervisor that stalled, or died, meanwhile), so one may come twice
        self._taken: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        self._acks: dict[int, set[str]] = {}
        self._final_round: int | None = None
        self._final_at: float | None = None
        self._arrived: set[str] = set()  # agents that said they are arriving and have not joined (or left) yet
        self._passes = 0  # passes begun: the door closes in one, the job settles in a later one (a drain between)
        self._door_pass: int | None = None  # the pass that closed the door (see SupervisorChannel.close_door)
        self._door_at = 0.0  # when (monotonic): arriving agents are waited for a short while after it
        self._preempted_end = False  # the final plan says preempted
        self._published: int | None = None  # the newest round whose plan agents can read
        self._born = time.monotonic()  # join_timeout counts from here
        self._say_forming_at = self._born + cfg.say_forming_every  # the next "still forming" line
        self._last_pass: float | None = None  # monotonic time of the last pass: a long gap is this loop's stall
        # node -> addr:port of the store it keeps bound to take over (its JOIN says it; a successor seeds it from
        # the plan it took over from): the succession order of every plan (default set-up only)
        self._standby: dict[str, str] = {}
        self._id_floor = 0  # the newest decision id of the supervisor this one took over from
        self._succession_said: dict[str, Any] | None = None  # the body last written under Keys.succession
        self.pauses: list[float] = []  # the gaps taken for this loop's own stalls, oldest first
        # half the node timeout: the nodes beyond a partition fall silent together (within a heartbeat), so the
        # majority is gone before the first of them counts as lost, and no decision is taken on a partition's silence
        self.quorum = Quorum(cfg.core.node_timeout / 2, cfg.host_node)
        self.held: list[Decision] = []  # decided without a majority: carried out once there is one again
        self._cut_off_since: float | None = None  # when this loop last lost its majority (None: it has one)
        self._had_majority = False
        self._grace_until = 0.0  # after this loop's own stall, nodes get a node timeout to be heard from again
        self._quorum_due = 0.0  # the next pass that counts even without a decision to carry out
        #: monotonic time this loop stood down for good (agent-hosted only), None while it may act
        self.stood_down_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.decisions: list[Decision] = []
        self.started: float | None = None  # wall time of the first round: the drills' clock on every node
        self.finished = threading.Event()  # the final plan is published
        self.settled = threading.Event()  # every live agent acknowledged it
        self._lock = threading.Lock()
        self.result: str | None = None  # "succeeded" or the stop reason

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="resilient-supervisor", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            self._round_stores.clear()
            with self._spare_lock:
                self._spare_store = None
            self.presence.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(time.monotonic())
            except Exception:  # noqa: BLE001 - fail static: a loop bug must not take the job down
                logger.exception("supervisor pass failed; going on")
            if self.settled.is_set() or (self._final_at is not None
                                         and time.monotonic() - self._final_at > self.cfg.linger):
                break
            self._stop.wait(self.cfg.tick)

    # ------------------------------------------------------------------ one pass
    def step(self, now: float) -> list[Decision]:
        """One pass. Thread-safe: the hosting agent calls it right after reporting a fault, so an in-process
        decision costs no polling period."""
        with self._lock:
            return self._step(now)

    def _step(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        if self._last_pass is not None and now - self._last_pass > self.cfg.pause_after:
            self._woke(now, now - self._last_pass)
        self._last_pass = max(now, self._last_pass or now)
        self._passes += 1
        hello, gone = self.presence.poll()
        for node in hello:
            self.core.seen(node, now)
            self.quorum.heard(node, now)
        for msg in self.chan.drain():
            out += self._on_message(msg, now)
        # after the queue: an agent's join went there before its presence connection was opened
        for msg in _newest_heartbeats(self.presence.messages()):
            out += self._on_message(msg, now)
        if now >= self._refusals_due:
            # a store round trip for a log line: once a second, not once a pass
            self._refusals_due = now + 1.0
            self._log_refusals()
        if self.cfg.host_node is None and hello and self._cut_off_since is None and self.quorum.nodes:
            # a standalone supervisor's plans name no spares between rounds: those that joined count from their hello
            view = self.core.view(now)
            self.quorum.grow([n for n in hello if (v := view.nodes.get(n)) is not None and v.state is NodeState.SPARE])
        # members that reported done in this pass's messages end the job before any timer is looked at: a
        # finished job is never failed by a loss or a silence noticed after the fact. Not when their done decided a
        # new round (a preempted node's agreed save carried out as a swap or scale-down): the job goes on in it
        if not any(d.assignment is not None for d in out):
            self._check_finished(now)
        for node in gone:
            # its kernel closed the connection: the agent is dead (or left; a LEAVE came first then)
            logger.warning("node %s disconnected", node)
            self._confirm_gone(node)
            out += self.core.handle(Event(EventKind.AGENT_LOST, node=node, details={"reason": "disconnected"}), now)
        out += self.core.tick(now)
        if self.core.assignment is None and self.core.stopped is None and self.core.ready(now, self.cfg.last_call):
            a = self.core.form(now)
            # recorded like any decision: a restarted supervisor adopts the newest assignment of the ledger
            self._write(Event(EventKind.ACTION, node=self.cfg.name, attempt=a.attempt,
                              details={"action": "start", "reason": f"{len(a.members)} node(s) joined", "id": 0,
                                       "round": a.round, "assignment": a.to_json()}))
            self._publish(a, action={"action": "start"}, decision_id=0)
        elif self.core.assignment is None and self.core.stopped is None and now - self._born > self.cfg.join_timeout:
            out += self.core.give_up_forming(self.cfg.join_timeout, now)
        elif self.core.assignment is None and self.core.stopped is None and now >= self._say_forming_at:
            self._say_forming(now)
        self._carry_out_pass(out, now)
        self._check_finished(now)
        if self.cfg.host_node is not None and (hello or gone or out or self._succession_said is None):
            self._say_succession(now)
        return out

    def _confirm_gone(self, node: str) -> None:
        """A node's presence connection closed: it counts as dead for the majority only when the store it keeps
        bound refuses connections (an agent that moved to a successor closes its old connection too)."""
        addr = self._standby.get(node)
        if addr is None:
            self.quorum.dead(node)  # no standby to ask (one node on its own, a test's agent): as before
            return
        r = reach(addr, timeout=0.5)
        if r is Reach.REFUSED:
            self.quorum.dead(node)
        else:
            logger.warning("node %s closed its connection but its standby store at %s %s: not counted as dead",
                           node, addr, "answers (the agent lives on elsewhere)" if r is Reach.ACCEPTS
                           else "does not answer")

    def candidates(self) -> list[tuple[str, str]]:
        """(node, address of the store it keeps bound) of every node that may have taken this loop's job over."""
        with self._lock:
            return [(n, addr) for n, addr in self._standby.items() if n != self.cfg.host_node]

    def cut_off_for(self, now: float) -> float:
        """Seconds this loop has been without a majority (0 while it has one)."""
        return 0.0 if self._cut_off_since is None else max(0.0, now - self._cut_off_since)

    def _may_act(self, now: float) -> bool:
        """Whether this pass may carry decisions out; notes the transitions (one ledger line each)."""
        if self.stood_down_at is not None:
            return False
        self._quorum_due = now + self.quorum.window / 4
        count = self.quorum.count(now)
        if count.majority:
            if self._cut_off_since is not None and count.nodes:
                self._say_quorum(f"the supervisor accounts for a majority again: {count.describe()}", count)
            self._cut_off_since = None
            self._had_majority = self._had_majority or bool(count.nodes)
            return True
        if self._cut_off_since is None:
            self._cut_off_since = now
            self._say_quorum(f"the supervisor cannot account for a majority of the job's nodes: {count.describe()}; "
                             "it holds its decisions", count)
        # for good only once the missing nodes were silent a whole node timeout (the window, then as long again):
        # about when the agents beyond a partition start a succession; a shorter stall of theirs only holds decisions
        if (self.cfg.host_node is not None and self._had_majority and now >= self._grace_until
                and now - self._cut_off_since >= self.quorum.window):
            self.stood_down_at = now
            self._say_quorum(f"the supervisor on {self.cfg.host_node} (term {self.term}) stands down for good: it "
                             f"lost the majority of the job's nodes ({count.describe()}), which may have a successor "
                             "now; this node stops its workers", count, stood_down=True)
        return False

    def _say_quorum(self, msg: str, count: Count, stood_down: bool = False) -> None:
        logger.warning("%s", msg)
        self._write(Event(EventKind.LOG, node=self.cfg.name, details={
            "message": msg, "quorum": {"nodes": list(count.nodes), "accounted": list(count.accounted),
                                       "majority": count.majority, "term": self.term,
                                       **({"stood_down": True} if stood_down else {})}}))

    def _say_succession(self, now: float) -> None:
        """Keep ``Keys.succession`` current between plans (only when it changed: it is O(nodes) to build)."""
        a = self.core.assignment
        if a is None or self._published is None or self._final_round is not None or self.stood_down_at is not None:
            return
        body = self._succession(a, now)
        if body == self._succession_said:
            return
        try:
            self.chan.store.set(self.chan.keys.succession,
                                self.chan.signer.seal({**body, "round": self._published, "term": self.term}))
            self._succession_said = body
            if self._cut_off_since is None and self.stood_down_at is None:
                self.quorum.grow(body["spares"])  # spares that joined since the round count from now on
        except Exception as e:  # noqa: BLE001 - said again in a later pass
            logger.debug("could not write the succession: %s", e)

    def _on_message(self, msg: dict[str, Any], now: float) -> list[Decision]:
        kind, node = msg.get("type"), msg.get("node")
        if not isinstance(node, str):
            return []
        if kind == MessageKind.LEAVE:
            self.quorum.dead(node)  # it said so itself: accounted for
        else:
            self.quorum.heard(node, now)
        if kind in (MessageKind.JOIN, MessageKind.LEAVE):
            self._arrived.discard(node)
        if kind == MessageKind.JOIN:
            nproc = int(msg.get("nproc", 1))
            if isinstance(msg.get("standby"), str):
                self._standby[node] = msg["standby"]
            logger.info("node %s %s (%d workers)", node, "joined again" if msg.get("rejoin") else "joined", nproc)
            rank = msg.get("node_rank")
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
                logger.warning("node %s sent a bad node_rank %r: ordered by when it joined", node, rank)
                rank = None
            out = self.core.join(node, nproc, now, node_rank=rank)
            a = self.core.assignment
            if msg.get("done") and a is not None and msg.get("round") == a.round:
                self._done.add(node)  # its workers finished while this supervisor was away
            return out
        if kind == MessageKind.ARRIVING:
            logger.info("node %s connected, warming up", node)
            self._arrived.add(node)
            self.core.arriving(node, now)
            for ev in self.core.take_notes():
                self._write(ev)
            return []
        self.core.seen(node, now)
        if kind == MessageKind.EVENT:
            try:
                ev = Event.from_json(msg["event"])
            except (KeyError, ValueError, TypeError) as e:
                logger.warning("unreadable event from %s: %s", node, e)
                return []
            key = (ev.kind, ev.node, ev.rank, ev.attempt, ev.wall, ev.mono)
            if key in self._taken:
                logger.info("a report from %s told again (%s of rank %s): taken once", node, ev.kind.value, ev.rank)
                return []
            self._taken[key] = None
            if len(self._taken) > _TAKEN_KEPT:
                self._taken.popitem(last=False)
            return self.core.handle(ev, now)
        if kind == MessageKind.ACK:
            self._acks.setdefault(int(msg.get("round", -1)), set()).add(node)
            self.quorum.acked(node, int(msg.get("round", -1)))
        elif kind == MessageKind.DONE:
            a = self.core.assignment
            if a is not None and int(msg.get("round", -1)) == a.round:
                self._done.add(node)
                return self.core.done(node, now)  # a pending preemption waits for the members' agreed save
        elif kind == MessageKind.LEAVE:
            logger.info("node %s left: %s", node, msg.get("reason"))
            return self.core.handle(Event(EventKind.AGENT_LOST, node=node, details={"reason": "left"}), now)
        return []

    def _log_refusals(self) -> None:
        """Agents of another job refused at this endpoint: one line each (rate-limited), and once per agent in
        the ledger (bounded: what they send is unsigned)."""
        for r in self.chan.refusals():
            line = refused_line(self.chan.keys.job, r["job"], r["node"], "this endpoint")
            self._refused_log.warning("%s", line, key=("refused", r["job"]))
            if (r["job"], r["node"]) not in self._refused_seen and len(self._refused_seen) < 100:
                self._refused_seen.add((r["job"], r["node"]))
                self._write(Event(EventKind.LOG, node=self.cfg.name,
                                  details={"message": line, "refused_job": r["job"], "refused_node": r["node"]}))

    def _carry_out(self, d: Decision, superseded_by: int | None = None) -> None:
        """Record a decision and carry it out. Once the final plan is out (the job ended), or when a stop of the
        same pass supersedes it (``superseded_by``: that stop's id), a new round is recorded, not published:
        agents must never read a restart next to the stop, nor a round after the final plan."""
        self.decisions.append(d)
        if d.cause is not None and d.cause.kind in (EventKind.AGENT_LOST, EventKind.NODE_JOINED):
            self._write(d.cause)  # synthesised here: no agent wrote it
        ev = d.to_event(self.cfg.name)
        ended = self._final_round is not None
        if d.assignment is not None and (superseded_by is not None or ended):
            ev.details["superseded_by"] = "final_plan" if ended and superseded_by is None else superseded_by
        self._write(ev)
        logger.log(logging.INFO if d.action.kind == "ignore" else logging.WARNING, "supervisor: %s (%s)", d.action.kind, d.action.reason or next(iter((d.fallback or "").strip().splitlines()[-1:]), ""))
        if self.core.stopped is not None and self._final_round is None:
            if superseded_by is None or superseded_by == d.id:
                self._finish(self.core.stopped, stop=True, decision_id=d.id)
        elif d.assignment is not None and not ended and superseded_by is None:
            self._publish(d.assignment, action=d.action.to_json(), decision_id=d.id)
        elif d.assignment is not None:
            logger.warning("supervisor: round %d of decision %d not published (%s)", d.assignment.round, d.id,
                           "the job already ended" if ended else f"decision {superseded_by} stops the job")

    def _say_forming(self, now: float) -> None:
        view = self.core.view(now)
        self._say_forming_at = now + self.cfg.say_forming_every
        came = ", ".join(view.nodes) or "none"
        logger.warning("the job is forming: %d of --nnodes MIN %d node(s) joined in %.0f s (%s); waiting for the rest "
                       "up to the rendezvous join_timeout (%.0f s left), then the job stops", len(view.nodes),
                       view.min_nodes, now - self._born, came, max(0.0, self.cfg.join_timeout - (now - self._born)))

    def _woke(self, now: float, gap: float) -> None:
        """This loop did not run for ``gap`` seconds (its process was stopped, its host froze): the nodes' silence
        meanwhile is its own. Every node in the job gets a fresh ``node_timeout`` to be heard from before it can
        count as lost; nodes that really died meanwhile are still lost at once, by their closed presence
        connections, read in this same pass."""
        self.pauses.append(gap)
        self._grace_until = now + self.cfg.core.node_timeout  # the silence is this loop's: no standing down for it
        view = self.core.view(now)
        fresh = [n for n, v in view.nodes.items() if v.state in (NodeState.ACTIVE, NodeState.SPARE)]
        for n in fresh:
            self.core.seen(n, now)
        msg = (f"the supervisor did not run for {gap:.1f} s (its own stall): {len(fresh)} node(s) get a fresh "
               f"{self.cfg.core.node_timeout:g} s (--node-timeout) before any counts as silent")
        logger.warning("%s", msg)
        self._write(Event(EventKind.LOG, node=self.cfg.name, details={"message": msg,
                                                                      "supervisor_paused": round(gap, 3)}))

    def _write(self, ev: Event) -> None:
        if self.ledger is not None:
            self.ledger.write(ev)

    def resume(self, events: list[Event], now: float) -> Assignment | None:
        """After a restart of the supervisor: adopt the ledger's newest assignment and publish it again for
        agents that join from now on. Agents already in that round see nothing new and keep training."""
        with self._lock:
            first = next((e for e in events if e.kind == EventKind.ACTION and e.details.get("action") == "start"), None)
            self.started = first.wall if first is not None else None
            a = self.core.resume(events, now)
            if a is not None:
                logger.warning("supervisor resumed at round %d: members %s, spares %s", a.round, list(a.members),
                               list(a.spares))
                self._publish(a, action={"action": "resume"}, decision_id=0)
            return a

    # ------------------------------------------------------------------ plans
    def _prepare_store(self) -> None:
        """Make the next round's store ahead of time, off the decision path: creating a TCPStore can stall for
        seconds (torch resolves host names; without a DNS answer the resolver's timeout runs out)."""
        try:
            store = connect_store("0.0.0.0", 0, self.cfg.store_timeout, is_master=True)
        except Exception as e:  # noqa: BLE001 - the decision path makes one itself then
            logger.warning("could not prepare the next round's store: %s", e)
            return
        with self._spare_lock:
            self._spare_store = store

    def _round_store(self, round_: int) -> tuple[str, int]:
        """A fresh store per round: nothing of an earlier attempt can reach a new one (pytorch#135712)."""
        with self._spare_lock:
            store, self._spare_store = self._spare_store, None
        if store is None:
            store = connect_store("0.0.0.0", 0, self.cfg.store_timeout, is_master=True)
        if not self._stop.is_set():
            threading.Thread(target=self._prepare_store, name="resilient-next-store", daemon=True).start()
        self._round_stores[round_] = store
        for r in [r for r in self._round_stores if r < round_ - 1]:
            del self._round_stores[r]  # the one before stays: its workers may still be tearing down
        return self.cfg.advertise_addr, store.port

    def _publish(self, a: Assignment, *, action: dict[str, Any], decision_id: int) -> None:
        addr, port = self._round_store(a.round)
        self._done.clear()
        if self.started is None:
            self.started = time.time()
        plan = {"round": a.round, "assignment": a.to_json(), "master": f"{addr}:{port}", "action": action,
                "id": decision_id, "started": self.started, "max_restarts": self.cfg.core.max_restarts}
        if self.cfg.host_node is not None:
            plan["succession"] = self._succession(a, time.monotonic())
        self.chan.publish(a.round, plan)
        self.presence.announce(a.round)
        self._published = a.round
        self.quorum.assigned(a.round, (*a.members, *a.spares, *plan.get("succession", {}).get("spares", ())),
                             time.monotonic())
        logger.info("round %d: members %s, spares %s, world %d", a.round, list(a.members), list(a.spares),
                    a.world_size)

    def _succession(self, a: Assignment, now: float) -> dict[str, Any]:
        """What an agent needs to take over if this loop's node is lost: the order (members in group-rank order,
        then spares; the host excluded; at most 16), each candidate's store address, the spares this supervisor
        knows (one that joined since the last round is in no assignment), and the core's state a plan does not
        say otherwise (budget spent, the newest decision id)."""
        view = self.core.view(now)
        spares = {n: v.nproc for n, v in view.nodes.items() if v.state is NodeState.SPARE}
        order = [[n, self._standby[n]] for n in (*a.members, *spares)
                 if n != self.cfg.host_node and n in self._standby][:16]
        last_id = max([self._id_floor, *(d.id for d in self.decisions)])
        return {"host": self.cfg.host_node, "order": order, "spares": spares, "last_id": last_id,
                "restarts_used": self.cfg.core.max_restarts - self.core.restarts_left}

    def succeed(self, plan: dict[str, Any], lost: list[str], now: float, dead: tuple[str, ...] = ()) -> None:
        """Take over from the supervisor of ``plan`` (the newest plan this node read), whose node ``lost[0]`` is gone
        (with the candidates before this one, ``lost[1:]``, found unreachable on the way; ``dead``: those of them
        whose address refused a connection, known dead rather than silent):
        adopt its assignment, budget and decision ids, publish it again for the agents that reconnect here, and
        decide on the lost node at once (its closed connections already said so; waiting for its silence would
        cost ``--node-timeout``)."""
        sc = plan["succession"]
        a = Assignment.from_json(plan["assignment"])
        used = max(0, int(sc.get("restarts_used", a.round)))
        last_id = int(sc.get("last_id", plan.get("id", 0)))
        # the core rebuilds from the ledger lines the plan stands for: one assignment per budget unit spent
        # (every assignment change spends one), the newest last
        past = [Event(EventKind.ACTION, node=self.cfg.name,
                      details={"id": last_id, "assignment": {**a.to_json(), "round": r, "attempt": r}})
                for r in range(max(1, a.round - used + 1), a.round)]
        past.append(Event(EventKind.ACTION, node=self.cfg.name, details={"id": last_id, "assignment": a.to_json()}))
        with self._lock:
            self._standby.update({str(n): str(addr) for n, addr in sc.get("order", ())
                                  if n != self.cfg.host_node})
            self._id_floor = last_id
            self.started = plan.get("started")
            self.core.resume(past, now)
            msg = (f"supervisor taken over by {self.cfg.host_node} (term {self.term}) from {lost[0]}, whose node "
                   f"was lost: round {a.round}, members {list(a.members)}, spares {list(a.spares)}")
            logger.warning("%s", msg)
            self._write(Event(EventKind.LOG, node=self.cfg.name,
                              details={"message": msg, "succession": {"from": lost[0], "to": self.cfg.host_node,
                                                                      "round": a.round, "term": self.term}}))
            self._publish(a, action={"action": "resume", "reason": f"succession from {lost[0]}"}, decision_id=0)
            # the nodes the plan it took over names, spares that joined since its round included: the old host may
            # live on beyond a partition, counting the same nodes
            self.quorum.reset((*a.members, *a.spares, *(str(n) for n in sc.get("spares", {}))))
            for n in dead:
                self.quorum.dead(n)
            self._last_pass = now
            for n in sc.get("spares", {}):
                if n not in a.members and n not in a.spares and n != self.cfg.host_node:
                    # a spare that joined after the last round: waited for (--spare-wait) as it reconnects here
                    self.core.arriving(str(n), now)
            out: list[Decision] = []
            for i, n in enumerate(lost):
                details = {"reason": "disconnected", **({"hosted_supervisor": True} if i == 0 else {})}
                out += self.core.handle(Event(EventKind.AGENT_LOST, node=n, details=details), now)
            self._carry_out_pass(out, now)

    def _carry_out_pass(self, out: list[Decision], now: float) -> None:
        """Carry out the decisions of one pass (and those held while this loop had no majority), then record the
        core's notes. A stop decided in the pass supersedes every new round decided beside it: agents read one
        outcome. Without a majority nothing is carried out: the decisions wait in ``held``."""
        # the count is O(nodes): looked at when there is something to carry out, else a few times per window (to
        # notice a lost majority, and stand down, while nothing is decided)
        if (out or self.held or now >= self._quorum_due) and not self._may_act(now):
            if out:
                self.held += out
                logger.warning("supervisor: %d decision(s) held (%s): no majority of the job's nodes",
                               len(out), ", ".join(d.action.kind for d in out))
            for ev in self.core.take_notes():
                self._write(ev)
            return
        out, self.held = self.held + out, []
        stop_id = next((d.id for d in out if d.action.kind == "stop"), None) if self.core.stopped else None
        for d in out:
            self._carry_out(d, superseded_by=stop_id if d.action.kind != "stop" else None)
        for ev in self.core.take_notes():
            self._write(ev)

    def _finish(self, reason: str, *, stop: bool, decision_id: int = 0, preempted: bool = False) -> None:
        # the round after the newest one published, not after the core's assignment: a new round decided beside a
        # stop in the same pass was never published, and agents look for the plan right after the round they read
        round_ = (self._published if self._published is not None else -1) + 1
        # "preempted": every agent exits 75 (the scheduler requeues, the rerun resumes), not 0 and not 1
        self.chan.publish(round_, {"round": round_, "final": True, "stop": reason if stop else None,
                                   "preempted": reason if preempted else None, "id": decision_id})
        self._preempted_end = preempted
        if not stop:
            self.core.finish(reason)  # agents leaving now are not failures
        self._final_round, self._final_at = round_, time.monotonic()
        self.result = reason
        self.finished.set()

    def end_preempted(self, host: str, reason: str, timeout: float) -> None:
        """The agent hosting this loop is preempted, and the supervisor goes with it: nothing can take its place.
        Wait (at most ``timeout``) until every other member's workers are done (they stop after the agreed step
        and save it; a plan published earlier would kill them mid-save), then end the job as preempted, and
        serve until every live agent read that (at most ``linger``): they exit 75 and the rerun resumes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step(time.monotonic())
            a = self.core.assignment
            if a is None or self._final_round is not None or self._done >= set(a.members) - {host}:
                break
            self._stop.wait(self.cfg.tick)
        with self._lock:
            if self._final_round is None:
                self._finish(reason, stop=False, preempted=True)
            self._acks.setdefault(self._final_round, set()).add(host)  # the host knows: only the others must read it
        settle = time.monotonic() + self.cfg.linger
        while not self.settled.is_set() and time.monotonic() < settle:
            self.step(time.monotonic())
            self.settled.wait(self.cfg.tick)

    # an agent warming up reads the door every 0.25 s; one that died while warming (it never joined, so no presence
    # connection tells of it) must not keep the job's end waiting for the whole linger
    ARRIVING_AFTER_DOOR = 3.0

    def _arriving_waited(self, now: float) -> set[str]:
        return self._arrived if now - self._door_at < self.ARRIVING_AFTER_DOOR else set()

    def _close_door(self, now: float) -> None:
        outcome = "preempted" if self._preempted_end else ("stopped" if self.core.stopped is not None else "succeeded")
        try:
            self.chan.close_door(outcome)
        except Exception as e:  # noqa: BLE001 - the store is ours; a failure here only costs a joiner its wait
            logger.debug("could not close the door: %s", e)
        self._door_pass, self._door_at = self._passes, now

    def _check_finished(self, now: float) -> None:
        if self.stood_down_at is not None:
            return  # the job goes on (or ends) elsewhere: this loop publishes nothing any more
        a = self.core.assignment
        if self._final_round is None and self.core.stopped is None and self.core.preempted_end is not None:
            self._finish(self.core.preempted_end, stop=False, preempted=True)
        if self._final_round is None and a is not None and self.core.stopped is None and self._done >= set(a.members):
            self._finish("succeeded", stop=False)
        if self._final_round is not None and not self.settled.is_set():
            view = self.core.view(now)
            live = {n for n, v in view.nodes.items() if v.state in (NodeState.ACTIVE, NodeState.SPARE)}
            acks = self._acks.get(self._final_round, set())
            if self._door_pass is None:
                if acks >= live:
                    # from now on a joining agent learns the end from the door, not from this store; what one sent
                    # before it read the door open is drained in a later pass, and that agent is waited for
                    self._close_door(now)
            elif self._passes > self._door_pass and acks >= live | self._arriving_waited(now):
                # spares still warming up watch the door and acknowledge once they see it closed
                self.settled.set()
