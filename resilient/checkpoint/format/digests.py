"""Checksums of checkpoint files, the one place they are computed: crc32c of a whole file (combined from
pieces on several threads for large ones), xxh3 per manifest block, a file's block layout (``blocks_of``,
``file_blocks``, ``bytes_blocks``, :data:`BLOCK`), and the checks against a manifest entry (``verify_file``,
``verify_bytes``, ``map_verified``)."""

from __future__ import annotations

import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import crc32c as _crc
import xxhash as _xxh

from resilient.checkpoint.api import CorruptFileError, FileEntry


logger = logging.getLogger(__name__)


def readinto_exactly(f: Any, view: memoryview) -> int:
    """Fill ``view`` from ``f``; returns the bytes read, fewer only at end of file."""
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return got

_CHUNK = 8 << 20


def crc_bytes(data: bytes | memoryview, value: int = 0) -> int:
    return _crc.crc32c(data, value)


def xxh3_bytes(data: Any) -> int:
    return _xxh.xxh3_64_intdigest(data)


class Crc32cHash:
    """crc32c with the incremental interface of ``xxhash.xxh3_64`` (``update``, ``intdigest``)."""

    __slots__ = ("_v",)

    def __init__(self) -> None:
        self._v = 0

    def update(self, data: Any) -> None:
        self._v = _crc.crc32c(data, self._v)

    def intdigest(self) -> int:
        return self._v


def hasher(entry: FileEntry) -> Callable[[], Any]:
    """A factory of incremental hashes of one verification block, by the digest ``entry`` is verified by."""
    return _xxh.xxh3_64 if entry.xxh3 else Crc32cHash


def file_entry(path: str | os.PathLike[str]) -> FileEntry:
    """Size, crc32c and xxh3 of a local file, read in chunks."""
    crc = 0
    size = 0
    h = _xxh.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = _crc.crc32c(view[:n], crc)
            h.update(view[:n])
            size += n
    return FileEntry(size=size, crc32c=crc, xxh3=(h.intdigest(),))


def bytes_entry(data: bytes | memoryview) -> FileEntry:
    """What :func:`file_entry` gives for a file holding ``data``."""
    return FileEntry(size=len(data), crc32c=_crc.crc32c(data), xxh3=(_xxh.xxh3_64_intdigest(data),))


def verify_file(path: str | os.PathLike[str], expected: FileEntry) -> None:
    """Raise :class:`CorruptFileError` unless the file's size and crc32c match ``expected``."""
    map_verified(path, expected)


_POLY = 0x82F63B78  # crc32c, reflected
_PARALLEL_MIN = 16 << 20


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the crc32c polynomial, both in reflected bit order (zlib's ``multmodp``)."""
    if not a:
        return 0
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, out = 1 << 30, []  # x^1
    for _ in range(32):
        out.append(p)  # x^(2^k)
        p = _multmodp(p, p)
    return out


_X2N = _x2n_table()


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial: what moves a crc past ``nbytes`` more bytes. Cached: a file's
    blocks are one length (its last one another), so a combine is one ``_multmodp`` (32 small steps)."""
    xp, k = 1 << 31, 3  # x^0; bit i of nbytes stands for x^(2^(i + 3))
    while nbytes:
        if nbytes & 1:
            xp = _multmodp(_X2N[k & 31], xp)
        nbytes >>= 1
        k += 1
    return xp


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of ``A + B`` from crc32c(A), crc32c(B) and len(B) (zlib's ``crc32_combine``, crc32c polynomial):
    a file's crc from its blocks' without a second pass over its bytes."""
    if len2 <= 0:
        return crc1
    return _multmodp(_shift(len2), crc1) ^ crc2


def crc_parallel(data: Any, threads: int | None = None) -> int:
    """crc32c of a large buffer, its parts checksummed on several threads (crc32c releases the GIL)."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    k = threads or min(4, os.cpu_count() or 1)
    if k <= 1 or n < _PARALLEL_MIN:
        return _crc.crc32c(mv)
    bounds = [n * i // k for i in range(k + 1)]
    out = [0] * k

    def part(i: int) -> None:
        out[i] = _crc.crc32c(mv[bounds[i]:bounds[i + 1]])

    workers = [threading.Thread(target=part, args=(i,), daemon=True) for i in range(1, k)]
    for w in workers:
        w.start()
    part(0)
    for w in workers:
        w.join()
    crc = out[0]
    for i in range(1, k):
        crc = crc_combine(crc, out[i], bounds[i + 1] - bounds[i])
    return crc


def map_verified(path: str | os.PathLike[str], expected: FileEntry) -> Any:
    """The file's bytes (a read-only mapping of the page cache, no copy), verified
    against ``expected``: one pass over the bytes instead of a verification read and a load read.

    Raises :class:`CorruptFileError` like :func:`verify_file`.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError as e:
        raise CorruptFileError(f"{path}: missing") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != expected.size:
            raise CorruptFileError(f"{path}: size {size} != manifest {expected.size} (torn or truncated write)")
        if size == 0:
            data: Any = bytearray(0)
        else:
            # read-only and shared: the page cache's own pages, mapped in bulk (a private writable
            # mapping would be populated by copying every page)
            try:
                data = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ)
            except (OSError, ValueError):  # a filesystem without mmap: one read into memory instead
                data = bytearray(size)
                got = readinto_exactly(f, memoryview(data))
                if got < size:
                    raise CorruptFileError(f"{path}: shorter than its size while reading ({got} < {size})")
    _check(data, expected, str(path))
    return data


def xxh3_blocks(data: Any, expected: FileEntry, threads: int | None = None) -> list[int]:
    """xxh3 of each of ``expected``'s verification blocks of ``data``, large buffers on several threads
    (xxhash releases the GIL)."""
    mv = memoryview(data).cast("B")
    bounds = expected.bounds()
    k = threads or min(4, os.cpu_count() or 1)
    if k <= 1 or len(mv) < _PARALLEL_MIN or len(bounds) < 2:
        return [_xxh.xxh3_64_intdigest(mv[a:b]) for a, b in bounds]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=k, thread_name_prefix="resilient-verify") as pool:
        return list(pool.map(lambda ab: _xxh.xxh3_64_intdigest(mv[ab[0]:ab[1]]), bounds))


def _check(data: Any, expected: FileEntry, what: str, crc: int | None = None) -> None:
    """Raise :class:`CorruptFileError` unless ``data`` matches ``expected``'s digest: xxh3 of every block
    when the manifest has it, else crc32c of the whole (``crc``: already computed)."""
    if expected.xxh3:
        for i, ((a, b), got, want) in enumerate(zip(expected.bounds(), xxh3_blocks(data, expected), expected.xxh3)):
            if got != want:
                raise CorruptFileError(f"{what}: xxh3 of block {i} (bytes {a}-{b}) {got:#018x} != manifest "
                                       f"{want:#018x}")
        return
    got = crc_parallel(data) if crc is None else crc
    if got != expected.crc32c:
        raise CorruptFileError(f"{what}: crc32c {got:#010x} != manifest {expected.crc32c:#010x}")


def verify_bytes(data: Any, expected: FileEntry, what: str, crc: int | None = None) -> None:
    """:func:`verify_file` for a file held in memory (``crc``: its crc32c, already computed while receiving,
    used when the manifest has no xxh3)."""
    n = memoryview(data).nbytes
    if n != expected.size:
        raise CorruptFileError(f"{what}: size {n} != manifest {expected.size}")
    _check(data, expected, what, crc)


class _Blocks:
    """crc32c of a file written in pieces, whole and per manifest block (what restore verifies by)."""

    def __init__(self, block_size: int):
        self.block_size, self.size, self.crc, self.blocks, self._bcrc, self._bfill = block_size, 0, 0, [], 0, 0

    def update(self, buf: Any) -> None:
        mv = memoryview(buf).cast("B")
        self.size += len(mv)
        while len(mv):
            k = min(len(mv), self.block_size - self._bfill)
            self._bcrc = crc_bytes(mv[:k], self._bcrc)
            self._bfill += k
            mv = mv[k:]
            if self._bfill == self.block_size:
                self.blocks.append(self._bcrc)
                self.crc = crc_combine(self.crc, self._bcrc, self.block_size)  # one pass over the bytes, not two
                self._bcrc, self._bfill = 0, 0

    def entry(self) -> FileEntry:
        blocks = self.blocks + ([self._bcrc] if self._bfill else [])
        crc = crc_combine(self.crc, self._bcrc, self._bfill)
        return FileEntry(size=self.size, crc32c=crc, block_size=self.block_size if self.size else 0,
                         blocks=tuple(blocks) if self.size else ())


def blocks_of(entry: FileEntry) -> list[tuple[int, int, int]]:
    """(start, end, digest) of the manifest's verification blocks of a file (the whole file when the
    manifest predates blocks); the digest is ``entry.digest``'s (see :func:`tiers.hasher`)."""
    wants = entry.xxh3 or (entry.blocks if entry.block_size and entry.blocks else (entry.crc32c,))
    return [(a, b, w) for (a, b), w in zip(entry.bounds(), wants)]


def file_blocks(path: str | os.PathLike[str], block_size: int) -> FileEntry:
    """Size, crc32c and per-block crc32c and xxh3 of a local file, in one read."""
    crc, size, blocks, xxh = 0, 0, [], []
    bcrc, bfill = 0, 0
    h = _xxh.xxh3_64()
    buf = bytearray(min(block_size, 8 << 20))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view[:min(len(buf), block_size - bfill)])
            if not n:
                break
            bcrc = _crc.crc32c(view[:n], bcrc)
            h.update(view[:n])
            size += n
            bfill += n
            if bfill == block_size:
                blocks.append(bcrc)
                crc = crc_combine(crc, bcrc, block_size)  # the file's crc from its blocks': one pass, not two
                xxh.append(h.intdigest())
                bcrc, bfill, h = 0, 0, _xxh.xxh3_64()
    crc = crc_combine(crc, bcrc, bfill)
    if bfill or not size:
        blocks.append(bcrc)
        xxh.append(h.intdigest())
    if not size:
        blocks = []
    return FileEntry(size=size, crc32c=crc, block_size=block_size, blocks=tuple(blocks), xxh3=tuple(xxh))


def bytes_blocks(data: Any, block_size: int) -> FileEntry:
    mv = memoryview(data).cast("B")
    blocks = tuple(_crc.crc32c(mv[i:i + block_size]) for i in range(0, len(mv), block_size))
    xxh = tuple(_xxh.xxh3_64_intdigest(mv[i:i + block_size]) for i in range(0, len(mv), block_size))
    return FileEntry(size=len(mv), crc32c=_crc.crc32c(mv), block_size=block_size, blocks=blocks,
                     xxh3=xxh or (_xxh.xxh3_64_intdigest(b""),))


BLOCK = 4 << 20  # manifest verification block: the unit fetched again from the next tier
