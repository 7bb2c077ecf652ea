"""The worker's steps loop: ``resilient.steps``, ``resilient.section``, ``resilient.on_scale``.

Under ``resilient-run`` (the agent's socket in the environment) every step sends one non-blocking packet to the
node agent: a heartbeat carrying the previous step's wall time and its *own-work* time (wall time minus the
time this rank spent blocked in collectives or waiting for a CPU outside them, measured by
:mod:`resilient.worker.collectives`). Own work is what
tells the straggler apart: in synchronous training every rank's step lasts as long as the slowest rank's, but
only the slow rank spends little of it waiting.

Global rank 0 also writes one ``STEP`` event per completed step (and one ``SECTION`` event per finished
section) to the run's ledger. Outside ``resilient-run`` ``steps()`` is a plain ``range``.

A drill's in-step faults plug in through :func:`add_step_hook`: this package never imports
:mod:`resilient.drill`; when the launcher put a drill plan in the environment, the loop loads the module named
by :data:`DRILL_MODULE` once, and that module registers its hook.
"""

from __future__ import annotations

import contextlib
import importlib
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
from resilient.signals.api import RESTORE_SECTION, ScaleEvent
from resilient.worker import collectives, exit_safety, preemption
from resilient.worker import scale as _scale
from resilient.worker.collectives import current_wait_seconds
from resilient.worker.preemption import preempt_save_due, preempted

__all__ = ["steps", "section", "on_scale", "ScaleEvent", "current_wait_seconds", "preempted", "preempt_save_due",
           "add_step_hook"]

logger = logging.getLogger(__name__)

_scale_callbacks: list[Callable[[ScaleEvent], Any]] = []
_perf = time.perf_counter
_RECONNECT_EVERY = 1.0  # seconds between reconnection attempts when the agent is unreachable
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
DRILL_MODULE = "resilient.drill.worker"  # registers the drill's step hook when imported
CHECKPOINT_SECTION = "checkpoint"  # the section a checkpoint save's blocking part is reported as
_looping = 0  # steps() loops running in this process

# called with each step number after its heartbeat, inside the step (what they cost is charged to the step)
_step_hooks: list[Callable[[int], Any]] = []


def add_step_hook(fn: Callable[[int], Any]) -> None:
    """Call ``fn(step)`` at the start of every step of ``steps()`` under ``resilient-run`` (once per ``fn``)."""
    if fn not in _step_hooks:
        _step_hooks.append(fn)


def _drill_hooks() -> list[Callable[[int], Any]]:
    if os.environ.get(env.FAULTS):
        importlib.import_module(DRILL_MODULE)
    return list(_step_hooks)


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
        # another node's preemption reaches this rank through the attempt's store (see preemption.stop_proposed)
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
        preemption.bind(self.run_dir, self.attempt, self.multi_node, self.started_wall)

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




# --- steps / section ---------------------------------------------------------------------------------

def steps(start: int, stop: int | None = None, *, dp_size: int | None = None) -> Iterator[int]:
    """Iterate over training steps ``start, start+1, ...`` (up to ``stop`` excluded; forever when None).

    Under ``resilient-run`` each step sends a heartbeat with the previous step's timings, rank 0 records a
    STEP event per completed step, and ``on_scale`` callbacks run before the first step when the world size
    (or ``dp_size``, default: ``resilient.topology().dp_size``) differs from the previous attempt's. A step
    left by ``break`` or an exception is not recorded as completed.
    """
    c = _client()
    if c is None:
        return range(start, stop) if stop is not None else itertools.count(start)  # type: ignore[return-value]
    return _steps(c, start, stop, dp_size)


def _check_scale(c: _Client, dp_size: int) -> None:
    if c.run_dir is None:
        return
    ev = _scale.scale_event(c.run_dir, c.world_size, dp_size)
    if ev is None:
        return
    logger.info("world changed since the last attempt: %s", ev)
    if c.ledger is not None:
        c.ledger.emit(EventKind.SCALE, rank=c.rank, old_world_size=ev.old_world_size,
                      new_world_size=ev.new_world_size, old_dp=ev.old_dp_size, new_dp=ev.new_dp_size,
                      old_dp_size=ev.old_dp_size, new_dp_size=ev.new_dp_size, reason=ev.reason)
    for fn in list(_scale_callbacks):
        fn(ev)


def _compile_cache() -> Any:
    """Restore the run's torch.compile caches before anything compiles (compilation is lazy, so the start of
    ``steps()`` is early enough); ``env.COMPILE_CACHE`` set to 0 turns it off."""
    if os.environ.get(env.COMPILE_CACHE, "1") == "0":
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
    dp = _scale.current_dp_size(c.world_size) if dp_size is None else dp_size
    _check_scale(c, dp)
    cc = _compile_cache()
    save_cc_at = start + 2  # by then the training step has been compiled, if it is compiled at all
    clock = collectives.install()
    ledger = c.ledger
    # local rank 0 of every node records the world, so each node's run dir has it (see scale.py)
    recorded_world = c.local_rank != 0 or c.run_dir is None
    global _looping
    c.hello(start)
    _looping += 1
    hooks = _drill_hooks()
    torch_mod = sys.modules.get("torch")
    last = start - 1
    t_prev = -1.0
    old_term = preemption.install_sigterm()
    pre = preemption._preemption
    w = preemption._worker()
    try:
        for s in (range(start, stop) if stop is not None else itertools.count(start)):
            if pre.signalled or pre.stop_step is not None or pre.noticed(w):
                agreed = pre.resolve(w, s)
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
            for hook in hooks:
                hook(s)  # a drill's in-step fault (--inject): charged to the step, as a real one would be
            if torch_mod is not None:
                # a plain loop (backward, then all_reduce) leaves the backward's context to gloo's threads as
                # DDP does: remember it, so the exit waits until they let it go (see drain_backward_state)
                exit_safety._remember_context(torch_mod)
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
            preemption.mark_stopped(c.run_dir, c.attempt, c.rank, last)
    finally:
        _looping -= 1
        c.done(last)
        collectives.uninstall()
        preemption.restore_sigterm(old_term)


def _record_world(c: _Client, dp: int) -> None:
    if c.run_dir is None:
        return
    try:
        _scale.record_world(c.run_dir, c.world_size, dp, attempt=c.attempt)
    except OSError as e:
        logger.warning("cannot record the world size in %s (%s); a later scale change goes unreported", c.run_dir, e)


@contextlib.contextmanager
def section(name: str, timeout: float | None = None) -> Iterator[None]:
    """A named phase (``"eval"``, a slow data reload) with its own hang timeout.

    While it is open the agent applies ``timeout`` (seconds) instead of the step heartbeat timeout; with
    None, the timeout is learned from this section's longest observed durations (× the safety factor; the
    initial timeout until a few were seen). A step that holds a section is not learned from, and the step
    after it gets the section's timeout on top. Open it on every rank, also on ranks that only wait for
    the ones doing the work (``with resilient.section("eval"): evaluate(); dist.barrier()``): a rank waiting
    outside a section is held to the step timeout. Rank 0 records a SECTION event (name, seconds) when it
    ends. A checkpoint save's blocking part is already a section (:func:`checkpoint_section`), and so is a restore
    through the checkpointer (:func:`restore_section`); a restore of one's own marked as ``section("restore")`` is
    held to the start-up bound like it and left out of the start-up a later attempt is held to.
    """
    if timeout is not None and timeout <= 0:
        raise ValueError(f"section {name!r}: timeout must be > 0 seconds or None, got {timeout}")
    c = _client()
    if c is None:
        yield
        return
    t0 = _perf()
    failed = False
    try:
        with _told(c, name, timeout):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        if c.ledger is not None:
            extra = {"failed": True} if failed else {}
            c.ledger.emit(EventKind.SECTION, rank=c.rank, name=name, seconds=_perf() - t0, **extra)


@contextlib.contextmanager
def _told(c: _Client, name: str, timeout: float | None) -> Iterator[None]:
    """The agent told that section ``name`` is open while the body runs, and its seconds when it ends."""
    c.section_start(name, timeout)
    t0 = _perf()
    try:
        yield
    finally:
        c.section_end(name, _perf() - t0)


@contextlib.contextmanager
def restore_section() -> Iterator[None]:
    """A checkpoint restore, reported to the agent as the section :data:`RESTORE_SECTION`, before ``steps()`` too (a
    restore comes before the loop): the agent holds it to the start-up bound and leaves its time out of the
    start-up it learns a later attempt's bound from. No SECTION ledger event: the restore's CKPT_RESTORE event
    has its seconds."""
    c = _client()
    if c is None:
        yield
        return
    with _told(c, RESTORE_SECTION, None):
        yield


@contextlib.contextmanager
def checkpoint_section() -> Iterator[None]:
    """The blocking part of a checkpoint save (waiting for the previous write, staging), reported to the agent
    as the section :data:`CHECKPOINT_SECTION` with a learned timeout, so a save longer than a few steps is
    neither a hang nor a step sample. Sent only inside a running ``steps()`` loop: outside it the agent does
    not watch this rank, and a section message would make it start. No SECTION ledger event: the save's
    CKPT_SAVE event already has its blocking seconds."""
    c = _client_obj
    if _looping <= 0 or c is None or c.pid != os.getpid():
        yield
        return
    with _told(c, CHECKPOINT_SECTION, None):
        yield
