"""What the supervisor needs from a node's ledger, sent to it over the control channel.

The supervisor learns the job's checkpoint boundaries (a deferred ``ScaleUp`` waits for the next local one) from
``ckpt_tier_done`` events, which global rank 0's checkpointer writes to its node's ledger and nowhere else. The
nodes may share nothing but the network (each its own ``--run-dir``), and the node of rank 0 need not be the
supervisor's; and where they share a run directory, it holds a file per writing process, thousands in a large job,
which a supervisor following the whole directory would stat at each look (its boundaries then came up to files ×
2 ms late, and its loop waited on the volume). So every agent, the one hosting the supervisor too, follows only
its own host's files for its own node's events of :data:`SUPERVISOR_KINDS` and sends each one to the supervisor
(``ControlClient.report``, which keeps what it cannot send until the supervisor is back); the supervisor reads no
ledger.

A duplicate does no harm (two agents on one host in a shared run directory each read the other's files, but send
only their own node's events): the core keeps only the newest step per tier, and a reported event goes to the core
only, never into the supervisor's ledger, so every report built from the ledger counts it once.

The files are read on a thread of this class (a shared volume can hold a read for seconds, and the agent's loop
must not wait on it); the events found wait in a bounded queue, and the agent's loop sends them (:meth:`pump`) from
its own thread, the control client's one caller.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from resilient.events.api import Event, EventKind
from resilient.events.follow import LEDGER_NAME, LedgerTail
from resilient.events.ledger import writer_host
from resilient.supervisor.api import LEDGER_KINDS

logger = logging.getLogger(__name__)

#: the kinds the supervisor needs from the workers' ledger lines (every other event it needs from a node the agent
#: reports itself: worker exits, detector events)
SUPERVISOR_KINDS: frozenset[EventKind] = LEDGER_KINDS

# events remembered as forwarded: a file read again from its start (replaced or truncated under the tail) sends
# nothing twice; far more than the boundaries written between two reads
_REMEMBERED = 4096


@dataclass(frozen=True)
class ForwardConfig:
    run_dir: Path
    #: this agent's node name: the ``node`` of every event its workers write (others' lines in a shared run
    #: directory are theirs to forward)
    node: str
    kinds: frozenset[EventKind] = SUPERVISOR_KINDS
    #: seconds between two looks at the files: the most a boundary waits here before the agent's loop sends it
    interval: float = 0.5
    #: events waiting for the agent's loop; beyond it the oldest are dropped (only the newest boundary matters)
    max_queued: int = 256
    #: the run directory is listed when its modification time changed, and at least this often (seconds): on a
    #: shared volume with a file per writer, every agent listing thousands of names twice a second would load the
    #: file server for nothing
    rescan: float = 5.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        object.__setattr__(self, "kinds", frozenset(self.kinds))
        if not isinstance(self.node, str) or not self.node:
            raise ValueError(f"ForwardConfig.node must be a node name, got {self.node!r}")
        if not self.kinds or not all(isinstance(k, EventKind) for k in self.kinds):
            raise ValueError(f"ForwardConfig.kinds must be a non-empty set of EventKind, got {set(self.kinds)!r}")
        v = self.interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.01 <= v <= 60:
            raise ValueError(f"ForwardConfig.interval must be between 0.01 and 60 seconds, got {v!r}")
        if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 1:
            raise ValueError(f"ForwardConfig.max_queued must be an integer >= 1, got {self.max_queued!r}")
        v = self.rescan
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
            raise ValueError(f"ForwardConfig.rescan must be a number of seconds > 0 (at most 3600), got {v!r}")


def _identity(ev: Event) -> tuple[object, ...]:
    """What tells two events apart: one writer writes an event once, at its own wall and monotonic times."""
    return ev.kind, ev.node, ev.rank, ev.attempt, ev.wall, ev.mono


class Forwarder:
    """Follows one node's ledger files for :attr:`ForwardConfig.kinds` and hands each new event, once, to
    :meth:`pump`'s ``send``. ``start`` passes over what the files already hold (a rerun in the same run directory
    must not send the last run's boundaries)."""

    def __init__(self, cfg: ForwardConfig):
        self.cfg = cfg
        # this host's writers only: events.jsonl (the run's first writer, maybe this node's agent) and events.<host>-*
        # (on one host with several agents, as in tests, the node filter below tells them apart)
        prefix = f"events.{writer_host()}-"
        self._tail = LedgerTail(cfg.run_dir, names=lambda n: n == LEDGER_NAME or n.startswith(prefix),
                                rescan=cfg.rescan)
        # one kind: only lines naming it are decoded (every step's line is skipped undecoded)
        self._contains = f'"{next(iter(cfg.kinds)).value}"'.encode() if len(cfg.kinds) == 1 else None
        self._lock = threading.Lock()
        self._queue: collections.deque[Event] = collections.deque()  # guarded by _lock
        self._sent: collections.OrderedDict[tuple[object, ...], None] = collections.OrderedDict()  # poll's thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()  # poll() from the thread and from a caller never overlap
        self.dropped = 0  # events dropped from a full queue
        self.forwarded = 0  # events handed to send

    def start(self) -> "Forwarder":
        self._tail.skip_to_end()
        self._thread = threading.Thread(target=self._run, name="resilient-forward", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval):
            self.poll()

    def poll(self) -> int:
        """Look at the files once; the number of new events queued. Never raises (fail static: a ledger that cannot
        be read costs the supervisor a boundary, not the job its training)."""
        with self._poll_lock:
            try:
                evs = self._tail.read_new(contains=self._contains, kinds=self.cfg.kinds)
            except Exception as e:  # noqa: BLE001
                logger.warning("cannot read the ledger in %s to forward checkpoint events: %s", self.cfg.run_dir, e)
                return 0
            new = []
            for ev in evs:
                key = _identity(ev)
                if ev.node != self.cfg.node or key in self._sent:
                    continue
                self._sent[key] = None
                if len(self._sent) > _REMEMBERED:
                    self._sent.popitem(last=False)
                new.append(ev)
            if new:
                with self._lock:
                    self._queue.extend(new)
                    over = len(self._queue) - self.cfg.max_queued
                    for _ in range(max(0, over)):
                        self._queue.popleft()
                    if over > 0:
                        self.dropped += over
                        logger.debug("forward queue full: %d event(s) dropped", over)
            return len(new)

    def pump(self, send: Callable[[Event], object]) -> int:
        """Send the queued events, oldest first (on the caller's thread); how many were sent."""
        with self._lock:
            evs = list(self._queue)
            self._queue.clear()
        for ev in evs:
            try:
                send(ev)
            except Exception as e:  # noqa: BLE001 - fail static; ControlClient.report itself never raises
                logger.warning("could not forward %s of step %s: %s", ev.kind.value, ev.details.get("step"), e)
        self.forwarded += len(evs)
        return len(evs)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop following, waiting at most ``timeout`` for the thread (one stuck in a read of a stalled volume is a
        daemon: it is left behind and never delays the agent's exit)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                logger.debug("the forwarder's thread is still reading %s; left behind", self.cfg.run_dir)

    close = stop


def start_forwarder(run_dir: str | os.PathLike[str], node: str,
                    kinds: Collection[EventKind] = SUPERVISOR_KINDS) -> Forwarder:
    """A started :class:`Forwarder` of ``node``'s events of ``kinds`` in ``run_dir``."""
    return Forwarder(ForwardConfig(Path(run_dir), node, frozenset(kinds))).start()
