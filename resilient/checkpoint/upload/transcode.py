"""Rewriting a step's files for a transfer: DCP's items as the byte ranges :mod:`.stream` codes and sends
(:class:`Plan`, :func:`stream_files`); the merged ``.metadata`` and manifest of
the coded step (:func:`merged_metadata`, :func:`finish_step`); and the way back, a plain copy that needs
nothing of this package (:func:`export_step`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from resilient.checkpoint.api import DCP_METADATA, FileEntry, Manifest, UnsafeCheckpointError
from resilient.checkpoint.format.codec import (Codec, CompressError, DESCRIPTOR, ItemTooLargeError, item_limit,
                                               iter_decode)
from resilient.checkpoint.format.digests import crc_bytes
from resilient.checkpoint.format.safe import load_metadata
from resilient.checkpoint.storage.parts import DirDest, TierDest
from resilient.checkpoint.upload.stream import CHUNK, INFLIGHT, Item, Streamed, stream_items


logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ rewriting a step for a transfer
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


class Plan:
    """This rank's ``.distcp`` files ``names`` of a plain step as the codec sees them (:class:`Item` byte ranges,
    for :mod:`.stream`, which imports no torch), and the way back to ``.metadata``'s entries for what was sent."""

    def __init__(self, names: Sequence[str], metadata: Any):
        sizes = _elem_sizes(metadata)
        mine = set(names)
        by_file: dict[str, list[tuple[Any, _StorageInfo]]] = {}
        for idx, info in metadata.storage_data.items():
            if info.relative_path in mine:
                if info.transform_descriptors:
                    raise CompressError(f"{info.relative_path}: item {idx.fqn!r} is already transformed")
                by_file.setdefault(info.relative_path, []).append((idx, info))
        self._by_file = {n: sorted(by_file.get(n, []), key=lambda p: p[1].offset) for n in names}
        self.files: tuple[tuple[str, tuple[Item, ...]], ...] = tuple(
            (n, tuple(Item(info.offset, info.length, sizes.get(idx.fqn, 1)) for idx, info in items))
            for n, items in self._by_file.items())

    def transcoded(self, s: Streamed, codec: Codec) -> Transcoded:
        """What ``.metadata`` must say of the items :func:`stream_items` sent (``s``)."""
        storage: dict[Any, _StorageInfo] = {}
        for name, items in self._by_file.items():
            for (idx, info), (pname, off, n) in zip(items, s.where[name], strict=True):
                storage[idx] = dataclasses.replace(info, relative_path=pname, offset=off, length=n,
                                                   transform_descriptors=[DESCRIPTOR[codec]])
        return Transcoded(codec=codec, files=s.files, storage=storage, raw_bytes=s.raw_bytes, seconds=s.seconds,
                          codec_seconds=s.codec_seconds, threads=s.threads, send_seconds=s.send_seconds)


def stream_files(src_dir: str | os.PathLike[str], names: Sequence[str], metadata: Any, codec: Codec,
                 dest: DirDest | TierDest, expected: dict[str, FileEntry] | None = None,
                 threads: int | None = None, inflight: int = INFLIGHT, chunk: int = CHUNK,
                 part: int | None = None) -> Transcoded:
    """Code this rank's ``.distcp`` files ``names`` of a plain step in ``src_dir`` with ``codec`` and send
    them to ``dest`` as they are coded (:func:`~resilient.checkpoint.upload.stream.stream_items`).
    ``metadata``: the step's DCP metadata. Returns this rank's part files and item layout; the caller gathers
    :attr:`Transcoded.storage` from every rank for :func:`merged_metadata`."""
    plan = Plan(names, metadata)
    s = stream_items(src_dir, plan.files, codec, dest, expected=expected, threads=threads, inflight=inflight,
                     chunk=chunk, part=part)
    return plan.transcoded(s, codec)


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


