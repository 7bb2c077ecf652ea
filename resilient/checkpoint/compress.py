"""Lossless, exponent-aware compression of checkpoint transfers, kept inside the DCP format.

Floating-point tensors compress badly as they are: each element's sign+exponent byte (very skewed: trained
weights and optimizer moments use a few dozen exponents) is interleaved with mantissa bytes (close to
random). Splitting each element's bytes into planes (byte 0 of every element, then byte 1, ...) and
entropy-coding each plane with zstd separately lets the exponent plane shrink 2-4x while the mantissa
planes pass through; that is ZipNN's and eXmY's observation. Measured on a small trained GPT
(``bench/compress.py``), this gives a ratio at or above blosc2's shuffle+zstd (and zipnn's) at about the
same speed, with zstandard alone as the dependency (the library DCP's own ``ZStandard`` extension uses).

Format at rest: a step stays a DCP directory. Each item of a ``.distcp`` file is rewritten on its own
and ``.metadata`` names the transform of every item (DCP's stream extensions) and the file that holds it:
a rank's coded file is sent as several part objects (``__0_0.distcp``, ``__0_0.p1.distcp``, ...; whole
items each), listed in that rank's manifest like any file.

* ``bgzstd`` -> descriptor ``resilient.bgzstd/1``: our :class:`ByteGroupZstd`. ``dcp.load`` reads it when
  given :func:`extension_registry` (``FileSystemReader(path, _extension_registry=extension_registry())``);
  ``resilient ckpt export URL DIR`` writes a plain copy that needs nothing of this package.
* ``zstd`` -> descriptor ``stream.zstd/1``: DCP's own ``ZStandard``; plain ``dcp.load`` reads it (with
  zstandard installed), at a lower ratio (no byte planes).

Upload (:func:`prepare_upload`, called by the uploader): items are coded in jobs of a few MB on two
threads, ahead of the sending; coded whole items are cut into parts of one request each, sent two at a
time while coding goes on (a single-request upload cost the GCS emulator half the CPU per byte of a
resumable one); an item larger than a part is streamed alone. No scratch copy, bounded memory.

Encoded stream of ``resilient.bgzstd/1``: ``b"RBGZ"``, element size ``es`` (1 byte), then blocks until the
end: ``raw_len`` (u32); per plane (``es`` planes of ``raw_len // es`` bytes), ``clen`` (u32) and ``clen``
bytes: a zstd frame, or the plane itself when ``clen`` equals the plane's length (planes that do not
compress are stored, not coded); then the ``raw_len % es`` bytes of a tail shorter than one element.

Decoding is bounded (:func:`decode_item`, :func:`iter_decode`): a coded item never decodes to more than its
true size as ``.metadata`` records it (:func:`item_limit`: a tensor chunk's bytes plus torch.save's
records; an object's, ``RESILIENT_CKPT_MAX_OBJECT_MB``), and a zstd frame that declares more is refused
from its header. Someone who can write to a tier can make a few hundred KB decode to GBs and fix the
manifests to match; restore, ``resilient ckpt export`` and ``verify`` refuse such an item as unsafe
without allocating it. (DCP's own reader, given :func:`extension_registry`, reads a stream to its end:
read untrusted copies through this package.)
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import logging
import os
import pickle
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np
import zstandard
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from resilient import env as _renv
from resilient.checkpoint.api import DCP_METADATA, CheckpointConfigError, CheckpointError, FileEntry, Manifest

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAGIC = b"RBGZ"
BLOCK = 4 << 20  # raw bytes per block: bounds memory, and blocks are coded on several threads
_U32 = struct.Struct("<I")
_LEVEL = 1  # higher levels gained < 2% on trained weights at half the speed (bench/compress.py)
_STORE_BELOW = 1.02  # a plane that shrinks less than this is stored from then on


def _cctx(threads: int = 0) -> Any:
    """For whole items (DCP's ``stream.zstd``): general bytes."""
    # the frame checksum (xxhash, ~free) makes a damaged coded plane fail loudly instead of decoding wrong;
    # stored planes rely on the manifests' crc32c, checked before anything is decoded
    return zstandard.ZstdCompressor(level=_LEVEL, write_checksum=True, threads=threads)


def _plane_cctx() -> Any:
    """For byte planes. An exponent plane is a few dozen distinct byte values, which zstd's Huffman stage
    codes well; short matches cost more time than they save. Looking only for matches of 7 bytes or more
    in a small table, measured on a trained GPT's weights and AdamW moments (thread CPU time, bf16 and
    fp32): 1.5x the speed of level 1 and a better ratio on the exponent plane (2.99x against 2.78x)."""
    return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=17, hash_log=11, chain_log=11, search_log=1, min_match=7, target_length=0,
        strategy=zstandard.STRATEGY_FAST, write_checksum=True))


class Codec(str, enum.Enum):
    NONE = "none"
    BGZSTD = "bgzstd"  # byte planes + zstd: resilient.bgzstd/1
    ZSTD = "zstd"  # DCP's own ZStandard: stream.zstd/1


class CompressMode(str, enum.Enum):
    AUTO = "auto"
    NONE = "none"
    BGZSTD = "bgzstd"
    ZSTD = "zstd"


CHOICES = tuple(m.value for m in CompressMode)


def parse_mode(value: str | None) -> CompressMode:
    """``--ckpt-compress`` / ``RESILIENT_CKPT_COMPRESS``: one of auto, none, bgzstd, zstd."""
    v = (value or "auto").strip().lower()
    try:
        return CompressMode(v)
    except ValueError:
        raise CheckpointConfigError(f"--ckpt-compress {value!r}: choose one of {', '.join(CHOICES)}") from None


class CompressError(CheckpointError):
    """A compressed stream is malformed (truncated, tampered with, or not written by this codec)."""


# ------------------------------------------------------------------ the codec
# plane i of an element is its byte i (little-endian): reading elements as integers and shifting is a
# vectorised pass per plane; a strided byte transpose (reshape(-1, es).T.copy()) was ~10x slower and was
# most of the codec's time on bf16 (bench/compress.py)
_UINT = {2: "<u2", 4: "<u4", 8: "<u8"}


def _split(whole: memoryview, es: int) -> list[Any]:
    """The ``es`` byte planes of ``whole`` (a whole number of elements of ``es`` bytes)."""
    if es == 1:
        return [whole]
    dt = _UINT.get(es)
    if dt is None:  # 16-byte elements: no integer that wide
        return list(np.frombuffer(whole, dtype=np.uint8).reshape(-1, es).T.copy())
    a = np.frombuffer(whole, dtype=dt)
    return [(a >> (8 * i)).astype(np.uint8) if i else a.astype(np.uint8) for i in range(es)]


def _planes_encode(raw: memoryview, es: int, cctx: Any, stored: list[bool]) -> list[Any]:
    """One block: its length, then per plane (length, zstd frame or the plane itself), then the tail."""
    n = len(raw)
    whole = n - n % es  # a torch.save item is any length: its tail of less than one element is stored
    out: list[Any] = [_U32.pack(n)]
    for i, p in enumerate(_split(raw[:whole], es) if whole else [b""] * es):
        pb = memoryview(p).cast("B")
        c = b"" if stored[i] else cctx.compress(pb)
        if stored[i] or len(c) * _STORE_BELOW >= len(pb):
            stored[i] = True
            out += [_U32.pack(len(pb)), pb]
        else:
            out += [_U32.pack(len(c)), c]
    out.append(raw[whole:])
    return out


def encode(data: Any, elem_size: int, threads: int = 1) -> bytes:
    """``data`` (any buffer) coded as ``resilient.bgzstd/1`` with byte planes of ``elem_size``."""
    if elem_size not in (1, 2, 4, 8, 16):
        raise ValueError(f"elem_size={elem_size}: must be 1, 2, 4, 8 or 16")
    mv = memoryview(data).cast("B")
    blocks = [mv[o:o + BLOCK] for o in range(0, len(mv), BLOCK)]
    head = MAGIC + bytes([elem_size])
    if not blocks:
        return head
    # the first block learns which planes do not compress; later blocks skip coding them
    stored = [False] * elem_size
    first = _planes_encode(blocks[0], elem_size, _plane_cctx(), stored)
    rest = blocks[1:]
    if threads > 1 and len(rest) > 1:
        local = threading.local()

        def one(b: memoryview) -> list[Any]:
            c = getattr(local, "c", None) or _plane_cctx()
            local.c = c
            return _planes_encode(b, elem_size, c, list(stored))

        with ThreadPoolExecutor(min(threads, len(rest))) as ex:
            coded = list(ex.map(one, rest))
    else:
        c = _plane_cctx()
        coded = [_planes_encode(b, elem_size, c, list(stored)) for b in rest]
    return b"".join([head, *first, *(x for blk in coded for x in blk)])


def _plane(dctx: Any, body: memoryview, plen: int) -> bytes:
    """One coded plane of ``plen`` bytes. A frame header that declares another size is refused before
    anything is allocated: python-zstandard allocates a declared content size whatever ``max_output_size``
    says (a 64 KB frame declaring 2 GiB allocated 2 GiB); an undeclared one is bounded by ``max_output_size``."""
    try:
        declared = zstandard.frame_content_size(body)
        if declared >= 0 and declared != plen:
            raise CompressError(f"resilient.bgzstd/1 stream: a plane declares {declared} bytes where its block "
                                f"holds {plen}")
        got = dctx.decompress(body, max_output_size=plen) if plen else b""
    except zstandard.ZstdError as e:
        raise CompressError(f"resilient.bgzstd/1 stream: {e}") from None
    if len(got) != plen:
        raise CompressError("resilient.bgzstd/1 stream: a plane decodes to the wrong length")
    return got


def _iter_bgzstd(data: Any, limit: int | None = None) -> Iterator[Any]:
    """The decoded blocks of a ``resilient.bgzstd/1`` stream, one at a time (at most BLOCK bytes each).
    ``limit``: the most bytes the whole stream may decode to; the block that would pass it is refused
    (:class:`ItemTooLargeError`) before it is allocated."""
    mv = memoryview(data).cast("B")
    if len(mv) < 5 or bytes(mv[:4]) != MAGIC:
        raise CompressError("not a resilient.bgzstd/1 stream (bad magic)")
    es = mv[4]
    if es not in (1, 2, 4, 8, 16):
        raise CompressError(f"resilient.bgzstd/1 stream: bad element size {es}")
    dctx = zstandard.ZstdDecompressor()
    pos, total = 5, 0

    def take(k: int) -> memoryview:
        nonlocal pos
        if pos + k > len(mv):
            raise CompressError("resilient.bgzstd/1 stream is truncated")
        v = mv[pos:pos + k]
        pos += k
        return v

    while pos < len(mv):
        (n,) = _U32.unpack(take(4))
        if n > BLOCK:
            raise CompressError(f"resilient.bgzstd/1 stream: block of {n} bytes exceeds {BLOCK}")
        total += n
        if limit is not None and total > limit:
            raise ItemTooLargeError(limit)
        plen = n // es
        elems = np.empty((plen, es), dtype=np.uint8)  # planes land in their columns: one strided write each
        for i in range(es):
            (c,) = _U32.unpack(take(4))
            body = take(c)
            elems[:, i] = np.frombuffer(body if c == plen else _plane(dctx, body, plen), dtype=np.uint8)
        if plen:
            yield memoryview(elems).cast("B")
        tail = take(n % es)
        if len(tail):
            yield tail


def decode(data: Any, limit: int | None = None) -> bytearray:
    """Inverse of :func:`encode`; raises :class:`CompressError` on a malformed stream, and
    :class:`ItemTooLargeError` (before allocating it) on one that decodes to more than ``limit`` bytes."""
    out = bytearray()
    for blk in _iter_bgzstd(data, limit):
        out += blk
    return out


class ItemTooLargeError(CompressError):
    """A coded item decodes to more bytes than the most it can hold: a decompression bomb."""

    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"decodes to more than {limit:,} bytes")


_UNZSTD_READ = 1 << 20  # decoded bytes per read of a streamed stream.zstd/1 item


def _zstd_limit_check(body: Any, limit: int | None) -> None:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise CompressError(f"stream.zstd/1 item: {e}") from None
    if limit is not None and declared > limit:
        raise ItemTooLargeError(limit)  # refused from its header: nothing decoded


def iter_decode(body: Any, descriptors: Sequence[str], limit: int | None) -> Iterator[Any]:
    """The decoded bytes of one coded item (its ``transform_descriptors``), in pieces of a few MB: a
    streamed decode whose memory is bounded whatever the item decodes to. Past ``limit`` decoded bytes it
    raises :class:`ItemTooLargeError` (nothing beyond the limit is allocated)."""
    kind = _one_descriptor(descriptors)
    if kind is Codec.BGZSTD:
        yield from _iter_bgzstd(body, limit)
        return
    _zstd_limit_check(body, limit)
    total = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=False)
        while True:
            piece = reader.read(_UNZSTD_READ)
            if not piece:
                return
            total += len(piece)
            if limit is not None and total > limit:
                raise ItemTooLargeError(limit)
            yield piece
    except zstandard.ZstdError as e:
        raise CompressError(f"stream.zstd/1 item: {e}") from None


def decode_item(body: Any, descriptors: Sequence[str], limit: int | None) -> Any:
    """One coded item decoded whole (restore needs it in memory), at most ``limit`` bytes: more raises
    :class:`ItemTooLargeError` before it is allocated."""
    kind = _one_descriptor(descriptors)
    if kind is Codec.BGZSTD:
        return decode(body, limit)
    if limit is None:
        return b"".join(iter_decode(body, descriptors, None))
    _zstd_limit_check(body, limit)
    try:
        # a declared size (checked above) is allocated as such; an undeclared one is bounded by the limit
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
    except zstandard.ZstdError as e:
        if "did not decompress full frame" in str(e):
            # more than the limit, or a truncated frame: a streamed pass (bounded memory) says which
            for _ in iter_decode(body, descriptors, limit):
                pass
        raise CompressError(f"stream.zstd/1 item: {e}") from None


def _one_descriptor(descriptors: Sequence[str]) -> Codec:
    """The codec of an item's ``transform_descriptors``: one of ours (what this package and DCP's
    ``ZStandard`` write); anything else is not a checkpoint we can decode within bounds."""
    ds = list(descriptors or ())
    if len(ds) == 1:
        name, _, version = str(ds[0]).partition("/")
        if version.partition(".")[0] == "1":
            if name == "resilient.bgzstd":
                return Codec.BGZSTD
            if name == "stream.zstd":
                return Codec.ZSTD
    raise CompressError(f"unsupported transform {ds!r}: expected one of {sorted(DESCRIPTOR.values())}")


def check_item(body: Any, descriptors: Sequence[str], metadata: Any, index: Any, what: str) -> None:
    """What ``resilient ckpt verify`` does for a coded item: decode it within its true size (a bomb raises
    :class:`~resilient.checkpoint.api.UnsafeCheckpointError` naming ``what``), check the decoded bytes'
    own checksums (zstd's frame checksums while decoding, the zip records' crc32 of torch.save after),
    load it as restore does, and check a tensor's dtype and shape against ``.metadata``."""
    import zipfile

    from resilient.checkpoint.api import UnsafeCheckpointError
    from resilient.checkpoint.safe import safe_torch_load

    item = f"item {index.fqn!r}"
    try:
        raw = decode_item(body, descriptors, item_limit(metadata, index))
    except ItemTooLargeError as e:
        raise UnsafeCheckpointError(what, None, f"{item} {e}, more than its .metadata entry allows "
                                    "(a decompression bomb)") from None
    try:
        bad = zipfile.ZipFile(io.BytesIO(raw)).testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CompressError(f"{item} decodes to no torch.save record ({e})") from None
    if bad is not None:
        raise CompressError(f"{item}: decoded record {bad} fails its crc32")
    obj = safe_torch_load(io.BytesIO(raw), what=item)
    meta = metadata.state_dict_metadata.get(index.fqn)
    if isinstance(meta, TensorStorageMetadata):
        import torch

        want = None if index.offset is None else tuple(index.offset)
        chunk = next((c for c in meta.chunks if want is None or tuple(c.offsets) == want), None)
        if not isinstance(obj, torch.Tensor) or obj.dtype != meta.properties.dtype or (
                chunk is not None and tuple(obj.shape) != tuple(chunk.sizes)):
            got = f"{obj.dtype} {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__
            raise CompressError(f"{item} decodes to {got}, .metadata says {meta.properties.dtype} "
                                f"{tuple(chunk.sizes) if chunk is not None else tuple(meta.size)}")


# torch.save's zip records around a tensor's bytes (pickle, version, byte order, alignment, directory):
# 1.5-1.6 KB measured for every dtype and size; a generous bound, still nothing like a bomb
SAVE_SLACK = 64 << 10
# objects (DCP's bytes items: RNG states, loader positions, optimizer hyper-parameters) have no size in
# ``.metadata``: they are bounded by this, which RESILIENT_CKPT_MAX_OBJECT_MB overrides
MAX_OBJECT_MB = 256
ENV_MAX_OBJECT_MB = "RESILIENT_CKPT_MAX_OBJECT_MB"


def max_object_bytes() -> int:
    raw = os.environ.get(ENV_MAX_OBJECT_MB, "").strip()
    try:
        mb = float(raw) if raw else MAX_OBJECT_MB
    except ValueError:
        logger.error("%s=%r is not a number of MB; using %d", ENV_MAX_OBJECT_MB, raw, MAX_OBJECT_MB)
        mb = MAX_OBJECT_MB
    return int(max(mb, 1) * (1 << 20))


def item_limit(metadata: Any, index: Any) -> int:
    """The most bytes item ``index`` of a step can decode to: a tensor chunk's bytes as ``.metadata``
    records them (dtype x the chunk's sizes) plus torch.save's records; an object's, :func:`max_object_bytes`."""
    import math

    meta = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(meta, TensorStorageMetadata):
        return max_object_bytes()
    es = meta.properties.dtype.itemsize
    whole = math.prod(meta.size) * es
    want = None if index.offset is None else tuple(index.offset)
    for ch in meta.chunks:
        if want is None or tuple(ch.offsets) == want:
            return min(math.prod(ch.sizes) * es, whole) + SAVE_SLACK
    return whole + SAVE_SLACK


class _EncodeOnClose(io.RawIOBase):
    def __init__(self, output: IO[bytes], elem_size: int):
        super().__init__()
        self._out, self._es, self._buf = output, elem_size, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._buf += mv
        return len(mv)

    def close(self) -> None:
        if not self.closed:
            self._out.write(encode(self._buf, self._es))
            self._buf = bytearray()
        super().close()


class ByteGroupZstd(StreamTransformExtension):
    """DCP stream extension ``resilient.bgzstd/1``. For writing (``FileSystemWriter(...,
    _extensions=[ByteGroupZstd(4)])``) the element size is the writer's; the stream records it, so
    reading needs nothing but :func:`extension_registry`."""

    def __init__(self, elem_size: int = 4):
        super().__init__()
        self.elem_size = elem_size

    @staticmethod
    def registry_name() -> str:
        return "resilient.bgzstd"

    @staticmethod
    def from_descriptor(version: str) -> "ByteGroupZstd":
        if str(version).partition(".")[0] != "1":
            raise ValueError(f"resilient.bgzstd: unknown version {version!r}; upgrade resilient")
        return ByteGroupZstd()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _EncodeOnClose(output, self.elem_size)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(decode(input.read()))


def extension_registry() -> ExtensionRegistry:
    """DCP's registry (``stream.zstd``) plus ``resilient.bgzstd``: pass it to a reader as
    ``_extension_registry``."""
    reg = ExtensionRegistry()
    reg.register(ByteGroupZstd)
    return reg


DESCRIPTOR = {Codec.BGZSTD: "resilient.bgzstd/1", Codec.ZSTD: "stream.zstd/1"}


# ------------------------------------------------------------------ rewriting a step for a transfer
CHUNK = 2 << 20  # raw bytes per coding job: small enough that coding runs ahead of the network early
INFLIGHT = 4  # coding jobs queued or running ahead of the one being sent: bounds memory per rank
PART = 4 << 20  # bytes per request of a streamed item (a multiple of 256 KiB, as GCS requires)


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


class _Blocks:
    """crc32c of a file written in pieces, whole and per manifest block (what restore verifies by)."""

    def __init__(self, block_size: int):
        self.block_size, self.size, self.crc, self.blocks, self._bcrc, self._bfill = block_size, 0, 0, [], 0, 0

    def update(self, buf: Any) -> None:
        from resilient.checkpoint.tiers import crc_bytes

        mv = memoryview(buf).cast("B")
        self.crc = crc_bytes(mv, self.crc)
        self.size += len(mv)
        while len(mv):
            k = min(len(mv), self.block_size - self._bfill)
            self._bcrc = crc_bytes(mv[:k], self._bcrc)
            self._bfill += k
            mv = mv[k:]
            if self._bfill == self.block_size:
                self.blocks.append(self._bcrc)
                self._bcrc, self._bfill = 0, 0

    def entry(self) -> FileEntry:
        blocks = self.blocks + ([self._bcrc] if self._bfill else [])
        return FileEntry(size=self.size, crc32c=self.crc, block_size=self.block_size if self.size else 0,
                         blocks=tuple(blocks) if self.size else ())


class Sink:
    """One file being written in parts; nothing shows under its name until :meth:`close` returns.

    Every call runs on a sender thread and is waited for at most ``timeout_s`` plus the time its bytes
    take at ``min_rate`` (a dead store must not hold the uploader forever); the caller meanwhile codes
    the next parts on other threads."""

    def __init__(self, open_fn: Callable[[], Any], commit: Callable[[Any], None], discard: Callable[[Any], None],
                 what: str, timeout_s: float = 30.0, min_rate: float = 8 << 20):
        self.what, self.timeout_s, self.min_rate = what, timeout_s, min_rate
        self._commit, self._discard = commit, discard
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="resilient-ckpt-send")
        self.sent, self.seconds, self._buffered = 0, 0.0, 0
        self._f = self._call("open", open_fn, 0)

    def _call(self, what: str, fn: Callable[[], T], nbytes: int) -> T:
        t0 = time.perf_counter()
        fut = self._ex.submit(fn)
        try:
            return fut.result(timeout=self.timeout_s + nbytes / self.min_rate)
        except FutureTimeout:
            raise TimeoutError(f"{self.what}: {what} got no answer within "
                               f"{self.timeout_s + nbytes / self.min_rate:.1f} s (is the store reachable?)") from None
        finally:
            self.seconds += time.perf_counter() - t0

    def write(self, buf: Any) -> None:
        n = len(memoryview(buf).cast("B"))
        self._buffered += n  # a write may send what earlier writes buffered
        self._call("write", lambda: self._f.write(buf), self._buffered)
        if self._buffered >= PART:
            self._buffered = 0
        self.sent += n

    def close(self) -> None:
        f = self._f
        self._call("close", lambda: self._commit(f), self._buffered)
        self._ex.shutdown(wait=False)

    def abort(self) -> None:
        f = self._f
        try:
            self._call("discard", lambda: self._discard(f), 0)
        except Exception as e:  # the file was never committed: nothing shows under its name either way
            logger.debug("%s: discard failed: %s", self.what, e)
        self._ex.shutdown(wait=False)


def dir_sink(out_dir: Path, name: str) -> Sink:
    """A file of a local directory, written under a temporary name and renamed when closed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp, dst = out_dir / f".{name}.tmp", out_dir / name

    def commit(f: Any) -> None:
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, dst)

    def discard(f: Any) -> None:
        f.close()
        tmp.unlink(missing_ok=True)

    return Sink(lambda: open(tmp, "wb"), commit, discard, what=str(dst), timeout_s=600.0)


def tier_sink(tier: Any, step: int, name: str) -> Sink:
    """File ``name`` of ``step`` on a tier (a :class:`~resilient.checkpoint.tiers.BoundedTier` or the tier
    itself): an fsspec file opened without autocommit (on GCS a resumable upload, finalised by commit;
    an aborted one leaves no object), or a temporary file renamed in a directory tier."""
    from resilient.checkpoint.tiers import step_dirname

    inner = getattr(tier, "inner", tier)
    timeout_s = float(getattr(tier, "timeout_s", 30.0))
    min_rate = float(getattr(tier, "min_rate", 8 << 20))
    fs = getattr(inner, "fs", None)
    if fs is None:  # a directory tier
        s = dir_sink(Path(inner.path(step)), name)
        s.timeout_s, s.min_rate = timeout_s, min_rate
        return s
    path = f"{inner.root}/{step_dirname(step)}/{name}"

    def open_() -> Any:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(fs, LocalFileSystem):
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return fs.open(path, "wb", block_size=PART, autocommit=False)

    def commit(f: Any) -> None:
        f.close()
        f.commit()

    def discard(f: Any) -> None:
        f.discard()
        try:
            # an unclosed gcsfs file is closed when collected, which would upload what it buffered
            f.closed = True
        except AttributeError:
            pass

    return Sink(open_, commit, discard, what=f"{inner!r}/{step_dirname(step)}/{name}", timeout_s=timeout_s,
                min_rate=min_rate)


def part_name(name: str, k: int) -> str:
    """The ``k``-th part of a coded file: the file's own name first, then ``__0_0.p1.distcp``, ... (DCP's
    ``.metadata`` says which file holds each item, so a coded file may be several objects)."""
    if k == 0:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}.p{k}.{ext}" if dot and ext == "distcp" else f"{name}.p{k}"


PART_MIN, PART_MAX = 4 << 20, 64 << 20


def part_size(raw_bytes: int) -> int:
    """Coded bytes per part object: about 8 parts per file, so sending starts early and parts go out two at
    a time, from PART_MIN (fewer requests) to PART_MAX (fewer objects)."""
    return int(min(PART_MAX, max(PART_MIN, raw_bytes // 8)))


class DirDest:
    """Parts written as files of a local directory (tmp + rename)."""

    def __init__(self, out_dir: str | os.PathLike[str]):
        self.out = Path(out_dir)
        self.timeout_s, self.min_rate = 600.0, float(8 << 20)

    def deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_rate

    def put(self, name: str, data: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / name)

    def open(self, name: str) -> Sink:
        return dir_sink(self.out, name)


class TierDest:
    """Parts written to ``step`` of a tier: a part in one request (``write_bytes``: a single-request upload
    on GCS), retried like any upload; an item larger than a part streamed through a :class:`Sink`."""

    def __init__(self, tier: Any, step: int, retries: int = 0, backoff_s: float = 0.5, backoff_max_s: float = 10.0,
                 should_stop: Callable[[], bool] | None = None):
        self.tier, self.step = tier, step
        self.retries, self.backoff_s, self.backoff_max_s = retries, backoff_s, backoff_max_s
        self.should_stop = should_stop
        self.timeout_s = float(getattr(tier, "timeout_s", 30.0))
        self.min_rate = float(getattr(tier, "min_rate", 8 << 20))

    def deadline(self, nbytes: int) -> float:
        """How long one part's upload may take, every retry included (each attempt is bounded by the tier)."""
        return (self.timeout_s + nbytes / self.min_rate + self.backoff_max_s) * (self.retries + 1)

    def put(self, name: str, data: Any) -> None:
        from resilient.checkpoint.tiers import retry

        retry(lambda: self.tier.write_bytes(self.step, name, data), what=f"upload {name} of step {self.step}",
              retries=self.retries, backoff_s=self.backoff_s, backoff_max_s=self.backoff_max_s,
              should_stop=self.should_stop)

    def open(self, name: str) -> Sink:
        return tier_sink(self.tier, self.step, name)


SENDERS = 2  # part objects sent at once


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
    from resilient.checkpoint.load import BLOCK as VERIFY_BLOCK
    from resilient.checkpoint.tiers import map_verified

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
    from resilient.checkpoint.tiers import crc_bytes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / DCP_METADATA).write_bytes(metadata_bytes)
    m = dataclasses.replace(manifest, files=dict(part.files),
                            metadata=FileEntry(size=len(metadata_bytes), crc32c=crc_bytes(metadata_bytes)))
    (out / manifest_name).write_text(json.dumps(m.to_json()))
    return m


# ------------------------------------------------------------------ when it pays
@dataclass
class Decision:
    tier: str
    codec: Codec
    reason: str
    link_mbps: float | None = None  # the link as last measured (bytes on the wire per second)
    codec_mbps: float | None = None  # the codec as last measured on this run's data (raw bytes per second)
    ratio: float | None = None
    mode: str = CompressMode.AUTO.value

    @property
    def decision(self) -> str:
        return "plain" if self.codec is Codec.NONE else "compress"

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "mode": self.mode, "codec": self.codec.value, "decision": self.decision,
                "reason": self.reason, "link_mbps": self.link_mbps, "codec_mbps": self.codec_mbps,
                "ratio": self.ratio}


MARGIN = 1.1  # compress only when the estimate beats plain by this much: per-step costs the model leaves out


class Chooser:
    """Per tier, per run: compress a transfer only if it is expected to take less time than sending it
    plain, from the measured link throughput (bytes on the wire per second of the last transfer) and the
    codec's measured throughput and ratio on this run's own data. Coding and sending overlap (a pipeline),
    so a coded transfer takes about max(coding, sending the smaller bytes).

    With ``auto``, transfers under ``min_bytes`` per rank go plain; the first transfer of a tier goes plain
    (it measures the link); the codec is measured on
    the first transfer it is tried on, and re-tried every ``probe_every`` transfers so that a link that
    slows down is noticed."""

    def __init__(self, mode: CompressMode | str = CompressMode.AUTO, tier: str = "persistent",
                 probe_every: int = 10, min_bytes: int = 16 << 20):
        self.mode = mode if isinstance(mode, CompressMode) else parse_mode(mode)
        self.tier, self.probe_every, self.min_bytes = tier, probe_every, min_bytes
        self.link_bps: float | None = None
        self.codec_bps: float | None = None
        self.ratio: float | None = None
        self._since_probe = 0
        self._lock = threading.Lock()
        self.last: Decision | None = None
        self.streamed = False  # the last transfer's data went out coded: its link was measured on the stream

    def decide(self, nbytes: int | None = None) -> Decision:
        """``nbytes``: this rank's plain bytes to send."""
        with self._lock:
            d = self._decide(nbytes)
            self.last = d
            return d

    def _decide(self, nbytes: int | None) -> Decision:
        mb = (lambda v: None if v is None else round(v / 1e6, 1))

        def dec(codec: Codec, reason: str) -> Decision:
            return Decision(self.tier, codec, reason, mb(self.link_bps), mb(self.codec_bps),
                            None if self.ratio is None else round(self.ratio, 3), self.mode.value)

        if self.mode is not CompressMode.AUTO:
            return dec(Codec(self.mode.value), "forced by --ckpt-compress")
        if nbytes is not None and nbytes < self.min_bytes:
            # a small transfer's time is round trips, not bandwidth; and it stays readable by plain dcp.load
            return dec(Codec.NONE, f"{nbytes} bytes per rank: below {self.min_bytes}")
        if self.link_bps is None:
            return dec(Codec.NONE, "link not measured yet: this transfer measures it")
        if self.codec_bps is None or self.ratio is None or self._since_probe >= self.probe_every:
            self._since_probe = 0
            return dec(Codec.BGZSTD, "codec not measured on this run's data yet: probing")
        self._since_probe += 1
        plain = 1 / self.link_bps
        coded = max(1 / self.codec_bps, 1 / (self.ratio * self.link_bps))
        pays = coded * MARGIN < plain
        why = (f"plain {plain * 1e6:.1f} s/MB vs coded {coded * 1e6:.1f} s/MB (x{MARGIN} margin; "
               f"codec {self.codec_bps / 1e6:.0f} MB/s, ratio {self.ratio:.2f}, link {self.link_bps / 1e6:.0f} MB/s)")
        return dec(Codec.BGZSTD if pays else Codec.NONE, why)

    def observe_link(self, wire_bytes: int, seconds: float) -> None:
        """A transfer of ``wire_bytes`` (as sent) took ``seconds``."""
        if seconds > 0 and wire_bytes > 0:
            with self._lock:
                self.link_bps = wire_bytes / seconds

    def observe_codec(self, raw_bytes: int, seconds: float, ratio: float) -> None:
        """The codec turned ``raw_bytes`` into ``raw_bytes / ratio`` in ``seconds`` (all its threads together)."""
        if seconds > 0 and raw_bytes > 0:
            with self._lock:
                self.codec_bps, self.ratio = raw_bytes / seconds, ratio


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
    from resilient.checkpoint.api import UnsafeCheckpointError
    from resilient.checkpoint.safe import load_metadata

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


__all__ = ["ByteGroupZstd", "Chooser", "Codec", "CompressError", "CompressMode", "Decision", "ItemTooLargeError",
           "Prepared", "Sink", "ZStandard", "check_item", "decode", "decode_item", "encode", "export_step",
           "extension_registry", "finish_step", "item_limit", "iter_decode", "merged_metadata", "parse_mode",
           "prepare_upload", "sent_bytes", "stream_files", "tier_sink", "transcode_files"]


# ------------------------------------------------------------------ the manager's upload hook
ENV_MODE = _renv.CKPT_COMPRESS  # set by resilient-run --ckpt-compress


def chooser_from_env(tier: str = "persistent") -> Chooser:
    raw = os.environ.get(ENV_MODE, "")
    try:
        return Chooser(parse_mode(raw), tier=tier)
    except CheckpointConfigError as e:
        # bad input must not stop training: say so once and send plain bytes
        logger.error("%s=%r: %s; checkpoints are sent uncompressed", ENV_MODE, raw, e)
        return Chooser(CompressMode.NONE, tier=tier)


def _chooser(mgr: Any) -> Chooser:
    c = mgr.__dict__.get("_compress_chooser")
    if c is None:
        c = mgr.__dict__["_compress_chooser"] = chooser_from_env()
    return c


class Prepared(tuple):  # type: ignore[type-arg]
    """``(directory, manifest)`` for the uploader: what is left to upload from that directory (this rank's
    manifest, and ``.metadata`` on rank 0; the manifest's ``files`` are empty because the data files went
    to the store as they were coded). ``sent``: the bytes of those data files."""

    sent: int

    def __new__(cls, directory: Path, manifest: Manifest, sent: int) -> "Prepared":
        t = super().__new__(cls, (directory, manifest))
        t.sent = sent
        return t


def sent_bytes(coded: Any) -> int:
    """Bytes :func:`prepare_upload` already sent to the store (0 for None or an older result)."""
    return int(getattr(coded, "sent", 0) or 0)


def prepare_upload(mgr: Any, step: int, src: Any, group: Any) -> Prepared | None:
    """Collective on ``group`` (every rank): decide, with rank 0's measurements, whether this step goes to
    the persistent tier compressed (rank 0 writes the decision to the ledger); if so send this rank's files
    of ``step`` from the local tier ``src`` to the store as they are coded (:func:`stream_files`: coding
    overlaps sending), gather every rank's item layout, and write this rank's manifest and the step's
    ``.metadata`` into a scratch directory. Returns (that directory, the manifest without the files already
    sent), or None to upload the local files as they are: compression off, not paying, or any rank failed
    to send its part (every rank then uploads plain, over whatever was sent).

    The decision is gathered before any call to the store. The layout is gathered after this rank's sends,
    which are bounded in time (:class:`Sink`), like the uploader's own gather of results that follows."""
    from resilient.checkpoint.api import COMMIT_MARKER
    from resilient.checkpoint.safe import load_metadata
    from resilient.checkpoint.tiers import manifest_name, read_manifest
    from resilient.events.api import EventKind

    chooser = _chooser(mgr)
    if chooser.mode is CompressMode.NONE:
        return None  # no collective, no work: compression off costs nothing
    chooser.streamed = False
    try:
        m: Manifest | None = read_manifest(src, step, mgr.rank)
    except (OSError, ValueError, KeyError) as e:
        m = None  # the upload itself reports it
        logger.debug("step %d: no manifest to compress from (%s)", step, e)
    mine = chooser.decide(sum(f.size for f in m.files.values()) if m is not None else None)
    decision = mgr._gather(mine, group)[0]  # rank 0's measurements decide for every rank
    if mgr.rank == 0:
        logger.info("step %d to the %s tier: %s (%s)", step, decision.tier, decision.codec.value, decision.reason)
        mgr._emit(EventKind.CKPT_COMPRESS, step=step, **decision.to_json())
    if decision.codec is Codec.NONE:
        return None
    # per rank: ranks of a node share the local tier, and each clears its own scratch when done
    out = Path(src.root) / ".coded" / f"step_{step:08d}-rank{mgr.rank}"
    clear(out)
    part: Transcoded | None = None
    tier = mgr.persistent
    try:
        if m is None:
            raise CompressError("no manifest")
        d = Path(src.path(step))
        md = load_metadata((d / DCP_METADATA).read_bytes(), what=f"{d / DCP_METADATA}")
        # a step uploaded again (a job restored from an older step saves this number anew) must not stay
        # visible as complete while its files are replaced: the marker goes before this rank's first write
        tier.delete_file(step, COMMIT_MARKER)
        cfg = mgr.config
        give_up = getattr(mgr, "_give_up", None)
        dest = TierDest(tier, step, retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                        backoff_max_s=cfg.upload_backoff_max_s,
                        should_stop=(lambda: bool(give_up(step))) if give_up is not None else None)
        part = stream_files(d, sorted(m.files), md, decision.codec, dest, expected=m.files)
    except Exception as e:  # never fatal: the plain upload that follows retries, and reports what it finds
        logger.warning("compressed upload of step %d failed (%s: %s); uploading it plain", step,
                       type(e).__name__, e)
    parts = mgr._gather(part.storage if part else None, group)
    if part is None or m is None or any(p is None for p in parts):
        clear(out)
        return None
    m2: Manifest | None = None
    try:
        m2 = finish_step(out, m, part, merged_metadata(md, parts), manifest_name(mgr.rank))
    except Exception as e:  # a full scratch disk: every rank must then go plain, or .metadata would lie
        logger.warning("step %d: writing the compressed manifest failed (%s: %s); uploading it plain", step,
                       type(e).__name__, e)
    if not all(mgr._gather(m2 is not None, group)) or m2 is None:
        clear(out)
        return None
    chooser.observe_codec(part.raw_bytes, part.codec_seconds / max(part.threads, 1), part.ratio)
    chooser.observe_link(part.coded_bytes, part.send_seconds)
    chooser.streamed = True
    if mgr.rank == 0:
        logger.info("step %d: %s %.2fx, sent in %.2f s (codec %.0f MB/s on %d threads, %.2f s blocked sending)",
                    step, decision.codec.value, part.ratio, part.seconds, part.codec_bps / 1e6, part.threads,
                    part.send_seconds)
    return Prepared(out, dataclasses.replace(m2, files={}), part.coded_bytes)


def observe_upload(mgr: Any, nbytes: int, seconds: float) -> None:
    """The bytes this rank sent to the store and how long that took: the link's measured throughput
    (unless the data went out coded: then the stream measured it, and what is left is a few small files)."""
    c = _chooser(mgr)
    if c.streamed:
        c.streamed = False
        return
    c.observe_link(nbytes, seconds)
