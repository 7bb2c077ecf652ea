"""Staging: the state's leaves copied into host buffers that are reused from one save to the next
(:class:`Stager`), and the guard that holds an optimizer step until its tensors are staged
(:class:`MutationGuard`)."""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from resilient.checkpoint.format.state import leaf_nbytes


logger = logging.getLogger(__name__)


class Stager:
    """Copies leaves into host buffers kept between saves (no allocation after the first save)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(leaf_nbytes(b) for b in self._buffers.values())

    def _buffer(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(fqn)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # contiguous whatever the source layout: copy_ handles strides, and restore reads it faster
            pin = t.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[fqn] = buf
        return buf

    def stage(self, leaves: Mapping[str, Any], *, tensors: bool = True, objects: bool = True) -> dict[str, Any]:
        """Copy of ``leaves``: tensors into reused buffers, other values deep-copied."""
        out: dict[str, Any] = {}
        for fqn, v in leaves.items():
            if isinstance(v, torch.Tensor):
                if tensors:
                    out[fqn] = self._stage_tensor(fqn, v)
            elif objects:
                out[fqn] = copy.deepcopy(v)
        return out

    def _stage_tensor(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            local = t.to_local()
            buf = self._buffer(fqn, local)
            buf.copy_(local.detach(), non_blocking=buf.is_pinned())
            return DTensor.from_local(buf, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return t.detach().clone().cpu()  # other tensor subclasses: no buffer reuse
        buf = self._buffer(fqn, t)
        buf.copy_(t.detach(), non_blocking=buf.is_pinned())
        return buf

    def synchronize(self) -> None:
        if torch.cuda.is_available() and any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()

    def drop(self) -> None:
        self._buffers.clear()


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
