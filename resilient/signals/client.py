"""Worker side of the signals: ``resilient.steps``, ``resilient.section``, ``resilient.on_scale``.

Under ``resilient-run`` (``RESILIENT_AGENT_SOCKET`` set) every step sends one non-blocking packet to the
node agent: a heartbeat carrying the previous step's wall time and its *own-work* time (wall time minus
the time this rank spent blocked in collectives). Own work is what tells the straggler apart: in
synchronous training every rank's step lasts as long as the slowest rank's, but only the slow rank spends
little of it waiting. Waiting is measured by wrapping the synchronous ``torch.distributed`` collectives and
by per-parameter gradient hooks and an end-of-backward callback on DDP modules (DDP keeps its own allreduce), installed while
``steps()`` runs, so unmodified DDP scripts and hand-written ``all_reduce`` loops both report it.

Global rank 0 also writes one ``STEP`` event per completed step (and one ``SECTION`` event per finished
section) to the run's ledger. Outside ``resilient-run`` ``steps()`` is a plain ``range``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from resilient import env
from resilient.events.api import SCHEMA_VERSION, Event, EventKind
from resilient.events.ledger import Ledger
from resilient.signals import protocol as P
from resilient.signals import scale as _scale
from resilient.signals.api import ScaleEvent

__all__ = ["steps", "section", "on_scale", "ScaleEvent", "current_wait_seconds", "preempted", "preempt_save_due"]

logger = logging.getLogger(__name__)

_scale_callbacks: list[Callable[[ScaleEvent], Any]] = []
_perf = time.perf_counter
_RECONNECT_EVERY = 1.0  # seconds between reconnection attempts when the agent is unreachable
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def on_scale(fn: Callable[[ScaleEvent], Any]) -> Callable[[ScaleEvent], Any]:
    """Register ``fn(ScaleEvent)``, called at the start of ``steps()`` (before the first step) in an attempt
    whose world size or data-parallel size differs from the last attempt that completed a step.
    Usable as a decorator. Exceptions from ``fn`` propagate: a wrong learning-rate rescale must not pass
    silently."""
    if not callable(fn):
        raise TypeError(f"on_scale needs a callable taking a ScaleEvent, got {fn!r}")
    _scale_callbacks.append(fn)
    return fn


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


class _Client:
    """Per-process connection to the node agent; created lazily, re-created after a fork."""

    def __init__(self, address: str) -> None:
        self.pid = os.getpid()
        self.started_wall = time.time() - 1.0  # file mtimes are coarse: a notice written just before counts
        self.address = P.socket_address(address)
        self.rank = _int_env("RANK", 0)
        self.local_rank = _int_env("LOCAL_RANK", 0)
        self.world_size = _int_env("WORLD_SIZE", 1)
        self.local_world_size = _int_env("LOCAL_WORLD_SIZE", 1)
        self.attempt = _int_env("TORCHELASTIC_RESTART_COUNT", -1)
        # another node's preemption reaches this rank through the attempt's store (see _peer_proposed)
        self.multi_node = _int_env("GROUP_WORLD_SIZE", 1) > 1
        self.run_dir = os.environ.get(env.RUN_DIR) or None
        self._hdr = {t: P.header(t, self.local_rank, self.rank, self.pid, self.attempt)
                     for t in (P.HELLO, P.STEP, P.SECTION_START, P.SECTION_END, P.DONE)}
        self.sock: socket.socket | None = None
        self._next_connect = 0.0
        self.dropped = 0
        self.ledger = Ledger.from_env() if self.rank == 0 else None
        self._step_prefix = b""
        if self.ledger is not None:
            # STEP lines are formatted here rather than through Event/asdict (~40 µs → a few): the hot path
            # of rank 0. The prefix holds the fields that never change; the ledger parses them like any line.
            proto = Event(kind=EventKind.STEP, rank=self.rank, attempt=self.ledger.attempt).to_json()
            self._step_prefix = ('{"kind":"step","node":%s,"rank":%d,"attempt":%s,"details":{"step":'
                                 % (json.dumps(proto["node"]), self.rank, json.dumps(proto["attempt"]))).encode()
        self._connect()

    def _connect(self) -> None:
        self._next_connect = _perf() + _RECONNECT_EVERY
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.setblocking(False)
            s.connect(self.address)
        except OSError as e:
            s.close()
            if self.sock is None and self.dropped == 0:
                logger.info("node agent socket %r unreachable (%s); heartbeats are dropped until it is", self.address, e)
            return
        old, self.sock = self.sock, s
        if old is not None:
            old.close()

    def send(self, data: bytes) -> None:
        # Hot path: one non-blocking send; on any failure the packet is dropped, never retried inline.
        s = self.sock
        if s is not None:
            try:
                s.send(data, _NOSIGNAL)  # a dead agent must not SIGPIPE a script that restored SIGPIPE
                return
            except BlockingIOError:
                self.dropped += 1
                return
            except OSError:
                s.close()
                self.sock = None
        self.dropped += 1
        if _perf() >= self._next_connect:
            self._connect()

    def hello(self, step: int) -> None:
        self.send(P.pack_hello(self._hdr[P.HELLO], self.world_size, self.local_world_size, step))

    def step(self, step: int, seconds: float, compute: float) -> None:
        self.send(P.pack_step(self._hdr[P.STEP], step, seconds, compute))

    def done(self, step: int) -> None:
        self.send(P.pack_done(self._hdr[P.DONE], step))

    def record_step(self, step: int, seconds: float, compute: float) -> None:
        """One STEP event in the ledger (rank 0), formatted as ``Event.to_json`` would, one os.write."""
        led = self.ledger
        if led is None:
            return
        line = self._step_prefix + (
            '%d,"seconds":%r,"compute_seconds":%r},"wall":%r,"mono":%r,"schema":%d}\n'
            % (step, seconds, compute, time.time(), time.monotonic(), SCHEMA_VERSION)).encode()
        if not led.write_line(line):
            self.ledger = None
            logger.warning("ledger write failed; step events are no longer recorded")

    def section_start(self, name: str, timeout: float | None) -> None:
        self.send(P.pack_section_start(self._hdr[P.SECTION_START], name, timeout))

    def section_end(self, name: str, seconds: float) -> None:
        self.send(P.pack_section_end(self._hdr[P.SECTION_END], name, seconds))


_client_lock = threading.Lock()
_client_obj: _Client | None = None


def _client() -> _Client | None:
    global _client_obj
    c = _client_obj
    if c is not None and c.pid == os.getpid():
        return c
    address = os.environ.get(env.AGENT_SOCKET)
    if not address:
        return None
    with _client_lock:
        if _client_obj is None or _client_obj.pid != os.getpid():
            _client_obj = _Client(address)
        return _client_obj


# --- waiting time in collectives ------------------------------------------------------------------

class _WaitClock:
    """Seconds the training thread spent blocked in collectives since the last ``take()``."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.wait = 0.0
        self.depth = 0
        # DDP buckets of the current step: latest arrival (hook call) and latest completion.
        self.ddp_arrival = -1.0
        self.ddp_done = -1.0

    def take(self) -> float:
        w = self.wait
        if self.ddp_arrival >= 0 and self.ddp_done > self.ddp_arrival:
            # backward returns right after the last bucket completes, and the last bucket is ready right
            # after this rank's own backward work: the span between is time spent waiting for peers.
            w += self.ddp_done - self.ddp_arrival
        self.wait = 0.0
        self.ddp_arrival = self.ddp_done = -1.0
        return w


_clock: _WaitClock | None = None
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "_all_gather_base", "_reduce_scatter_base",
)
_patched: list[tuple[object, str, object]] = []
_patch_lock = threading.Lock()


def current_wait_seconds() -> float:
    """Seconds spent blocked in collectives since the current step began (0 outside ``steps()``)."""
    c = _clock
    return c.wait if c is not None else 0.0


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
        work = fn(*args, **kwargs, async_op=True)
        if work is None or not hasattr(work, "wait"):  # not a member of the group: nothing was issued
            return None
        _hold(work)
        work.wait()
        return None  # what the blocking form returns

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        c = _clock
        # async ops return at once (their wait is elsewhere); other threads (a checkpointer's background
        # collectives) do not block the training loop; nested calls (all_gather_object → all_gather)
        # count once.
        if c is None or kwargs.get("async_op") or c.depth or threading.get_ident() != c.thread:
            return call(args, kwargs)
        c.depth += 1
        t0 = _perf()
        try:
            return call(args, kwargs)
        finally:
            c.wait += _perf() - t0
            c.depth -= 1

    timed.__resilient_timed__ = True  # type: ignore[attr-defined]
    return timed


# DDP's gradient waits are timed without a communication hook. A Python comm hook (torch's own
# ``allreduce_hook`` included) chains ``fut.then(callback)``; the callback, and the release of its
# references, run on the backend's thread when the allreduce completes. If that thread reaches for the GIL
# after the training thread has begun interpreter shutdown, CPython ends it with ``pthread_exit`` and the
# unwind through C++ ``noexcept`` frames aborts the process ("terminate called without an active
# exception"): a successful worker killed by SIGABRT at exit, most often under CPU contention. So DDP keeps
# its built-in C++ allreduce, and the two instants come from the autograd thread: each parameter's
# post-accumulate-grad hook (the last one is when this rank's own backward work is done, i.e. the last
# bucket is ready) and an end-of-backward callback (after DDP waited for every bucket).

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
_bw_queued = False  # one end-of-backward callback per backward pass


def _ddp_grad_ready(_param: Any) -> None:
    global _bw_queued
    c = _clock
    if c is not None:
        c.ddp_arrival = max(c.ddp_arrival, _perf())
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
        c.ddp_done = max(c.ddp_done, _perf())


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


def _install_timers() -> None:
    """Wrap collectives of an already imported ``torch.distributed`` (never imports torch itself)."""
    global _clock, _active_loops
    with _patch_lock:
        _active_loops += 1
        if _clock is None:
            _clock = _WaitClock()
        if _patched:
            return
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
        ddp_mod = sys.modules.get("torch.nn.parallel.distributed")
        ddp = getattr(ddp_mod, "DistributedDataParallel", None) if ddp_mod is not None else None
        if ddp is not None and not getattr(ddp.forward, "__resilient_timed__", False):
            _patched.append((ddp, "forward", ddp.forward))
            ddp.forward = _ddp_forward_wrapper(ddp.forward)


def _uninstall_timers() -> None:
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
        _clock = None


# --- preemption -----------------------------------------------------------------------------------
# SIGTERM to the agent is how schedulers announce preemption; the agent forwards it to the workers. A
# notice can also be a file, RUN_DIR/preempt (see resilient.signals.health). While steps() runs, SIGTERM
# only sets a flag; at the next step boundary (or at the next CheckpointManager.save) the ranks agree on
# the last step S to run through the attempt's store — the first rank to look proposes (its step + 1: in
# synchronous training no rank can have finished a later step yet), the others read its word. The manager
# saves S whatever its interval, steps() ends after S and leaves a mark the agent reads to exit "preempted".

PREEMPT_MARK_DIR = "preempted"  # RUN_DIR/preempted/attempt<A>.rank<R>: this rank stopped after a saved step
PREEMPT_NOTICE_FILE = "preempt"  # RUN_DIR/preempt: a notice for this node (same name the monitor watches)


class _Preemption:
    def __init__(self) -> None:
        self.signalled = False
        self.stop_step: int | None = None
        self.saved_step: int | None = None

    def noticed(self, c: "_Client | None") -> bool:
        if self.signalled:
            return True
        if c is not None and c.run_dir is not None:
            try:
                # a notice left from before this worker started (an earlier run in the same run dir) is stale
                if os.stat(os.path.join(c.run_dir, PREEMPT_NOTICE_FILE)).st_mtime >= c.started_wall:
                    self.signalled = True
            except OSError:
                pass
        if not self.signalled and c is not None and c.multi_node:
            self.signalled = _peer_proposed(c.attempt)
        return self.signalled

    def resolve(self, c: "_Client | None", step: int) -> int | None:
        """The agreed last step, once a notice is known; ``step`` is the step running or about to run."""
        if self.stop_step is not None or not self.noticed(c):
            return self.stop_step
        proposal = step + 1
        agreed = proposal
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                store = dist.distributed_c10d._get_default_store()
                attempt = c.attempt if c is not None else -1
                got = store.compare_set(f"resilient/preempt_stop/{attempt}", "", str(proposal))
                agreed = int(got.decode() if isinstance(got, bytes) else got)
        except Exception as e:  # noqa: BLE001 - alone, this rank's own proposal is the best it can do
            logger.warning("cannot agree on the preemption step with the other ranks (%s); stopping after step %d",
                           e, proposal)
        self.stop_step = agreed
        logger.warning("preemption notice: stopping after step %d (a checkpoint of it is saved)", agreed)
        return agreed


def _peer_proposed(attempt: int) -> bool:
    """Another node's ranks proposed the last step (their node is being preempted): this rank stops there too.
    Checked at every step boundary of a multi-node job, so every rank reads it in time: the proposer's step + 1
    cannot end before every rank has passed the boundary after the proposal (synchronous training)."""
    global _peer_store_broken
    if _peer_store_broken:
        return False
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        return bool(dist.distributed_c10d._get_default_store().check([f"resilient/preempt_stop/{attempt}"]))
    except Exception as e:  # noqa: BLE001 - no store: this node's own notices still work
        # the store's host went away while training goes on (a restarted supervisor): asked again, it fails at
        # once each time but prints torch's C++ trace to stderr every step; so it is asked no more
        _peer_store_broken = True
        logger.warning("the attempt's store is unreachable (%s); another node's preemption will not stop this "
                       "rank (its own notices still do)", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


_peer_store_broken = False


_preemption = _Preemption()


def preempted() -> bool:
    """True once this worker knows the job is being preempted (SIGTERM forwarded by the agent while
    ``steps()`` runs, or a ``RUN_DIR/preempt`` notice file)."""
    return _preemption.noticed(_client_obj if _client_obj is not None and _client_obj.pid == os.getpid() else None)


def preempt_save_due(step: int) -> bool:
    """For checkpointers: must ``step`` be saved now whatever the interval? True for the agreed last step
    of a preempted attempt (every rank gets the same answer for the same step)."""
    if not _preemption.signalled and _client_obj is None:
        return False
    c = _client_obj if _client_obj is not None and _client_obj.pid == os.getpid() else None
    stop = _preemption.resolve(c, step)
    if stop is not None and step == stop:
        _preemption.saved_step = step
        return True
    return False


def _on_sigterm(_signum: int, _frame: object) -> None:
    _preemption.signalled = True


def _install_sigterm() -> object | None:
    """Catch SIGTERM while steps() runs, unless the script handles it itself (its handler wins)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        import signal

        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return None


def _restore_sigterm(old: object | None) -> None:
    if old is None:
        return
    import signal

    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, old)  # type: ignore[arg-type]
    except (ValueError, OSError):
        pass


def _mark_preempted(c: _Client, step: int) -> None:
    if c.run_dir is None:
        return
    try:
        d = os.path.join(c.run_dir, PREEMPT_MARK_DIR)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".attempt{c.attempt}.rank{c.rank}.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(d, f"attempt{c.attempt}.rank{c.rank}"))
    except OSError as e:
        logger.warning("cannot mark the preempted stop in %s: %s", c.run_dir, e)
    # no second PREEMPTION_NOTICE in the ledger: the agent's is the one the goodput report counts


# --- steps / section ---------------------------------------------------------------------------------

def steps(start: int, stop: int | None = None, *, dp_size: int | None = None) -> Iterator[int]:
    """Iterate over training steps ``start, start+1, ...`` (up to ``stop`` excluded; forever when None).

    Under ``resilient-run`` each step sends a heartbeat with the previous step's timings, rank 0 records a
    STEP event per completed step, and ``on_scale`` callbacks run before the first step when the world size
    (or ``dp_size``, default: the world size) differs from the previous attempt's. A step left by ``break``
    or an exception is not recorded as completed.
    """
    c = _client()
    if c is None:
        return range(start, stop) if stop is not None else itertools.count(start)  # type: ignore[return-value]
    return _steps(c, start, stop, dp_size)


def _check_scale(c: _Client, dp_size: int) -> None:
    if c.run_dir is None:
        return
    prev = _scale.read_world(c.run_dir)
    if prev is None or (prev.world_size == c.world_size and prev.dp_size == dp_size):
        return
    ev = ScaleEvent(old_world_size=prev.world_size, new_world_size=c.world_size,
                    old_dp_size=prev.dp_size, new_dp_size=dp_size)
    logger.info("world changed since the last attempt: %s", ev)
    if c.ledger is not None:
        c.ledger.emit(EventKind.SCALE, rank=c.rank, old_world_size=ev.old_world_size,
                      new_world_size=ev.new_world_size, old_dp=ev.old_dp_size, new_dp=ev.new_dp_size)
    for fn in list(_scale_callbacks):
        fn(ev)


def _compile_cache() -> Any:
    """Restore the run's torch.compile caches before anything compiles (compilation is lazy, so the start of
    ``steps()`` is early enough); ``RESILIENT_COMPILE_CACHE=0`` turns it off."""
    if os.environ.get("RESILIENT_COMPILE_CACHE", "1") == "0":
        return None
    try:
        from resilient.compile_cache import enable

        return enable()
    except Exception as e:  # noqa: BLE001 - a cache is a speed-up, never a reason to stop training
        logger.warning("compile cache unavailable: %s", e)
        return None


def _save_compile_cache(cc: Any) -> None:
    try:
        cc.maybe_save()
    except Exception as e:  # noqa: BLE001
        logger.warning("compile cache not saved: %s", e)


def _steps(c: _Client, start: int, stop: int | None, dp_size: int | None) -> Iterator[int]:
    dp = c.world_size if dp_size is None else dp_size
    _check_scale(c, dp)
    cc = _compile_cache()
    save_cc_at = start + 2  # by then the training step has been compiled, if it is compiled at all
    _install_timers()
    clock = _clock
    assert clock is not None
    ledger = c.ledger
    # local rank 0 of every node records the world, so each node's run dir has it (see scale.py)
    recorded_world = c.local_rank != 0 or c.run_dir is None
    c.hello(start)
    drill = bool(os.environ.get(env.FAULTS))
    torch_mod = sys.modules.get("torch")
    if drill:
        from resilient.testing.faults import maybe_fail
    last = start - 1
    t_prev = -1.0
    old_term = _install_sigterm()
    pre = _preemption
    try:
        for s in (range(start, stop) if stop is not None else itertools.count(start)):
            if pre.signalled or pre.stop_step is not None or pre.noticed(c):
                agreed = pre.resolve(c, s)
                if agreed is not None and s > agreed:
                    break  # the last step ran (and was saved): end the loop as if it had reached its end
            now = _perf()
            if t_prev < 0:
                c.step(s, math.nan, math.nan)
                clock.take()
            else:
                secs = now - t_prev
                compute = max(0.0, secs - clock.take())
                c.step(s, secs, compute)
                if ledger is not None:
                    c.record_step(last, secs, compute)
                if not recorded_world:
                    recorded_world = True
                    _record_world(c, dp)
            if cc is not None and s == save_cc_at:
                _save_compile_cache(cc)
            last = s
            t_prev = _perf()  # our own send/ledger cost is not charged to the step
            if drill:
                maybe_fail(s)  # a drill's in-step fault (--inject): charged to the step, as a real one would be
            if torch_mod is not None:
                # a plain loop (backward, then all_reduce) leaves the backward's context to gloo's threads as
                # DDP does: remember it, so the exit waits until they let it go (see drain_backward_state)
                _remember_context(torch_mod)
            yield s
        if t_prev >= 0:
            secs = _perf() - t_prev
            compute = max(0.0, secs - clock.take())
            c.step(last + 1, secs, compute)
            if ledger is not None:
                c.record_step(last, secs, compute)
            if not recorded_world:
                _record_world(c, dp)
        if pre.stop_step is not None and last >= pre.stop_step:
            _mark_preempted(c, last)
    finally:
        c.done(last)
        _uninstall_timers()
        _restore_sigterm(old_term)


def _record_world(c: _Client, dp: int) -> None:
    if c.run_dir is None:
        return
    try:
        _scale.record_world(c.run_dir, c.world_size, dp, attempt=c.attempt)
    except OSError as e:
        logger.warning("cannot record the world size in %s (%s); a later scale change goes unreported", c.run_dir, e)


@contextlib.contextmanager
def section(name: str, timeout: float | None = None) -> Iterator[None]:
    """A named phase (``"checkpoint"``, ``"eval"``) with its own hang timeout.

    While it is open the agent applies ``timeout`` (seconds) instead of the step heartbeat timeout; with
    None, the timeout is learned from this section's longest observed duration (× the safety factor).
    Rank 0 records a SECTION event (name, seconds) when it ends.
    """
    if timeout is not None and timeout <= 0:
        raise ValueError(f"section {name!r}: timeout must be > 0 seconds or None, got {timeout}")
    c = _client()
    if c is None:
        yield
        return
    c.section_start(name, timeout)
    t0 = _perf()
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        secs = _perf() - t0
        c.section_end(name, secs)
        if c.ledger is not None:
            extra = {"failed": True} if failed else {}
            c.ledger.emit(EventKind.SECTION, rank=c.rank, name=name, seconds=secs, **extra)
