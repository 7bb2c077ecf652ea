"""Host → device copies for restore through a bounded ring of host buffers (pinned for a CUDA target).

A restore reads checkpoint bytes on the host; a target on the GPU cannot be read into directly. Bytes are
read into one buffer of the ring while the copy of the previous buffer to the device runs on a side stream
(double buffering): the device copy hides behind the read, and the pinned memory a restore holds is the
ring (``nbuf × chunk`` bytes per copier), never a host copy of the whole state.

With a CPU target the same code runs with plain host buffers and synchronous copies: the chunking and the
ring are exercised (and tested) on machines without a GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch


logger = logging.getLogger(__name__)

CHUNK = 32 << 20  # bytes per ring buffer: large enough that one copy's launch cost is noise
NBUF = 2
_POOL_MAX = 16  # ring buffers kept for the next restore (pinning is slow: 0.4 s per GiB)
_pool: dict[tuple[bool, int], list[torch.Tensor]] = {}
_pool_lock = threading.Lock()


def is_device(t: torch.Tensor) -> bool:
    """Does ``t`` live on an accelerator (where bytes cannot be read into directly)?"""
    return t.device.type != "cpu" and t.device.type != "meta"


def _get_buffer(pin: bool, n: int) -> torch.Tensor:
    with _pool_lock:
        free = _pool.get((pin, n))
        if free:
            return free.pop()
    return torch.empty(n, dtype=torch.uint8, pin_memory=pin)


def _put_buffer(pin: bool, buf: torch.Tensor) -> None:
    with _pool_lock:
        free = _pool.setdefault((pin, buf.numel()), [])
        if sum(len(v) for v in _pool.values()) < _POOL_MAX:
            free.append(buf)


def release_pool() -> None:
    """Drop the kept ring buffers (their pinned memory goes back to the allocator)."""
    with _pool_lock:
        _pool.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has none
        return t
    return t.to_local() if isinstance(t, DTensor) else t


class ChunkCopier:
    """Copies bytes read on the host into tensors on ``device`` through ``nbuf`` buffers of ``chunk`` bytes.

    Two ways in: :meth:`copy_into` (a whole tensor from a reader), and :meth:`take`/:meth:`put` (a region of
    a ring buffer to read into, then where its bytes go), for callers that read several targets in one
    system call. A region taken must be put before ``(nbuf - 1) × chunk`` more bytes are taken. Not thread
    safe: one copier per thread. :meth:`finish` returns once every copy has landed. ``after``: a CUDA event
    the copies wait for (default: the work queued so far on this thread's current stream).
    """

    def __init__(self, device: torch.device | str, chunk: int = CHUNK, nbuf: int = NBUF, after: Any = None):
        if chunk <= 0 or nbuf < 2:
            raise ValueError(f"chunk must be > 0 and nbuf >= 2 (got {chunk}, {nbuf})")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk, self.nbuf = chunk, nbuf
        self._bufs = [_get_buffer(self.cuda, chunk) for _ in range(nbuf)]
        self._events: list[Any] = [None] * nbuf
        self._i = 0
        self._used = 0
        self.copies = 0  # device copies issued (the tests read it)
        self._stream: Any = None
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            # the targets may still be written by work queued on the training stream (their initialisation)
            if after is not None:
                self._stream.wait_event(after)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))

    @property
    def pinned_bytes(self) -> int:
        return self.chunk * self.nbuf if self.cuda else 0

    def take(self, n: int) -> tuple[memoryview, torch.Tensor]:
        """``n`` bytes (at most ``chunk``) of a ring buffer: a view to read into and the tensor to :meth:`put`."""
        if n > self.chunk:
            raise ValueError(f"{n} bytes asked of a {self.chunk}-byte buffer")
        if self._used + n > self.chunk:
            self._i = (self._i + 1) % self.nbuf
            self._used = 0
            ev = self._events[self._i]
            if ev is not None:
                ev.synchronize()  # the copies out of this buffer are done: it may be overwritten
                self._events[self._i] = None
        region = self._bufs[self._i][self._used:self._used + n]
        self._used += n
        return memoryview(region.numpy()), region

    def put(self, dst: torch.Tensor, region: torch.Tensor) -> None:
        """Copy ``region`` (from :meth:`take`, filled) into ``dst``, a contiguous uint8 view of the target."""
        if not self.cuda:
            dst.copy_(region)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(region, non_blocking=True)
        i = next(k for k, b in enumerate(self._bufs) if b.data_ptr() <= region.data_ptr() < b.data_ptr() + self.chunk)
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = torch.cuda.Event()
        ev.record(self._stream)  # re-recorded: waiting on it covers every copy out of buffer i so far
        self.copies += 1

    def copy_into(self, target: torch.Tensor, fill: Callable[[int, memoryview], None]) -> None:
        """Fill ``target`` (a DTensor: its local shard) with its bytes in row-major order, ``fill(off, view)``
        writing bytes ``[off, off + len(view))`` of them into ``view``."""
        local = _local(target).detach()
        t = local if local.is_contiguous() else torch.empty_like(local, memory_format=torch.contiguous_format)
        flat = t.reshape(-1).view(torch.uint8)
        n, off = flat.numel(), 0
        while off < n:
            k = min(self.chunk, n - off)
            view, region = self.take(k)
            fill(off, view)
            self.put(flat[off:off + k], region)
            off += k
        if t is not local:
            if self.cuda:
                with torch.cuda.stream(self._stream):  # after the chunks: the same stream keeps the order
                    local.copy_(t)
                t.record_stream(self._stream)
            else:
                local.copy_(t)

    def finish(self) -> None:
        """Wait for every copy issued (an event on the side stream, not a device-wide synchronisation)."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self._stream)
            ev.synchronize()
            self._events = [None] * self.nbuf

    def close(self) -> None:
        self.finish()
        for b in self._bufs:
            _put_buffer(self.cuda, b)
        self._bufs = []


class Copiers:
    """One :class:`ChunkCopier` per (thread, device), for a pool of reader threads; :meth:`finish` waits
    for all of them (call it once the threads are done). Made on the training thread: every copy waits for
    the work queued on its current stream until then (reader threads have other current streams)."""

    def __init__(self, chunk: int = CHUNK, nbuf: int = NBUF, devices: Iterable[torch.device] = ()):
        self.chunk, self.nbuf = chunk, nbuf
        self._after: dict[torch.device, Any] = {}
        for d in set(devices):  # only the targets' devices: an event elsewhere would start a context there
            if d.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(d))
                self._after[d] = ev
        self._by: dict[tuple[int, torch.device], ChunkCopier] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> ChunkCopier:
        key = (threading.get_ident(), device)
        cop = self._by.get(key)
        if cop is None:
            cop = ChunkCopier(device, self.chunk, self.nbuf, after=self._after.get(device))
            with self._lock:
                self._by[key] = cop
        return cop

    def finish(self) -> None:
        with self._lock:
            copiers = list(self._by.values())
            self._by.clear()
        for cop in copiers:
            cop.close()
