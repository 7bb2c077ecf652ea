"""The scheduling priority of the checkpointer's background threads (``CheckpointConfig.background_nice``).

Linux keeps a nice value and a scheduling policy per thread (``setpriority(PRIO_PROCESS, tid)`` changes that
thread alone, unlike POSIX's per-process rule), and a thread starts with its creator's: lowering the save
worker's and the uploader's priority once, from inside each, also lowers every thread they start (DCP's
writer threads, peer sends run from the save worker, parallel digests, coding and upload-part threads). The
training thread and the threads it started before (gloo's, the data loader's) keep theirs. An unprivileged
thread cannot raise its priority again, so only threads that do nothing but checkpoint work call this.

Elsewhere than Linux a thread id is no process id (``setpriority`` could reach an unrelated process): nothing
is changed there.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

IDLE = "idle"


def thread_priority() -> tuple[int, str] | None:
    """(nice, policy name) of the calling thread, on Linux; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    policy = os.sched_getscheduler(tid)
    name = {os.SCHED_OTHER: "other", getattr(os, "SCHED_IDLE", -1): IDLE,
            getattr(os, "SCHED_BATCH", -1): "batch"}.get(policy, str(policy))
    return os.getpriority(os.PRIO_PROCESS, tid), name


def lower_thread_priority(nice: int | str) -> bool:
    """Lower the calling thread's priority: ``nice`` 1-19, or ``"idle"`` (SCHED_IDLE); 0 leaves it. Never
    raises it (a thread already nicer keeps its value). Returns whether the thread's priority is now the one
    asked for. Call it only from a thread that does checkpoint work alone (see the module note)."""
    if nice == 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        if nice == IDLE:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return True
        n = int(nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < n:
            os.setpriority(os.PRIO_PROCESS, tid, n)
        return True
    except (OSError, AttributeError, ValueError) as e:  # a sandbox may refuse it: the threads run as they were
        logger.debug("cannot lower the priority of checkpoint thread %d to %r: %s", tid, nice, e)
        return False
