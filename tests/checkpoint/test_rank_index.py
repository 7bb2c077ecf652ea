"""A rank's own entries of ``.metadata`` in its manifest (``format/rank_index.py``): what a restart that restores
the layout it saved plans from instead of the whole file.

Checks: a restore of the saved layout plans from the index and is bit-exact; a damaged index (a flipped byte, and
entries altered under their old checksum: two tensors' places swapped), one bound to another ``.metadata``, and a
target that is not the saved layout each fall back to the whole ``.metadata`` and restore exactly (or raise its
error); and, by definition on random layouts, the index fits exactly when the target is a saved chunk, and then
reads the items the whole file would. The multi-rank layouts (FSDP2, TP, FSDP2 x TP, HSDP, a world-size change)
are in ``test_dtensor.py``."""

from __future__ import annotations

import base64
import json
import pickle
import random
import zlib
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.api import CheckpointMismatchError, Manifest
from resilient.checkpoint.format.digests import file_entry
from resilient.checkpoint.format import rank_index
from resilient.checkpoint.restore.restore import _items_read_of
from resilient.checkpoint.save.manager import CheckpointManager
from resilient import env as _env
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .test_restore_planning import _expected, _grid, _metadata


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(16, 16).state_dict(), "a": torch.randn(64), "b": torch.randn(64),
            "step": 7, "note": {"lr": 0.1}}


def _fresh() -> dict:
    return {"model": torch.nn.Linear(16, 16).state_dict(), "a": torch.zeros(64), "b": torch.zeros(64),
            "step": 0, "note": {"lr": 0.0}}


def _equal(a: dict, b: dict) -> bool:
    return (all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and torch.equal(a["a"], b["a"])
            and torch.equal(a["b"], b["b"]) and a["step"] == b["step"] and a["note"] == b["note"])


@pytest.fixture(autouse=True)
def _one_rank_keeps_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # a single rank's index would hold all of .metadata, which is not kept (MOST); these single-process tests keep
    # it to exercise what a rank of a sharded job does with its share (test_dtensor.py runs those jobs)
    monkeypatch.setattr(rank_index, "MOST", 1.0)


def _saved(root: Path) -> dict:
    state = _state()
    ck = CheckpointManager(local=root, interval=1)
    try:
        assert ck.save(0, state) and ck.wait(60)
    finally:
        ck.close()
    return state


def _restore(root: Path, target: dict) -> dict:
    """Restore with a fresh manager; the phases of its restore."""
    from resilient.checkpoint.restore import restore as restoring

    restoring.clear_caches()  # no parsed .metadata from an earlier restore in this process
    ck = CheckpointManager(local=root, interval=1)
    try:
        assert ck.restore(target) == 1
        assert ck.last_restore is not None
        return dict(ck.last_restore.phases)
    finally:
        ck.close()


def _manifest(root: Path) -> Path:
    return root / "step_00000000" / "manifest-rank0.json"


def _edit_index(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    p = _manifest(root)
    m = json.loads(p.read_text())
    edit(m["index"])
    p.write_text(json.dumps(m))


@pytest.mark.timeout(60)
def test_the_saved_layout_is_planned_from_the_index_and_bit_exact(tmp_path: Path) -> None:
    state = _saved(tmp_path / "c")
    m = json.loads(_manifest(tmp_path / "c").read_text())
    assert set(m["index"]) == {"of", "crc", "data"} and m["index"]["of"] == m["metadata"]["crc32c"]
    target = _fresh()
    phases = _restore(tmp_path / "c", target)
    assert "index" in phases and "metadata" not in phases, phases
    assert _equal(state, target)


def _flip(ix: dict) -> None:
    """A flipped bit in the pickled entries."""
    raw = bytearray(base64.b64decode(ix["data"]))
    raw[len(raw) // 2] ^= 0x01
    ix["data"] = base64.b64encode(bytes(raw)).decode()


def _swap(ix: dict) -> None:
    """A readable index that lies (two tensors of one size swapped) under the old checksum: without the checksum it
    would load each into the other's place."""
    md = pickle.loads(base64.b64decode(ix["data"]))
    ia = next(i for i in md.storage_data if i.fqn == "a")
    ib = next(i for i in md.storage_data if i.fqn == "b")
    md.storage_data[ia], md.storage_data[ib] = md.storage_data[ib], md.storage_data[ia]
    ix["data"] = base64.b64encode(pickle.dumps(md)).decode()


def _other(ix: dict) -> None:
    """An index bound to another .metadata (a rewritten copy's manifest)."""
    ix["of"] ^= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage,rotted", [(_flip, True), (_swap, True), (_other, False)],
                         ids=["flipped-byte", "altered-entries", "other-metadata"])
def test_a_damaged_or_foreign_index_falls_back_to_the_whole_metadata(tmp_path: Path, damage, rotted: bool,  # type: ignore[no-untyped-def]
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    state = _saved(tmp_path / "c")
    _edit_index(tmp_path / "c", damage)
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv(_env.RUN_DIR, str(run))
    target = _fresh()
    phases = _restore(tmp_path / "c", target)
    assert "metadata" in phases and "index" not in phases, phases
    assert _equal(state, target)
    # a manifest whose bytes changed on its tier is a disk to look at: the ledger says so (a copy rewritten for
    # another encoding is not damage)
    failed = [e.details for e in read_events(run) if e.kind == EventKind.CKPT_TIER_FAILED]
    if rotted:
        assert [(f["step"], f["tier"]) for f in failed] == [(0, "local")], failed
        assert "manifest-rank0.json" in failed[0]["error"] and "checksum" in failed[0]["error"], failed
    else:
        assert failed == [], failed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dcp_path", [False, True], ids=["direct", "dcp-reader"])
def test_a_rank_planned_from_its_index_never_reads_the_metadata_file(tmp_path: Path, dcp_path: bool) -> None:
    """With its index, a rank needs nothing of ``.metadata``: here the file is damaged (any read of it fails its
    checksum) and the restore is still exact, DCP's own reader included (a float64 target for a float32 tensor
    takes that path: it is handed the index)."""
    state = _saved(tmp_path / "c")
    md = tmp_path / "c" / "step_00000000" / ".metadata"
    raw = bytearray(md.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    md.write_bytes(bytes(raw))
    target = _fresh()
    if dcp_path:
        target["a"] = torch.zeros(64, dtype=torch.float64)
    phases = _restore(tmp_path / "c", target)
    assert "index" in phases and "metadata" not in phases, phases
    if dcp_path:
        assert target["a"].dtype == torch.float64 and torch.equal(target["a"], state["a"].double())
        target["a"] = target["a"].float()
    assert _equal(state, target)


@pytest.mark.timeout(60)
def test_dcp_reader_is_handed_the_parsed_metadata_not_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an index (a single rank's is not kept), a target DCP's reader fills (float64 for a float32 tensor)
    is planned from the ``.metadata`` the restore parsed once: the reader never parses the file again."""
    from resilient.checkpoint.restore import reader

    monkeypatch.setattr(rank_index, "MOST", 0.75)
    state = _saved(tmp_path / "c")
    assert "index" not in json.loads(_manifest(tmp_path / "c").read_text())

    def parsed_again(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("DCP's reader parsed .metadata again")
    monkeypatch.setattr(reader, "load_metadata", parsed_again)
    target = {**_fresh(), "a": torch.zeros(64, dtype=torch.float64)}
    phases = _restore(tmp_path / "c", target)
    assert "metadata" in phases, phases
    assert torch.equal(target["a"], state["a"].double())


@pytest.mark.timeout(60)
def test_an_empty_container_is_filled_from_the_index(tmp_path: Path) -> None:
    # a fresh optimizer's state is empty at a restart: filled with what this rank saved under its key
    state = _saved(tmp_path / "c")
    target = {**_fresh(), "note": {}}
    phases = _restore(tmp_path / "c", target)
    assert "index" in phases and "metadata" not in phases, phases
    assert target["note"] == state["note"] and _equal(state, target)


@pytest.mark.timeout(60)
def test_a_target_not_of_the_saved_layout_is_planned_from_the_whole_metadata(tmp_path: Path) -> None:
    _saved(tmp_path / "c")
    # a key the checkpoint lacks: the whole .metadata decides, and its error names the key
    target = {**_fresh(), "extra": torch.zeros(3)}
    with pytest.raises(CheckpointMismatchError, match="extra"):
        _restore(tmp_path / "c", target)


def _partial(md, chunk: int):  # type: ignore[no-untyped-def]
    """``md`` reduced to what the rank that saved chunk number ``chunk`` of every key holds, as build() makes it."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    sdm, sd = {}, {}
    for fqn, m in md.state_dict_metadata.items():
        c = list.__getitem__(m.chunks, chunk)
        sdm[fqn] = TensorStorageMetadata(m.properties, m.size, [c])
        idx = next(i for i in md.storage_data if i.fqn == fqn and tuple(i.offset) == tuple(c.offsets))
        sd[idx] = md.storage_data[idx]
    return Metadata(state_dict_metadata=sdm, storage_data=sd)


@pytest.mark.timeout(120)
def test_the_index_fits_exactly_a_saved_chunk_and_then_reads_what_the_whole_file_would() -> None:
    rnd = random.Random(11)
    fits = 0
    for i in range(300):
        nd = 1 + i % 3
        shape = tuple(rnd.randint(1, 30) for _ in range(nd))
        parts = tuple(rnd.randint(1, 6) for _ in range(nd))
        md = _metadata({"w": (shape, parts)})
        boxes = _grid(shape, parts)
        mine = rnd.randrange(len(boxes))
        partial = _partial(md, mine)
        if i % 2:  # the rank's own chunk: the saved layout
            lo, n = boxes[mine]
        else:  # any box
            lo = tuple(rnd.randint(0, s) for s in shape)
            n = tuple(rnd.randint(0, s - a) for s, a in zip(shape, lo))
        load_sd = {"w": torch.empty(0)}
        shards = {"w": (torch.empty(n), lo)}
        ok = rank_index.fits(partial, load_sd, shards)  # type: ignore[arg-type]
        assert ok == ((lo, n) == boxes[mine]), (shape, parts, boxes[mine], lo, n)
        if ok:
            fits += 1
            got = {(idx.fqn, tuple(idx.offset)) for idx, _ in _items_read_of(partial, load_sd, shards)}  # type: ignore
            assert got == _expected(md, {"w": (lo, n)}), (shape, parts, lo, n)
    assert fits >= 100, fits


@pytest.mark.timeout(60)
def test_an_index_holding_most_of_the_metadata_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_index, "MOST", 0.75)  # the default
    state = _saved(tmp_path / "c")
    assert "index" not in json.loads(_manifest(tmp_path / "c").read_text())
    target = _fresh()
    phases = _restore(tmp_path / "c", target)
    assert "metadata" in phases and "index" not in phases, phases
    assert _equal(state, target)


@pytest.mark.timeout(60)
def test_decode_names_what_is_wrong() -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    blob = pickle.dumps(Metadata(state_dict_metadata={"w": BytesStorageMetadata()}, storage_data={}))
    ix = rank_index.encode(blob, metadata_crc=5)
    assert rank_index.decode(ix, 5, what="m").state_dict_metadata.keys() == {"w"}
    with pytest.raises(Exception, match="another .metadata"):
        rank_index.decode(ix, 6, what="m")
    bad = type(ix)(of=5, crc=zlib.crc32(blob) ^ 1, data=ix.data)
    with pytest.raises(Exception, match="checksum"):
        rank_index.decode(bad, 5, what="m")
    with pytest.raises(Exception, match="base64"):
        rank_index.decode(type(ix)(of=5, crc=ix.crc, data="!!"), 5, what="m")


# ------------------------------------------------------------------ .metadata to the other nodes, as ids
SPREAD = Path(__file__).resolve().parent / "_spread_train.py"


def _spread(workers, tmp_path: Path, args: list[str], damaged: str = "") -> int:  # type: ignore[no-untyped-def]
    from .conftest import ok

    res = ok(workers.run(SPREAD, ["--local", str(tmp_path / "node{node}"), *args], 4, local_world_size=2,
                         timeout=200))
    line = next(x for x in res[0].output.splitlines() if x.startswith("{"))
    steps = sorted(p.name for p in (tmp_path / "node0").glob("step_*"))
    assert steps and steps == sorted(p.name for p in (tmp_path / "node1").glob("step_*")), steps
    for s in steps:  # every node's copy of every step is rank 0's file, byte for byte (but the one damaged)
        a, b = (tmp_path / "node1" / s / ".metadata").read_bytes(), (tmp_path / "node0" / s / ".metadata").read_bytes()
        assert (a != b) if s == damaged else (a == b), s
        # and every rank's manifest names it as it is (the entry the ids' offer carried, not read again)
        want = file_entry(tmp_path / "node0" / s / ".metadata")
        for r in range(4):
            got = Manifest.from_json(json.loads((tmp_path / f"node{r // 2}" / s / f"manifest-rank{r}.json").read_text()))
            assert (got.metadata.size, got.metadata.crc32c, got.metadata.xxh3) == (want.size, want.crc32c, want.xxh3), \
                (s, r)
    return json.loads(line)["spread_by_ids"]


@pytest.mark.timeout(240)
def test_later_saves_reach_the_other_node_as_ids_and_make_the_same_file(tmp_path: Path, workers) -> None:  # type: ignore[no-untyped-def]
    # the first save sends the file; each later one (the same plan, ids changed) only the ids that differ
    assert _spread(workers, tmp_path, ["--steps", "4"]) == 3


@pytest.mark.timeout(240)
def test_a_damaged_copy_of_the_last_file_gets_the_whole_file(tmp_path: Path, workers) -> None:  # type: ignore[no-untyped-def]
    # node 1's copy of step 2's .metadata has a flipped byte: step 3 made from it would fail its crc, so rank 0
    # sends step 3's whole file; step 4 is made from that again
    assert _spread(workers, tmp_path, ["--steps", "5", "--damage", "3"], damaged="step_00000002") == 3
