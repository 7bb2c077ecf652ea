"""``--inject``: a drill's faults, carried out for real.

Time-based faults (seconds after training started: a first-round node counts from its own first spawn, a
node that joined later from the supervisor's start time) are carried out by the agent holding the target,
for any script:
SIGKILL or SIGSTOP of a worker, deletion of the node's local tier, SIGKILL of the whole node (agent, fork
server, workers). Step-based and in-step faults (``slow-rank``, ``raise-worker``, ``…@stepN``) are handed to
the workers through ``RESILIENT_FAULTS``; ``resilient.steps()`` carries them out. Every fault is written to
the ledger as ``fault_injected`` before it happens.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence

from resilient.events import EventKind, Ledger
from resilient.drill.spec import KIND_TO_HOW, FaultKind, FaultSpec, WorkerFault, plan_env

logger = logging.getLogger(__name__)

_IN_WORKER = (FaultKind.SLOW_RANK, FaultKind.RAISE_WORKER)


class Injector:
    def __init__(self, specs: Sequence[FaultSpec], ledger: Ledger):
        self.ledger = ledger
        self.timed = [f for f in specs if f.at_seconds is not None and f.kind not in _IN_WORKER]
        self.worker = [WorkerFault(KIND_TO_HOW[f.kind], f.target or 0, f.at_step or 0,
                                   attempt=None if f.kind == FaultKind.SLOW_RANK else 0, seconds=f.seconds)
                       for f in specs if f not in self.timed]
        self.t0: float | None = None  # wall time the job's first round started
        self._done: set[int] = set()

    def env(self) -> dict[str, str]:
        return plan_env(*self.worker) if self.worker else {}

    def started(self, round_: int, job_start_wall: float | None) -> None:
        """This node runs workers from now on. A node of the first round counts from its own first spawn
        (the job's start, give or take the nodes' start-up skew); a node that joins later (a spare) counts on
        the supervisor's clock, and the faults that fell due before it ran are not its business."""
        if self.t0 is not None:
            return
        now = time.time()
        if round_ == 0 or job_start_wall is None:
            self.t0 = now
            return
        self.t0 = job_start_wall
        for i, f in enumerate(self.timed):
            if self.t0 + (f.at_seconds or 0.0) <= now:  # fell due before this node ran: it happened elsewhere
                self._done.add(i)

    def tick(self, workers: dict[int, int], group_rank: int, ckpt_local: str | None,
             kill_node: Callable[[], None]) -> float | None:
        """The agent's one call per pass: carry out what is due; seconds until the next fault, or None."""
        due = self.next_due()
        self.fire(workers, group_rank, ckpt_local, kill_node)
        return due

    def next_due(self) -> float | None:
        """Seconds until the next fault, or None."""
        if self.t0 is None:
            return None
        left = [self.t0 + (f.at_seconds or 0.0) - time.time() for i, f in enumerate(self.timed) if i not in self._done]
        return max(0.0, min(left)) if left else None

    def fire(self, workers: dict[int, int], group_rank: int, ckpt_local: str | None,
             kill_node: Callable[[], None]) -> None:
        """Carry out what is due and targets this node: ``workers`` maps this node's ranks to live pids."""
        if self.t0 is None:
            return
        now = time.time()
        for i, f in enumerate(self.timed):
            if i in self._done or self.t0 + (f.at_seconds or 0.0) > now:
                continue
            mine = (group_rank == f.target) if f.kind == FaultKind.KILL_NODE else (f.target in workers)
            self._done.add(i)  # every node reads the same list: only the holder of the target acts
            if not mine:
                continue
            self.ledger.emit(EventKind.FAULT_INJECTED, rank=None if f.kind == FaultKind.KILL_NODE else f.target,
                             fault=f.kind.value, target=f.target, at=f.describe())
            logger.warning("injecting %s", f.describe())
            if f.kind == FaultKind.KILL_WORKER:
                _signal(workers[f.target], signal.SIGKILL)
            elif f.kind == FaultKind.HANG_WORKER:
                _signal(workers[f.target], signal.SIGSTOP)
            elif f.kind == FaultKind.WIPE_TIER and ckpt_local:
                shutil.rmtree(ckpt_local, ignore_errors=True)
            elif f.kind == FaultKind.KILL_NODE:
                sys.stderr.flush()
                kill_node()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
