"""Staging: the state's leaves copied into host buffers that are reused from one save to the next
(:class:`Stager`), and the guard that holds an optimizer step until its tensors are staged
(:class:`MutationGuard`).

Tensors on a GPU are copied into one page-locked host arena (:class:`_Arena`) on a side stream that first
waits for the training stream, so the copy sees the finished values; the save waits on an event recorded
after the copies (not a device-wide synchronisation). Tensors on the CPU take per-tensor buffers.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

from resilient.checkpoint.format.state import dtensor_type, leaf_nbytes, local_tensor


logger = logging.getLogger(__name__)

_ALIGN = 512  # each buffer of the arena starts aligned (DMA and vector copies prefer it)


class _Arena:
    """Host buffers for device tensors: one allocation, page-locked once, carved into one buffer per tensor.

    One allocation registered with ``cudaHostRegister`` holds exactly the state's bytes: the pinned caching
    allocator rounds every request up to a power of two, up to twice the state in host memory. Each buffer is
    a tensor with a storage of exactly its own bytes (DCP's writer clones a view of a larger storage, which
    would be a second copy). ``pin=False`` builds the same layout in plain memory (CPU tests)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
        self._base: torch.Tensor | None = None
        self._registered = False
        self.buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0  # how many times host memory was taken (the tests read it)

    @property
    def nbytes(self) -> int:
        return 0 if self._base is None else self._base.numel()

    def ensure(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
        """Buffers for ``specs`` (fqn, shape, dtype), the same as last time when the layout did not change."""
        layout = tuple(specs)
        if layout == self._layout and self._base is not None:
            return self.buffers
        self.release()
        offs, total = [], 0
        for _, shape, dtype in layout:
            n = math.prod(shape) * dtype.itemsize
            offs.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        base = self._allocate(max(total, 1))
        mv = memoryview(base.numpy())
        bufs: dict[str, torch.Tensor] = {}
        for (fqn, shape, dtype), off in zip(layout, offs):
            n = math.prod(shape) * dtype.itemsize
            if n == 0:
                bufs[fqn] = torch.empty(shape, dtype=dtype)
                continue
            bufs[fqn] = torch.frombuffer(mv, dtype=torch.uint8, count=n, offset=off).view(dtype).view(shape)
        self._base, self._layout, self.buffers = base, layout, bufs
        self.allocations += 1
        return bufs

    def _allocate(self, total: int) -> torch.Tensor:
        if not self.pin:
            return torch.empty(total, dtype=torch.uint8)
        base = torch.empty(total, dtype=torch.uint8)
        try:
            err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), total, 1)  # portable, as torch's own
            if int(err) == 0:
                self._registered = True
                return base
            logger.info("cudaHostRegister of %d bytes failed (%s); pinned allocator instead", total, err)
        except (AttributeError, RuntimeError, TypeError) as e:
            logger.info("cudaHostRegister unavailable (%s); pinned allocator instead", e)
        return torch.empty(total, dtype=torch.uint8, pin_memory=True)

    def release(self) -> None:
        """Give the memory back. The caller has waited for every copy into it."""
        if self._base is not None and self._registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            except (AttributeError, RuntimeError, TypeError) as e:
                logger.debug("cudaHostUnregister failed: %s", e)
        self._base, self._layout, self.buffers, self._registered = None, (), {}, False


class Stager:
    """Copies leaves into host buffers kept between saves (no allocation after the first save)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # fqn -> (buffer, the DTensor staged around it): made once while the buffer and the placement stay
        # (from_local builds a spec and an autograd node, ~65 us a tensor a save)
        self._wrapped: dict[str, tuple[torch.Tensor, Any]] = {}
        self._wrapping: dict[str, tuple[torch.Tensor, Any]] = {}  # this stage()'s, replacing _wrapped at its end
        self._arena: _Arena | None = None
        self._streams: dict[torch.device, Any] = {}
        self._pending: list[Any] = []  # events recorded after the device copies of the last stage()

    @property
    def nbytes(self) -> int:
        return sum(leaf_nbytes(b) for b in self._buffers.values()) + (self._arena.nbytes if self._arena else 0)

    @property
    def allocations(self) -> int:
        """How many times the device tensors' host arena was allocated (once while the state keeps its shapes)."""
        return self._arena.allocations if self._arena is not None else 0

    def _buffer(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(fqn)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # contiguous whatever the source layout: copy_ handles strides, and restore reads it faster
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self._buffers[fqn] = buf
        return buf

    def stage(self, leaves: Mapping[str, Any], *, tensors: bool = True, objects: bool = True) -> dict[str, Any]:
        """Copy of ``leaves``: tensors into reused buffers, other values deep-copied. Copies from a GPU are
        only issued here: :meth:`synchronize` waits for them."""
        out: dict[str, Any] = {}
        on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # fqn -> (leaf, its local tensor)
        dt = dtensor_type()
        for fqn, v in leaves.items():
            if isinstance(v, torch.Tensor):
                if not tensors:
                    continue
                local = local_tensor(v)
                plain = (dt is not None and isinstance(v, dt)) or type(v) is torch.Tensor \
                    or isinstance(v, torch.nn.Parameter)
                if plain and local.device.type == "cuda" and torch.cuda.is_available():
                    on_device[fqn] = (v, local)
                    out[fqn] = None  # filled below: keeps the leaves' order
                else:
                    out[fqn] = self._stage_tensor(fqn, v)
            elif objects:
                out[fqn] = copy.deepcopy(v)
        if on_device:
            self._stage_device(on_device, out)
        if tensors:
            # every call that stages tensors is handed all of them: a leaf not among them left the state, and its
            # buffer and wrapper go (a wrapper kept would hold its buffer, and an arena's view the whole old
            # pinned arena, for as long as the manager lives)
            self._wrapped, self._wrapping = self._wrapping, {}
            if len(self._buffers) > len(leaves):
                for k in [k for k in self._buffers if k not in leaves]:
                    del self._buffers[k]
        return out

    def _stage_tensor(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        dt = dtensor_type()
        if dt is not None and isinstance(t, dt):
            local = local_tensor(t)
            buf = self._buffer(fqn, local)
            buf.copy_(local.detach())
            return self._wrap(fqn, buf, t)
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return t.detach().clone().cpu()  # other tensor subclasses: no buffer reuse
        buf = self._buffer(fqn, t)
        buf.copy_(t.detach())
        return buf

    def _wrap(self, fqn: str, buf: torch.Tensor, like: Any) -> Any:
        """``buf`` as a DTensor placed like ``like`` (a DTensor of the state)."""
        got = self._wrapped.get(fqn)
        if got is not None and got[0] is buf:
            w = got[1]
            if (w.device_mesh is like.device_mesh and w.placements == like.placements and w.shape == like.shape
                    and w.stride() == like.stride()):
                self._wrapping[fqn] = got
                return w
        w = dtensor_type().from_local(buf, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                      stride=like.stride())
        self._wrapping[fqn] = (buf, w)
        return w

    def _stage_device(self, leaves: dict[str, tuple[torch.Tensor, torch.Tensor]], out: dict[str, Any]) -> None:
        """GPU tensors into the pinned arena on a side stream per device, ordered after the training stream."""
        self.synchronize()  # the arena may be rebuilt: no copy into the old one may still run
        if self._arena is None:
            self._arena = _Arena(pin=True)
        bufs = self._arena.ensure([(fqn, tuple(local.shape), local.dtype) for fqn, (_, local) in leaves.items()])
        by_device: dict[torch.device, list[str]] = {}
        for fqn, (_, local) in leaves.items():
            by_device.setdefault(local.device, []).append(fqn)
        dt = dtensor_type()
        for device, fqns in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            # the copy must see what the training stream computed up to now
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for fqn in fqns:
                    v, local = leaves[fqn]
                    bufs[fqn].copy_(local.detach(), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            self._pending.append(ev)
        for fqn, (v, _) in leaves.items():
            buf = bufs[fqn]
            if dt is not None and isinstance(v, dt):
                out[fqn] = self._wrap(fqn, buf, v)
            else:
                out[fqn] = buf

    def synchronize(self) -> None:
        """Wait until the copies of the last :meth:`stage` landed (their events; the device runs on)."""
        pending, self._pending = self._pending, []
        for ev in pending:
            ev.synchronize()

    def drop(self) -> None:
        self.synchronize()
        self._buffers.clear()
        self._wrapped.clear()
        self._wrapping.clear()
        if self._arena is not None:
            self._arena.release()
            self._arena = None


class MutationGuard:
    """Holds back what mutates training state until background staging has copied it.

    Armed in ``save()`` on the training thread: an optimizer step pre-hook (parameters, optimizer
    state) and a forward pre-hook that waits only for modules owning buffers in training mode
    (BatchNorm running statistics). Other forwards and backward run while the copy proceeds.
    Hooks are removed on the training thread (never from the staging thread, whose removal could
    race with torch iterating its hook dicts).
    """

    def __init__(self, timeout_s: float = 600.0):
        self._staged = threading.Event()
        self._staged.set()
        self._timeout_s = timeout_s
        self._opt_handle: Any = None
        self._fwd_handle: Any = None
        self.waited_s = 0.0  # time training spent waiting in hooks (reported as blocking)
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        return not self._staged.is_set()

    def arm(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.disarm_hooks()
        self._staged.clear()
        self._opt_handle = register_optimizer_step_pre_hook(self._on_optimizer_step)
        self._fwd_handle = register_module_forward_pre_hook(self._on_forward)

    def release(self) -> None:
        """Called by the staging thread once the copy is done (or failed)."""
        self._staged.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._staged.is_set():
            return True
        import time

        t0 = time.perf_counter()
        ok = self._staged.wait(self._timeout_s if timeout is None else timeout)
        with self._lock:
            self.waited_s += time.perf_counter() - t0
        return ok

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.wait():
            logger.error("staging did not finish within %.0f s; optimizer step proceeds", self._timeout_s)
        if self._fwd_handle is not None:  # the optimizer hook dict is being iterated: leave it for later
            self._fwd_handle.remove()
            self._fwd_handle = None

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._staged.is_set():
            self.disarm_hooks()  # forward hooks are iterated from a snapshot: safe to remove here
            return None
        if module.training and any(b is not None for b in module._buffers.values()):
            self.wait()
            self.disarm_hooks()
        return None

    def disarm_hooks(self) -> None:
        for name in ("_opt_handle", "_fwd_handle"):
            h = getattr(self, name)
            if h is not None:
                h.remove()
                setattr(self, name, None)
