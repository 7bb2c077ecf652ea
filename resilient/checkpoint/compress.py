"""Lossless, exponent-aware compression of checkpoint transfers, kept inside the DCP format.

Floating-point tensors compress badly as they are: each element's sign+exponent byte (very skewed: trained
weights and optimizer moments use a few dozen exponents) is interleaved with mantissa bytes (close to
random). Splitting each element's bytes into planes (byte 0 of every element, then byte 1, ...) and
entropy-coding each plane with zstd separately lets the exponent plane shrink 2-4x while the mantissa
planes pass through; that is ZipNN's and eXmY's observation. Measured on a small trained GPT
(``bench/compress.py``), this gives the ratio of blosc2's shuffle+zstd and of zipnn at about the same
speed, with zstandard alone as the dependency (the library DCP's own ``ZStandard`` extension uses).

Format at rest: a step stays a DCP directory. Each item of a ``.distcp`` file is rewritten on its own
and ``.metadata`` names the transform of every item (DCP's stream extensions):

* ``bgzstd`` -> descriptor ``resilient.bgzstd/1``: our :class:`ByteGroupZstd`. ``dcp.load`` reads it when
  given :func:`extension_registry` (``FileSystemReader(path, _extension_registry=extension_registry())``);
  ``resilient ckpt export URL DIR`` writes a plain copy that needs nothing of this package.
* ``zstd`` -> descriptor ``stream.zstd/1``: DCP's own ``ZStandard``; plain ``dcp.load`` reads it (with
  zstandard installed), at a lower ratio (no byte planes).

Encoded stream of ``resilient.bgzstd/1``: ``b"RBGZ"``, element size ``es`` (1 byte), then blocks until the
end: ``raw_len`` (u32); per plane (``es`` planes of ``raw_len // es`` bytes), ``clen`` (u32) and ``clen``
bytes: a zstd frame, or the plane itself when ``clen`` equals the plane's length (planes that do not
compress are stored, not coded); then the ``raw_len % es`` bytes of a tail shorter than one element.
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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import zstandard
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from resilient import env as _renv
from resilient.checkpoint.api import DCP_METADATA, CheckpointConfigError, CheckpointError, FileEntry, Manifest

logger = logging.getLogger(__name__)

MAGIC = b"RBGZ"
BLOCK = 4 << 20  # raw bytes per block: bounds memory, and blocks are coded on several threads
_U32 = struct.Struct("<I")
_LEVEL = 1  # higher levels gained < 2% on trained weights at half the speed (bench/compress.py)
_STORE_BELOW = 1.02  # a plane that shrinks less than this is stored from then on


def _cctx(threads: int = 0) -> Any:
    # the frame checksum (xxhash, ~free) makes a damaged coded plane fail loudly instead of decoding wrong;
    # stored planes rely on the manifests' crc32c, checked before anything is decoded
    return zstandard.ZstdCompressor(level=_LEVEL, write_checksum=True, threads=threads)


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
def _planes_encode(raw: memoryview, es: int, cctx: Any, stored: list[bool]) -> bytes:
    n = len(raw)
    whole = n - n % es  # a torch.save item is any length: its tail of less than one element is stored
    out = [_U32.pack(n)]
    planes: Any = [raw[:whole]] if es == 1 else np.frombuffer(raw[:whole], dtype=np.uint8).reshape(-1, es).T.copy()
    for i, p in enumerate(planes):
        pb = memoryview(p).cast("B")
        c = b"" if stored[i] else cctx.compress(pb)
        if stored[i] or len(c) * _STORE_BELOW >= len(pb):
            stored[i] = True
            out += [_U32.pack(len(pb)), pb]
        else:
            out += [_U32.pack(len(c)), c]
    out.append(raw[whole:])
    return b"".join(out)


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
    first = _planes_encode(blocks[0], elem_size, _cctx(), stored)
    rest = blocks[1:]
    if threads > 1 and len(rest) > 1:
        local = threading.local()

        def one(b: memoryview) -> bytes:
            c = getattr(local, "c", None) or _cctx()
            local.c = c
            return _planes_encode(b, elem_size, c, list(stored))

        with ThreadPoolExecutor(min(threads, len(rest))) as ex:
            coded = list(ex.map(one, rest))
    else:
        c = _cctx()
        coded = [_planes_encode(b, elem_size, c, list(stored)) for b in rest]
    return b"".join([head, first, *coded])


def decode(data: Any) -> bytearray:
    """Inverse of :func:`encode`; raises :class:`CompressError` on a malformed stream."""
    mv = memoryview(data).cast("B")
    if len(mv) < 5 or bytes(mv[:4]) != MAGIC:
        raise CompressError("not a resilient.bgzstd/1 stream (bad magic)")
    es = mv[4]
    if es not in (1, 2, 4, 8, 16):
        raise CompressError(f"resilient.bgzstd/1 stream: bad element size {es}")
    dctx = zstandard.ZstdDecompressor()
    out = bytearray()
    pos = 5

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
        plen = n // es
        planes = np.empty((es, plen), dtype=np.uint8)
        for i in range(es):
            (c,) = _U32.unpack(take(4))
            body = take(c)
            if c == plen:
                planes[i] = np.frombuffer(body, dtype=np.uint8)
            else:
                try:
                    got = dctx.decompress(body, max_output_size=plen)
                except zstandard.ZstdError as e:
                    raise CompressError(f"resilient.bgzstd/1 stream: {e}") from None
                if len(got) != plen:
                    raise CompressError("resilient.bgzstd/1 stream: a plane decodes to the wrong length")
                planes[i] = np.frombuffer(got, dtype=np.uint8)
        out += planes.T.tobytes() if es > 1 else planes.tobytes()
        out += take(n % es)
    return out


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
@dataclass
class Transcoded:
    """This rank's part of a step rewritten with a codec: the new files are in the output directory;
    ``storage`` is what ``.metadata`` must say of their items (gathered from every rank)."""

    codec: Codec
    files: dict[str, FileEntry]
    storage: dict[Any, _StorageInfo]
    raw_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        coded = sum(f.size for f in self.files.values())
        return self.raw_bytes / coded if coded else 1.0


def _elem_sizes(md: Any) -> dict[str, int]:
    """fqn -> element size of a tensor entry of the checkpoint's metadata."""
    out = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[fqn] = m.properties.dtype.itemsize
    return out


def _code_item(codec: Codec, raw: memoryview, es: int, threads: int) -> bytes:
    if codec is Codec.BGZSTD:
        return encode(raw, es, threads=threads)
    return _cctx(threads if threads > 1 else 0).compress(raw)


def transcode_files(src_dir: str | os.PathLike[str], names: Sequence[str], metadata: Any, codec: Codec,
                    out_dir: str | os.PathLike[str], threads: int | None = None) -> Transcoded:
    """Rewrite this rank's ``.distcp`` files ``names`` of a plain step in ``src_dir`` into ``out_dir``
    (same names), every item coded with ``codec``. ``metadata``: the step's DCP metadata. Local work
    only; the caller gathers :attr:`Transcoded.storage` from every rank for :func:`finish_step`."""
    from resilient.checkpoint.tiers import crc_bytes

    t0 = time.perf_counter()
    threads = threads or min(2, os.cpu_count() or 1)
    sizes = _elem_sizes(metadata)
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mine = set(names)
    by_file: dict[str, list[tuple[Any, _StorageInfo]]] = {}
    for idx, info in metadata.storage_data.items():
        if info.relative_path in mine:
            if info.transform_descriptors:
                raise CompressError(f"{info.relative_path}: item {idx.fqn!r} is already transformed")
            by_file.setdefault(info.relative_path, []).append((idx, info))
    files: dict[str, FileEntry] = {}
    storage: dict[Any, _StorageInfo] = {}
    raw_total = 0
    for name in names:
        items = sorted(by_file.get(name, []), key=lambda p: p[1].offset)
        data = (src / name).read_bytes()
        raw_total += len(data)
        mv = memoryview(data)
        crc, off = 0, 0
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            # items are coded on several threads each; items are many and small, so a pool over items too
            def one(p: tuple[Any, _StorageInfo]) -> bytes:
                idx, info = p
                return _code_item(codec, mv[info.offset:info.offset + info.length], sizes.get(idx.fqn, 1),
                                  threads=1 if len(items) > 1 else threads)

            with ThreadPoolExecutor(threads) as ex:
                for (idx, info), coded in zip(items, ex.map(one, items)):
                    f.write(coded)
                    crc = crc_bytes(coded, crc)
                    storage[idx] = dataclasses.replace(info, offset=off, length=len(coded),
                                                       transform_descriptors=[DESCRIPTOR[codec]])
                    off += len(coded)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out / name)
        files[name] = FileEntry(size=off, crc32c=crc)
    return Transcoded(codec=codec, files=files, storage=storage, raw_bytes=raw_total,
                      seconds=time.perf_counter() - t0)


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
    link_mbps: float | None = None
    codec_mbps: float | None = None
    ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "codec": self.codec.value, "reason": self.reason, "link_mbps": self.link_mbps,
                "codec_mbps": self.codec_mbps, "ratio": self.ratio}


class Chooser:
    """Per tier, per run: compress a transfer only if coding it then sending the smaller bytes is expected
    to take less time than sending it plain, from the measured link throughput (plain bytes per second
    of the last transfer) and the codec's measured throughput and ratio on this run's own data.

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

    def decide(self, nbytes: int | None = None) -> Decision:
        """``nbytes``: this rank's plain bytes to send."""
        with self._lock:
            d = self._decide(nbytes)
            self.last = d
            return d

    def _decide(self, nbytes: int | None) -> Decision:
        mb = (lambda v: None if v is None else round(v / 1e6, 1))
        if self.mode is not CompressMode.AUTO:
            return Decision(self.tier, Codec(self.mode.value), "forced by --ckpt-compress")
        if nbytes is not None and nbytes < self.min_bytes:
            # a small transfer's time is round trips, not bandwidth; and it stays readable by plain dcp.load
            return Decision(self.tier, Codec.NONE, f"{nbytes} bytes per rank: below {self.min_bytes}")
        if self.link_bps is None:
            return Decision(self.tier, Codec.NONE, "link not measured yet: this transfer measures it")
        if self.codec_bps is None or self.ratio is None or self._since_probe >= self.probe_every:
            self._since_probe = 0
            return Decision(self.tier, Codec.BGZSTD, "codec not measured on this run's data yet: probing",
                            mb(self.link_bps))
        self._since_probe += 1
        plain = 1 / self.link_bps
        coded = 1 / self.codec_bps + 1 / (self.ratio * self.link_bps)
        pays = coded < plain
        why = (f"plain {plain * 1e6:.1f} s/MB vs coded {coded * 1e6:.1f} s/MB "
               f"(codec {self.codec_bps / 1e6:.0f} MB/s, ratio {self.ratio:.2f}, link {self.link_bps / 1e6:.0f} MB/s)")
        return Decision(self.tier, Codec.BGZSTD if pays else Codec.NONE, why, mb(self.link_bps),
                        mb(self.codec_bps), round(self.ratio, 3))

    def observe_link(self, raw_bytes: int, seconds: float) -> None:
        """A transfer of ``raw_bytes`` (on the wire) took ``seconds``."""
        if seconds > 0 and raw_bytes > 0:
            with self._lock:
                self.link_bps = raw_bytes / seconds

    def observe_codec(self, raw_bytes: int, seconds: float, ratio: float) -> None:
        if seconds > 0 and raw_bytes > 0:
            with self._lock:
                self.codec_bps, self.ratio = raw_bytes / seconds, ratio


# ------------------------------------------------------------------ a plain copy
def export_step(read_file: Callable[[str], bytes], names: Sequence[str], out_dir: str | os.PathLike[str]) -> int:
    """Write a plain (untransformed) DCP copy of a step into ``out_dir``; ``read_file(name)`` gives a
    file of the step. Returns the number of items decoded. Files with no transformed item are copied."""
    from resilient.checkpoint.safe import load_metadata

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = load_metadata(read_file(DCP_METADATA), what=DCP_METADATA)
    reg = extension_registry()
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
        off = 0
        with open(out / f".{name}.tmp", "wb") as f:
            for idx, info in items:
                body = data[info.offset:info.offset + info.length]
                if info.transform_descriptors:
                    stream: Any = io.BytesIO(body)
                    for ex in reg.from_descriptor_list(info.transform_descriptors):
                        stream = ex.transform_from(stream)  # type: ignore[attr-defined]
                    body = stream.read()
                    decoded += 1
                f.write(body)
                storage[idx] = dataclasses.replace(info, offset=off, length=len(body), transform_descriptors=None)
                off += len(body)
        os.replace(out / f".{name}.tmp", out / name)
    md.storage_data = storage
    tmp = out / f"{DCP_METADATA}.tmp"
    tmp.write_bytes(pickle.dumps(md))
    os.replace(tmp, out / DCP_METADATA)  # last: DCP's own commit marker
    return decoded


def clear(out_dir: str | os.PathLike[str]) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)


__all__ = ["ByteGroupZstd", "Chooser", "Codec", "CompressError", "CompressMode", "Decision", "ZStandard",
           "decode", "encode", "export_step", "extension_registry", "finish_step", "merged_metadata",
           "parse_mode", "transcode_files"]


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


def prepare_upload(mgr: Any, step: int, src: Any, group: Any) -> tuple[Path, Manifest] | None:
    """Collective on ``group`` (every rank, before any call to the store): decide, with rank 0's measurements,
    whether this step goes to the persistent tier compressed; if so rewrite this rank's files of ``step``
    from the local tier ``src`` into a scratch step directory. Returns (that directory, its manifest), or
    None to upload the local files as they are (also when any rank failed to rewrite its part)."""
    from resilient.checkpoint.safe import load_metadata
    from resilient.checkpoint.tiers import read_manifest

    chooser = _chooser(mgr)
    if chooser.mode is CompressMode.NONE:
        return None  # no collective, no work: compression off costs nothing
    try:
        m: Manifest | None = read_manifest(src, step, mgr.rank)
    except (OSError, ValueError, KeyError) as e:
        m = None  # the upload itself reports it
        logger.debug("step %d: no manifest to compress from (%s)", step, e)
    mine = chooser.decide(sum(f.size for f in m.files.values()) if m is not None else None)
    decision = mgr._gather(mine, group)[0]  # rank 0's measurements decide for every rank
    if mgr.rank == 0:
        logger.info("step %d to the %s tier: %s (%s)", step, decision.tier, decision.codec.value, decision.reason)
    if decision.codec is Codec.NONE:
        return None
    out = Path(src.root) / ".coded" / f"step_{step:08d}"
    clear(out)
    part: Transcoded | None = None
    try:
        if m is None:
            raise CompressError("no manifest")
        d = Path(src.path(step))
        md = load_metadata((d / DCP_METADATA).read_bytes(), what=f"{d / DCP_METADATA}")
        part = transcode_files(d, sorted(m.files), md, decision.codec, out)
    except (OSError, ValueError, KeyError, CheckpointError) as e:
        logger.warning("compressing step %d for upload failed (%s: %s); uploading it plain", step,
                       type(e).__name__, e)
    parts = mgr._gather(part.storage if part else None, group)
    if part is None or any(p is None for p in parts):
        clear(out)
        return None
    chooser.observe_codec(part.raw_bytes, part.seconds, part.ratio)
    m2 = finish_step(out, m, part, merged_metadata(md, parts), f"manifest-rank{mgr.rank}.json")
    if mgr.rank == 0:
        logger.info("step %d: %s %.2fx in %.2f s (%.0f MB/s)", step, decision.codec.value, part.ratio, part.seconds,
                    part.raw_bytes / max(part.seconds, 1e-9) / 1e6)
    return out, m2


def observe_upload(mgr: Any, nbytes: int, seconds: float) -> None:
    """The bytes this rank sent to the store and how long that took: the link's measured throughput."""
    _chooser(mgr).observe_link(nbytes, seconds)
