"""Restore planning against DCP's global ``.metadata`` (W chunks of every sharded tensor in a job of W ranks).

Which storage items a rank reads for its targets, without processes: the chunks that overlap each DTensor target's
local shard (at the saved layout, at another one), every item of a plain target, nothing of a key the rank does not
load; each key's chunk list walked once, not once per storage item (a walk per item was W^2 a key). And a large
``.metadata`` is not kept in the process after the restore that parsed it."""

from __future__ import annotations

import gc
import itertools
import json
import random
import weakref
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from resilient.checkpoint.restore import restore as restoring
from resilient.checkpoint.restore.restore import _items_read_of
from resilient.checkpoint.save.manager import CheckpointManager


class _Chunks(list):  # type: ignore[type-arg]
    """A key's chunk list that counts the walks over it."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _Chunks.walks += 1
        return super().__iter__()


def _grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of a tensor cut into parts[0] x parts[1] x ... boxes (the last of a dimension the shorter)."""
    out = []
    steps = [-(-s // p) for s, p in zip(shape, parts)]
    for at in itertools.product(*(range(p) for p in parts)):
        off = tuple(i * st for i, st in zip(at, steps))
        size = tuple(min(st, s - o) for st, s, o in zip(steps, shape, off))
        if all(x > 0 for x in size):
            out.append((off, size))
    return out


def _metadata(keys: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], objects: tuple[str, ...] = (),
              lists: bool = False) -> Metadata:
    """``lists``: chunk offsets and sizes as lists, as metadata not written by DCP itself may hold them."""
    sdm: dict[str, object] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for fqn, (shape, parts) in keys.items():
        chunks = _Chunks()
        for r, (off, size) in enumerate(_grid(shape, parts)):
            chunks.append(ChunkStorageMetadata(list(off), list(size)) if lists else
                          ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
            storage[MetadataIndex(fqn, off, r)] = _StorageInfo(f"__{r}_0.distcp", 100 * r, 100)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    for fqn in objects:
        sdm[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", 7, 9)
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def _overlaps(off: tuple[int, ...], size: tuple[int, ...], lo: tuple[int, ...], n: tuple[int, ...]) -> bool:
    return 0 not in n and all(o < a + b and a < o + s for o, s, a, b in zip(off, size, lo, n))


def _expected(md: Metadata, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]) -> set[tuple[str, tuple]]:
    """By definition: every item of a loaded key whose chunk overlaps the key's local box (any item of a key
    loaded whole)."""
    out = set()
    for idx in md.storage_data:
        if idx.fqn not in boxes:
            continue
        box = boxes[idx.fqn]
        if box is not None and idx.offset is not None:
            size = next(tuple(c.sizes) for c in list.__iter__(md.state_dict_metadata[idx.fqn].chunks)
                        if tuple(c.offsets) == tuple(idx.offset))
            if not _overlaps(tuple(idx.offset), size, *box):
                continue
        out.add((idx.fqn, None if idx.offset is None else tuple(idx.offset)))
    return out


def _read(md: Metadata, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]) -> set[tuple[str, tuple]]:
    load_sd = {k: torch.empty(0) for k in boxes}
    shards = {k: None if b is None else (torch.empty(b[1]), b[0]) for k, b in boxes.items()}
    got = _items_read_of(md, load_sd, shards)  # type: ignore[arg-type]
    assert all(md.storage_data[idx] is info for idx, info in got)
    keys = [(idx.fqn, None if idx.offset is None else tuple(idx.offset)) for idx, _ in got]
    assert len(keys) == len(set(keys)), "an item listed twice"
    return set(keys)


@pytest.mark.timeout(60)
def test_a_shard_at_the_saved_layout_reads_its_own_chunk_and_nothing_else() -> None:
    world = 8
    md = _metadata({"w": ((4 * world, 8), (world, 1)), "b": ((4 * world, 3), (world, 1))}, objects=("step",))
    for r in range(world):
        boxes = {"w": ((4 * r, 0), (4, 8)), "b": ((4 * r, 0), (4, 3)), "step": None}
        assert _read(md, boxes) == {("w", (4 * r, 0)), ("b", (4 * r, 0)), ("step", None)}


@pytest.mark.timeout(60)
def test_a_key_not_loaded_reads_nothing_and_a_plain_target_reads_every_chunk() -> None:
    md = _metadata({"w": ((12, 5), (3, 2)), "v": ((6, 6), (2, 2))})
    assert _read(md, {"w": None}) == {("w", off) for off, _ in _grid((12, 5), (3, 2))}
    assert _read(md, {}) == set()


@pytest.mark.timeout(120)
def test_any_other_layout_reads_exactly_the_overlapping_chunks() -> None:
    rnd = random.Random(5)
    for i in range(300):
        nd = 1 + i % 3  # a bias, a matrix, a 3-d weight
        shape = tuple(rnd.randint(1, 30) for _ in range(nd))
        md = _metadata({"w": (shape, tuple(rnd.randint(1, 6) for _ in range(nd)))}, lists=i % 5 == 0)
        lo = tuple(rnd.randint(0, s) for s in shape)
        n = tuple(rnd.randint(0, s - a) for s, a in zip(shape, lo))  # empty shards included
        assert _read(md, {"w": (lo, n)}) == _expected(md, {"w": (lo, n)}), (shape, lo, n)


@pytest.mark.timeout(60)
def test_each_keys_chunks_are_walked_once_not_once_per_storage_item() -> None:
    world, tensors = 64, 20
    md = _metadata({f"t{i}": ((4 * world, 8), (world, 1)) for i in range(tensors)})
    boxes = {f"t{i}": ((4 * 3, 0), (4, 8)) for i in range(tensors)}
    _Chunks.walks = 0
    assert _read(md, boxes) == {(f"t{i}", (12, 0)) for i in range(tensors)}
    # one walk a key (a walk per storage item would be world x tensors = 1,280)
    assert _Chunks.walks <= tensors, _Chunks.walks


def _restore_keeping_watch(root: Path, target: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> list:
    """Restore into ``target`` with a fresh manager; returns weak references to each .metadata it parsed."""
    parsed: list = []
    real = restoring.load_metadata

    def watched(data, what):  # type: ignore[no-untyped-def]
        md = real(data, what)
        parsed.append(weakref.ref(md))
        return md

    monkeypatch.setattr(restoring, "load_metadata", watched)
    ck = CheckpointManager(local=root, interval=1)
    try:
        assert ck.restore(target) == 1
    finally:
        ck.close()
    return parsed


@pytest.mark.timeout(60)
def test_a_large_metadata_is_not_kept_after_its_restore_and_a_small_one_is(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.arange(12.0), "b": torch.ones(3)}
    ck = CheckpointManager(local=tmp_path / "c", interval=1)
    assert ck.save(0, state)
    ck.close()
    # without a rank index (a single rank keeps none: it would be the whole file), .metadata is parsed
    for p in (tmp_path / "c").glob("step_*/manifest-rank*.json"):
        assert "index" not in json.loads(p.read_text())
    restoring.clear_caches()
    try:
        monkeypatch.setattr(restoring, "METADATA_CACHE_MAX", 0)  # every .metadata counts as large
        target = {"w": torch.zeros(12), "b": torch.zeros(3)}
        parsed = _restore_keeping_watch(tmp_path / "c", target, monkeypatch)
        assert all(torch.equal(target[k], state[k]) for k in state)
        gc.collect()
        assert len(parsed) == 1 and parsed[0]() is None, "the parsed .metadata outlived its restore"
        assert len(restoring._metadata_cache) == 0

        monkeypatch.setattr(restoring, "METADATA_CACHE_MAX", 2 << 20)  # the default: this one is small
        target = {"w": torch.zeros(12), "b": torch.zeros(3)}
        parsed = _restore_keeping_watch(tmp_path / "c", target, monkeypatch)
        gc.collect()
        assert all(torch.equal(target[k], state[k]) for k in state)
        assert len(parsed) == 1 and parsed[0]() is not None and len(restoring._metadata_cache) == 1
        # a second restore in the process reads the kept one instead of parsing again
        assert _restore_keeping_watch(tmp_path / "c", target, monkeypatch) == []
    finally:
        restoring.clear_caches()
