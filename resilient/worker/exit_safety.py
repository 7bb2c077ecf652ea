"""Exit safety of workers that communicate over gloo: nothing gloo's threads release may reach for the GIL
once the interpreter has begun finalising (CPython then ends such a thread with ``pthread_exit``, and the
unwind through C++ ``noexcept`` frames aborts a worker that had succeeded).

Two things are kept here for that: the last works of blocking host collectives (:func:`hold`, pinned for good
at exit) and the Python context of every backward pass that a communication thread may still hold
(:func:`remember_context`, waited for at exit by :func:`drain_backward_state`).

And the exit itself (:func:`finish`): a process that imported torch spends seconds in the interpreter's
finalisation (its garbage collections over every object, in a forked worker also copying each page they touch),
after everything it wrote is done. Workers started by resilient-run's fork server, and the launcher, end instead
with ``os._exit`` once their non-daemon threads are joined, every exit hook ran (the checkpointer's final flush,
the ledger's close) and every open file is flushed; no finalisation follows, so no gloo thread can meet one.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from resilient import env as renv

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
    if _finishing:  # ended by finish(): no finalisation follows, and the threads die with the process
        _backward_contexts.clear()
        return True
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


_finishing = False  # set by finish(): the process ends with os._exit after the exit hooks


def fast_exit_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(renv.FAST_EXIT, "1").strip() != "0"


def _join_non_daemon_threads() -> None:
    """As the interpreter does before its exit hooks: wait for every non-daemon thread (they may start more)."""
    me = threading.current_thread()
    while True:
        left = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
        if not left:
            return
        for t in left:
            t.join()  # the program's own semantics: Python's exit waits for them without a bound too


def _flush_open_files() -> None:
    """Flush what finalisation would have flushed when it freed them: every open file object that still holds
    buffered writes (text layers first: they write into the buffered layer below them)."""
    import _io
    import gc
    import io

    objs = gc.get_objects()
    # by type, each type once, through its MRO: isinstance would read each object's ``__class__`` (which some
    # proxies answer with a warning), and an ABC check per object took seconds over a torch process's objects
    bases = (_io._IOBase, io.IOBase)

    def is_file_type(t: type) -> bool:
        try:
            return any(b in t.__mro__ for b in bases)
        except Exception:  # noqa: BLE001 - a metaclass's own __mro__ that fails: not a file
            return False

    file_types = {t for t in {type(o) for o in objs} if is_file_type(t)}
    files = [o for o in objs if type(o) in file_types]
    del objs
    for f in sorted(files, key=lambda o: not isinstance(o, io.TextIOBase)):
        try:
            if not f.closed and f.writable():
                f.flush()
        except Exception:  # noqa: BLE001 - a broken file object cannot stop the exit
            pass


def _skip_torch_library_teardown() -> None:
    """torch deregisters each operator library at exit (a ``weakref.finalize`` per library): a second of
    dispatcher updates in a forked worker, for a process about to end."""
    import weakref

    del_library = getattr(sys.modules.get("torch.library"), "_del_library", None)
    registry = getattr(weakref.finalize, "_registry", None)
    if del_library is None or not isinstance(registry, dict):
        return
    for f, info in list(registry.items()):
        if getattr(info, "func", None) is del_library:
            f.atexit = False


def finish(code: int, *, flush_files: bool = True) -> NoReturn:
    """End this process with ``code`` as the interpreter would, less its finalisation: join the non-daemon
    threads, run the exit hooks (before threading's own exit callbacks, so an executor still takes the final
    upload), run those callbacks (they join executors' threads and threads the hooks started), flush open files
    (``flush_files``: a process that runs only our code knows it closed its own), then ``os._exit``."""
    global _finishing
    import atexit

    _finishing = True
    _join_non_daemon_threads()
    _skip_torch_library_teardown()
    atexit._run_exitfuncs()
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    _join_non_daemon_threads()
    if flush_files:
        _flush_open_files()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
