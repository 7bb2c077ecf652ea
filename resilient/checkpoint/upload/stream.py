"""Coding a rank's files of a step and sending the coded parts as they are produced: the bytes' part of a compressed
upload, as :mod:`.send` is of a plain one.

The upload thread runs it in the training process, or hands it to the upload process (:mod:`.process`), which runs
the same function: so this module imports no torch, and knows a step's items only as byte ranges
(:class:`Item`, which :mod:`.transcode` makes from DCP's ``.metadata`` and turns back into it). Coding threads work a
few jobs ahead; the coded bytes of whole items are cut into part objects, each sent on a sender thread while coding
goes on; an item larger than a part is streamed on its own (:class:`~resilient.checkpoint.storage.parts.Sink`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.checkpoint.api import FileEntry
from resilient.checkpoint.format.codec import BLOCK, Codec, MAGIC, _cctx, _plane_cctx, _planes_encode
from resilient.checkpoint.format.digests import BLOCK as VERIFY_BLOCK, _Blocks, map_verified
from resilient.checkpoint.storage.parts import PART_MIN, SENDERS, DirDest, TierDest, part_name, part_size

logger = logging.getLogger(__name__)

CHUNK = 2 << 20  # raw bytes per coding job: small enough that coding runs ahead of the network early
INFLIGHT = 4  # coding jobs queued or running ahead of the one being sent: bounds memory per rank
# the slowest coding a job's bound allows for (raw bytes/s on one thread of a loaded node): only a process that
# stopped answering runs past it
MIN_CODEC_RATE = float(4 << 20)


@dataclass(frozen=True)
class Item:
    """One item of a ``.distcp`` file as the codec sees it: its byte range and its element size (the byte planes)."""

    offset: int
    length: int
    elem_size: int = 1


@dataclass(frozen=True)
class CodeJob:
    """This rank's files of ``step`` to code with ``codec`` and send: ``files`` in order, each with its items
    sorted by offset, read from the step's local directory ``src`` and verified against ``expected`` first."""

    step: int
    src: str
    files: tuple[tuple[str, tuple[Item, ...]], ...]
    codec: Codec
    expected: dict[str, FileEntry] = field(default_factory=dict)
    retries: int = 0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    threads: int | None = None
    inflight: int = INFLIGHT
    chunk: int = CHUNK
    part: int | None = None

    @property
    def raw_bytes(self) -> int:
        return sum(fe.size for n, _ in self.files if (fe := self.expected.get(n)) is not None)

    def deadline_s(self, timeout_s: float, min_rate: float) -> float:
        """How long the whole job may take: every part's upload one after another with every retry (each attempt
        bounded by the tier), and the coding at :data:`MIN_CODEC_RATE`."""
        raw = self.raw_bytes
        # small items share parts (at most one per PART_MIN of the file); an item larger than a part is one of its own
        # (counting every item would give a stopped process hours at a thousand tensors)
        parts = sum(1 + (fe.size if (fe := self.expected.get(n)) else 0) // PART_MIN
                    + sum(1 for it in items if it.length > PART_MIN) for n, items in self.files)
        return ((parts * (timeout_s + self.backoff_max_s) + raw / min_rate) * (self.retries + 1)
                + raw / MIN_CODEC_RATE)


@dataclass
class Streamed:
    """What :func:`stream_items` sent: the part files, where each item went (per file, in the order of its items:
    ``(part, offset, coded length)``), and the measurements the chooser learns from."""

    files: dict[str, FileEntry]
    where: dict[str, list[tuple[str, int, int]]]
    raw_bytes: int
    seconds: float  # wall time of the whole rewrite (coding and sending overlapped)
    codec_seconds: float = 0.0  # coding time summed over the coding threads
    threads: int = 1
    send_seconds: float = 0.0  # time blocked sending (writes and the final commit)


@dataclass(frozen=True)
class _Piece:
    """Bytes ``start:end`` of the source file, part of item ``item``; ``first``: its stream header goes first."""

    item: int
    start: int
    end: int
    first: bool
    last: bool


def _jobs(items: Sequence[Item], codec: Codec, chunk: int) -> list[list[_Piece]]:
    """Items cut into pieces (a bgzstd block of at most BLOCK bytes, or a whole item for zstd: DCP's
    ``stream.zstd`` reads one frame per item), grouped in file order into jobs of about ``chunk`` bytes."""
    jobs: list[list[_Piece]] = []
    cur: list[_Piece] = []
    fill = 0
    for k, it in enumerate(items):
        a, end = it.offset, it.offset + it.length
        step = BLOCK if codec is Codec.BGZSTD else max(it.length, 1)
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


def code_files(tier: Any, job: CodeJob, should_stop: Callable[[], bool] | None = None,
               on_landed: Callable[[str], None] | None = None) -> Streamed:
    """Run ``job`` against ``tier`` (the upload process's entry, and the upload thread's when it sends itself):
    :func:`stream_items` into the job's step of the tier, retried as any upload; ``should_stop`` ends the retries."""
    dest = TierDest(tier, job.step, retries=job.retries, backoff_s=job.backoff_s, backoff_max_s=job.backoff_max_s,
                    should_stop=should_stop)
    return stream_items(job.src, job.files, job.codec, dest, expected=job.expected, threads=job.threads,
                        inflight=job.inflight, chunk=job.chunk, part=job.part, on_landed=on_landed)


def stream_items(src_dir: str | os.PathLike[str], files: Sequence[tuple[str, Sequence[Item]]], codec: Codec,
                 dest: DirDest | TierDest, expected: dict[str, FileEntry] | None = None,
                 threads: int | None = None, inflight: int = INFLIGHT, chunk: int = CHUNK,
                 part: int | None = None, on_landed: Callable[[str], None] | None = None) -> Streamed:
    """Code the ``files`` of ``src_dir`` (each with its items, sorted by offset) with ``codec`` and send them to
    ``dest`` as they are coded: coding threads work up to ``inflight`` jobs of ``chunk`` raw bytes ahead; the coded
    bytes of whole items are cut into part objects of about ``part`` bytes (:func:`part_size`; :func:`part_name`),
    each sent on a sender thread while coding goes on; an item larger than a part is streamed on its own. Codec and
    network overlap; memory stays bounded by a few chunks and parts (and by the largest item for DCP's
    ``stream.zstd``). ``expected``: the local manifest's entries, verified before a byte is sent (a copy that rotted
    on the local disk is never uploaded). ``on_landed`` is told each part's name once it is on ``dest``."""
    t0 = time.perf_counter()
    threads = threads or min(2, os.cpu_count() or 1)
    src = Path(src_dir)
    parts: dict[str, FileEntry] = {}
    where_all: dict[str, list[tuple[str, int, int]]] = {}
    raw_total, busy, send = 0, 0.0, 0.0
    local = threading.local()
    sent: deque[tuple[str, int, Future[Any]]] = deque()  # (part, bytes, future)

    def put(pname: str, body: bytes) -> None:
        dest.put(pname, body)
        if on_landed is not None:
            on_landed(pname)

    def wait_sent(keep: int) -> None:
        nonlocal send
        while len(sent) > keep:
            n, nbytes, fut = sent.popleft()
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
            for name, items in files:
                fe = (expected or {}).get(name)
                data: Any = map_verified(src / name, fe) if fe is not None else (src / name).read_bytes()
                mv = memoryview(data).cast("B")
                raw_total += len(mv)
                psize = part or part_size(len(mv))
                es_of = [it.elem_size for it in items]
                big = [it.length > psize for it in items]  # streamed alone: a part could not hold it
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
                sink: Any = None

                def ship() -> None:
                    # the buffered whole items become part k, sent while coding goes on
                    nonlocal k, buf, crc
                    pname, body = part_name(name, k), b"".join(buf)
                    parts[pname] = crc.entry()
                    wait_sent(SENDERS)  # bounded: at most SENDERS parts queued behind the ones sending
                    sent.append((pname, len(body), senders.submit(put, pname, body)))
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
                                    pname = part_name(name, k)
                                    parts[pname] = crc.entry()
                                    if on_landed is not None:
                                        on_landed(pname)
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
                where_all[name] = [(where[i][0], where[i][1], length[i]) for i in range(len(items))]
            wait_sent(0)
        except BaseException:
            for _, _, fut in sent:
                fut.cancel()
            raise
    return Streamed(files=parts, where=where_all, raw_bytes=raw_total, seconds=time.perf_counter() - t0,
                    codec_seconds=busy, threads=threads, send_seconds=send)
