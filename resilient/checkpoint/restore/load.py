"""Restore's data path: bytes land straight in the target tensors, verified block by block right after.

``restore()`` owns the target tensors until it returns, so a tensor's bytes are read from the fastest
copy straight into the tensor (``preadv`` from a local file, a copy from a buffer already in memory), and
the digest of each manifest block (xxh3, or crc32c in manifests written before xxh3) is computed over what
landed while it is still in cache: one pass over the memory instead of a verification pass then a copy
pass. Bytes of a file that no target receives (zip headers, pickles, objects) are checksummed where they
are. A block whose digest differs from the manifest is read again from the next source into the same place; when no source has a good copy,
:class:`StateUndefinedError` is raised.

Only plain tensors take this path (one chunk covering the whole tensor, a contiguous target of the saved
dtype, an uncompressed ``torch.save`` record); everything else is left to DCP's reader over files this
module has verified. A target on a GPU takes the same path through a ring of pinned buffers: bytes are
read and checksummed there, then copied to the device on a side stream while the next bytes are read
(:mod:`resilient.checkpoint.restore.device`).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from resilient.checkpoint.api import CorruptFileError, FileEntry, StateUndefinedError
from resilient.checkpoint.format.digests import Crc32cHash, blocks_of, hasher, verify_bytes
from resilient.checkpoint.format.spans import Span
from resilient.checkpoint.restore.device import Copiers, is_device
from resilient.checkpoint.restore.reader import _tensor_record


logger = logging.getLogger(__name__)


PIECE = 1 << 20  # bytes copied then checksummed at once: stays in cache between the two
_IOV_MAX = 1024
_local = threading.local()


def _scratch(n: int) -> memoryview:
    """A per-thread buffer for bytes no target takes (headers, pickles), reused across blocks."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(max(n, PIECE))
    return memoryview(buf)[:n]
THREADS = max(1, min(4, os.cpu_count() or 1))


class Source(Protocol):
    """One copy of one file: a local file, a buffer in memory, a remote object read by ranges."""

    tier: str

    def readinto(self, off: int, dst: memoryview) -> None: ...
    def read(self, off: int, n: int) -> Any: ...  # a buffer of n bytes
    def close(self) -> None: ...


class FileSource:
    """A local file: data read with ``preadv`` straight into the destination (no mapping to populate);
    the small parts no tensor receives are read through a lazy read-only mapping."""

    def __init__(self, path: str | os.PathLike[str], tier: str, size: int):
        self.tier, self.path = tier, os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        real = os.fstat(self._fd).st_size
        if real != size:
            os.close(self._fd)
            raise OSError(f"{self.path}: size {real} != manifest {size} (torn or truncated write)")
        self._mm = mmap.mmap(self._fd, size, prot=mmap.PROT_READ) if size else None

    def readinto(self, off: int, dst: memoryview) -> None:
        got = 0
        while got < len(dst):
            k = os.preadv(self._fd, [dst[got:]], off + got)
            if k <= 0:
                raise OSError(f"{self.path}: short read at {off + got}")
            got += k

    def readv(self, off: int, bufs: list[memoryview], total: int | None = None) -> None:
        """Fill ``bufs`` (``total`` bytes, when the caller knows) from the contiguous bytes at ``off``: one
        system call for many small tensors."""
        if total is None:
            total = sum(len(b) for b in bufs)
        got = os.preadv(self._fd, bufs, off) if len(bufs) <= _IOV_MAX else 0
        if got == total:
            return
        pos = off  # a short read (or too many buffers): finish piece by piece
        for b in bufs:
            if got >= len(b):
                got -= len(b)
            else:
                self.readinto(pos + got, b[got:])
                got = 0
            pos += len(b)

    def read(self, off: int, n: int) -> Any:
        assert self._mm is not None or n == 0
        return memoryview(self._mm)[off:off + n] if n else b""  # type: ignore[arg-type]

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view of it is still referenced; the mapping goes with it
                pass
        os.close(self._fd)


class MemSource:
    """A file already in memory (received from a peer, downloaded)."""

    def __init__(self, data: Any, tier: str):
        self.tier = tier
        self._mv = memoryview(data).cast("B")

    def readinto(self, off: int, dst: memoryview) -> None:
        if off + len(dst) > len(self._mv):
            raise OSError("short buffer")
        dst[:] = self._mv[off:off + len(dst)]

    def read(self, off: int, n: int) -> Any:
        return self._mv[off:off + n]

    def close(self) -> None:
        pass


class RangeSource:
    """A remote copy read by byte ranges (``read(off, n)`` of the whole object is a plain download)."""

    def __init__(self, read_range: Callable[[int, int], bytes], tier: str):
        self.tier, self._rr = tier, read_range

    def readinto(self, off: int, dst: memoryview) -> None:
        data = self._rr(off, len(dst))
        if len(data) != len(dst):
            raise OSError(f"ranged read returned {len(data)} of {len(dst)} bytes")
        dst[:] = data

    def read(self, off: int, n: int) -> Any:
        return self._rr(off, n)

    def close(self) -> None:
        pass


class _RangeView(MemSource):
    """Bytes ``[base, base + len(data))`` of a file, addressed by file offsets."""

    def __init__(self, data: Any, base: int, tier: str):
        super().__init__(data, tier)
        if len(self._mv) != 0 and base < 0:
            raise ValueError("negative base")
        self._base = base

    def readinto(self, off: int, dst: memoryview) -> None:
        super().readinto(off - self._base, dst)

    def read(self, off: int, n: int) -> Any:
        return super().read(off - self._base, n)


@dataclass(frozen=True)
class Item:
    """A plain tensor stored at ``[offset, offset + length)`` of a file, to be loaded into ``target``."""

    offset: int
    length: int
    target: torch.Tensor


_EOCD = b"PK\x05\x06"
_CEN = struct.Struct("<4s6H3I5H2I")
_LOC = struct.Struct("<4s5H3I2H")
_record_cache: dict[bytes, Any] = {}
_cache_lock = threading.Lock()


def data_span(src: Source, item_off: int, item_len: int, target: torch.Tensor) -> int | None:
    """Offset in the file where ``target``'s bytes start inside its ``torch.save`` record, or None when the
    record is not a plain, uncompressed, little-endian, contiguous tensor of the target's dtype and shape
    (the item then takes DCP's own path). Reads only the record's directory and pickle."""
    if not target.is_contiguous() or target.device.type not in ("cpu", "cuda"):
        return None
    got = plain_record(src, item_off, item_len)
    if got is None:
        return None
    start, dtype, shape, nbytes = got
    if target.dtype != dtype or tuple(target.shape) != tuple(shape):
        return None
    return start


def plain_record(src: Source, item_off: int, item_len: int) -> tuple[int, Any, tuple[int, ...], int] | None:
    """(data offset, dtype, shape, bytes) of a plain contiguous tensor's ``torch.save`` record, else None."""
    if item_len < 22:
        return None
    end = item_off + item_len
    tail = bytes(src.read(end - 22, 22))
    if tail[:4] != _EOCD:
        return None
    n_rec, cd_size, cd_off = struct.unpack_from("<H", tail, 10)[0], *struct.unpack_from("<II", tail, 12)
    if cd_off + cd_size > item_len - 22 or n_rec > 64:
        return None
    cd = bytes(src.read(item_off + cd_off, cd_size))
    p, recs = 0, {}
    for _ in range(n_rec):
        if p + 46 > len(cd):
            return None
        f = _CEN.unpack_from(cd, p)
        if f[0] != b"PK\x01\x02":
            return None
        method, csize, usize, nlen, elen, clen, lho = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        name = cd[p + 46:p + 46 + nlen].decode("utf-8", "replace")
        recs[name] = (method, csize, usize, lho)
        p += 46 + nlen + elen + clen
    pkl = [n for n in recs if n.endswith("/data.pkl")]
    if len(pkl) != 1:
        return None
    prefix = pkl[0][:-len("data.pkl")]
    bo = recs.get(prefix + "byteorder")
    if bo is not None and bytes(_record_bytes(src, item_off, bo)).strip() != b"little":
        return None
    pickled = bytes(_record_bytes(src, item_off, recs[pkl[0]]))
    with _cache_lock:
        meta = _record_cache.get(pickled)
    if meta is None:
        meta = _tensor_record(pickled) or ()
        with _cache_lock:
            if len(_record_cache) > 4096:
                _record_cache.clear()
            _record_cache[pickled] = meta
    if not meta:
        return None
    dtype, key, storage_numel, offset, shape, stride = meta
    numel, acc, expect = 1, 1, []
    for d in reversed(shape):
        expect.append(acc)
        acc *= d
    numel = acc
    if offset != 0 or storage_numel != numel or (numel > 1 and tuple(reversed(expect)) != stride):
        return None
    data = [n for n in recs if n.startswith(prefix + "data/") and not n.endswith(".pkl")]
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if data != [f"{prefix}data/{key}"]:
        return None
    method, csize, usize, lho = recs[data[0]]
    if method != 0 or usize != nbytes or csize != nbytes:
        return None
    start = _record_start(src, item_off, lho)
    if start is None or start + nbytes > end:
        return None
    return start, dtype, tuple(shape), nbytes


def file_layout(src: Source, items: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """(item offset, data offset, bytes) of the plain tensors among ``items`` ((offset, length) in a file),
    for the manifest: restore then knows where each tensor's bytes are before reading the file."""
    out = []
    for off, length in sorted(items):
        try:
            got = plain_record(src, off, length)
        except (OSError, ValueError, struct.error):
            got = None
        if got is not None:
            out.append((off, got[0], got[3]))
    return tuple(out)


def _record_start(src: Source, item_off: int, lho: int) -> int | None:
    head = bytes(src.read(item_off + lho, 30))
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    f = _LOC.unpack(head)
    return item_off + lho + 30 + f[9] + f[10]


def _record_bytes(src: Source, item_off: int, rec: tuple[int, int, int, int]) -> Any:
    method, csize, _, lho = rec
    start = _record_start(src, item_off, lho)
    if start is None or method != 0:
        return b""
    return src.read(start, csize)


def plan_spans(src: Source | None, size: int, items: Sequence[Item],
               layout: Sequence[tuple[int, int, int]] = ()) -> tuple[list[Span], list[Item]]:
    """The file cut into spans in file order (target bytes and the rest), and the items left to DCP.

    With the manifest's ``layout`` no byte of the file is read to plan (the caller has checked the targets
    against DCP's metadata, and every byte is verified against the manifest as it lands); else each item's
    record is parsed from ``src``."""
    spans: list[Span] = []
    slow: list[Item] = []
    pos = 0
    known = {off: (start, n) for off, start, n in layout}
    for it in sorted(items, key=lambda i: i.offset):
        start = None
        t = it.target
        nbytes = t.nbytes  # one call per tensor: with thousands of tensors every call shows
        if layout:
            got = known.get(it.offset)
            if got is not None and got[1] == nbytes and (t.is_cpu or t.is_cuda) and t.is_contiguous():
                start = got[0]
        elif src is not None:
            try:
                start = data_span(src, it.offset, it.length, t)
            except (OSError, ValueError, struct.error):
                start = None
        if start is None or start < pos:  # unknown, or overlapping items (not a file DCP wrote): DCP's path
            slow.append(it)
            continue
        if start > pos:
            spans.append(Span(pos, start - pos))
        if nbytes:
            spans.append(Span(start, nbytes, target=t))
        pos = start + nbytes
    if pos < size:
        spans.append(Span(pos, size - pos))
    return spans, slow


@dataclass
class FileLoad:
    """One file of this rank: its spans, its manifest blocks, and its sources, best first."""

    name: str
    entry: FileEntry
    sources: list[Source]
    spans: list[Span] = field(default_factory=list)
    served: str | None = None  # tier of the copy that served it (the slowest one used for some block)
    keep_gaps: Any = None  # see load_block
    blocks: frozenset[int] | None = None  # only these blocks (the rest landed verified already)


def _overlapping(spans: Sequence[Span], start: int, end: int, starts: Sequence[int] | None = None) -> Sequence[Span]:
    """The spans (sorted, disjoint) that overlap ``[start, end)``: found by bisection, not by a scan of every
    span for every block (thousands of tensors times the blocks of a file)."""
    if starts is None:
        starts = [s.off for s in spans]
    i = max(0, bisect.bisect_right(starts, start) - 1)
    j = bisect.bisect_left(starts, end, lo=i)
    return spans[i:j]


def _block_work(spans: Sequence[Span], start: int, end: int,
                starts: Sequence[int] | None = None) -> list[tuple[int, int, Span | None, int]]:
    """(file offset, length, span taking the bytes or None, offset in its target) pieces of ``[start, end)``,
    at most PIECE long."""
    out = []
    for s in _overlapping(spans, start, end, starts):
        a, b = max(s.off, start), min(s.off + s.n, end)
        take = s if s.takes else None
        while a < b:
            k = min(PIECE, b - a)
            out.append((a, k, take, a - s.off))
            a += k
    return out


def load_block(src: Source, spans: Sequence[Span], start: int, end: int, want: int,
               verified: bool = False, keep: Any = None, starts: Sequence[int] | None = None,
               new_hash: Callable[[], Any] = Crc32cHash, device: "_DeviceSpans | None" = None) -> bool:
    """Read ``[start, end)`` of the file from ``src`` into the targets and check the digest of what
    landed (``new_hash``: the manifest's, see :func:`tiers.hasher`) against ``want``. Returns whether it
    matched. ``keep``: a file-sized buffer that receives the bytes no target takes (headers, objects), for
    DCP's path over a copy that was never whole. ``device``: the spans whose targets are on a GPU and the
    copiers their bytes go through."""
    h = new_hash()
    if isinstance(src, RangeSource):
        # a remote copy: one ranged read per block, copied from there (a few blocks in flight, no full copy)
        src = _RangeView(src.read(start, end - start), start, src.tier)
    if isinstance(src, FileSource) and keep is None and not verified:
        return _load_block_file(src, _overlapping(spans, start, end, starts), start, end, want, h, device)
    for off, n, dst, doff in _block_work(spans, start, end, starts):
        if dst is not None and device is not None and id(dst) in device.ids:
            cop = device.copiers.get(dst.dst.device)  # type: ignore[union-attr]
            view, region = cop.take(n)
            src.readinto(off, view)
            if not verified:
                h.update(view)
            cop.put(dst.dst[doff:doff + n], region)  # type: ignore[index]
        elif dst is not None:
            view = memoryview(dst.array()[doff:doff + n])
            src.readinto(off, view)
            if not verified:
                h.update(view)
        elif not verified or keep is not None:
            data = src.read(off, n)
            if not verified:
                h.update(data)
            if keep is not None:
                keep[off:off + n] = data
    return verified or h.intdigest() == want


def _load_block_file(src: FileSource, spans: Sequence[Span], start: int, end: int, want: int, h: Any,
                     device: "_DeviceSpans | None" = None) -> bool:
    """:func:`load_block` from a local file: runs of pieces up to PIECE bytes are read with one ``preadv``
    into their targets (and a scratch buffer for the bytes between them), then checksummed while in cache.
    A piece for a GPU target is read into a pinned ring buffer and copied to the device after the check."""
    run: list[memoryview] = []
    puts: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (copier, device bytes, ring region)
    run_off = run_n = gap_used = 0
    gaps = _scratch(min(end - start, PIECE))  # a run holds at most PIECE bytes, gaps included

    def flush() -> None:
        nonlocal run, run_n, gap_used
        if run:
            src.readv(run_off, run, run_n)
            for v in run:
                h.update(v)
            for cop, dst, region in puts:
                cop.put(dst, region)
            puts.clear()
        run, run_n, gap_used = [], 0, 0

    for s in spans:
        a, b = max(s.off, start), min(s.off + s.n, end)
        while a < b:
            k = min(PIECE, b - a)
            if run and run_n + k > PIECE:
                flush()
            if not run:
                run_off = a
            if s.takes and device is not None and id(s) in device.ids:
                cop = device.copiers.get(s.dst.device)  # type: ignore[union-attr]
                view, region = cop.take(k)
                run.append(view)
                puts.append((cop, s.dst[a - s.off:a - s.off + k], region))  # type: ignore[index]
            elif s.takes:
                run.append(memoryview(s.array()[a - s.off:a - s.off + k]))
            else:
                run.append(gaps[gap_used:gap_used + k])
                gap_used += k
            run_n += k
            a += k
    flush()
    return h.intdigest() == want


@dataclass
class _DeviceSpans:
    """The spans of a load whose targets are on a GPU (by id), and the per-thread copiers they go through."""

    ids: frozenset[int]
    copiers: Copiers


def _device_spans(files: Sequence[FileLoad]) -> _DeviceSpans | None:
    if not torch.cuda.is_available():
        return None  # no target can be on a GPU: the plain path, no view made per span
    on = [s for f in files for s in f.spans if s.takes and is_device(s.dst)]  # type: ignore[arg-type]
    if not on:
        return None
    # a run of pieces (at most PIECE) is put before the next buffer of the ring is taken
    devices = {s.dst.device for s in on}  # type: ignore[union-attr]
    return _DeviceSpans(frozenset(id(s) for s in on), Copiers(chunk=8 * PIECE, devices=devices))


def load_files(files: Sequence[FileLoad], on_bad: Callable[[FileLoad, int, str, str], None] | None = None,
               threads: int = THREADS, verified: frozenset[str] = frozenset()) -> list[str]:
    """Load every block of every file from its first source, verified; a bad block is read again from the
    next source into the same place. ``on_bad(file, block, tier, why)`` is told of each failure;
    ``verified``: names whose first source was verified already (only copied).

    Returns the blocks no source could serve ("name block i (bytes a-b)"), empty when all landed verified.
    """
    tasks = [(f, i, blk) for f in files for i, blk in enumerate(blocks_of(f.entry))
             if blk[1] > blk[0] and (f.blocks is None or i in f.blocks)]
    order = {t.name: -1 for t in files}
    starts = {t.name: [s.off for s in t.spans] for t in files}
    hashes = {t.name: hasher(t.entry) for t in files}
    lock = threading.Lock()
    device = _device_spans(files)

    def run(task: tuple[FileLoad, int, tuple[int, int, int]]) -> str | None:
        f, i, (a, b, want) = task
        for k, src in enumerate(f.sources):
            why = f"{f.entry.digest} differs from the manifest"
            try:
                if load_block(src, f.spans, a, b, want, verified=(k == 0 and f.name in verified),
                              keep=f.keep_gaps, starts=starts[f.name], new_hash=hashes[f.name],
                              device=device):
                    with lock:
                        order[f.name] = max(order[f.name], k)
                    return None
            except (OSError, ValueError, RuntimeError, TimeoutError) as e:
                why = f"{type(e).__name__}: {e}"
            if on_bad is not None:
                on_bad(f, i, src.tier, why)
        return f"{f.name} block {i} (bytes {a}-{b})"

    try:
        if threads > 1 and len(tasks) > 1:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="resilient-restore") as pool:
                results = list(pool.map(run, tasks))
        else:
            results = [run(t) for t in tasks]
    finally:
        if device is not None:
            device.copiers.finish()  # every device copy landed before the state is handed back
    for f in files:
        if f.sources and order[f.name] >= 0:
            f.served = f.sources[order[f.name]].tier
        elif f.sources and f.served is None:
            f.served = f.sources[0].tier
    return [r for r in results if r is not None]


def undefined(lost: Sequence[str], step: int | None = None) -> StateUndefinedError:
    at = f"step {step}: " if step is not None else ""
    return StateUndefinedError(
        f"{at}no tier holds a good copy of {len(lost)} block(s) ({'; '.join(lost[:5])}"
        f"{' ...' if len(lost) > 5 else ''}); bytes of the checkpoint already landed in the state, which is "
        "now undefined: restore again from an older step or start from a fresh state")


def whole_file(src: Source, entry: FileEntry) -> Any:
    """A verified in-memory copy of a whole file from ``src`` (for DCP's path), or raise OSError."""
    data = bytearray(entry.size)
    if entry.size:
        src.readinto(0, memoryview(data))
    try:
        verify_bytes(data, entry, what=f"{src.tier} copy")
    except CorruptFileError as e:
        raise OSError(str(e)) from None
    return data
