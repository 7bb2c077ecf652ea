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

* ``bgzstd`` -> descriptor ``resilient.bgzstd/1``: our ``ByteGroupZstd`` (:mod:`.dcp_extension`, apart so that
  this module imports without torch). ``dcp.load`` reads it when given ``extension_registry()``
  (``FileSystemReader(path, _extension_registry=extension_registry())``);
  ``resilient ckpt export URL DIR`` writes a plain copy that needs nothing of this package.
* ``zstd`` -> descriptor ``stream.zstd/1``: DCP's own ``ZStandard``; plain ``dcp.load`` reads it (with
  zstandard installed), at a lower ratio (no byte planes).

Upload (:mod:`resilient.checkpoint.upload.prepare`, called by the uploader): items are coded in jobs of a few MB on two
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
without allocating it. (DCP's own reader, given ``dcp_extension.extension_registry()``, reads a stream to its end:
read untrusted copies through this package.)
"""

from __future__ import annotations

import enum
import io
import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import zstandard

from resilient import env
from resilient.checkpoint.api import CheckpointConfigError, CheckpointError, UnsafeCheckpointError
from resilient.checkpoint.format.safe import safe_torch_load


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


def _is_tensor_meta(meta: Any) -> bool:
    # imported here, not at the top: this module serves `resilient ckpt ls`, which must start without torch
    # (seconds of CPU); whoever holds a parsed .metadata has imported torch already
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(meta, TensorStorageMetadata)


def check_item(body: Any, descriptors: Sequence[str], metadata: Any, index: Any, what: str) -> None:
    """What ``resilient ckpt verify`` does for a coded item: decode it within its true size (a bomb raises
    :class:`~resilient.checkpoint.api.UnsafeCheckpointError` naming ``what``), check the decoded bytes'
    own checksums (zstd's frame checksums while decoding, the zip records' crc32 of torch.save after),
    load it as restore does, and check a tensor's dtype and shape against ``.metadata``."""
    import zipfile

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
    if _is_tensor_meta(meta):
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
ENV_MAX_OBJECT_MB = env.CKPT_MAX_OBJECT_MB


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
    if not _is_tensor_meta(meta):
        return max_object_bytes()
    es = meta.properties.dtype.itemsize
    whole = math.prod(meta.size) * es
    want = None if index.offset is None else tuple(index.offset)
    for ch in meta.chunks:
        if want is None or tuple(ch.offsets) == want:
            return min(math.prod(ch.sizes) * es, whole) + SAVE_SLACK
    return whole + SAVE_SLACK


DESCRIPTOR = {Codec.BGZSTD: "resilient.bgzstd/1", Codec.ZSTD: "stream.zstd/1"}
