"""A rank's own part of DCP's ``.metadata``, kept in its manifest, so a restart that restores the layout it saved
reads that instead of the whole file.

DCP's ``.metadata`` is global: a job of W ranks saving T sharded tensors lists W x T chunks, and every rank
unpickles all of them at every restart (2.3 s and 1.7 GB per rank at 1,024 ranks x 900 tensors,
``bench/metadata_scale.py``). A rank restoring exactly the shards it saved (same world size, same placements)
reads only the items of its own save plan: its shards, and the replicated values DCP wrote once for every rank
(another rank's file may hold those: DCP's dedup picks one writer). So at a save planned through DCP, whose
finished metadata every rank receives, each rank keeps the entries of its own plan's items as a ``Metadata`` of
its own, pickled; the manager writes it into the rank's manifest, bound to the ``.metadata`` it came from, with a
checksum. At restore it is used only when it fits: the world size unchanged, every key of the target found with a
chunk of exactly the target's local shard; anything else (a world-size change, a corrupted or missing index, a
manifest rewritten for a compressed upload) parses ``.metadata`` as before.
"""

from __future__ import annotations

import base64
import pickle
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from resilient.checkpoint.api import CheckpointError, RankIndex
from resilient.checkpoint.format.safe import load_metadata


# an index holding more than this share of ``.metadata``'s items is not kept: decoding it would cost about what
# parsing the whole file does (a single rank, or a data-parallel job whose every value is replicated)
MOST = 0.75


def build(md: Any, items: Iterable[Any]) -> bytes | None:
    """The pickled ``Metadata`` of ``items`` (this rank's local save plan, before DCP's dedup) taken from the
    finished global metadata ``md``; None when ``md`` lacks any of them, or they are most of it (:data:`MOST`):
    restores then parse the whole file. Work in the items only: the chunk, properties and size of each come from
    its write item."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import WriteItemType

    storage = getattr(md, "storage_data", None)
    items = list(items)
    if not isinstance(storage, dict) or len(items) > MOST * len(storage):
        return None
    sdm: dict[str, Any] = {}
    sd: dict[Any, Any] = {}
    for it in items:
        info = storage.get(it.index)
        if info is None:
            return None
        sd[it.index] = info
        if it.type == WriteItemType.BYTE_IO:
            sdm[it.index.fqn] = BytesStorageMetadata()
            continue
        td = it.tensor_data
        if td is None:
            return None
        entry = sdm.get(it.index.fqn)
        if entry is None:
            entry = sdm[it.index.fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
        entry.chunks.append(ChunkStorageMetadata(offsets=td.chunk.offsets, sizes=td.chunk.sizes))
    planner_data = getattr(md, "planner_data", None)
    if isinstance(planner_data, dict):
        planner_data = {k: v for k, v in planner_data.items() if k in sdm}
    return pickle.dumps(Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=sd,
                                 version=getattr(md, "version", None)), protocol=pickle.HIGHEST_PROTOCOL)


class Encoder:
    """Encodes one planner's index as the manifest carries it. The planner keeps the same blob across its saves, so
    its checksum and base64 text are computed once, not at every save's manifest."""

    def __init__(self) -> None:
        self._last: tuple[bytes, int, str] | None = None

    def __call__(self, blob: bytes, metadata_crc: int) -> RankIndex:
        """``blob`` bound to the ``.metadata`` (its crc32c) it was taken from."""
        last = self._last
        if last is None or last[0] is not blob:
            last = self._last = (blob, zlib.crc32(blob), base64.b64encode(blob).decode("ascii"))
        return RankIndex(of=metadata_crc, crc=last[1], data=last[2])


def encode(blob: bytes, metadata_crc: int) -> RankIndex:
    """``blob`` as the manifest carries it, bound to the ``.metadata`` (its crc32c) it was taken from."""
    return Encoder()(blob, metadata_crc)


def decode(index: RankIndex, metadata_crc: int, what: str) -> Any:
    """The ``Metadata`` in ``index``, through the same restricted unpickler as ``.metadata``; raises
    :class:`CheckpointError` naming what is wrong when it belongs to another ``.metadata`` or is damaged."""
    if index.of != metadata_crc:
        raise CheckpointError(f"{what}: the rank index belongs to another .metadata (a rewritten copy)")
    try:
        blob = base64.b64decode(index.data, validate=True)
    except ValueError as e:
        raise CheckpointError(f"{what}: the rank index is not base64 ({e})") from e
    if zlib.crc32(blob) != index.crc:
        raise CheckpointError(f"{what}: the rank index fails its checksum")
    return load_metadata(blob, what=what)


def fits(md: Any, load_sd: Mapping[str, Any], shards: Mapping[str, tuple[torch.Tensor, tuple[int, ...]] | None],
         ) -> bool:
    """Does ``md`` (a rank index) hold everything this rank loads into ``load_sd``, as the whole ``.metadata``
    would plan it: every key present, a tensor target's local shard (a plain tensor: the whole tensor) saved as
    one chunk of exactly its offsets and sizes with its storage item, a bytes target's item. DCP's chunks never
    overlap, so that chunk is the only one the whole file would have this rank read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    sdm, sd = md.state_dict_metadata, md.storage_data or {}
    for key, v in load_sd.items():
        m = sdm.get(key)
        if isinstance(m, BytesStorageMetadata):
            if MetadataIndex(key) not in sd:
                return False
            continue
        if not isinstance(m, TensorStorageMetadata):
            return False
        shard = shards.get(key)
        if shard is not None:
            off, size = tuple(shard[1]), tuple(shard[0].shape)
        elif isinstance(v, torch.Tensor):
            off, size = (0,) * v.dim(), tuple(v.shape)
        else:
            return False
        if not any(tuple(c.offsets) == off and tuple(c.sizes) == size for c in m.chunks):
            return False
        if MetadataIndex(key, torch.Size(off)) not in sd:
            return False
    return True
