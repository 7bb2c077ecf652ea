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

# The third exit hazard: gloo releases a finished work on its own thread, some time after ``wait()`` has
# returned to the caller, and with it the work's tensors. Releasing a C++ reference to a tensor that has a
# Python object calls back into Python (``ProcessGroupGloo::AsyncWork::~AsyncWork`` -> ``decref_pyobject``
# -> ``take_gil``, seen in a core dump): the same abort if the training thread has begun finalising. So a
# blocking collective on host tensors is issued as an async one and waited for here, and the last works are
# kept: gloo's thread then never holds the last reference, the release happens in the training thread (when
# a newer call pushes the work out), and at exit the kept works are pinned for good, never released at all.
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


# The second exit hazard is torch's: every backward stashes a Python ``contextvars.Context`` in the
# thread-local state, and each gloo work enqueued during it (DDP's bucket allreduces) copies that state.
# The work is destroyed on gloo's thread after it completes, and that releases the context: the same GIL
# grab, the same abort if the interpreter is already finalising (a core dump shows it: ~AsyncAllreduceWork
# on gloo's runLoop → ~ThreadLocalState → SafePyObject decref → take_gil → pthread_exit → std::terminate,
# while the main thread is in Py_FinalizeEx). So every backward's context is kept for as long as a C++ copy
# holds it (a starved gloo thread may destroy a work several backward passes late: keeping only the last
# two let about one exit in 1,200 abort), and at exit, before finalisation, we wait, bounded, until none does.
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
        # the reference that pass finds (every exit that found a context held once then waited the full time)
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

