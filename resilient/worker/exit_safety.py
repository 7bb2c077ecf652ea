"""Exit safety of workers that communicate over gloo: nothing gloo's threads release may reach for the GIL
once the interpreter has begun finalising (CPython then ends such a thread with ``pthread_exit``, and the
unwind through C++ ``noexcept`` frames aborts a worker that had succeeded).

Two things are kept here for that: the last works of blocking host collectives (:func:`hold`, pinned for good
at exit) and the Python context of every backward pass that a communication thread may still hold
(:func:`remember_context`, waited for at exit by :func:`drain_backward_state`).
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

# Gloo releases a finished work (and with it tensors that have Python objects) on its own thread, after
# ``wait()`` returned: a GIL grab that aborts a finalising interpreter. So blocking host collectives are issued
# async and waited for here, the last works are kept (released by the training thread as newer ones push them
# out), and at exit the kept ones are pinned for good.
_held_works: collections.deque[Any] = collections.deque(maxlen=16)
_pin_registered = False


def _hold(work: Any) -> None:
    global _pin_registered
    if work is None:
        return
    _held_works.append(work)
    if not _pin_registered:
        _pin_registered = True
        import atexit

        atexit.register(_pin_held_works)


def _pin_held_works() -> None:
    """At interpreter exit: a reference nobody releases to each kept work (it costs their memory, at exit)."""
    import ctypes

    incref = ctypes.pythonapi.Py_IncRef
    incref.argtypes = [ctypes.py_object]
    for w in list(_held_works):
        incref(w)


# Every backward stashes a Python ``contextvars.Context`` in thread-local state that each gloo work enqueued
# during it (DDP's bucket allreduces) copies, and gloo's thread releases that copy when it destroys the work:
# the same GIL grab. A starved gloo thread may do so several backward passes late, so every context is kept
# while a C++ copy holds it, and the exit waits, bounded, until none does.
_backward_contexts: list[Any] = []
_EXIT_DRAIN_TIMEOUT = 5.0
_drain_registered = False


def _remember_context(torch: Any) -> None:
    global _drain_registered
    get = getattr(torch._C, "_get_obj_in_tls", None)
    if get is None:
        return
    try:
        ctx = get("context")
    except Exception:  # noqa: BLE001 - not stashed by this torch version
        return
    if ctx is None:
        return
    if any(c is ctx for c in _backward_contexts):
        return  # the same backward, seen again (a second entry would count as a holder of the first)
    # drop the contexts no C++ copy holds any more (referenced only by the list slot and the argument)
    _backward_contexts[:] = [_backward_contexts[i] for i in range(len(_backward_contexts))
                             if sys.getrefcount(_backward_contexts[i]) > 2] + [ctx]
    if not _drain_registered:
        _drain_registered = True
        import atexit

        atexit.register(drain_backward_state)


def drain_backward_state(timeout: float = _EXIT_DRAIN_TIMEOUT) -> bool:
    """Wait until no communication thread still holds Python state of a finished backward; True if none does.

    Run at interpreter exit (before finalisation) so that gloo's threads release it while they still may
    take the GIL. Our list holds one reference per context, ``sys.getrefcount`` one more: anything beyond is
    a C++ copy not yet released. Polled (nothing signals the release), with the GIL released meanwhile."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        # a count, not a list of the held contexts: such a list, alive during the next pass, would itself be
        # a reference that pass counts
        held = sum(1 for ctx in _backward_contexts if sys.getrefcount(ctx) > 3)  # list, loop variable, argument
        if not held:
            _backward_contexts.clear()
            if time.monotonic() - t0 > 1.0:  # a starved communication thread: worth knowing why an exit was slow
                logger.warning("exit waited %.1fs for communication threads to release a finished backward pass",
                               time.monotonic() - t0)
            return True
        if time.monotonic() > deadline:
            logger.warning("%d finished backward pass(es) still referenced by communication threads after %.1fs",
                           held, timeout)
            return False
        time.sleep(0.002)

