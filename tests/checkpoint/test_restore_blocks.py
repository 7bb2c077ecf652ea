"""Restore's block-verified data path: bytes land in the state, a bad block comes again from the next tier
into the same place, and a block with no good copy anywhere leaves an undefined state that is reported."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import xxhash

from resilient.checkpoint.api import FileEntry, StateUndefinedError
from resilient.checkpoint.format.digests import BLOCK, blocks_of, bytes_blocks
from resilient.checkpoint.restore.load import FileLoad, MemSource, load_files, plan_spans
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import GCS


def big_state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v))
    # three 2 MiB tensors and a small one: the data file spans two 4 MiB verification blocks
    return {"model": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(3)},
            "b": torch.arange(7.0) + v, "pos": int(v)}


def zeros() -> dict:
    return {"model": {f"w{i}": torch.zeros(512, 1024) for i in range(3)}, "b": torch.zeros(7), "pos": -1}


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("digest", ["xxh3", "crc32c"])
def test_load_files_refetches_only_the_bad_block_into_the_same_tensor(digest: str) -> None:
    """Pure data path: two in-memory copies, the first with a flipped byte in block 1; verified by xxh3,
    and by crc32c as a manifest written before xxh3 is."""
    t = torch.randn(3 * BLOCK // 4)  # three blocks of raw tensor bytes
    good = bytes(t.view(torch.uint8).numpy())
    bad = bytearray(good)
    bad[BLOCK + 12345] ^= 0x01
    entry = bytes_blocks(good, BLOCK)
    if digest == "crc32c":
        entry = dataclasses.replace(entry, xxh3=())
    assert entry.digest == digest
    assert len(blocks_of(entry)) == 3
    target = torch.zeros_like(t)
    ptr = target.data_ptr()
    from resilient.checkpoint.format.spans import Span

    f = FileLoad("f", entry, [MemSource(bad, "local"), MemSource(good, "persistent")],
                 [Span(0, len(good), target.view(torch.uint8))])
    failures: list[tuple[int, str]] = []
    lost = load_files([f], on_bad=lambda fl, i, tier, why: failures.append((i, tier)))
    assert lost == [] and failures == [(1, "local")]
    assert torch.equal(target, t) and target.data_ptr() == ptr
    assert f.served == "persistent"
    # no good copy of block 2 anywhere
    worse = bytearray(good)
    worse[2 * BLOCK + 1] ^= 0x01
    f2 = FileLoad("f", entry, [MemSource(worse, "local"), MemSource(worse, "persistent")],
                  [Span(0, len(good), torch.zeros_like(t).view(torch.uint8))])
    assert load_files([f2], threads=1) == [f"f block 2 (bytes {2 * BLOCK}-{len(good)})"]


def test_manifest_blocks_round_trip_and_old_manifests() -> None:
    e = bytes_blocks(b"x" * (BLOCK + 5), BLOCK)
    back = FileEntry.from_json(json.loads(json.dumps(e.to_json())))
    assert back == e and back.xxh3 == e.xxh3 and len(e.xxh3) == 2 and e.digest == "xxh3"
    assert [w for _, _, w in blocks_of(e)] == [xxhash.xxh3_64_intdigest(b"x" * BLOCK),
                                                xxhash.xxh3_64_intdigest(b"x" * 5)]
    old = FileEntry.from_json({"size": 10, "crc32c": 7})  # written before blocks existed: one block
    assert blocks_of(old) == [(0, 10, 7)] and old.digest == "crc32c"
    # xxh3 not one per block (hand-edited, or blocks dropped as inconsistent): crc32c is checked instead
    assert FileEntry.from_json({**e.to_json(), "xxh3": [1]}).digest == "crc32c"
    assert FileEntry.from_json({"size": 10, "crc32c": 7, "xxh3": [5]}).xxh3 == (5,)
    assert plan_spans(MemSource(b"\0" * 10, "local"), 10, [])[0][0].n == 10


@pytest.mark.timeout(120)
def test_flipped_byte_in_one_block_is_fetched_again_from_gcs(tmp_path: Path, gcs: GCS,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    gcs.make_bucket("ckpt")
    url = f"gs://ckpt/{tmp_path.name}"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1)
    ck.save(0, big_state(3.0))
    assert ck.wait(60)
    ck.close()
    f = tmp_path / "local" / "step_00000000" / "__0_0.distcp"
    assert f.stat().st_size > BLOCK
    m = json.loads((f.parent / "manifest-rank0.json").read_text())
    assert len(m["files"]["__0_0.distcp"]["xxh3"]) == 2  # verified by xxh3 block by block
    flip(f, BLOCK + 1000)  # inside block 1, in tensor bytes
    st = zeros()
    ptrs = {k: v.data_ptr() for k, v in st["model"].items()}
    ck2 = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1)
    assert ck2.restore(st) == 1
    ck2.close()
    ref = big_state(3.0)
    assert all(torch.equal(st["model"][k], ref["model"][k]) for k in ref["model"])
    assert torch.equal(st["b"], ref["b"]) and st["pos"] == 3
    assert {k: v.data_ptr() for k, v in st["model"].items()} == ptrs  # the same tensors, filled in place
    assert ck2.last_restore is not None and ck2.last_restore.sources["__0_0.distcp"] == "persistent"
    failed = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert [(e.details["tier"], e.details["error"].split(":")[0]) for e in failed] == \
        [("local", "__0_0.distcp block 1")]


@pytest.mark.timeout(120)
def test_no_good_copy_anywhere_raises_state_undefined_and_records_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    url = f"file://{tmp_path}/bucket"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1)
    ck.save(0, big_state(4.0))
    ck.close()
    for root in (tmp_path / "local", tmp_path / "bucket"):
        flip(root / "step_00000000" / "__0_0.distcp", BLOCK + 2000)
    ck2 = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1)
    with pytest.raises(StateUndefinedError, match="undefined"):
        ck2.restore(zeros())
    ck2.close()
    evs = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert any(e.details.get("state_undefined") for e in evs), [e.details for e in evs]
    tiers = {e.details["tier"] for e in evs}
    assert {"local", "persistent"} <= tiers


@pytest.mark.timeout(120)
def test_manifests_without_xxh3_still_restore_and_find_a_flipped_byte(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Manifests written before xxh3 existed: blocks are verified by crc32c, a bad one comes from the next tier."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    url = f"file://{tmp_path}/bucket"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1)
    ck.save(0, big_state(5.0))
    assert ck.wait(60)
    ck.close()
    for root in (tmp_path / "local", tmp_path / "bucket"):
        m = root / "step_00000000" / "manifest-rank0.json"
        d = json.loads(m.read_text())
        for fe in [*d["files"].values(), d["metadata"]]:
            del fe["xxh3"]
        m.write_text(json.dumps(d))
    flip(tmp_path / "local" / "step_00000000" / "__0_0.distcp", BLOCK + 1000)
    st = zeros()
    ck2 = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1)
    assert ck2.restore(st) == 1
    ck2.close()
    ref = big_state(5.0)
    assert all(torch.equal(st["model"][k], ref["model"][k]) for k in ref["model"]) and st["pos"] == 5
    assert ck2.last_restore is not None and ck2.last_restore.sources["__0_0.distcp"] == "persistent"
    failed = [e.details["error"] for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert failed == ["__0_0.distcp block 1: crc32c differs from the manifest"]
