"""Never two supervisors: a supervisor acts (publishes a plan that changes the job) only while it accounts for a
majority of the nodes of the last assignment it published, spares included.

A node is accounted for when this supervisor heard from it within ``window`` (half of ``--node-timeout``, see
:mod:`.loop`: its presence hello or any message, heartbeats included), when it is known dead (its presence connection closed and the store
it keeps bound to take over refuses connections, or it said it left), or when it is the node this supervisor runs
in. A node that is merely silent is not: it may be alive on the other side of a partition, following another
supervisor. A closed presence connection alone proves nothing either: an agent that moved to a successor closes
its old connection too, and after a partition heals that close arrives late; only a refused connection (its
kernel answers, nothing listens) says the agent is gone.

Counting is pure (:class:`Quorum`); the loop decides what to do without a majority (hold its decisions; an
agent-hosted supervisor that had a majority and lost it stands down for good, see :mod:`.loop`).
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Iterable
from dataclasses import dataclass


class Reach(enum.Enum):
    """What a TCP connect to an address says about the process behind it."""

    ACCEPTS = "accepts"  # something listens there
    REFUSED = "refused"  # its host answered, nothing listens: the process is gone
    SILENT = "silent"  # no answer within the timeout (a partition, a dead host, a full backlog): nothing is known


def reach(addr: str, timeout: float = 1.0) -> Reach:
    """Try one connection to ``addr`` (host:port), at most ``timeout`` seconds."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return Reach.ACCEPTS
    except ConnectionRefusedError:
        return Reach.REFUSED
    except (OSError, ValueError):
        return Reach.SILENT


@dataclass(frozen=True)
class Count:
    """The nodes of the last assignment and those of them accounted for."""

    nodes: tuple[str, ...]
    accounted: tuple[str, ...]

    @property
    def majority(self) -> bool:
        # before any assignment there is nothing to split: the first one is formed by the nodes that joined
        return not self.nodes or 2 * len(self.accounted) > len(self.nodes)

    def describe(self) -> str:
        missing = [n for n in self.nodes if n not in self.accounted]
        return (f"{len(self.accounted)} of {len(self.nodes)} node(s) of the last assignment accounted for (a majority "
                f"is {len(self.nodes) // 2 + 1}); not heard from: {', '.join(missing) or 'none'}")


class Quorum:
    """Who this supervisor can account for, among which nodes. One writer: the loop's pass (under its lock).

    The set counted changes only as a supervisor with a majority changes it: it grows by the spares that join (they
    are heard: each side of a split could only grow by nodes it hears, and neither side grows without a majority);
    it becomes a new assignment's nodes only once a majority of the set it replaces acknowledged that assignment
    (the dead count, they follow nobody). A set that shrank as soon as a silent node was dropped could leave the
    side of a partition that lost more slowly with a majority of a smaller set while the other side holds one of the
    larger set: two supervisors."""

    def __init__(self, window: float, host: str | None = None) -> None:
        if not (window == window and 0 < window < float("inf")):
            raise ValueError(f"Quorum window must be a positive, finite number of seconds, got {window}")
        self.window, self.host = window, host
        self._nodes: tuple[str, ...] = ()
        self._next: tuple[int, tuple[str, ...]] | None = None  # (round, nodes) waiting for acknowledgements
        self._acks: set[str] = set()
        self._heard: dict[str, float] = {}
        self._dead: set[str] = set()

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    def reset(self, nodes: Iterable[str]) -> None:
        """Count among ``nodes`` from now on (the first assignment; the plan a successor adopts)."""
        self._nodes, self._next, self._acks = tuple(dict.fromkeys(nodes)), None, set()

    def assigned(self, round_: int, nodes: Iterable[str], now: float) -> None:
        """An assignment of ``round_`` was published: its nodes (members and spares) are counted once a majority of
        the current set acknowledged it."""
        if not self._nodes:
            self.reset(nodes)
            return
        self._next, self._acks = (round_, tuple(dict.fromkeys(nodes))), set()
        # spares that came and went must not grow these without bound
        keep = set(self._nodes) | set(self._next[1])
        self._heard = {n: t for n, t in self._heard.items() if n in keep or now - t <= self.window}
        self._dead &= keep
        self._switch()

    def acked(self, node: str, round_: int) -> None:
        if self._next is not None and round_ >= self._next[0]:
            self._acks.add(node)
            self._switch()

    def _switch(self) -> None:
        assert self._next is not None
        sure = self._acks | self._dead | ({self.host} if self.host else set())
        if 2 * len(sure.intersection(self._nodes)) > len(self._nodes):
            self._nodes, self._next, self._acks = self._next[1], None, set()

    def grow(self, nodes: Iterable[str]) -> None:
        """Spares that joined, counted from now on (called only while this supervisor has a majority)."""
        new = [n for n in nodes if n not in self._nodes]
        if new and self._nodes:  # before the first assignment there is nothing to grow
            self._nodes = (*self._nodes, *new)
        if self._next is not None:
            self._next = (self._next[0], (*self._next[1], *(n for n in new if n not in self._next[1])))

    def heard(self, node: str, now: float) -> None:
        if now > self._heard.get(node, float("-inf")):
            self._heard[node] = now
        self._dead.discard(node)

    def dead(self, node: str) -> None:
        self._dead.add(node)
        self._heard.pop(node, None)
        if self._next is not None:
            self._switch()

    def count(self, now: float) -> Count:
        acc = tuple(n for n in self._nodes if n == self.host or n in self._dead
                    or now - self._heard.get(n, float("-inf")) <= self.window)
        return Count(nodes=self._nodes, accounted=acc)
