"""Contract of the supervisor: the actions a policy can take, the read-only view it decides on, and the
``Policy`` protocol.

A decision is a pure function of an event and a :class:`JobView`; carrying it out is the control loop's
job (:mod:`resilient.supervisor.loop`) and the agents'. Nothing here touches a process, a socket or a file,
so a policy is tested by feeding it events (the scenario table: :mod:`resilient.supervisor.scenarios`,
``resilient policy check``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

from resilient.events.api import Event, EventKind
from resilient.supervisor.classify import FailureClass, classify


class PolicyError(Exception):
    """A policy file that cannot be used (syntax error, no ``decide``): refused before anything starts."""


# --------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Action:
    """Base of every action. ``reason`` is free text for people; it goes to the ledger with the action."""

    kind: ClassVar[str] = "action"
    reason: str = field(default="", kw_only=True)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"action": self.kind}
        for k, v in self.__dict__.items():
            d[k] = list(v) if isinstance(v, tuple) else v
        return d


@dataclass(frozen=True)
class Restart(Action):
    """Restart every worker of the active nodes in place (same nodes, same ranks), from the newest checkpoint."""

    kind: ClassVar[str] = "restart"


@dataclass(frozen=True)
class HotSwap(Action):
    """Give ``spare`` the group rank of ``node`` (lost or cordoned); its workers restore that node's shards.

    ``cool_down``: None (the default) cordons an active ``node`` for good; a number of seconds benches it
    instead: once they have passed, a node whose agent is still connected and healthy becomes a warm spare
    again (a node swapped out on suspicion, not on proof, is not lost to the job)."""

    kind: ClassVar[str] = "hot_swap"
    node: str
    spare: str
    cool_down: float | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class ScaleDown(Action):
    """Continue without ``nodes`` (data parallelism shrinks), within ``--nnodes MIN:MAX``."""

    kind: ClassVar[str] = "scale_down"
    nodes: tuple[str, ...]
    cool_down: float | None = field(default=None, kw_only=True)  # as for HotSwap: None cordons for good

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))


@dataclass(frozen=True)
class ScaleUp(Action):
    """Grow onto ``spares`` at the next checkpoint boundary (save, restart at the larger size, restore)."""

    kind: ClassVar[str] = "scale_up"
    spares: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "spares", tuple(self.spares))


@dataclass(frozen=True)
class Cordon(Action):
    """Never use ``node`` again in this job (it stays out of the active set and of the spares)."""

    kind: ClassVar[str] = "cordon"
    node: str


@dataclass(frozen=True)
class Ignore(Action):
    """Do nothing (the event is recorded all the same). Refused for the kinds in :data:`WORKERS_STOPPED_KINDS`:
    the default policy decides instead."""

    kind: ClassVar[str] = "ignore"


@dataclass(frozen=True)
class Stop(Action):
    """End the job: workers are stopped and every agent exits with a failure."""

    kind: ClassVar[str] = "stop"


ACTIONS: tuple[type[Action], ...] = (Restart, HotSwap, ScaleDown, ScaleUp, Cordon, Ignore, Stop)

# --------------------------------------------------------------------------------------------- event kinds
# a node's failures: counted against it in its view (``NodeView.failures``)
FAILURE_KINDS = frozenset({EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST})
HEALTH_KINDS = frozenset({EventKind.HOST_UNHEALTHY, EventKind.GPU_UNHEALTHY})
# the node's agent stopped its workers before reporting these: an Ignore would leave the job idle for good
WORKERS_STOPPED_KINDS = frozenset({EventKind.WORKER_EXIT, EventKind.HANG})
# what workers write only to their node's ledger and the supervisor still needs (checkpoint boundaries): every
# agent follows its own node's ledger files for these and forwards them (:mod:`resilient.launcher.forward`); the
# supervisor reads no ledger (a shared run directory of thousands of writers' files would cost it a look each)
LEDGER_KINDS = frozenset({EventKind.CKPT_TIER_DONE})


# --------------------------------------------------------------------------------------------- the view
class NodeState(str, enum.Enum):
    ACTIVE = "active"  # holds a group rank in the current assignment
    SPARE = "spare"  # joined and warm (fork server ready), no workers
    LOST = "lost"  # stopped reporting for --node-timeout, or its connection dropped
    CORDONED = "cordoned"  # excluded by a Cordon action, or benched by a swap/scale-down with a cool-down


@dataclass(frozen=True)
class NodeView:
    name: str
    state: NodeState
    group_rank: int | None = None  # set while ACTIVE, and while LOST until the decision that replaces it
    nproc: int = 1  # workers it runs when active
    healthy: bool = True  # False after a host/GPU-unhealthy event, until it reports healthy again
    failures: int = 0  # failures attributed to this node within the view's failure window
    stragglers: int = 0  # straggler events attributed to this node within the window
    last_seen: float = 0.0  # monotonic time of its last report, as seen by the supervisor


@dataclass(frozen=True)
class JobView:
    """What a policy knows when it decides. Frozen; mappings are read-only proxies."""

    nodes: Mapping[str, NodeView]
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    restarts_left: int  # what remains of --max-restarts (every restart, swap or scale counts one)
    attempt: int = 0
    ckpt_steps: Mapping[str, int] = field(default_factory=dict)  # tier → newest complete step
    recent: tuple[Event, ...] = ()  # newest last, bounded; checkpoint reports are in ckpt_steps, not here
    failure_window: float = 3600.0  # seconds over which ``NodeView.failures`` is counted
    now: float = 0.0
    pending_scale_up: tuple[str, ...] = ()  # spares of a ScaleUp decided, waiting for a checkpoint boundary
    # joining spares: agents that connected and are still warming up (within SupervisorConfig.spare_wait), oldest
    # first; an Ignore for a lost member while there are some waits for them (bounded by spare_wait)
    joining: tuple[str, ...] = ()
    # --replacement-wait: seconds the oldest lost member still waits for a node to join in its place (0: none, or
    # the wait is over); an Ignore for a lost member while it is > 0 is decided again when a spare is ready, or
    # when it runs out
    replacement_wait_left: float = 0.0
    # --nodes-per-replica K: a replica is K nodes of consecutive group ranks, and the job grows and shrinks by whole
    # replicas (the core refuses a ScaleDown or ScaleUp that would split one); None: every rank is a replica
    nodes_per_replica: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", MappingProxyType(dict(self.nodes)))
        object.__setattr__(self, "ckpt_steps", MappingProxyType(dict(self.ckpt_steps)))
        object.__setattr__(self, "recent", tuple(self.recent))
        object.__setattr__(self, "pending_scale_up", tuple(self.pending_scale_up))
        object.__setattr__(self, "joining", tuple(self.joining))

    def _in(self, state: NodeState) -> tuple[str, ...]:
        return tuple(n for n, v in self.nodes.items() if v.state == state)

    @property
    def active(self) -> tuple[str, ...]:
        """Active nodes in group-rank order."""
        act = [v for v in self.nodes.values() if v.state == NodeState.ACTIVE]
        return tuple(v.name for v in sorted(act, key=lambda v: (v.group_rank is None, v.group_rank or 0)))

    @property
    def members(self) -> tuple[str, ...]:
        """Nodes holding a group rank in the current assignment, in group-rank order: the active ones and a
        just-lost one that the decision being made has to replace or drop."""
        mem = [v for v in self.nodes.values() if v.group_rank is not None
               and v.state in (NodeState.ACTIVE, NodeState.LOST)]
        return tuple(v.name for v in sorted(mem, key=lambda v: v.group_rank or 0))

    @property
    def spares(self) -> tuple[str, ...]:
        """Healthy spares, oldest first."""
        return tuple(n for n in self._in(NodeState.SPARE) if self.nodes[n].healthy)

    @property
    def lost(self) -> tuple[str, ...]:
        return self._in(NodeState.LOST)

    @property
    def cordoned(self) -> tuple[str, ...]:
        return self._in(NodeState.CORDONED)

    @property
    def world_size(self) -> int:
        return sum(self.nodes[n].nproc for n in self.active)

    @property
    def replicas(self) -> tuple[tuple[str, ...], ...]:
        """The members chunked into replicas, in group-rank order: replica i holds group ranks i*K .. i*K+K-1
        (``nodes_per_replica`` K). A just-lost member still sits in its replica, so that a decision sees which
        replica broke. Without K, one node per tuple."""
        k = self.nodes_per_replica or 1
        out: dict[int, list[str]] = {}
        for m in self.members:
            out.setdefault((self.nodes[m].group_rank or 0) // k, []).append(m)
        return tuple(tuple(out[i]) for i in sorted(out))

    def replica_of(self, node: str) -> tuple[str, ...]:
        """The replica ``node`` belongs to (its nodes in group-rank order); ``()`` for a node holding no group rank."""
        return next((r for r in self.replicas if node in r), ())

    @property
    def dp_size(self) -> int:
        """Data-parallel size: with ``nodes_per_replica``, the replicas whose nodes are all active (a replica with a
        lost node cannot train); without it, the world size (every rank is a replica)."""
        if not self.nodes_per_replica:
            return self.world_size
        return sum(all(self.nodes[m].state is NodeState.ACTIVE for m in r) for r in self.replicas)

    @property
    def newest_checkpoint(self) -> int | None:
        return max(self.ckpt_steps.values(), default=None)

    def node_of(self, event: Event) -> NodeView | None:
        return self.nodes.get(event.node)

    @staticmethod
    def failure_class(event: Event) -> FailureClass:
        """Why ``event``'s failure happened, as one stable class (:mod:`resilient.supervisor.classify`): the
        ``failure_class`` the agent wrote into the event, else the class its kind and details give."""
        return classify(event.kind, event.details)


@runtime_checkable
class Policy(Protocol):
    """``decide(event, view) -> Action``. Called once per event that can need a decision; must be quick
    (``--policy-timeout``), must not block, and must not change the view."""

    def decide(self, event: Event, view: JobView) -> Action: ...
