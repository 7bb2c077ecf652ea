"""Moving checkpoint files between ranks over the manager's own gloo group.

Two patterns: a ring (every rank sends its files to its partner and receives its other neighbour's,
all at once with isend/irecv) for replication, and a list of point-to-point transfers executed in one
global order (each rank does only the ones it takes part in, so the earliest unfinished transfer
always has both ends ready: no deadlock) for restore.

A restored file whose manifest gives each tensor's byte range travels *cut at those ranges*
(:func:`wire_pieces`, computed by both ends from the same manifest entry), so the receiver lands each piece
straight in the target tensor's memory (no receive buffer the size of the file) and checks each manifest
block's digest (xxh3, or crc32c in older manifests) right after its last piece lands.
"""

from __future__ import annotations

import bisect
import collections
import logging
import mmap
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resilient.checkpoint.api import FileEntry
from resilient.checkpoint.format.digests import blocks_of, crc_bytes, hasher, readinto_exactly
from resilient.checkpoint.format.spans import Span

logger = logging.getLogger(__name__)

CHUNK = 32 << 20
# tensors at least this large are received straight into their target; smaller ones (and the bytes between
# tensors) arrive together in a staging piece and are copied out: one message per few KiB tensor would cost
# more than the copy
DIRECT_MIN = 256 << 10


@dataclass(frozen=True)
class FileSpec:
    name: str
    size: int


def _chunks(files: Sequence[FileSpec]) -> list[tuple[int, int, int]]:
    """(file index, offset, length) pieces of at most CHUNK bytes; empty files have none."""
    out = []
    for i, f in enumerate(files):
        off = 0
        while off < f.size:
            n = min(CHUNK, f.size - off)
            out.append((i, off, n))
            off += n
    return out


class _Reader:
    """Reads pieces of files into reused buffers; ``slot`` alternates so one piece can be in flight
    while the next is read."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]]):
        self._paths = list(paths)
        self._open: dict[int, Any] = {}
        self._bufs = [bytearray(0), bytearray(0)]

    def read(self, i: int, off: int, n: int, slot: int = 0) -> torch.Tensor:
        f = self._open.get(i)
        if f is None:
            f = self._open[i] = open(self._paths[i], "rb", buffering=0)
        if len(self._bufs[slot]) < n:
            self._bufs[slot] = bytearray(max(n, min(CHUNK, 1 << 20)))
        buf = self._bufs[slot]
        f.seek(off)
        got = readinto_exactly(f, memoryview(buf)[:n])
        if got < n:
            raise OSError(f"{self._paths[i]}: file shorter than announced ({off + got} < {off + n})")
        return torch.frombuffer(buf, dtype=torch.uint8)[:n]

    def close(self) -> None:
        for f in self._open.values():
            f.close()


class _Writer:
    """Writes received pieces to ``<dir>/.<name>.part`` and renames to ``<name>`` once complete."""

    def __init__(self, out_dir: str | os.PathLike[str], files: Sequence[FileSpec]):
        self._dir = Path(out_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._files = list(files)
        self._open: dict[int, Any] = {}

    def _part(self, i: int) -> Path:
        return self._dir / f".{self._files[i].name}.part"

    def write(self, i: int, off: int, data: torch.Tensor) -> None:
        f = self._open.get(i)
        if f is None:
            f = self._open[i] = open(self._part(i), "wb")
        f.seek(off)
        f.write(data.numpy().tobytes())

    def finish(self, durable: bool = True) -> list[Path]:
        out = []
        for i, spec in enumerate(self._files):
            f = self._open.pop(i, None)
            if f is None:
                open(self._part(i), "wb").close()  # empty file
            else:
                f.flush()
                if durable:
                    os.fsync(f.fileno())
                f.close()
            dst = self._dir / spec.name
            os.replace(self._part(i), dst)
            out.append(dst)
        return out

    def abort(self) -> None:
        for i, f in list(self._open.items()):
            f.close()
            Path(self._part(i)).unlink(missing_ok=True)
        self._open.clear()


def ring_exchange(group: Any, *, send_to: int, send_paths: Sequence[str | os.PathLike[str]],
                  send_files: Sequence[FileSpec], recv_from: int, recv_files: Sequence[FileSpec],
                  out_dir: str | os.PathLike[str]) -> list[Path]:
    """Send ``send_paths`` to ``send_to`` while receiving ``recv_files`` from ``recv_from`` into ``out_dir``.

    Both sides know every size beforehand (exchanged by the caller), so pieces pair up one to one.
    """
    sc, rc = _chunks(send_files), _chunks(recv_files)
    reader, writer = _Reader(send_paths), _Writer(out_dir, recv_files)
    try:
        for k in range(max(len(sc), len(rc))):
            works = []
            rbuf = None
            if k < len(sc):
                i, off, n = sc[k]
                works.append(dist.isend(reader.read(i, off, n), dst=send_to, group=group))
            if k < len(rc):
                i, off, n = rc[k]
                rbuf = torch.empty(n, dtype=torch.uint8)
                works.append(dist.irecv(rbuf, src=recv_from, group=group))
            for w in works:
                w.wait()
            if rbuf is not None:
                i, off, _ = rc[k]
                writer.write(i, off, rbuf)
        return writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()


def receive_buffer(n: int) -> Any:
    """A writable buffer of ``n`` bytes for a received file, left untouched: its pages fault in while
    gloo writes the pieces (``bytearray(n)`` would zero-fill all of them before the first piece).
    Not huge pages: on a host short of free huge pages their allocation stalls in compaction."""
    return torch.empty(n, dtype=torch.uint8).numpy()


def _as_tensor(buf: Any) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without copying it; read-only buffers (file mappings) are only sent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-writable.*")
        return torch.frombuffer(buf, dtype=torch.uint8)


@dataclass(frozen=True)
class Received:
    """A file received into memory, with the crc32c of its bytes."""

    data: Any  # a writable buffer
    crc32c: int


@dataclass(frozen=True)
class Transfer:
    """``size``: the bytes that travel; ``blocks``: only these verification blocks of the file travel
    (a resharded restore reads part of another rank's file), None for the whole file."""

    src: int
    dst: int
    name: str
    size: int
    blocks: tuple[int, ...] | None = None


def run_transfers(group: Any, rank: int, transfers: Sequence[Transfer], *,
                  src_path: dict[str, str], out_dir: str | os.PathLike[str] | None,
                  to_memory: bool = False, src_mem: dict[str, Any] | None = None,
                  wire: dict[str, FileEntry] | None = None,
                  land: dict[str, Landing] | None = None) -> dict[str, Any]:
    """Execute ``transfers`` (identical list on every rank) in order.

    Returns name -> received file: a path under ``out_dir`` (scratch, not fsynced), or with
    ``to_memory`` a :class:`Received` (the bytes and their crc32c, computed while later pieces arrive).
    Files in ``wire`` (name -> manifest entry, the same on every rank) travel in :func:`wire_pieces` and land
    where ``land`` says (see :class:`Landing`; a file with no landing lands whole in a kept buffer): those
    come back as :class:`Landed`.
    """
    received: dict[str, Any] = {}
    for t in transfers:
        if wire is not None and t.name in wire and t.src != t.dst:
            entry = wire[t.name]
            if t.src == rank:
                if src_mem and t.name in src_mem:
                    send_pieces(group, t.dst, entry, data=src_mem[t.name], blocks=t.blocks)
                else:
                    send_pieces(group, t.dst, entry, path=src_path[t.name], blocks=t.blocks)
            elif t.dst == rank:
                how = (land or {}).get(t.name) or Landing([Span(0, entry.size)], keep=True)
                received[t.name] = receive_into(group, t.src, entry, how, blocks=t.blocks)
            continue
        pieces = _chunks([FileSpec(t.name, t.size)])
        if t.src == rank and t.dst != rank and src_mem and t.name in src_mem:
            data = _as_tensor(src_mem[t.name]) if t.size else None
            for _, off, n in pieces:
                assert data is not None
                dist.send(data[off:off + n], dst=t.dst, group=group)
        elif t.src == rank and t.dst != rank:
            reader = _Reader([src_path[t.name]])
            try:
                inflight = None
                for k, (i, off, n) in enumerate(pieces):
                    work = dist.isend(reader.read(i, off, n, slot=k % 2), dst=t.dst, group=group)
                    if inflight is not None:
                        inflight.wait()  # frees the other slot for the next read
                    inflight = work
                if inflight is not None:
                    inflight.wait()
            finally:
                reader.close()
        elif t.dst == rank and t.src != rank and to_memory:
            data = receive_buffer(t.size)
            crc = 0
            if t.size:
                view = torch.frombuffer(data, dtype=torch.uint8)
                mv = memoryview(data)
                prev = None
                for _, off, n in pieces:
                    work = dist.irecv(view[off:off + n], src=t.src, group=group)
                    if prev is not None:
                        prev[0].wait()
                        crc = crc_bytes(mv[prev[1]:prev[1] + prev[2]], crc)
                    prev = (work, off, n)
                assert prev is not None
                prev[0].wait()
                crc = crc_bytes(mv[prev[1]:prev[1] + prev[2]], crc)
            received[t.name] = Received(data, crc)
        elif t.dst == rank and t.src != rank:
            assert out_dir is not None
            spec = [FileSpec(t.name, t.size)]
            writer = _Writer(out_dir, spec)
            try:
                for i, off, n in _chunks(spec):
                    buf = torch.empty(n, dtype=torch.uint8)
                    dist.recv(buf, src=t.src, group=group)
                    writer.write(i, off, buf)
                received[t.name] = writer.finish(durable=False)[0]
            except BaseException:
                writer.abort()
                raise
    return received


def wire_pieces(entry: FileEntry, blocks: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(offset, length) pieces a file travels in when it lands in the receiver's tensors: cut at the
    manifest's verification blocks and around the bytes of every tensor of at least ``DIRECT_MIN`` bytes
    (the manifest's layout), at most ``CHUNK`` long. Both ends compute it from the same manifest entry.

    ``blocks``: only the pieces of these verification blocks (a part of the file), at most ``RANGED_PIECE``
    long: the receiver stages the bytes no target takes in pieces that small."""
    size = entry.size
    bounds = [(a, b) for a, b, _ in blocks_of(entry)]
    cuts = {a for a, _ in bounds} | {0, size}
    for _, start, n in entry.items:
        if n >= DIRECT_MIN and 0 <= start and start + n <= size:
            cuts.update((start, start + n))
    pts = sorted(cuts)
    longest = CHUNK
    chosen = set(range(len(bounds))) if blocks is None else {i for i in blocks if 0 <= i < len(bounds)}
    if blocks is not None:
        longest = RANGED_PIECE
    out = []
    bi = 0
    for a, b in zip(pts, pts[1:]):
        while bi < len(bounds) and bounds[bi][1] <= a:
            bi += 1
        if bi not in chosen:
            continue  # a block not sent (pieces never cross a block: its start is a cut)
        while a < b:
            k = min(longest, b - a)
            out.append((a, k))
            a += k
    return out


@dataclass
class Landing:
    """Where the bytes of a file received from a peer go: ``spans`` (file order, covering the file: into a
    uint8 view of a target tensor, or with no target only checked) and, with ``keep``, the bytes no target
    takes are also kept in a file-sized buffer (objects DCP reads afterwards)."""

    spans: list[Span]
    keep: bool = False


@dataclass(frozen=True)
class Landed:
    """A file received into its targets: the manifest blocks whose digest differed (their bytes are to be
    fetched again from another copy) and the kept bytes (or None)."""

    bad: tuple[int, ...]
    keep: Any = None
    staged: int = 0  # bytes of the staging buffers it allocated beside the targets
    received: int = 0  # bytes that travelled


class _Pieces:
    """Where each wire piece of a file lands, given the receiver's spans."""

    def __init__(self, spans: Sequence[Span]):
        self._spans = sorted(spans, key=lambda s: s.off)
        self._starts = [s.off for s in self._spans]

    def covering(self, a: int, n: int) -> list[Span]:
        i = max(0, bisect.bisect_right(self._starts, a) - 1)
        out = []
        while i < len(self._spans) and self._spans[i].off < a + n:
            s = self._spans[i]
            if s.off + s.n > a:
                out.append(s)
            i += 1
        return out


# pieces in flight at once on each end of a landed transfer: one at a time pays a round trip per piece
# (hundreds of pieces for a model's tensors); at most WINDOW_BYTES of them, so the staging buffers stay small
WINDOW = 16
WINDOW_BYTES = 64 << 20
# a part of a file (a resharded restore): small pieces and few bytes in flight, so that what the receiver
# stages beside its targets stays a small fraction of its new shard
RANGED_PIECE = 128 << 10
RANGED_WINDOW_BYTES = 512 << 10


def receive_into(group: Any, src: int, entry: FileEntry, landing: Landing,
                 blocks: Sequence[int] | None = None) -> Landed:
    """Receive a file sent with :func:`send_pieces` straight into ``landing``'s targets; the digest of each
    manifest block (xxh3, or crc32c in older manifests) is computed over what landed, while later pieces
    are in flight. ``blocks``: only these blocks travel (the others are neither received nor checked)."""
    pieces = wire_pieces(entry, blocks)
    window_bytes = WINDOW_BYTES if blocks is None else RANGED_WINDOW_BYTES
    bounds = blocks_of(entry)
    starts = [a for a, _, _ in bounds]
    new_hash = hasher(entry)
    hashes = [new_hash() for _ in bounds]
    staged_bytes = [0]  # staging buffers allocated beside the targets: what this receive holds beyond them
    where = _Pieces(landing.spans)
    keep = receive_buffer(entry.size) if landing.keep and entry.size else None
    keep_t = torch.from_numpy(keep) if keep is not None else None
    spare: list[torch.Tensor] = []  # staging buffers free for reuse

    def post(k: int) -> tuple[Any, int, int, torch.Tensor, list[Span] | None, torch.Tensor | None]:
        a, n = pieces[k]
        over = where.covering(a, n)
        slot = None
        if len(over) == 1 and over[0].dst is not None:
            s = over[0]
            buf = s.dst[a - s.off:a - s.off + n]
            staged = None
        else:
            if keep_t is not None:
                buf = keep_t[a:a + n]
            else:
                i = next((i for i, b in enumerate(spare) if b.numel() >= n), None)
                if i is None:
                    slot = torch.empty(max(n, 1 << 20) if blocks is None else n, dtype=torch.uint8)
                    staged_bytes[0] += slot.numel()
                else:
                    slot = spare.pop(i)  # by position: list.remove would compare tensors element-wise
                buf = slot[:n]
            staged = [s for s in over if s.dst is not None]
        return dist.irecv(buf, src=src, group=group), a, n, buf, staged, slot

    def finish(p: tuple[Any, int, int, torch.Tensor, list[Span] | None, torch.Tensor | None]) -> None:
        work, a, n, buf, staged, slot = p
        work.wait()
        b = bisect.bisect_right(starts, a) - 1
        hashes[b].update(memoryview(buf.numpy()))
        for s in staged or ():
            x, y = max(a, s.off), min(a + n, s.off + s.n)
            assert s.dst is not None
            s.dst[x - s.off:y - s.off].copy_(buf[x - a:y - a])
        if slot is not None:
            spare.append(slot)

    inflight: collections.deque[Any] = collections.deque()
    in_bytes = 0
    for k in range(len(pieces)):
        while inflight and (len(inflight) >= WINDOW or in_bytes + pieces[k][1] > window_bytes):
            done = inflight.popleft()
            in_bytes -= done[2]
            finish(done)
        inflight.append(post(k))
        in_bytes += pieces[k][1]
    while inflight:
        finish(inflight.popleft())
    sent = set(range(len(bounds))) if blocks is None else set(blocks)
    bad = tuple(i for i, (a, b, want) in enumerate(bounds) if i in sent and b > a and hashes[i].intdigest() != want)
    return Landed(bad, keep, staged=staged_bytes[0], received=sum(n for _, n in pieces))


def send_pieces(group: Any, dst: int, entry: FileEntry, *, path: str | None = None, data: Any = None,
                blocks: Sequence[int] | None = None) -> None:
    """Send a file (``path`` on disk, or ``data`` in memory) in :func:`wire_pieces`, several pieces in flight
    (only ``blocks`` of it, when given). A file on disk is sent from a read-only mapping of it: no buffer,
    no copy on this side."""
    pieces = wire_pieces(entry, blocks)
    window_bytes = WINDOW_BYTES if blocks is None else RANGED_WINDOW_BYTES
    if not entry.size:
        return
    mm = None
    f = None
    try:
        if data is None:
            assert path is not None
            f = open(path, "rb")
            real = os.fstat(f.fileno()).st_size
            if real < entry.size:
                raise OSError(f"{path}: file shorter than announced ({real} < {entry.size})")
            mm = mmap.mmap(f.fileno(), entry.size, prot=mmap.PROT_READ)
            data = mm
        t = _as_tensor(data)
        inflight: collections.deque[tuple[Any, int]] = collections.deque()
        in_bytes = 0
        for a, n in pieces:
            while inflight and (len(inflight) >= WINDOW or in_bytes + n > window_bytes):
                w, m = inflight.popleft()
                w.wait()
                in_bytes -= m
            inflight.append((dist.isend(t[a:a + n], dst=dst, group=group), n))
            in_bytes += n
        while inflight:
            inflight.popleft()[0].wait()
        del t
    finally:
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still referenced somewhere; the mapping goes with it
                pass
        if f is not None:
            f.close()
