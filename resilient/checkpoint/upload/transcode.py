"""Rewriting a step's files for a transfer: items coded in jobs on a few threads, whole coded items cut into
part objects and sent while coding goes on (:func:`stream_files`); the merged ``.metadata`` and manifest of
the coded step (:func:`merged_metadata`, :func:`finish_step`); and the way back, a plain copy that needs
nothing of this package (:func:`export_step`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from resilient.checkpoint.api import DCP_METADATA, FileEntry, Manifest, UnsafeCheckpointError
from resilient.checkpoint.format.codec import (BLOCK, Codec, CompressError, DESCRIPTOR, ItemTooLargeError, MAGIC, _cctx,
                                               _plane_cctx, _planes_encode, item_limit, iter_decode)
from resilient.checkpoint.format.digests import BLOCK as VERIFY_BLOCK, _Blocks, crc_bytes, map_verified
from resilient.checkpoint.format.safe import load_metadata
from resilient.checkpoint.storage.parts import DirDest, SENDERS, Sink, TierDest, part_name, part_size


logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ rewriting a step for a transfer
CHUNK = 2 << 20  # raw bytes per coding job: small enough that coding runs ahead of the network early
INFLIGHT = 4  # coding jobs queued or running ahead of the one being sent: bounds memory per rank


@dataclass
class Transcoded:
    """This rank's part of a step rewritten with a codec, sent to a sink (a directory or the store);
    ``storage`` is what ``.metadata`` must say of their items (gathered from every rank)."""

    codec: Codec
    files: dict[str, FileEntry]
    storage: dict[Any, _StorageInfo]
    raw_bytes: int
    seconds: float  # wall time of the whole rewrite (coding and sending overlapped)
    codec_seconds: float = 0.0  # coding time summed over the coding threads
    threads: int = 1
    send_seconds: float = 0.0  # time blocked sending (writes and the final commit)

    @property
    def ratio(self) -> float:
        coded = sum(f.size for f in self.files.values())
        return self.raw_bytes / coded if coded else 1.0

    @property
    def coded_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def codec_bps(self) -> float:
        """Raw bytes per second the coding threads sustained together."""
        return self.raw_bytes / max(self.codec_seconds / max(self.threads, 1), 1e-9)


def _elem_sizes(md: Any) -> dict[str, int]:
    """fqn -> element size of a tensor entry of the checkpoint's metadata."""
    out = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[fqn] = m.properties.dtype.itemsize
    return out


@dataclass(frozen=True)
class _Piece:
    """Bytes ``start:end`` of the source file, part of item ``item``; ``first``: its stream header goes first."""

    item: int
    start: int
    end: int
    first: bool
    last: bool


def _jobs(items: Sequence[tuple[Any, _StorageInfo]], codec: Codec, chunk: int) -> list[list[_Piece]]:
    """Items cut into pieces (a bgzstd block of at most BLOCK bytes, or a whole item for zstd: DCP's
    ``stream.zstd`` reads one frame per item), grouped in file order into jobs of about ``chunk`` bytes."""
    jobs: list[list[_Piece]] = []
    cur: list[_Piece] = []
    fill = 0
    for k, (_, info) in enumerate(items):
        a, end = info.offset, info.offset + info.length
        step = BLOCK if codec is Codec.BGZSTD else max(info.length, 1)
        starts = range(a, end, step) or range(a, a + 1)  # an empty item is one empty piece
        for j, s in enumerate(starts):
            e = min(s + step, end)
            if cur and fill + (e - s) > chunk:
                jobs.append(cur)
                cur, fill = [], 0
            cur.append(_Piece(k, s, e, j == 0, e == end))
            fill += e - s
    if cur:
        jobs.append(cur)
    return jobs


def _code_job(codec: Codec, src: memoryview, pieces: Sequence[_Piece], es_of: Sequence[int],
              local: threading.local) -> tuple[list[int], list[list[Any]], float]:
    """(coded length of each piece, each piece's coded buffers, seconds)."""
    t0 = time.perf_counter()
    if codec is Codec.BGZSTD:
        cctx = getattr(local, "planes", None) or _plane_cctx()
        local.planes = cctx
    else:
        cctx = getattr(local, "items", None) or _cctx()
        local.items = cctx
    lens: list[int] = []
    out: list[list[Any]] = []
    for p in pieces:
        raw = src[p.start:p.end]
        if codec is Codec.BGZSTD:
            es = es_of[p.item]
            bufs: list[Any] = [MAGIC + bytes([es])] if p.first else []
            if len(raw):
                # each block learns on its own which planes are stored: incompressible planes are
                # recognised by zstd at GB/s, so learning costs little, and blocks need not wait for each other
                bufs += _planes_encode(raw, es, cctx, [False] * es)
        else:
            bufs = [cctx.compress(raw)]
        lens.append(sum(len(b) for b in bufs))
        out.append(bufs)
    return lens, out, time.perf_counter() - t0


def stream_files(src_dir: str | os.PathLike[str], names: Sequence[str], metadata: Any, codec: Codec,
                 dest: DirDest | TierDest, expected: dict[str, FileEntry] | None = None,
                 threads: int | None = None, inflight: int = INFLIGHT, chunk: int = CHUNK,
                 part: int | None = None) -> Transcoded:
    """Code this rank's ``.distcp`` files ``names`` of a plain step in ``src_dir`` with ``codec`` and send
    them to ``dest`` as they are coded: coding threads work up to ``inflight`` jobs of ``chunk`` raw bytes
    ahead; the coded bytes of whole items are cut into part objects of about ``part`` bytes
    (:func:`part_size`; :func:`part_name`), each sent on a sender thread while coding goes on; an item
    larger than a part is streamed on its own (:class:`Sink`). Codec and network overlap; memory stays
    bounded by a few chunks and parts (and by the largest item for DCP's ``stream.zstd``).

    ``expected``: the local manifest's entries, verified before a byte is sent (a copy that rotted on the
    local disk is never uploaded). ``metadata``: the step's DCP metadata. Returns this rank's part files
    and item layout; the caller gathers :attr:`Transcoded.storage` from every rank for :func:`merged_metadata`."""
    t0 = time.perf_counter()
    threads = threads or min(2, os.cpu_count() or 1)
    sizes = _elem_sizes(metadata)
    src = Path(src_dir)
    mine = set(names)
    by_file: dict[str, list[tuple[Any, _StorageInfo]]] = {}
    for idx, info in metadata.storage_data.items():
        if info.relative_path in mine:
            if info.transform_descriptors:
                raise CompressError(f"{info.relative_path}: item {idx.fqn!r} is already transformed")
            by_file.setdefault(info.relative_path, []).append((idx, info))
    files: dict[str, FileEntry] = {}
    storage: dict[Any, _StorageInfo] = {}
    raw_total, busy, send = 0, 0.0, 0.0
    local = threading.local()
    sent: deque[tuple[str, int, Future[Any], float]] = deque()  # (part, bytes, future, when submitted)

    def wait_sent(keep: int) -> None:
        nonlocal send
        while len(sent) > keep:
            n, nbytes, fut, _ = sent.popleft()
            t = time.perf_counter()
            try:
                fut.result(timeout=dest.deadline(nbytes))
            except FutureTimeout:
                raise TimeoutError(f"upload of {n} got no answer in time (is the store reachable?)") from None
            finally:
                send += time.perf_counter() - t

    with ThreadPoolExecutor(threads, thread_name_prefix="resilient-ckpt-code") as pool, \
            ThreadPoolExecutor(SENDERS, thread_name_prefix="resilient-ckpt-send") as senders:
        try:
            for name in names:
                items = sorted(by_file.get(name, []), key=lambda p: p[1].offset)
                fe = (expected or {}).get(name)
                data: Any = map_verified(src / name, fe) if fe is not None else (src / name).read_bytes()
                mv = memoryview(data).cast("B")
                raw_total += len(mv)
                psize = part or part_size(len(mv))
                es_of = [sizes.get(idx.fqn, 1) for idx, _ in items]
                big = [info.length > psize for _, info in items]  # streamed alone: a part could not hold it
                todo = iter(_jobs(items, codec, chunk))
                pending: deque[tuple[list[_Piece], Future[Any]]] = deque()

                def ahead() -> None:
                    while len(pending) < inflight:
                        job = next(todo, None)
                        if job is None:
                            return
                        pending.append((job, pool.submit(_code_job, codec, mv, job, es_of, local)))

                k = 0  # next part number
                buf: list[Any] = []
                crc = _Blocks(VERIFY_BLOCK)
                where: dict[int, tuple[str, int]] = {}  # item -> (part, offset)
                length: dict[int, int] = {}
                sink: Sink | None = None

                def ship() -> None:
                    # the buffered whole items become part k, sent while coding goes on
                    nonlocal k, buf, crc
                    pname, body = part_name(name, k), b"".join(buf)
                    files[pname] = crc.entry()
                    wait_sent(SENDERS)  # bounded: at most SENDERS parts queued behind the ones sending
                    sent.append((pname, len(body), senders.submit(dest.put, pname, body), time.perf_counter()))
                    k, buf, crc = k + 1, [], _Blocks(VERIFY_BLOCK)

                try:
                    ahead()
                    while pending:
                        job, fut = pending.popleft()
                        lens, bufs, secs = fut.result()
                        ahead()  # keep the coders busy while this job's bytes go out
                        busy += secs
                        for p, n, out in zip(job, lens, bufs):
                            if big[p.item]:
                                if p.first:
                                    if buf:
                                        ship()  # the big item starts a part of its own
                                    pname = part_name(name, k)
                                    sink, where[p.item], length[p.item] = dest.open(pname), (pname, 0), 0
                                assert sink is not None
                                blob = b"".join(out)
                                crc.update(blob)
                                sink.write(blob)
                                length[p.item] += n
                                if p.last:
                                    sink.close()
                                    send += sink.seconds
                                    files[part_name(name, k)] = crc.entry()
                                    sink, k, crc = None, k + 1, _Blocks(VERIFY_BLOCK)
                            else:
                                if p.first:
                                    where[p.item], length[p.item] = (part_name(name, k), crc.size), 0
                                for b in out:
                                    crc.update(b)
                                buf += out
                                length[p.item] += n
                                if p.last and crc.size >= psize:
                                    ship()
                    if buf or k == 0:
                        ship()
                except BaseException:
                    for _, fut in pending:
                        fut.cancel()
                    if sink is not None:
                        sink.abort()
                    raise
                for i, (idx, info) in enumerate(items):
                    pname, off = where[i]
                    storage[idx] = dataclasses.replace(info, relative_path=pname, offset=off, length=length[i],
                                                       transform_descriptors=[DESCRIPTOR[codec]])
            wait_sent(0)
        except BaseException:
            for _, _, fut, _ in sent:
                fut.cancel()
            raise
    return Transcoded(codec=codec, files=files, storage=storage, raw_bytes=raw_total,
                      seconds=time.perf_counter() - t0, codec_seconds=busy, threads=threads, send_seconds=send)


def transcode_files(src_dir: str | os.PathLike[str], names: Sequence[str], metadata: Any, codec: Codec,
                    out_dir: str | os.PathLike[str], threads: int | None = None) -> Transcoded:
    """Rewrite this rank's ``.distcp`` files ``names`` of a plain step in ``src_dir`` into ``out_dir``
    (:func:`stream_files` into a directory: the coded parts, the first under each file's own name)."""
    return stream_files(src_dir, names, metadata, codec, DirDest(out_dir), threads=threads)


def merged_metadata(metadata: Any, parts: Iterable[dict[Any, _StorageInfo]]) -> bytes:
    """The step's ``.metadata`` with every rank's rewritten items; the same bytes on every rank."""
    md = pickle.loads(pickle.dumps(metadata))
    storage = dict(md.storage_data)
    for part in parts:
        storage.update(part)
    md.storage_data = storage
    return pickle.dumps(md)


def finish_step(out_dir: str | os.PathLike[str], manifest: Manifest, part: Transcoded, metadata_bytes: bytes,
                manifest_name: str) -> Manifest:
    """Write ``.metadata`` and this rank's manifest of the rewritten step into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / DCP_METADATA).write_bytes(metadata_bytes)
    # the rank index names the plain copy's byte ranges: not this copy's (restores of it parse its .metadata)
    m = dataclasses.replace(manifest, files=dict(part.files), index=None,
                            metadata=FileEntry(size=len(metadata_bytes), crc32c=crc_bytes(metadata_bytes)))
    (out / manifest_name).write_text(json.dumps(m.to_json()))
    return m


# ------------------------------------------------------------------ a plain copy
def export_step(read_file: Callable[[str], bytes], names: Sequence[str], out_dir: str | os.PathLike[str],
                metadata: Any = None) -> int:
    """Write a plain (untransformed) DCP copy of a step into ``out_dir``; ``read_file(name)`` gives a
    file of the step. Returns the number of items decoded. Files with no transformed item are copied.

    ``metadata``: the step's DCP metadata (read through ``read_file`` when None). Each coded item is
    decoded as a stream straight into its file, at most :func:`item_limit` bytes (its true size from
    ``.metadata``): memory stays a few MB whatever an item decodes to, and a decompression bomb raises
    :class:`~resilient.checkpoint.api.UnsafeCheckpointError` naming the file and item. The caller removes
    what was written when this raises."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = metadata if metadata is not None else load_metadata(read_file(DCP_METADATA), what=DCP_METADATA)
    by_file: dict[str, list[tuple[Any, _StorageInfo]]] = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((idx, info))
    storage = dict(md.storage_data)
    decoded = 0
    for name in names:
        if name == DCP_METADATA:
            continue
        data = read_file(name)
        items = sorted(by_file.get(name, []), key=lambda p: p[1].offset)
        if not any(info.transform_descriptors for _, info in items):
            (out / name).write_bytes(data)
            continue
        mv = memoryview(data).cast("B")
        off = 0
        with open(out / f".{name}.tmp", "wb") as f:
            for idx, info in items:
                if info.offset < 0 or info.length < 0 or info.offset + info.length > len(mv):
                    raise CompressError(f"{name}: item {idx.fqn!r} lies outside the file ({info.offset}+"
                                        f"{info.length} > {len(mv)} bytes)")
                body = mv[info.offset:info.offset + info.length]
                n = 0
                if info.transform_descriptors:
                    try:
                        for piece in iter_decode(body, info.transform_descriptors, item_limit(md, idx)):
                            f.write(piece)
                            n += len(piece)
                    except ItemTooLargeError as e:
                        raise UnsafeCheckpointError(name, None, f"item {idx.fqn!r} {e}, more than its "
                                                    ".metadata entry allows (a decompression bomb)") from None
                    decoded += 1
                else:
                    f.write(body)
                    n = len(body)
                storage[idx] = dataclasses.replace(info, offset=off, length=n, transform_descriptors=None)
                off += n
        os.replace(out / f".{name}.tmp", out / name)
    md.storage_data = storage
    tmp = out / f"{DCP_METADATA}.tmp"
    tmp.write_bytes(pickle.dumps(md))
    os.replace(tmp, out / DCP_METADATA)  # last: DCP's own commit marker
    return decoded


def clear(out_dir: str | os.PathLike[str]) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)


