"""The local tier's writer (``save.writer.RecordWriter``): its files are plain DCP that stock ``dcp.load`` reads
bit-exact, every tensor record is a valid zip (real crc32s), and the manifest entries it computes while writing
are what reading the file back computes (sizes, crc32c and xxh3 per block, where each tensor's bytes are)."""

from __future__ import annotations

import io
import warnings
import zipfile
import zlib

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from resilient.checkpoint.format.digests import BLOCK, file_blocks
from resilient.checkpoint.format.safe import load_metadata
from resilient.checkpoint.restore.load import FileSource, file_layout
from resilient.checkpoint.save.writer import RecordWriter

pytestmark = pytest.mark.timeout(120)


def _plain_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 33, generator=g),
        "bf": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "i": torch.randint(-2**40, 2**40, (9,), generator=g, dtype=torch.int64),
        "b": torch.rand(11, generator=g) > 0.5,
        "h": torch.randn(3, 3, generator=g).to(torch.float16),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        # crosses the manifest's verification blocks: hashing while writing must cut blocks where a read does
        "big": torch.randn(BLOCK // 4 + 1000, generator=g),
        "step": 12,
        "note": ("lr", 3e-4),
    }


def _save(state: dict, d, writer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)


def _load(like: dict, d) -> dict:
    out = {k: torch.full_like(v, 0) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(d), no_dist=True)
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
            assert torch.equal(_raw(b[k]), _raw(a[k])), k  # bit-exact, NaN payloads and signed zeros included
        else:
            assert b[k] == a[k], k


def _records(d) -> list[bytes]:
    md = load_metadata((d / ".metadata").read_bytes(), what=".metadata")
    out = []
    for info in md.storage_data.values():
        raw = (d / info.relative_path).read_bytes()
        out.append(raw[info.offset:info.offset + info.length])
    return out


def test_stock_dcp_load_reads_it_bit_exact_and_every_record_is_a_valid_zip(tmp_path):
    state = _plain_state()
    # a view into a larger storage and a transposed tensor: DCP clones the first, the second keeps its strides
    base = torch.arange(100, dtype=torch.float32)
    state["view"] = base[10:30]
    state["t"] = torch.randn(6, 4).t()
    w = RecordWriter(tmp_path / "ours")
    _save(state, tmp_path / "ours", w)
    assert w.templated > 0
    _same(state, _load(state, tmp_path / "ours"))
    for rec in _records(tmp_path / "ours"):
        if rec[:2] == b"PK":
            assert zipfile.ZipFile(io.BytesIO(rec)).testzip() is None
    # the same state through DCP's own writer loads to the same values
    _save(state, tmp_path / "stock", FileSystemWriter(tmp_path / "stock", thread_count=1))
    _same(_load(state, tmp_path / "stock"), _load(state, tmp_path / "ours"))


@pytest.mark.parametrize("block", [BLOCK, 256 << 10])
def test_entries_written_equal_entries_read_back(tmp_path, block):
    """Also at the block size a manager was given (the writer hashes by the manager's block, not its own
    default: a manifest of 4 MiB blocks made a restore of a 256 KiB-block manager read whole files)."""
    state = _plain_state()
    d = tmp_path / "s"
    w = RecordWriter(d, block=block)
    _save(state, d, w)
    assert w.fallbacks == 0 and list(w.entries) == ["__0_0.distcp"]
    got = w.entries["__0_0.distcp"]
    read = file_blocks(d / "__0_0.distcp", block)
    assert len(read.blocks) > 1  # the state crosses a block boundary
    # both sides combine the file's crc from its blocks': it must be the crc of the file's bytes
    assert read.crc32c == crc32c.crc32c((d / "__0_0.distcp").read_bytes())
    assert (got.size, got.crc32c, got.block_size, got.blocks, got.xxh3) == \
        (read.size, read.crc32c, read.block_size, read.blocks, read.xxh3)
    md = load_metadata((d / ".metadata").read_bytes(), what=".metadata")
    items = [(i.offset, i.length) for i in md.storage_data.values()]
    src = FileSource(d / "__0_0.distcp", "local", read.size)
    try:
        assert got.items == file_layout(src, items)
    finally:
        src.close()
    assert len(got.items) == sum(isinstance(v, torch.Tensor) for v in state.values())


def test_a_tensor_no_template_covers_goes_through_torch_save_and_its_file_gets_no_entry(tmp_path):
    state = {"t": torch.randn(6, 4).t(), "w": torch.randn(5)}  # transposed: not row-major
    d = tmp_path / "s"
    w = RecordWriter(d)
    _save(state, d, w)
    assert w.fallbacks == 1 and w.templated == 1
    assert w.entries == {}  # the manager reads such a file back, as it did before
    _same(state, _load(state, d))


def test_a_wrapped_dcp_item_write_sees_every_item(tmp_path, monkeypatch):
    """The drills' kill in the middle of a write wraps DCP's per-item write; the record writer must not go around
    it (or the drill would kill nothing)."""
    import torch.distributed.checkpoint.filesystem as fs

    seen = []
    orig = fs._write_item

    def spy(transforms, stream, data, write_item, storage_key, fmt):  # noqa: ANN001, ANN202
        seen.append(write_item.index.fqn)
        return orig(transforms, stream, data, write_item, storage_key, fmt)

    monkeypatch.setattr(fs, "_write_item", spy)
    state = _plain_state()
    d = tmp_path / "s"
    w = RecordWriter(d)
    _save(state, d, w)
    assert w.templated == 0 and w.entries == {}
    assert {k for k, v in state.items() if isinstance(v, torch.Tensor)} <= set(seen)
    _same(state, _load(state, d))


def test_records_kept_from_the_last_write_follow_new_values_and_step_aside_for_other_tensors(tmp_path):
    """The planner's ``RecordMemo``: saves of the same buffers with new values write each save's own bytes from the
    kept records; a buffer replaced by another tensor (same shape) or a key pointing at another buffer makes the
    writer look every tensor up again; ``.metadata`` from the last file's bytes is what pickling it gives, and a
    directory whose name has another length falls back to DCP's own ``finish``."""
    import pickle

    from resilient.checkpoint.save import plan

    state = {k: v for k, v in _plain_state().items() if k != "note"}
    planner = plan.CachedSavePlanner("test")
    memo = planner.records

    def save(name: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel():
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point()
                        else torch.randint(0, 2, v.shape, generator=g).to(v.dtype))
        state["step"] = seed
        d = tmp_path / name
        d.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan.save(state, RecordWriter(d), planner, None, no_dist=True)
        _same(state, _load(state, d))  # this save's own values, bit-exact
        md = (d / ".metadata").read_bytes()
        back = load_metadata(md, what=".metadata")
        assert pickle.dumps(back) == md and str(back.storage_meta.checkpoint_id) == str(d)

    try:
        save("step_01", 1)
        assert (memo.hits, memo.patched) == (0, 0)
        save("step_02", 2)
        save("step_03", 3)
        assert (memo.hits, memo.patched, planner.short_saves) == (2, 2, 2)
        # the records name the very tensors they were made from: another tensor of the same kind is not theirs
        assert memo.holds(memo.plan, state) and not memo.holds(memo.plan, {**state, "w": state["w"].clone()})
        state["w"] = state["w"].clone()  # the same shape in another buffer: its address is not the record's
        save("step_04", 4)
        assert memo.hits == 2
        save("step_05", 5)
        assert memo.hits == 3
        state["h"], state["bf"] = state["bf"], state["h"]  # two keys trade buffers: planned and written again
        save("step_06", 6)
        save("step_07", 7)
        assert memo.hits == 4
        patched = memo.patched
        save("step_0008", 8)  # another length of name: the last file's bytes cannot take it; DCP pickles
        assert memo.patched == patched
        save("step_0009", 9)
        assert memo.patched == patched + 1
    finally:
        planner.forget()
    assert memo.plan is None and memo.records == []


@pytest.mark.parametrize("n", [1, 5000, (1 << 20) + 3])
def test_the_zip_records_crc32_is_zlibs_at_every_size(n):
    """The records' crc32 comes from ISA-L (a declared dependency, 2-3x zlib's speed) and must be zlib's value, also
    over a tensor's bytes as the writer hands them (a memoryview); every record's zip check above rests on it."""
    from resilient.checkpoint.save import writer

    assert writer._zip_crc32.__module__ == "isal.isal_zlib", "isal is a dependency: the writer fell back to zlib"
    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    mv = writer._data_view(t)
    assert writer._zip_crc32(mv) == zlib.crc32(bytes(mv)) and writer._zip_crc32(mv, 7) == zlib.crc32(bytes(mv), 7)


def test_a_step_saved_again_is_overwritten_without_torchs_warning(tmp_path):
    """A job restored from an older step saves that step number again: the manager overwrites it on purpose (its
    marker removed first), and torch's "overwrite will default to False" warning must not reach the job's log."""
    from resilient.checkpoint.save.manager import CheckpointManager

    ck = CheckpointManager(local=tmp_path / "local", interval=1)
    try:
        ck.save(5, {"w": torch.zeros(1000)})
        assert ck.wait(30)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ck.save(5, {"w": torch.ones(1000)}, force=True)
            assert ck.wait(30)
    finally:
        ck.close()
    assert not [w for w in seen if "existing checkpoint" in str(w.message)], [str(w.message) for w in seen]
    got = {"w": torch.zeros(1000)}
    dcp.load(got, storage_reader=FileSystemReader(tmp_path / "local" / "step_00000005"), no_dist=True)
    assert torch.equal(got["w"], torch.ones(1000))
