"""The supervisor's decision core: a pure state machine from events to decisions.

No I/O and no threads except the one a user's policy runs in (so that a hung policy is abandoned after
``policy_timeout``). Time is passed in (``now``, monotonic seconds), which makes every decision a
function of the inputs: the control loop feeds it joins, reports, events and ticks, and carries out the
:class:`Decision` s it returns; tests feed it the scenario table.

The core enforces the rules that keep the job sound whatever the policy says: only events of the current
attempt and of active nodes decide anything (several reports of one failure decide once), every action is
validated against the view, the restart budget is spent by every assignment change, and no assignment
ever holds fewer than ``min_nodes`` or more than ``max_nodes`` nodes, a node twice, or a lost or cordoned
node.

This file is longer than 700 lines on purpose: it is one state machine, and its rules (validation, effects,
deferred scale-ups and preemptions) read and write the same state; split, each invariant would span files.
"""

from __future__ import annotations

import collections
import logging
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Protocol, TypeVar

from resilient.bounded import BoundedCaller, CallBusy
from resilient.events.api import Event, EventKind
from resilient.supervisor.api import (
    FAILURE_KINDS, WORKERS_STOPPED_KINDS, Action, Cordon, HotSwap, Ignore, JobView, NodeState, NodeView, Policy,
    PolicyError, Restart, ScaleDown, ScaleUp, Stop,
)
from resilient.supervisor.classify import classify
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.default_policy import DefaultPolicy

logger = logging.getLogger(__name__)

T = TypeVar("T")

# events that may need a decision (when they come from an active node of the current attempt)
DECIDING_KINDS = frozenset({
    EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST, EventKind.NODE_JOINED, EventKind.STRAGGLER,
    EventKind.HOST_UNHEALTHY, EventKind.GPU_UNHEALTHY, EventKind.PREEMPTION_NOTICE,
})
# causes whose failure class the action's ledger record names
CLASSIFIED_KINDS = DECIDING_KINDS - {EventKind.NODE_JOINED, EventKind.STRAGGLER}
_CHANGING = (Restart, HotSwap, ScaleDown, ScaleUp)
LOCAL_TIER = "local"


@dataclass(frozen=True)
class Assignment:
    round: int  # increases by one with every new assignment (first is 0)
    attempt: int  # == round (kept separate for clarity in the ledger)
    members: tuple[str, ...]  # active nodes in group-rank order (node i has group rank i)
    spares: tuple[str, ...]
    nproc: Mapping[str, int]  # workers per member
    world_size: int
    previous_world_size: int | None  # world size of the previous assignment (for on_scale), None at start
    # --nodes-per-replica K: replica i is members[i*K:(i+1)*K] (consecutive group ranks, so consecutive global
    # ranks: the data-parallel dimension is outermost); None: every rank is a replica
    nodes_per_replica: int | None = None
    previous_dp_size: int | None = None  # data-parallel size of the previous assignment, None at start

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "spares", tuple(self.spares))
        object.__setattr__(self, "nproc", MappingProxyType(dict(self.nproc)))
        k = self.nodes_per_replica
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1 or len(self.members) % k):
            raise ValueError(f"Assignment: nodes_per_replica {k!r} does not divide its {len(self.members)} member(s)")

    @property
    def dp_size(self) -> int:
        """Data-parallel size: the number of replicas with ``nodes_per_replica``, else the world size."""
        k = self.nodes_per_replica
        return len(self.members) // k if k else self.world_size

    @property
    def replicas(self) -> tuple[tuple[str, ...], ...]:
        """Members chunked into replicas, in group-rank order (one node per tuple without ``nodes_per_replica``)."""
        k = self.nodes_per_replica or 1
        return tuple(self.members[i:i + k] for i in range(0, len(self.members), k))

    def group_rank(self, node: str) -> int | None:
        try:
            return self.members.index(node)
        except ValueError:
            return None

    def base_rank(self, node: str) -> int:
        """Global rank of ``node``'s local rank 0."""
        gr = self.group_rank(node)
        if gr is None:
            raise KeyError(f"{node} is not a member of round {self.round}")
        return sum(self.nproc[m] for m in self.members[:gr])

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "members": list(self.members),
                "spares": list(self.spares), "nproc": dict(self.nproc), "world_size": self.world_size,
                "previous_world_size": self.previous_world_size, "nodes_per_replica": self.nodes_per_replica,
                "dp_size": self.dp_size, "previous_dp_size": self.previous_dp_size}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Assignment":
        return cls(round=int(d["round"]), attempt=int(d.get("attempt", d["round"])), members=tuple(d["members"]),
                   spares=tuple(d.get("spares", ())), nproc={k: int(v) for k, v in d["nproc"].items()},
                   world_size=int(d["world_size"]), previous_world_size=d.get("previous_world_size"),
                   nodes_per_replica=_opt_int(d.get("nodes_per_replica")),
                   previous_dp_size=_opt_int(d.get("previous_dp_size")))


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


@dataclass(frozen=True)
class Decision:
    id: int  # unique, increasing: agents acknowledge actions by id
    action: Action
    cause: Event | None  # the event that caused it (None for timer-driven ones)
    assignment: Assignment | None  # the new assignment when membership/round changes, else None
    fallback: str | None = None  # why the user's policy was overruled (traceback text), None if it decided
    pending: bool = False  # a ScaleUp recorded now and carried out by a later decision (checkpoint boundary)

    def to_event(self, node: str) -> Event:
        """The ledger's ``action`` event. ``action`` stays the kind string (the ledger's contract);
        ``action_args`` holds the whole action."""
        c = self.cause
        details: dict[str, Any] = {
            "action": self.action.kind, "action_args": self.action.to_json(), "reason": self.action.reason,
            "cause": c.kind.value if c is not None else None, "cause_node": c.node if c is not None else None,
            "cause_rank": c.rank if c is not None else None, "id": self.id,
            "round": self.assignment.round if self.assignment is not None else None,
        }
        if c is not None and c.kind in CLASSIFIED_KINDS:
            details["failure_class"] = classify(c.kind, c.details).value
        if self.assignment is not None:
            details["assignment"] = self.assignment.to_json()
        if self.fallback is not None:
            details["fallback"] = self.fallback
        if self.pending:
            details["pending"] = True
        attempt = self.assignment.attempt if self.assignment is not None else (c.attempt if c else None)
        return Event(kind=EventKind.ACTION, node=node, attempt=attempt, details=details)


@dataclass
class _Node:
    name: str
    nproc: int
    joined: float
    last_seen: float
    state: NodeState | None = None  # None before the first assignment
    healthy: bool = True
    failures: collections.deque = field(default_factory=collections.deque)  # times
    stragglers: collections.deque = field(default_factory=collections.deque)
    returns_at: float | None = None  # benched (CORDONED with a cool-down): when it may be a spare again
    node_rank: int | None = None  # torchrun's --node-rank under a static rendezvous: the job's first order


@dataclass
class _PendingScaleUp:
    action: ScaleUp
    spares: list[str]
    decided: float
    local_step: int | None  # newest local step known when decided: the boundary is a newer one
    decision_id: int


@dataclass
class _PendingPreemption:
    """A member announced its preemption. The policy's answer waits until every rank has saved the step they
    agree to stop after (the other members report their workers done, the preempted node leaves): a swap or a
    scale-down then restarts from that step and loses nothing; no action means the job ends as preempted."""

    node: str
    event: Event
    action: Action | None  # HotSwap / ScaleDown to carry out, None: every node exits as preempted
    decided: float
    decision_id: int
    gone: bool = False
    done: set[str] = field(default_factory=set)


class _Invalid(Exception):
    pass


class PolicyCalls(Protocol):
    """How the core calls an in-process policy: :class:`BoundedCaller`'s ``call``."""

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T: ...


class SupervisorCore:
    """``policy_calls``: how an in-process policy is called; by default on a thread, abandoned after
    ``policy_timeout`` and never called again while an earlier call runs. A caller without a deadline (the
    planner) passes one that calls inline."""

    def __init__(self, cfg: SupervisorConfig, policy: Policy | None = None, *,
                 policy_calls: PolicyCalls | None = None) -> None:
        self.cfg = cfg
        self._default = DefaultPolicy()
        self._policy = policy
        self._policy_calls: PolicyCalls = policy_calls or BoundedCaller("policy", max_abandoned=1, serial=True)
        self._nodes: dict[str, _Node] = {}  # join order
        self._assignment: Assignment | None = None
        self._restarts_used = 0
        self._stopped: str | None = None
        self._finished: str | None = None
        self._recent: collections.deque[Event] = collections.deque(maxlen=cfg.recent_events)
        self._ckpt_steps: dict[str, int] = {}
        self._pending: _PendingScaleUp | None = None
        self._preempting: _PendingPreemption | None = None
        self._preempted_end: str | None = None  # the job ends as preempted (every node exits 75), and why
        self._next_id = 1
        # attempt -> (node blamed for the failure that ended it, when that fault happened, when it was counted)
        self._blame: dict[int, tuple[str, float, float]] = {}
        # records for the ledger that decide nothing (a spare lost): the loop writes them (take_notes)
        self._notes: collections.deque[Event] = collections.deque(maxlen=256)
        self._joining: dict[str, float] = {}  # node -> when its agent said it is arriving (connected, warming up)
        # lost members whose decision waits for a joining spare: (the loss, until when), oldest first
        self._awaiting: list[tuple[Event, float]] = []
        # lost members the policy was asked about, with when it was first asked: --replacement-wait counts from then
        self._lost_since: dict[str, float] = {}
        self._node_views: dict[str, tuple[tuple[Any, ...], NodeView]] = {}  # node -> (what it was made of, view)
        # no node's timer (cool-down, --node-timeout, forgetting) can fire before this: a pass does not look at every
        # node when none can be due (O(changes) per pass, not O(nodes)). Recomputed by the tick that scans; every
        # entry point that may change a node's state or place sets it back to -inf (only ``seen`` does not: it only
        # moves a node's timeout later)
        self._timers_due = float("-inf")

    # ------------------------------------------------------------------------------------------ state
    @property
    def assignment(self) -> Assignment | None:
        return self._assignment

    @property
    def stopped(self) -> str | None:
        return self._stopped

    @property
    def finished(self) -> str | None:
        return self._finished

    @property
    def preempting(self) -> str | None:
        """The member whose preemption notice is being handled, or None."""
        return self._preempting.node if self._preempting is not None else None

    @property
    def preempted_end(self) -> str | None:
        """Why the job ends as preempted (a notice no swap or scale-down could answer), or None."""
        return self._preempted_end

    def done(self, node: str, now: float) -> list[Decision]:
        """``node``'s workers of the current round all finished (exit 0): while a member's preemption is
        pending, the other members' workers finishing means they stopped after the agreed step, saved."""
        self._timers_due = float("-inf")
        p = self._preempting
        if p is None or self._stopped or self._finished or self._preempted_end:
            return []
        p.done.add(node)
        return self._settle_preemption(now, "the agreed step is saved")

    @property
    def restarts_left(self) -> int:
        return max(0, self.cfg.max_restarts - self._restarts_used)

    def take_notes(self) -> list[Event]:
        """Events the core recorded that no decision carries (``spare_lost``), oldest first; each is returned once."""
        out = list(self._notes)
        self._notes.clear()
        return out

    def finish(self, reason: str = "done") -> None:
        """The job ended by itself (training finished): no further decisions."""
        self._finished = reason

    def advance_ids(self, last_id: int) -> None:
        """After a supervisor restart: the next decision id follows ``last_id`` (read from the ledger), so
        agents never mistake a new action for one they already acknowledged."""
        self._next_id = max(self._next_id, last_id + 1)

    def adopt(self, assignment: Assignment, now: float) -> None:
        """Rebuild from an assignment the agents report (supervisor restarted mid-run)."""
        self._timers_due = float("-inf")
        self._assignment = assignment
        for n in (*assignment.members, *assignment.spares):
            node = self._nodes.get(n)
            if node is None:
                node = self._nodes[n] = _Node(n, assignment.nproc.get(n, self.cfg.nproc_per_node), now, now)
            node.state = NodeState.ACTIVE if n in assignment.members else NodeState.SPARE
            node.last_seen = max(node.last_seen, now)
        for n, node in self._nodes.items():
            if node.state is None:
                node.state = NodeState.SPARE

    def resume(self, events: Iterable[Event], now: float) -> Assignment | None:
        """Rebuild after a supervisor restart from the ledger's ``action`` events: the last assignment, the
        restart budget spent and the decision ids used. Nodes of that assignment count as seen ``now``:
        each has ``node_timeout`` to reconnect before it counts as lost. Returns the adopted assignment."""
        last: Assignment | None = None
        last_id = 0
        used = 0
        stopped = None
        for ev in events:
            if ev.kind is not EventKind.ACTION or not isinstance(ev.details, dict):
                continue
            d = ev.details
            if isinstance(d.get("id"), int):
                last_id = max(last_id, d["id"])
            if isinstance(d.get("assignment"), dict):
                try:
                    a = Assignment.from_json(d["assignment"])
                except (KeyError, TypeError, ValueError):
                    continue
                if last is None or a.round > last.round:
                    last = a
                    used += a.round > 0  # round 0 is the start, not a restart
            if d.get("action") == Stop.kind:
                stopped = str(d.get("reason") or "stopped")
        self.advance_ids(last_id)
        if last is not None:
            self._restarts_used = used
            self.adopt(last, now)
        if stopped is not None:
            self._stopped = stopped
        return last

    def arriving(self, node: str, now: float) -> None:
        """``node``'s agent connected and is warming up: a joining spare once the job runs (until it joins, or for
        ``spare_wait`` seconds)."""
        self._timers_due = float("-inf")
        n = self._nodes.get(node)
        if self._assignment is None or (n is not None and n.state is not NodeState.LOST) or node in self._joining:
            return
        self._joining[node] = now
        self._notes.append(Event(kind=EventKind.NODE_ARRIVING, node=node, attempt=None, mono=now, wall=time.time()))

    def _joining_now(self, now: float) -> tuple[str, ...]:
        return tuple(n for n, t in self._joining.items() if now - t <= self.cfg.spare_wait)

    def _replacement_left(self, now: float) -> float:
        """Seconds the oldest lost member still waits for a node to join in its place (``replacement_wait``);
        entries of nodes no longer lost members are dropped here, their one reader."""
        if not self._lost_since:
            return 0.0  # every view asks: the common case costs nothing
        members = set(self._assignment.members) if self._assignment is not None else set()
        self._lost_since = {n: t for n, t in self._lost_since.items()
                            if n in members and self._nodes.get(n) is not None
                            and self._nodes[n].state is NodeState.LOST}
        if not self._lost_since or self.cfg.replacement_wait <= 0:
            return 0.0
        return max(0.0, min(self._lost_since.values()) + self.cfg.replacement_wait - now)

    def view(self, now: float) -> JobView:
        gr = {n: i for i, n in enumerate(self._assignment.members)} if self._assignment else {}
        nodes = {}
        views = self._node_views
        for n, node in self._nodes.items():
            self._prune(node, now)
            state = node.state if node.state is not None else NodeState.SPARE
            rank = gr.get(n) if state in (NodeState.ACTIVE, NodeState.LOST) else None
            key = (state, rank, node.nproc, node.healthy, len(node.failures), len(node.stragglers), node.last_seen)
            cached = views.get(n)
            if cached is None or cached[0] != key:
                # a node's view is made again only when it changed: many spares joining in one pass each get a
                # decision, and each decision a view of every node
                cached = views[n] = (key, NodeView(name=n, state=state, group_rank=rank, nproc=node.nproc,
                                                   healthy=node.healthy, failures=len(node.failures),
                                                   stragglers=len(node.stragglers), last_seen=node.last_seen))
            nodes[n] = cached[1]
        return JobView(nodes=nodes, min_nodes=self.cfg.min_nodes, max_nodes=self.cfg.max_nodes,
                       nproc_per_node=self.cfg.nproc_per_node, restarts_left=self.restarts_left,
                       attempt=self._assignment.attempt if self._assignment else 0, ckpt_steps=self._ckpt_steps,
                       recent=tuple(self._recent), failure_window=self.cfg.failure_window, now=now,
                       pending_scale_up=tuple(self._pending.spares) if self._pending else (),
                       joining=self._joining_now(now), nodes_per_replica=self.cfg.nodes_per_replica,
                       replacement_wait_left=self._replacement_left(now))

    def _prune(self, node: _Node, now: float) -> None:
        horizon = now - self.cfg.failure_window
        for q in (node.failures, node.stragglers):
            while q and q[0] < horizon:
                q.popleft()

    # ------------------------------------------------------------------------------------------ joining
    def join(self, node: str, nproc: int, now: float, node_rank: int | None = None) -> list[Decision]:
        """``node_rank``: the node's torchrun ``--node-rank`` under a static rendezvous, which orders the job's
        first members (and so their group ranks) as torchrun does; later joins ignore it (a spare takes the place of
        the node it replaces)."""
        self._timers_due = float("-inf")
        if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
            raise ValueError(f"join: nproc of {node} must be an integer >= 1, got {nproc!r}")
        if node_rank is not None and (isinstance(node_rank, bool) or not isinstance(node_rank, int) or node_rank < 0):
            raise ValueError(f"join: node_rank of {node} must be an integer >= 0 or None, got {node_rank!r}")
        n = self._nodes.get(node)
        self._joining.pop(node, None)
        ev = Event(kind=EventKind.NODE_JOINED, node=node, attempt=None, details={"nproc": nproc},
                   mono=now, wall=time.time())
        if node_rank is not None:
            ev.details["node_rank"] = node_rank
        if self._assignment is None:
            if n is None:
                self._nodes[node] = _Node(node, nproc, now, now, node_rank=node_rank)
            else:
                n.nproc, n.last_seen, n.node_rank = nproc, now, node_rank
            ev.details["spare"] = False
            self._recent.append(ev)
            return []
        if n is None:
            n = self._nodes[node] = _Node(node, nproc, now, now, state=NodeState.SPARE)
        else:
            n.last_seen = now
            if n.state in (NodeState.ACTIVE, NodeState.SPARE):
                # an agent that came back before it was declared lost: its peers report the failure
                self._recent.append(ev)
                return []
            if n.state is NodeState.LOST:
                n.state, n.nproc, n.healthy = NodeState.SPARE, nproc, True
                # to the back of the line: spares are offered in join order, and a node that just came back (one
                # that comes and goes, perhaps) is offered after those that stayed
                self._nodes[node] = self._nodes.pop(node)
        ev.details["spare"] = n.state is NodeState.SPARE
        self._recent.append(ev)
        if n.state is not NodeState.SPARE or self._stopped or self._finished or self._preempted_end:
            return []
        if self._awaiting:
            # the spare a lost member waited for: that loss is decided now (the spare's own joining waits)
            lost, _ = self._awaiting.pop(0)
            logger.info("spare %s is ready: deciding on %s lost", node, lost.node)
            return self._decide(lost, now)
        return self._decide(ev, now)

    def seen(self, node: str, now: float) -> None:
        n = self._nodes.get(node)
        if n is not None and now > n.last_seen:
            n.last_seen = now

    def ready(self, now: float, last_call: float) -> bool:
        if len(self._nodes) >= self.cfg.max_nodes:
            return True
        if len(self._nodes) < self.cfg.min_nodes:
            return False
        nth = sorted(n.joined for n in self._nodes.values())[self.cfg.min_nodes - 1]
        return now - nth >= last_call

    def give_up_forming(self, join_timeout: float, now: float) -> list[Decision]:
        """Fewer than ``min_nodes`` joined within ``join_timeout`` of the supervisor's start: the job stops before its
        first start (torchrun's rendezvous fails the same way), naming who came and what to do."""
        if self._assignment is not None or self._stopped is not None:
            return []
        self._timers_due = float("-inf")
        came = ", ".join(self._nodes) or "none"
        a = Stop(reason=f"only {len(self._nodes)} of --nnodes MIN {self.cfg.min_nodes} node(s) joined within the "
                        f"rendezvous join_timeout ({join_timeout:g} s; joined: {came}): start the missing nodes with "
                        "the same --rdzv-endpoint and --rdzv-id, lower --nnodes, or raise --rdzv-conf "
                        "join_timeout=SECONDS")
        self._stopped = a.reason
        logger.error("job stopped: %s", self._stopped)
        return [Decision(self._id(), a, None, None)]

    def form(self, now: float) -> Assignment:
        self._timers_due = float("-inf")
        if self._assignment is not None:
            raise RuntimeError("form: the job already has an assignment; changes go through handle()")
        if len(self._nodes) < self.cfg.min_nodes:
            raise RuntimeError(f"form: {len(self._nodes)} node(s) joined, min_nodes is {self.cfg.min_nodes}")
        # torchrun's static rendezvous gives node --node-rank N the group ranks after those of nodes 0..N-1; nodes
        # without one (another rendezvous) keep their join order, after those with one
        order = sorted(self._nodes, key=lambda n: (self._nodes[n].node_rank is None, self._nodes[n].node_rank or 0))
        ranks = [self._nodes[n].node_rank for n in order if self._nodes[n].node_rank is not None]
        if len(set(ranks)) < len(ranks):
            logger.warning("nodes share a --node-rank (%s): those are ordered by when they joined",
                           ", ".join(f"{n}={self._nodes[n].node_rank}" for n in order
                                     if ranks.count(self._nodes[n].node_rank) > 1))
        size = min(len(order), self.cfg.max_nodes)
        k = self.cfg.nodes_per_replica
        if k:
            size -= size % k  # whole replicas; the rest wait as spares (MIN is a multiple of K: size stays >= MIN)
        members, spares = order[:size], order[size:]
        for n in members:
            self._nodes[n].state = NodeState.ACTIVE
        for n in spares:
            self._nodes[n].state = NodeState.SPARE
        self._assignment = self._make(0, members, None)
        return self._assignment

    def _make(self, rnd: int, members: list[str] | tuple[str, ...], previous: Assignment | None) -> Assignment:
        nproc = {m: self._nodes[m].nproc for m in members}
        spares = tuple(n for n, v in self._nodes.items() if v.state is NodeState.SPARE)
        return Assignment(round=rnd, attempt=rnd, members=tuple(members), spares=spares, nproc=nproc,
                          world_size=sum(nproc.values()),
                          previous_world_size=previous.world_size if previous is not None else None,
                          nodes_per_replica=self.cfg.nodes_per_replica,
                          previous_dp_size=previous.dp_size if previous is not None else None)

    # ------------------------------------------------------------------------------------------ events
    def handle(self, event: Event, now: float) -> list[Decision]:
        self._timers_due = float("-inf")
        if event.kind is EventKind.NODE_JOINED:
            n = self._nodes.get(event.node)
            if n is None or n.state is NodeState.LOST:
                nproc = event.details.get("nproc", self.cfg.nproc_per_node)
                try:
                    return self.join(event.node, int(nproc), now)
                except (TypeError, ValueError) as e:
                    logger.warning("node_joined from %s with a bad nproc (%r): ignored (%s)", event.node, nproc, e)
                    return []
        if event.kind is not EventKind.CKPT_TIER_DONE:
            # a save reports once per tier, every few steps: in the bounded history those reports would push out the
            # failures a policy compares attempts by (the newest step per tier is in view.ckpt_steps)
            self._recent.append(event)
        if event.kind is not EventKind.AGENT_LOST:
            self.seen(event.node, now)
        elif self._joining.pop(event.node, None) is not None and event.node not in self._nodes:
            return self._arrival_gone(event.node, now)
        if event.kind is EventKind.CKPT_TIER_DONE:
            return self._ckpt_done(event, now)
        if self._assignment is None or self._stopped or self._finished or self._preempted_end:
            return []
        if event.kind not in DECIDING_KINDS or event.kind is EventKind.NODE_JOINED:
            return []
        node = self._nodes.get(event.node)
        if node is None:
            return []
        if event.kind in (EventKind.HOST_UNHEALTHY, EventKind.GPU_UNHEALTHY):
            node.healthy = False
        current = event.attempt is None or event.attempt == self._assignment.attempt
        member = node.state is NodeState.ACTIVE
        p = self._preempting
        if event.kind is EventKind.AGENT_LOST:
            was_spare = node.state is NodeState.SPARE
            if was_spare:
                self._spare_lost(event, node, now)
            if node.state in (NodeState.ACTIVE, NodeState.SPARE) or node.returns_at is not None:
                node.state, node.returns_at = NodeState.LOST, None  # a benched node that died comes back by joining
            if not member:
                # a spare or an already-replaced node: nothing to decide, unless a scale-up was waiting for it
                return self._promised_spare_lost(event.node, now) if was_spare else []
            if p is not None and event.node == p.node:
                p.gone = True  # the preempted node left, as announced: not a failure
                return self._settle_preemption(now, f"{event.node} left")
            if p is not None:
                return self._settle_preemption(now, f"{event.node} lost", force=True)
            node.failures.append(now)
            return self._decide(event, now)
        if not (current and member):
            self._reblame(event, node)
            return []  # a stale attempt's report, or a node outside the job
        if event.kind is EventKind.WORKER_EXIT and not _nonzero_exit(event):
            return []
        if event.kind is EventKind.PREEMPTION_NOTICE and p is not None:
            return []  # one node's preemption at a time: the first notice's decision stands
        if self._awaiting and event.kind in FAILURE_KINDS:
            # the survivors of a lost member fail in their collectives: the decision waiting for a joining
            # spare restarts this attempt
            node.failures.append(now)
            return []
        if p is not None and event.kind in FAILURE_KINDS:
            # a rank failed while a node is going (its peers left without it, a save failed): what was decided
            # for the preemption is done now, from the newest complete checkpoint
            return self._settle_preemption(now, f"{event.kind.value} on {event.node}", force=True)
        if event.kind in FAILURE_KINDS:
            node.failures.append(now)
            w = _fault_wall(event)
            if event.attempt is not None and w is not None:
                self._blame[event.attempt] = (event.node, w, now)
                for old in [k for k in self._blame if k < event.attempt - 4]:
                    del self._blame[old]
        elif event.kind is EventKind.STRAGGLER:
            node.stragglers.append(now)
        return self._decide(event, now)

    def _spare_lost(self, event: Event, node: _Node, now: float) -> None:
        """A warm spare's agent is gone: the job has one spare fewer, which the ledger says (no decision does)."""
        d = event.details if isinstance(event.details, dict) else {}
        cause = str(d.get("reason") or "unknown")
        if cause == "left" and (self._finished or self._stopped or self._preempted_end):
            return  # the job ended and its spares go with it
        logger.warning("spare %s lost (%s)", event.node, cause)
        self._notes.append(Event(kind=EventKind.SPARE_LOST, node=event.node, attempt=None, mono=now, wall=event.wall,
                                 details={"cause": cause, "last_seen_age": round(max(0.0, now - node.last_seen), 3)}))

    def _arrival_gone(self, name: str, now: float) -> list[Decision]:
        """An agent that said it was arriving left before it joined. A lost member's decision that waited for a
        joining spare, and has no other joining spare left to wait for, is decided now rather than once
        ``spare_wait`` has passed."""
        if not self._awaiting or self._joining_now(now) or self._stopped or self._finished or self._preempted_end:
            return []
        out: list[Decision] = []
        waiting, self._awaiting = self._awaiting, []
        for lost, _ in waiting:
            if self._stopped:
                break
            logger.warning("joining spare %s left: deciding on %s lost now", name, lost.node)
            out += self._decide(lost, now)
        return out

    def _promised_spare_lost(self, name: str, now: float) -> list[Decision]:
        """A spare promised to the pending scale-up left before its boundary. The scale-up goes on without it;
        if it promised no other spare, the policy is asked again, as for a spare joining, on behalf of the free
        spare that has been here the longest: otherwise the job would stay below MAX, with spares waiting,
        until the next spare happens to join."""
        p = self._pending
        if p is None or name not in p.spares:
            return []
        p.spares.remove(name)
        if p.spares:
            return []
        self._pending = None
        free = next((n for n, v in self._nodes.items() if v.state is NodeState.SPARE and v.healthy), None)
        if free is None:
            logger.info("scale-up %d dropped: its spare %s left and no other spare is free", p.decision_id, name)
            return []
        ev = Event(kind=EventKind.NODE_JOINED, node=free, attempt=None,
                   details={"nproc": self._nodes[free].nproc, "spare": True, "after": f"promised spare {name} lost"},
                   mono=now, wall=time.time())
        self._recent.append(ev)
        logger.info("spare %s, promised to scale-up %d, left: asking again for spare %s", name, p.decision_id, free)
        return self._decide(ev, now)

    def _reblame(self, event: Event, node: _Node) -> None:
        """A later report of a failure in an attempt already decided, from another node, whose fault happened
        first (by its agent's clock): that node's failure started it (the first report to arrive may be a
        survivor's, failing in a collective with the dead rank). The decision stands; the blame moves, so that
        a node's failure count says what its own workers did."""
        if event.kind not in (EventKind.WORKER_EXIT, EventKind.HANG) or event.attempt is None:
            return
        if event.kind is EventKind.WORKER_EXIT and not _nonzero_exit(event):
            return
        b = self._blame.get(event.attempt)
        w = _fault_wall(event)
        if b is None or b[0] == event.node or w is None or not w < b[1]:
            return
        blamed, _, t = b
        old = self._nodes.get(blamed)
        if old is not None and t in old.failures:
            old.failures.remove(t)
        q = node.failures  # kept in time order: the window is pruned from the left
        i = len(q)
        while i > 0 and q[i - 1] > t:
            i -= 1
        q.insert(i, t)
        self._blame[event.attempt] = (event.node, w, t)
        logger.info("failure of attempt %d blamed on %s rather than %s (its fault came %.3f s earlier)",
                    event.attempt, event.node, blamed, b[1] - w)

    def tick(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        if self._assignment is None or self._stopped or self._finished or self._preempted_end:
            return out
        if now >= self._timers_due:
            out += self._node_timers(now)
            if self._stopped or self._preempted_end:  # a job that ended grows no more (a pending scale-up too)
                return out
        while self._awaiting and now >= self._awaiting[0][1]:
            lost, _ = self._awaiting.pop(0)
            late = [n for n, t in self._joining.items() if now - t >= self.cfg.spare_wait]
            for n in late:
                del self._joining[n]
            if self._replacement_left(now) > 0 or self.cfg.replacement_wait <= 0:
                logger.warning("no joining spare became ready within %g s (--spare-wait) for %s",
                               self.cfg.spare_wait, lost.node)
            else:
                logger.warning("no node joined in place of %s within %g s (--replacement-wait)", lost.node,
                               self.cfg.replacement_wait)
            out += self._decide(lost, now)
            if self._stopped or self._preempted_end:  # a job that ended grows no more
                return out
        pp = self._preempting
        if pp is not None and now - pp.decided >= self.cfg.preempt_wait:
            out += self._settle_preemption(now, f"no agreed save within {self.cfg.preempt_wait:g} s", force=True)
            if self._stopped or self._preempted_end:  # a job that ended grows no more
                return out
        p = self._pending
        if p is not None and now - p.decided >= self.cfg.scale_up_wait:
            out += self._apply_scale_up(None, now, f"no checkpoint within {self.cfg.scale_up_wait:g} s")
        return out

    def _node_timers(self, now: float) -> list[Decision]:
        """Every node's timers: forgotten, back from a cool-down, silent past ``node_timeout``; then when the next
        can fire at the earliest."""
        out: list[Decision] = []
        self._timers_due = float("-inf")  # stays so if a stop ends the scan early
        self._forget_gone(now)
        for name, n in list(self._nodes.items()):
            if n.returns_at is not None and now >= n.returns_at:
                out += self._cooled_down(name, n, now)
                if self._stopped:
                    return out
        for name, n in list(self._nodes.items()):
            if n.state in (NodeState.ACTIVE, NodeState.SPARE) and now - n.last_seen > self.cfg.node_timeout:
                ev = Event(kind=EventKind.AGENT_LOST, node=name, attempt=None,
                           details={"reason": "timeout", "last_seen_age": round(now - n.last_seen, 3)},
                           mono=now, wall=time.time())
                out += self.handle(ev, now)
                if self._stopped:
                    return out
        self._timers_due = self._next_timer()
        return out

    def _next_timer(self) -> float:
        """The earliest time at which a node's timer can fire, from the state as it is (each bound is at or before
        the time its condition in :meth:`_node_timers` first holds)."""
        due = float("inf")
        timeout = self.cfg.node_timeout
        horizon = max(self.cfg.failure_window, timeout)
        members = set(self._assignment.members) if self._assignment is not None else set()
        for name, n in self._nodes.items():
            if n.returns_at is not None and n.returns_at < due:
                due = n.returns_at
            if n.state is NodeState.ACTIVE or n.state is NodeState.SPARE:
                due = min(due, n.last_seen + timeout)
            elif n.state is NodeState.LOST and name not in members:
                newest = max(max(n.failures, default=float("-inf")), max(n.stragglers, default=float("-inf")))
                due = min(due, max(n.last_seen + horizon, newest + self.cfg.failure_window))
        return due - 1e-6  # a sum's rounding must not put the bound after the moment its difference test holds

    def _forget_gone(self, now: float) -> None:
        """Forget nodes lost longer ago than the failure window (and ``node_timeout``) that hold no place in the
        job and no failure within the window: spares that come and go (each agent start a new name) would
        otherwise grow every view, and every decision, without bound. One that comes back joins as new."""
        horizon = max(self.cfg.failure_window, self.cfg.node_timeout)
        members = set(self._assignment.members) if self._assignment is not None else set()
        for name, n in list(self._nodes.items()):
            if n.state is NodeState.LOST and name not in members and now - n.last_seen > horizon:
                self._prune(n, now)
                if not n.failures and not n.stragglers:
                    del self._nodes[name]
                    self._node_views.pop(name, None)

    def _cooled_down(self, name: str, n: _Node, now: float) -> list[Decision]:
        """A benched node's cool-down is over: a spare again if its agent still reports and is healthy (the
        policy is asked as for any joining spare), lost if it went quiet; an unhealthy one stays benched."""
        if not n.healthy or n.state is not NodeState.CORDONED:
            if n.state is not NodeState.CORDONED:
                n.returns_at = None
            return []
        n.returns_at = None
        if now - n.last_seen > self.cfg.node_timeout:
            n.state = NodeState.LOST  # it may still come back by joining again
            return []
        n.state = NodeState.SPARE
        ev = Event(kind=EventKind.NODE_JOINED, node=name, attempt=None,
                   details={"nproc": n.nproc, "spare": True, "after": "cool_down"}, mono=now, wall=time.time())
        self._recent.append(ev)
        logger.info("node %s is a spare again after its cool-down", name)
        return self._decide(ev, now)

    def _ckpt_done(self, event: Event, now: float) -> list[Decision]:
        tier, step = event.details.get("tier"), event.details.get("step")
        if not isinstance(tier, str) or isinstance(step, bool) or not isinstance(step, int):
            return []
        if step > self._ckpt_steps.get(tier, -1):
            self._ckpt_steps[tier] = step
        p = self._pending
        if (tier == LOCAL_TIER and p is not None and (p.local_step is None or step > p.local_step)
                and not self._stopped and not self._finished and not self._preempted_end):
            return self._apply_scale_up(event, now, f"checkpoint boundary (step {step})")
        return []

    # ------------------------------------------------------------------------------------------ deciding
    def _ask(self, policy: Any, event: Event, view: JobView) -> Action:
        """Ask a policy. A policy file runs in a process of its own (``decide_within``: the time and memory
        limits, and every way it can fail, are enforced there, and calls never overlap). Any other policy
        object is called through ``policy_calls``, by default a serial :class:`BoundedCaller`: on timeout the call
        is abandoned, and the policy is not called again until that call returns (two calls at once could
        corrupt a stateful policy)."""
        decide_within = getattr(policy, "decide_within", None)
        if decide_within is not None:
            try:
                action = decide_within(event, view, self.cfg.policy_timeout)
            except PolicyError as e:
                raise _Invalid(str(e)) from None
            if not isinstance(action, Action) or type(action) is Action:
                raise _Invalid(f"the policy returned {action!r:.200}, not an action")
            return action
        def run() -> tuple[bool, Any]:
            try:
                return True, policy.decide(event, view)
            except KeyboardInterrupt:  # the user's, when a policy is called inline
                raise
            except BaseException:  # noqa: BLE001 - anything a policy raises is the policy's failure
                return False, traceback.format_exc()

        try:
            ok, action = self._policy_calls.call(run, self.cfg.policy_timeout, "the policy")
        except CallBusy:
            raise _Invalid("the policy's previous call has not returned (it overran --policy-timeout); it is not "
                           "called again until it does") from None
        except TimeoutError:
            raise _Invalid(f"the policy did not decide within {self.cfg.policy_timeout:g} s "
                           f"(--policy-timeout); its thread is abandoned") from None
        if not ok:
            raise _Invalid(f"the policy raised:\n{action}")
        if not isinstance(action, Action) or type(action) is Action:
            raise _Invalid(f"the policy returned {action!r:.200}, not an action (Restart, HotSwap, ScaleDown, "
                           "ScaleUp, Cordon, Ignore or Stop)")
        return action

    def _decide(self, event: Event, now: float) -> list[Decision]:
        if event.kind is EventKind.AGENT_LOST and event.node is not None:
            self._lost_since.setdefault(event.node, now)  # kept only while it is a lost member (see the view)
        view = self.view(now)
        fallback: str | None = None
        action: Action | None = None
        if self._policy is not None:
            try:
                action = self._ask(self._policy, event, view)
                action = self._validate(action, event, view)
            except _Invalid as e:
                fallback = str(e)
                logger.warning("policy overruled on %s from %s, the default policy decides: %s",
                               event.kind.value, event.node, fallback.strip().splitlines()[-1])  # traceback: in the ledger
                action = None
        if action is None:
            try:
                action = self._default.decide(event, view)
                action = self._validate(action, event, view)
            except _Invalid as e:
                action = Stop(reason=f"no valid action for {event.kind.value} on {event.node}: {e}")
            except Exception:  # noqa: BLE001 - the default failing must still end in a decision
                logger.exception("the default policy failed on %s", event)
                action = Stop(reason=f"the default policy failed on {event.kind.value} on {event.node}")
        if event.kind is EventKind.PREEMPTION_NOTICE and isinstance(action, (HotSwap, ScaleDown, Ignore)):
            return self._defer_preemption(action, event, now, fallback)
        return self._apply(action, event, now, fallback)

    def _defer_preemption(self, a: Action, event: Event, now: float, fallback: str | None) -> list[Decision]:
        """A swap or a scale-down for a preempted member waits for the step every rank agreed to stop after;
        an ``Ignore`` means nothing replaces it: the job ends as preempted once that step is saved."""
        d = Decision(self._id(), a, event, None, fallback, pending=not isinstance(a, Ignore))
        self._preempting = _PendingPreemption(event.node, event, None if isinstance(a, Ignore) else a, now, d.id)
        return [d]

    def _settle_preemption(self, now: float, why: str, *, force: bool = False) -> list[Decision]:
        p = self._preempting
        a = self._assignment
        if p is None or a is None:
            return []
        if not force and not (p.gone and p.done >= set(a.members) - {p.node}):
            return []
        self._preempting = None
        if p.action is None:
            self._preempted_end = (f"node {p.node} was preempted and nothing could take its place; every node "
                                   f"stopped after the agreed step ({why})")
            logger.warning("job preempted: %s", self._preempted_end)
            return []
        view = self.view(now)
        try:
            act = self._validate(p.action, p.event, view)
        except _Invalid as e:
            self._preempted_end = f"node {p.node} was preempted and {p.action.kind} is no longer possible ({e})"
            logger.warning("job preempted: %s", self._preempted_end)
            return []
        if isinstance(act, Stop):  # the budget is spent: end as preempted (requeued), not as failed
            self._preempted_end = f"node {p.node} was preempted: {act.reason}"
            logger.warning("job preempted: %s", self._preempted_end)
            return []
        import dataclasses

        act = dataclasses.replace(act, reason=f"{p.action.reason}; carried out: {why}")
        return self._apply(act, p.event, now, None)

    def _validate(self, a: Action, event: Event, view: JobView) -> Action:
        """Return the action to carry out (a budget Stop, or a Cordon resolved) or raise :class:`_Invalid`."""
        members = list(view.members)
        lost_members = [m for m in members if view.nodes[m].state is NodeState.LOST]
        nodes = view.nodes

        def left_lost(remaining: list[str]) -> None:
            bad = [m for m in remaining if m in lost_members]
            if bad:
                raise _Invalid(f"{a.kind} leaves lost node(s) {', '.join(bad)} in the job (it would wait forever)")

        def spare_ok(s: str) -> None:
            v = nodes.get(s)
            if v is None or v.state is not NodeState.SPARE or not v.healthy:
                raise _Invalid(f"{a.kind}: {s!r} is not a healthy spare (spares: {', '.join(view.spares) or 'none'})")

        def budget() -> None:
            if view.restarts_left <= 0:
                raise _Budget(a)

        try:
            cd = getattr(a, "cool_down", None)
            if cd is not None and (isinstance(cd, bool) or not isinstance(cd, (int, float)) or not 0 <= cd < float("inf")):
                raise _Invalid(f"{a.kind}: cool_down must be None or a finite number of seconds >= 0, got {cd!r}")
            if isinstance(a, Stop):
                return a
            if isinstance(a, Ignore):
                if event.kind in WORKERS_STOPPED_KINDS:
                    raise _Invalid(f"ignore: {event.node}'s agent already stopped its workers for {event.kind.value}; "
                                   "ignoring it would leave the job idle")
                if (event.kind is EventKind.AGENT_LOST and event.node in lost_members
                        and (view.joining or view.replacement_wait_left > 0)):
                    return a  # waits for a joining spare or a replacement, bounded (see _apply)
                left_lost(members)
                return a
            if isinstance(a, Restart):
                left_lost(members)
                budget()
                return a
            if isinstance(a, HotSwap):
                if a.node not in members:
                    raise _Invalid(f"hot_swap: {a.node!r} holds no group rank (members: {', '.join(members)})")
                spare_ok(a.spare)
                left_lost([m for m in members if m != a.node])
                budget()
                return a
            if isinstance(a, ScaleDown):
                if not a.nodes or len(set(a.nodes)) != len(a.nodes):
                    raise _Invalid(f"scale_down needs distinct nodes, got {list(a.nodes)}")
                out = [n for n in a.nodes if n not in members]
                if out:
                    raise _Invalid(f"scale_down: {', '.join(out)} hold no group rank")
                if view.nodes_per_replica:
                    a = _whole_replicas(a, event, view)
                if len(members) - len(a.nodes) < view.min_nodes:
                    raise _Invalid(f"scale_down to {len(members) - len(a.nodes)} node(s) is below --nnodes min "
                                   f"{view.min_nodes}")
                left_lost([m for m in members if m not in a.nodes])
                budget()
                return a
            if isinstance(a, ScaleUp):
                if not a.spares or len(set(a.spares)) != len(a.spares):
                    raise _Invalid(f"scale_up needs distinct spares, got {list(a.spares)}")
                for s in a.spares:
                    spare_ok(s)
                k = view.nodes_per_replica
                if k and len(a.spares) % k:
                    raise _Invalid(f"scale_up adds whole replicas of {k} node(s) (--nodes-per-replica), got "
                                   f"{len(a.spares)} spare(s): {', '.join(a.spares)}")
                grown = set(view.pending_scale_up) | set(a.spares)
                if len(members) + len(grown) > view.max_nodes:
                    raise _Invalid(f"scale_up to {len(members) + len(grown)} node(s) is above --nnodes max "
                                   f"{view.max_nodes}")
                left_lost(members)
                if view.restarts_left <= 0:  # growing is optional: never stop a healthy job for it
                    raise _Invalid("scale_up needs a restart and the restart budget is spent")
                return a
            if isinstance(a, Cordon):
                if a.node not in nodes:
                    raise _Invalid(f"cordon: unknown node {a.node!r}")
                if a.node not in members:
                    left_lost(members)
                    return a
                why = a.reason or f"cordon {a.node}"
                spares = [s for s in view.spares if s not in view.pending_scale_up] or list(view.spares)
                if spares:
                    inner: Action = HotSwap(a.node, spares[0], reason=f"{why}: spare {spares[0]} takes its place")
                elif len(members) - len(drop := _drop_of(a.node, view)) >= view.min_nodes:
                    inner = ScaleDown(drop, reason=f"{why}: no spare, scaling down"
                                      + (f" by its replica ({', '.join(drop)})" if len(drop) > 1 else ""))
                else:
                    return Stop(reason=f"{why}: no spare, and --nnodes min {view.min_nodes} forbids scaling down")
                left_lost([m for m in members if m not in (a.node, *getattr(inner, "nodes", ()))])
                budget()
                return _Cordoning(inner, node=a.node)
        except _Budget:
            return Stop(reason=f"restart budget spent (--max-restarts {self.cfg.max_restarts}): {a.kind} "
                               f"for {event.kind.value} on {event.node} not possible")
        raise _Invalid(f"unknown action {a!r:.200}")

    # ------------------------------------------------------------------------------------------ effects
    def _id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def _new_round(self, members: list[str]) -> Assignment:
        old = self._assignment
        assert old is not None
        self._restarts_used += 1
        for m in members:
            self._nodes[m].state = NodeState.ACTIVE
        self._assignment = self._make(old.round + 1, members, old)
        return self._assignment

    def _apply(self, a: Action, event: Event | None, now: float, fallback: str | None) -> list[Decision]:
        assert self._assignment is not None
        members = list(self._assignment.members)
        cordon = isinstance(a, _Cordoning)
        cordoned = a.node if isinstance(a, _Cordoning) else None
        if cordon:
            a = a.inner  # type: ignore[attr-defined]

        def out_of_job(n: str) -> None:
            node = self._nodes[n]
            if cordon or node.state is NodeState.ACTIVE:
                node.state = NodeState.CORDONED
                cool = None if cordon else getattr(a, "cool_down", None)
                node.returns_at = None if cool is None else now + cool  # benched, not cordoned for good
            # a lost node stays LOST: it may come back as a spare

        if isinstance(a, Restart):
            return [Decision(self._id(), a, event, self._new_round(members), fallback)]
        if isinstance(a, HotSwap):
            out_of_job(a.node)
            members[members.index(a.node)] = a.spare
            if self._pending is not None and a.spare in self._pending.spares:
                self._pending.spares.remove(a.spare)
                if not self._pending.spares:
                    self._pending = None
            return [Decision(self._id(), a, event, self._new_round(members), fallback)]
        if isinstance(a, ScaleDown):
            benched = self._benched(a, event, cordoned)
            for n in a.nodes:
                if n not in benched:
                    out_of_job(n)
            replica_of = {n: i for i, r in enumerate(self._assignment.replicas) for n in r}
            for n in benched:
                # a healthy node of a dropped replica: a warm spare at once (a hot swap or a scale-up may use it)
                self._nodes[n].state, self._nodes[n].returns_at = NodeState.SPARE, None
                i = replica_of[n]
                self._notes.append(Event(
                    kind=EventKind.NODE_BENCHED, node=n, attempt=self._assignment.attempt, mono=now, wall=time.time(),
                    details={"node": n, "replica": i, "replica_nodes": list(self._assignment.replicas[i]),
                             "reason": a.reason}))
                logger.info("node %s of dropped replica %d is a warm spare", n, i)
            members = [m for m in members if m not in a.nodes]
            return [Decision(self._id(), a, event, self._new_round(members), fallback)]
        if isinstance(a, ScaleUp):
            d = Decision(self._id(), a, event, None, fallback, pending=True)
            if self._pending is None:
                self._pending = _PendingScaleUp(a, list(a.spares), now, self._ckpt_steps.get(LOCAL_TIER), d.id)
            else:
                self._pending.spares += [s for s in a.spares if s not in self._pending.spares]
            return [d]
        if isinstance(a, Cordon):
            self._nodes[a.node].state = NodeState.CORDONED
            self._nodes[a.node].returns_at = None
            if self._pending is not None and a.node in self._pending.spares:
                self._pending.spares.remove(a.node)
                if not self._pending.spares:
                    self._pending = None
            return [Decision(self._id(), a, event, None, fallback)]
        if isinstance(a, Stop):
            self._stopped = a.reason or "stopped by the policy"
            self._pending = None
            logger.error("job stopped: %s", self._stopped)
            return [Decision(self._id(), a, event, None, fallback)]
        if (event is not None and event.kind is EventKind.AGENT_LOST and event.node in members
                and self._nodes[event.node].state is NodeState.LOST):
            # Ignore of a lost member, allowed only while a spare is joining or the replacement wait runs: decided
            # again when a spare is ready, or when the wait has passed (spare_wait for a joining spare)
            left = 0.0 if self._joining_now(now) else self._replacement_left(now)
            self._awaiting.append((event, now + (left if left > 0 else self.cfg.spare_wait)))
        return [Decision(self._id(), a, event, None, fallback)]  # Ignore

    def _benched(self, a: Action, event: Event | None, cordoned: str | None) -> tuple[str, ...]:
        """With --nodes-per-replica: the nodes of a ScaleDown that become warm spares at once: in each dropped
        replica that broke (it holds a lost node, the node the event is about, or the node being cordoned), the
        others, while healthy and active. Without K, or for a replica dropped whole while intact: none."""
        if not self.cfg.nodes_per_replica or not isinstance(a, ScaleDown) or self._assignment is None:
            return ()
        culprits = {n for n in a.nodes if self._nodes[n].state is NodeState.LOST}
        culprits |= {n for n in (cordoned, event.node if event is not None else None) if n in a.nodes}
        out: list[str] = []
        for r in self._assignment.replicas:
            if set(r) & set(a.nodes) and set(r) & culprits:
                out += [n for n in r if n not in culprits and self._nodes[n].state is NodeState.ACTIVE
                        and self._nodes[n].healthy]
        return tuple(out)

    def _apply_scale_up(self, event: Event | None, now: float, why: str) -> list[Decision]:
        p = self._pending
        assert p is not None and self._assignment is not None
        self._pending = None
        members = list(self._assignment.members)
        room = self.cfg.max_nodes - len(members)
        grow = [s for s in p.spares if (n := self._nodes.get(s)) is not None and n.state is NodeState.SPARE
                and n.healthy][:max(0, room)]
        k = self.cfg.nodes_per_replica
        if k:
            grow = grow[:len(grow) - len(grow) % k]  # whole replicas only: a partial one waits as spares
        if not grow:
            logger.info("scale-up %d dropped at %s: none of %s is still a healthy spare, or no room",
                        p.decision_id, why, p.spares)
            return []
        if self.restarts_left <= 0:
            logger.info("scale-up %d dropped: the restart budget is spent", p.decision_id)
            return []
        a = ScaleUp(tuple(grow), reason=f"{p.action.reason}; carried out at {why}".lstrip("; "))
        return [Decision(self._id(), a, event, self._new_round(members + grow))]


class _Budget(Exception):
    def __init__(self, action: Action) -> None:
        self.action = action


@dataclass(frozen=True)
class _Cordoning(Action):
    """A Cordon of a member, resolved to the swap or scale-down that takes it out."""

    inner: Action = field(default_factory=Ignore)
    node: str | None = None  # the node cordoned (the others of its dropped replica become spares)
    kind = "cordon"


def _drop_of(node: str, view: JobView) -> tuple[str, ...]:
    """What a scale-down without ``node`` removes: its replica with --nodes-per-replica, else the node alone."""
    return view.replica_of(node) if view.nodes_per_replica else (node,)


def _whole_replicas(a: ScaleDown, event: Event, view: JobView) -> ScaleDown:
    """A ScaleDown in replica units (--nodes-per-replica): one that names only broken nodes of a replica (lost
    ones, or the node the event is about) drops their whole replica, and says so in its reason; one that would
    leave part of a replica running is refused."""
    named = set(a.nodes)
    broken = {n for n in a.nodes if view.nodes[n].state is NodeState.LOST or n == event.node}
    nodes: list[str] = []
    added: list[str] = []
    for i, r in enumerate(view.replicas):
        if not named & set(r):
            continue
        rest = [n for n in r if n not in named]
        if rest and not (named & set(r)) <= broken:
            raise _Invalid(f"scale_down of {', '.join(n for n in r if n in named)} would split replica {i} "
                           f"({', '.join(r)}): --nodes-per-replica {view.nodes_per_replica} drops whole replicas")
        nodes += r
        added += rest
    if not added:
        return a
    import dataclasses

    why = f"dropping the whole replica of {', '.join(a.nodes)} (also {', '.join(added)})"
    return dataclasses.replace(a, nodes=tuple(nodes), reason=f"{a.reason}; {why}" if a.reason else why)


def _fault_wall(ev: Event) -> float | None:
    """When the fault an event reports happened, on its agent's clock: a hang began at its last heartbeat."""
    wall = ev.wall
    if not isinstance(wall, (int, float)):
        return None
    age = ev.details.get("last_heartbeat_age") if ev.kind is EventKind.HANG else None
    return wall - age if isinstance(age, (int, float)) and not isinstance(age, bool) and age >= 0 else wall


def _nonzero_exit(ev: Event) -> bool:
    code = ev.details.get("exit_code")
    return not (code == 0 and not ev.details.get("signal"))
