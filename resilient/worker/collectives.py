"""Timing hooks: the seconds the training thread spends blocked in collectives, so a heartbeat can carry a
step's *own-work* time (wall time minus waiting), which tells a straggler apart in synchronous training.

Waiting is measured, while ``steps()`` runs (:func:`install` / :func:`uninstall`, counted: nested loops share
one set of wrappers), in four places:

* the ``torch.distributed`` collectives, blocking or issued with ``async_op=True`` (the issue itself);
* ``Work.wait()``, where an async collective's caller blocks: FSDP2 issues its all-gathers and
  reduce-scatters async and waits on the work later, and only the blocked part is waiting (compute overlapped
  between issue and wait is the rank's own work);
* ``wait_tensor`` of the functional collectives (``torch.distributed._functional_collectives``), where eager
  DTensor redistributions block: their collectives are issued as ops and waited on first use;
* for DDP (which keeps its own allreduce), per-parameter gradient hooks and an end-of-backward callback.

Only the training thread is charged, and nested calls (a blocking collective that waits on its work) count
once. Time the training thread spent runnable but waiting for a CPU outside those waits (its run-queue delay,
``/proc/thread-self/schedstat``) is not its own work either: on a busy node the scheduler's choice of which rank
runs next would otherwise make a rank a straggler of its peers (a rank's delay inside a wait is already part of
that wait). Nothing here imports torch: only what the script has already imported is wrapped (a functional
collectives module imported after ``steps()`` began is not).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from resilient.worker.exit_safety import _hold, _remember_context

logger = logging.getLogger(__name__)

_perf = time.perf_counter


class _WaitClock:
    """Seconds the training thread was not doing its own work since the last ``take()``: blocked in collectives,
    or waiting for a CPU outside them. Made by the training thread (its run-queue delay is read from there)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.wait = 0.0
        self.depth = 0
        # DDP buckets of the current step: latest arrival (hook call) and latest completion, and the training
        # thread's run-queue delay at each.
        self.ddp_arrival = -1.0
        self.ddp_done = -1.0
        self.ddp_arrival_queued = self.ddp_done_queued = 0.0
        self.ddp_arrival_read = -1.0  # when ddp_arrival_queued was read
        self._schedstat = _open_schedstat()
        self.queued_in_waits = 0.0  # run-queue delay inside the waits above (already counted as waiting)
        self._queued_mark = self.queued()

    def queued(self) -> float:
        """The training thread's run-queue delay so far, in seconds (0.0 where the kernel does not report it)."""
        fd = self._schedstat
        if fd is None:
            return 0.0
        try:
            return int(os.pread(fd, 96, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError) as e:
            self._schedstat = None  # a failed read turns the reading off for this clock: nothing is subtracted
            _close(fd)
            logger.info("cannot read the training thread's run-queue delay (%s); straggler scores count it as "
                        "the rank's own work from now on", e)
            return 0.0

    def take(self) -> float:
        w = self.wait
        in_waits = self.queued_in_waits
        if self.ddp_arrival >= 0 and self.ddp_done > self.ddp_arrival:
            # backward returns right after the last bucket completes, and the last bucket is ready right
            # after this rank's own backward work: the span between is time spent waiting for peers.
            w += self.ddp_done - self.ddp_arrival
            in_waits += max(0.0, self.ddp_done_queued - self.ddp_arrival_queued)
        now = self.queued()
        w += max(0.0, now - self._queued_mark - in_waits)
        self._queued_mark = now
        self.wait = self.queued_in_waits = 0.0
        self.ddp_arrival = self.ddp_done = self.ddp_arrival_read = -1.0
        return w

    def close(self) -> None:
        fd, self._schedstat = self._schedstat, None
        if fd is not None:
            _close(fd)


def _open_schedstat() -> int | None:
    # bound to the calling thread when opened: any thread may read it later (DDP's hooks may run on autograd's)
    try:
        return os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        logger.info("cannot read the training thread's run-queue delay (%s); straggler scores count it as the "
                    "rank's own work", e)
        return None


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_clock: _WaitClock | None = None
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "_all_gather_base", "_reduce_scatter_base",
    # FSDP2's names for its flat all-gather and reduce-scatter (torch >= 2.13; absent names are skipped)
    "all_gather_single", "reduce_scatter_single",
)
_patched: list[tuple[object, str, object]] = []
_patch_lock = threading.Lock()


def current_wait_seconds() -> float:
    """Seconds spent blocked in collectives since the current step began (0 outside ``steps()``)."""
    c = _clock
    return c.wait if c is not None else 0.0


def _on_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True if the first tensor argument lives in host memory (gloo's case; a device buffer is never held
    longer than its caller holds it: accelerator memory is too dear)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
            if isinstance(a, (list, tuple)) and a:
                a = a[0]
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    return False


def _coalescing() -> bool:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    return bool(getattr(world, "pg_coalesce_state", None))


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    try:
        params = list(inspect.signature(fn).parameters)
        async_pos = params.index("async_op") if "async_op" in params else -1
    except (TypeError, ValueError):
        async_pos = -1

    def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if async_pos < 0 or len(args) > async_pos or not _on_host(args, kwargs) or _coalescing():
            return fn(*args, **kwargs)
        if kwargs.get("async_op"):
            work = fn(*args, **kwargs)
            _hold(work)
            return work
        work = fn(*args, **{**kwargs, "async_op": True})  # a caller may pass async_op=False by name
        if work is None or not hasattr(work, "wait"):  # not a member of the group: nothing was issued
            return None
        _hold(work)
        work.wait()
        return None  # what the blocking form returns

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        return _charged(call, args, kwargs)

    timed.__resilient_timed__ = True  # type: ignore[attr-defined]
    return timed


def _charged(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``call(args, kwargs)``, its time charged to the clock as waiting."""
    c = _clock
    # other threads (a checkpointer's background collectives) do not block the training loop; nested calls
    # (all_gather_object → all_gather, a blocking collective → its work's wait) count once
    if c is None or c.depth or threading.get_ident() != c.thread:
        return call(args, kwargs)
    c.depth += 1
    q0 = c.queued()
    t0 = _perf()
    try:
        return call(args, kwargs)
    finally:
        c.wait += _perf() - t0
        c.queued_in_waits += c.queued() - q0
        c.depth -= 1


def _timed_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper of an unbound method or function whose every call is waiting (``Work.wait``, ``wait_tensor``)."""

    def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if _clock is None or _compiling():
            return fn(*args, **kwargs)
        return _charged(call, args, kwargs)

    timed.__resilient_timed__ = True  # type: ignore[attr-defined]
    return timed


def _compiling() -> bool:
    # inside a traced region the clock would be a graph break, and the wait an op of the graph
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


# DDP's gradient waits are timed without a communication hook: a Python comm hook's callback runs, and is
# released, on the backend's thread, which aborts a finalising interpreter when it takes the GIL. So DDP keeps
# its C++ allreduce, and both instants come from the autograd thread: each parameter's post-accumulate-grad
# hook (the last one: this rank's own backward work is done) and an end-of-backward callback (after DDP
# waited for every bucket).
_bw_queued = False  # one end-of-backward callback per backward pass


def _ddp_grad_ready(_param: Any) -> None:
    global _bw_queued
    c = _clock
    if c is not None:
        t = _perf()
        if t > c.ddp_arrival:
            c.ddp_arrival = t
            # one read a millisecond, not one a parameter (a model of thousands): the delay at the last
            # gradient is then known to within the delay of that millisecond
            if t - c.ddp_arrival_read >= 1e-3:
                c.ddp_arrival_read, c.ddp_arrival_queued = t, c.queued()
    if _bw_queued:
        return
    _bw_queued = True
    try:
        import torch
        from torch.autograd import Variable

        _remember_context(torch)
        Variable._execution_engine.queue_callback(_ddp_requeue)
    except Exception as e:  # noqa: BLE001 - a measurement must never break training
        _bw_queued = False
        logger.debug("cannot time the end of DDP's backward: %s", e)


def _ddp_requeue() -> None:
    # Queued by the first gradient, before DDP queues its own finalize_backward (DDP's hook runs after the
    # parameter's): queue once more so the timing runs after DDP has waited for its buckets.
    try:
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(_ddp_backward_done)
    except Exception:  # noqa: BLE001
        _ddp_backward_done()


def _ddp_backward_done() -> None:
    global _bw_queued
    _bw_queued = False
    c = _clock
    if c is not None:
        t = _perf()
        if t > c.ddp_done:
            c.ddp_done, c.ddp_done_queued = t, c.queued()


def _ddp_forward_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get("_resilient_hook_tried", False):
            self.__dict__["_resilient_hook_tried"] = True
            # hooks stay after steps() ends (they cannot be told apart from a user's): silent without a clock
            try:
                for p in self.module.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(_ddp_grad_ready)
            except Exception as e:  # noqa: BLE001 - a measurement must never break training
                logger.info("cannot time DDP gradient waits (%s); straggler scores will miss them", e)
        return orig(self, *args, **kwargs)

    forward.__resilient_timed__ = True  # type: ignore[attr-defined]
    return forward


_active_loops = 0  # nested or successive steps() loops share one set of wrappers


def install() -> _WaitClock:
    """Wrap collectives of an already imported ``torch.distributed`` (never imports torch itself); returns the
    clock the wrappers charge waiting to."""
    global _clock, _active_loops
    with _patch_lock:
        _active_loops += 1
        if _clock is None:
            _clock = _WaitClock()
        clock = _clock
        if _patched:
            return clock
        mods = [sys.modules.get("torch.distributed"), sys.modules.get("torch.distributed.distributed_c10d")]
        for mod in mods:
            if mod is None:
                continue
            for name in _COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "__resilient_timed__", False):
                    continue
                _patched.append((mod, name, fn))
                setattr(mod, name, _timed(fn))
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        work = getattr(c10d, "Work", None) if c10d is not None else None
        funcol = sys.modules.get("torch.distributed._functional_collectives")
        for obj, name in ((work, "wait"), (funcol, "wait_tensor")):
            fn = getattr(obj, name, None) if obj is not None else None
            if fn is None or getattr(fn, "__resilient_timed__", False):
                continue
            try:
                setattr(obj, name, _timed_method(fn))
            except (AttributeError, TypeError) as e:  # a torch whose Work type is closed: waits go untimed
                logger.info("cannot time %s.%s (%s); straggler scores will miss async waits", obj, name, e)
                continue
            _patched.append((obj, name, fn))
        ddp_mod = sys.modules.get("torch.nn.parallel.distributed")
        ddp = getattr(ddp_mod, "DistributedDataParallel", None) if ddp_mod is not None else None
        if ddp is not None and not getattr(ddp.forward, "__resilient_timed__", False):
            _patched.append((ddp, "forward", ddp.forward))
            ddp.forward = _ddp_forward_wrapper(ddp.forward)
        return clock


def uninstall() -> None:
    """When the last loop ends, restore the original functions (gradient hooks already registered stay;
    they only time, and fall silent without a clock)."""
    global _clock, _active_loops
    with _patch_lock:
        _active_loops = max(0, _active_loops - 1)
        if _active_loops:
            return
        while _patched:
            obj, name, fn = _patched.pop()
            setattr(obj, name, fn)
        if _clock is not None:
            _clock.close()
        _clock = None


