"""Preemption in the worker: the one place that decides where a preempted attempt stops.

SIGTERM to the agent is how schedulers announce preemption; the agent forwards it to the workers. A notice can
also be a file, ``RUN_DIR/preempt`` (see :mod:`resilient.signals.health`). While ``steps()`` runs, SIGTERM only
sets a flag; at the next step boundary (or at the next ``CheckpointManager.save``) the ranks agree on the last
step S to run through the attempt's store with :func:`agree_stop` — the first rank to look proposes (its
step + 1: in synchronous training no rank can have finished a later step yet), the others read its word. The
manager saves S whatever its interval, ``steps()`` ends after S and leaves a mark (:func:`mark_stopped`) the
agent reads to exit "preempted". Trainer integrations and drills reach the agreement through this module only;
:func:`agree_stop` is the one writer of the store key.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["PREEMPT_MARK_DIR", "PREEMPT_NOTICE_FILE", "agree_stop", "stop_proposed", "preempted",
           "preempt_save_due", "on_sigterm", "mark_stopped"]

PREEMPT_MARK_DIR = "preempted"  # RUN_DIR/preempted/attempt<A>.rank<R>: this rank stopped after a saved step
PREEMPT_NOTICE_FILE = "preempt"  # RUN_DIR/preempt: a notice for this node (same name the monitor watches)


def stop_key(attempt: int) -> str:
    """The attempt's store key holding the agreed last step."""
    return f"resilient/preempt_stop/{attempt}"


def _default_store() -> object | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


def agree_stop(attempt: int, proposal: int) -> int:
    """The last step of a preempted attempt every rank agrees on: ``proposal`` if this rank is the first to
    propose, else the first proposal. Raises what the store raises; without a process group, ``proposal``."""
    store = _default_store()
    if store is None:
        return proposal
    got = store.compare_set(stop_key(attempt), "", str(proposal))  # type: ignore[attr-defined]
    return int(got.decode() if isinstance(got, bytes) else got)


@dataclass(frozen=True)
class _Worker:
    """What the agreement needs to know of this worker, bound by ``steps()`` when it reaches the agent."""

    pid: int
    run_dir: str | None
    attempt: int
    multi_node: bool  # another node's preemption reaches this rank through the attempt's store
    started_wall: float


_bound: _Worker | None = None


def bind(run_dir: str | None, attempt: int, multi_node: bool, started_wall: float) -> None:
    global _bound
    _bound = _Worker(os.getpid(), run_dir, attempt, multi_node, started_wall)


def _worker() -> _Worker | None:
    w = _bound
    return w if w is not None and w.pid == os.getpid() else None


class _Preemption:
    def __init__(self) -> None:
        self.signalled = False
        self.stop_step: int | None = None
        self.saved_step: int | None = None

    def noticed(self, w: _Worker | None) -> bool:
        if self.signalled:
            return True
        if w is not None and w.run_dir is not None:
            try:
                # a notice left from before this worker started (an earlier run in the same run dir) is stale
                if os.stat(os.path.join(w.run_dir, PREEMPT_NOTICE_FILE)).st_mtime >= w.started_wall:
                    self.signalled = True
            except OSError:
                pass
        if not self.signalled and w is not None and w.multi_node:
            self.signalled = stop_proposed(w.attempt)
        return self.signalled

    def resolve(self, w: _Worker | None, step: int) -> int | None:
        """The agreed last step, once a notice is known; ``step`` is the step running or about to run."""
        if self.stop_step is not None or not self.noticed(w):
            return self.stop_step
        proposal = step + 1
        agreed = proposal
        try:
            agreed = agree_stop(w.attempt if w is not None else -1, proposal)
        except Exception as e:  # noqa: BLE001 - alone, this rank's own proposal is the best it can do
            logger.warning("cannot agree on the preemption step with the other ranks (%s); stopping after step %d",
                           e, proposal)
        self.stop_step = agreed
        logger.warning("preemption notice: stopping after step %d (a checkpoint of it is saved)", agreed)
        return agreed


_peer_store_broken = False


def stop_proposed(attempt: int) -> bool:
    """Another node's ranks proposed the last step (their node is being preempted): this rank stops there too.
    Checked at every step boundary of a multi-node job, so every rank reads it in time: the proposer's step + 1
    cannot end before every rank has passed the boundary after the proposal (synchronous training)."""
    global _peer_store_broken
    if _peer_store_broken:
        return False
    try:
        store = _default_store()
        if store is None:
            return False
        return bool(store.check([stop_key(attempt)]))  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - no store: this node's own notices still work
        # asked again, an unreachable store fails at once each time but prints torch's C++ trace every step
        _peer_store_broken = True
        logger.warning("the attempt's store is unreachable (%s); another node's preemption will not stop this "
                       "rank (its own notices still do)", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


_preemption = _Preemption()


def preempted() -> bool:
    """True once this worker knows the job is being preempted (SIGTERM forwarded by the agent while
    ``steps()`` runs, or a ``RUN_DIR/preempt`` notice file)."""
    return _preemption.noticed(_worker())


def preempt_save_due(step: int) -> bool:
    """For checkpointers: must ``step`` be saved now whatever the interval? True for the agreed last step
    of a preempted attempt (every rank gets the same answer for the same step)."""
    if not _preemption.signalled and _bound is None:
        return False
    stop = _preemption.resolve(_worker(), step)
    if stop is not None and step == stop:
        _preemption.saved_step = step
        return True
    return False


def on_sigterm(_signum: int, _frame: object) -> None:
    """A SIGTERM handler that only records the notice; the ranks agree on a step at the next step boundary."""
    _preemption.signalled = True


def install_sigterm() -> object | None:
    """Catch SIGTERM while steps() runs, unless the script handles it itself (its handler wins)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        import signal

        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        return signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        return None


def restore_sigterm(old: object | None) -> None:
    if old is None:
        return
    import signal

    try:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, old)  # type: ignore[arg-type]
    except (ValueError, OSError):
        pass


def mark_stopped(run_dir: str | None, attempt: int, rank: int, step: int) -> None:
    """Leave the mark the agent reads to exit "preempted": this rank stopped after the saved ``step``."""
    if run_dir is None:
        return
    try:
        d = os.path.join(run_dir, PREEMPT_MARK_DIR)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".attempt{attempt}.rank{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(d, f"attempt{attempt}.rank{rank}"))
    except OSError as e:
        logger.warning("cannot mark the preempted stop in %s: %s", run_dir, e)
    # no second PREEMPTION_NOTICE in the ledger: the agent's is the one the goodput report counts
