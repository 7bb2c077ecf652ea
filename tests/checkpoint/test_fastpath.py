"""The restore fast paths: one-pass verification of mapped files, parallel crc32c, reading tensors
straight into their targets (and falling back to DCP's own path for anything else)."""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient.checkpoint.api import CorruptFileError
from resilient.checkpoint.restore.reader import FastReader, _tensor_record
from resilient.checkpoint.format.digests import crc_combine, crc_parallel, file_entry, map_verified


@pytest.mark.parametrize("n", [0, 1, 4097, (16 << 20) + 3, (33 << 20) + 1])
@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_crc_parallel_matches_crc32c(n: int, threads: int | None) -> None:
    data = os.urandom(n)
    assert crc_parallel(data, threads=threads) == crc32c.crc32c(data)


@pytest.mark.parametrize("n1", [0, 1, 1000])
@pytest.mark.parametrize("n2", [0, 1, 777, 4 << 20, (4 << 20) + 5])
def test_crc_combine(n1: int, n2: int) -> None:
    a, b = os.urandom(n1), os.urandom(n2)
    assert crc_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


@pytest.mark.parametrize("size", [0, 5, 3 << 20, 4 << 20, (9 << 20) + 77])
def test_a_files_crc_combined_from_its_blocks_is_its_crc(tmp_path: Path, size: int) -> None:
    """The digests that hash a file once per block (written in pieces, read back, in memory) give the whole
    file's crc32c from the blocks' (no second pass): the same as crc32c over its bytes, at every size."""
    from resilient.checkpoint.format.digests import _Blocks, bytes_blocks, file_blocks

    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    pieces = _Blocks(1 << 20)
    for i in range(0, size, 300007):  # pieces that straddle the blocks
        pieces.update(data[i:i + 300007])
    read, mem = file_blocks(tmp_path / "f", 1 << 20), bytes_blocks(data, 1 << 20)
    assert pieces.entry().crc32c == read.crc32c == mem.crc32c == crc32c.crc32c(data)
    assert pieces.entry().blocks == read.blocks == mem.blocks


def test_map_verified_detects_damage(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(3 << 20))
    fe = file_entry(f)
    assert bytes(map_verified(f, fe)) == f.read_bytes()
    data = bytearray(f.read_bytes())
    data[12345] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="xxh3"):
        map_verified(f, fe)
    with pytest.raises(CorruptFileError, match="crc32c"):  # a manifest entry written before xxh3
        map_verified(f, dataclasses.replace(fe, xxh3=()))
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptFileError, match="size"):
        map_verified(f, fe)
    f.unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        map_verified(f, fe)
    e = tmp_path / "empty"
    e.write_bytes(b"")
    assert len(map_verified(e, file_entry(e))) == 0


def test_tensor_record() -> None:
    b = io.BytesIO()
    torch.save(torch.zeros(4, 3, dtype=torch.bfloat16), b)
    import zipfile

    zf = zipfile.ZipFile(io.BytesIO(b.getvalue()))
    pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    dtype, key, numel, offset, shape, stride = _tensor_record(pkl)  # type: ignore[misc]
    assert (dtype, numel, offset, shape, stride) == (torch.bfloat16, 12, 0, (4, 3), (3, 1))
    assert _tensor_record(b"not a pickle") is None
    b = io.BytesIO()
    torch.save({"x": 1}, b)
    zf = zipfile.ZipFile(io.BytesIO(b.getvalue()))
    assert _tensor_record(zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))) is None


@pytest.mark.parametrize("in_memory", [False, True])
def test_fast_reader_bit_exact_with_fallbacks(tmp_path: Path, in_memory: bool) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=g)
    state = {"plain": torch.randn(1000, generator=g), "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
             "transposed": base.t(), "view": base[2:4], "empty": torch.empty(0, 3), "scalar": torch.tensor(3.5),
             "ints": torch.arange(10, dtype=torch.int64), "obj": "per-rank bytes"}
    d = tmp_path / "ck"
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "" for k, v in state.items()}
    files = None
    if in_memory:
        files = {p.name: bytearray(p.read_bytes()) for p in d.iterdir() if p.name.endswith(".distcp")}
    reader = FastReader(d, files)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), k
            raw = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in (target[k], v)]
            assert raw[0] == raw[1], k
    assert target["obj"] == "per-rank bytes"
    assert reader.fast_items >= 3
