"""Staging and restore for GPU state, the parts that run on a CPU: the CPU staging path is unchanged (bit-exact,
buffers reused), the host arena GPU tensors stage into (exact storages, reused, rebuilt on a new layout), and the
chunked host→target copier restore uses for GPU targets, here with CPU targets standing in (same chunking, same
ring of buffers; only the copy is synchronous). The CUDA paths themselves are tested in tests/gpu; the benchmark's
dry run (bench/gpu/staging.py --dry-run) runs in tests/bench/test_gpu_check.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient.checkpoint import CheckpointManager
from resilient.checkpoint.restore.device import ChunkCopier, Copiers
from resilient.checkpoint.save.stage import Stager, _Arena


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(37, 5, generator=g), "h": torch.randn(9, 4, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 30, (11,), generator=g), "nc": torch.randn(6, 8, generator=g).t(),
            "z": torch.empty(0, 3), "s": torch.tensor(2.5)}


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_cpu_staging_round_trip_is_bit_exact_and_reuses_its_buffers(tmp_path: Path) -> None:
    ck = CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False)
    try:
        st = {"m": _state()}
        ck.save(0, st)
        ptrs = {k: b.data_ptr() for k, b in ck._stager._buffers.items()}
        assert set(ptrs) == {f"m.{k}" for k in st["m"]}
        with torch.no_grad():
            for t in st["m"].values():
                t.add_(1)
        ck.save(1, st)
        assert {k: b.data_ptr() for k, b in ck._stager._buffers.items()} == ptrs  # no allocation per save
        assert ck._stager.allocations == 0  # CPU tensors never take the GPU arena
        assert ck.wait(60)
        want = {k: _bits(v) for k, v in st["m"].items()}
        fresh = {"m": {k: torch.zeros_like(v) for k, v in st["m"].items()}}
        assert ck.restore(fresh) == 2
        assert {k: _bits(v) for k, v in fresh["m"].items()} == want
    finally:
        ck.close()


def test_arena_buffers_hold_exactly_their_bytes_and_are_reused() -> None:
    arena = _Arena(pin=False)
    specs = [("a", (3, 5), torch.float32), ("b", (7,), torch.bfloat16), ("z", (0, 4), torch.float32),
             ("c", (), torch.int64)]
    bufs = arena.ensure(specs)
    for name, shape, dtype in specs:
        b = bufs[name]
        assert b.shape == shape and b.dtype == dtype and b.is_contiguous()
        # a view of one big storage would be cloned by DCP's writer: a second host copy of the state
        assert b.untyped_storage().size() == b.nbytes, name
    ptrs = [bufs[n].data_ptr() for n in ("a", "b", "c")]
    assert len(set(ptrs)) == 3 and all((p - ptrs[0]) % 512 == 0 for p in ptrs[1:])  # aligned within the arena
    assert arena.nbytes >= sum(bufs[n].nbytes for n in bufs)
    assert arena.nbytes < sum(bufs[n].nbytes for n in bufs) + 512 * len(specs)  # one copy, no power-of-two rounding
    bufs["a"].fill_(1.5)
    again = arena.ensure(list(specs))
    assert arena.allocations == 1 and again["a"].data_ptr() == ptrs[0] and float(again["a"][0, 0]) == 1.5
    arena.ensure(specs + [("d", (2,), torch.float16)])  # a new tensor (optimizer state after the first step)
    assert arena.allocations == 2
    arena.release()
    assert arena.nbytes == 0


def test_stager_keeps_cpu_leaves_off_the_arena() -> None:
    s = Stager()
    st = _state()
    out = s.stage(st)
    assert s.allocations == 0 and set(out) == set(st)
    for k, v in st.items():
        assert _bits(out[k]) == _bits(v) and (v.numel() == 0 or out[k].data_ptr() != v.data_ptr())
    s.synchronize()  # nothing pending on a CPU: returns at once
    s.drop()


def _fill_from(src: torch.Tensor):
    raw = _bits(src)

    def fill(off: int, view: memoryview) -> None:
        view[:] = raw[off:off + len(view)]
    return fill


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_chunk_copier_copies_every_byte_whatever_the_chunk(chunk: int) -> None:
    src = _state()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst["nc"] = torch.zeros(6, 8).t()  # a non-contiguous target: its bytes in row-major order
    assert not dst["nc"].is_contiguous()
    cop = ChunkCopier("cpu", chunk=chunk)
    for k in src:
        cop.copy_into(dst[k], _fill_from(src[k]))
    cop.close()
    for k in src:
        assert torch.equal(dst[k], src[k]) and _bits(dst[k]) == _bits(src[k]), k
    assert not dst["nc"].is_contiguous()  # filled in place, not replaced


def test_chunk_copier_ring_hands_out_disjoint_regions_until_it_wraps() -> None:
    cop = ChunkCopier("cpu", chunk=10, nbuf=2)
    a_view, a = cop.take(6)
    b_view, b = cop.take(4)  # fills the first buffer
    c_view, c = cop.take(3)  # the second
    assert a.data_ptr() + 6 == b.data_ptr() and c.data_ptr() not in range(a.data_ptr(), a.data_ptr() + 10)
    d_view, d = cop.take(9)  # no room left in the second: back to the first
    assert d.data_ptr() == a.data_ptr()
    with pytest.raises(ValueError):
        cop.take(11)
    with pytest.raises(ValueError):
        ChunkCopier("cpu", chunk=8, nbuf=1)
    cop.close()


def test_copiers_one_per_thread() -> None:
    import threading

    cs = Copiers(chunk=16)
    got: list[ChunkCopier] = []
    t = threading.Thread(target=lambda: got.append(cs.get(torch.device("cpu"))))
    t.start()
    t.join(10)
    mine = cs.get(torch.device("cpu"))
    assert got and got[0] is not mine and cs.get(torch.device("cpu")) is mine
    cs.finish()


@pytest.fixture
def world1(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_chunk_copier_fills_a_dtensor_local_shard(world1: None) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    src = torch.randn(13, 3)
    dt = distribute_tensor(torch.zeros(13, 3), mesh, [Shard(0)])
    cop = ChunkCopier("cpu", chunk=5)
    cop.copy_into(dt, _fill_from(src))
    cop.close()
    assert _bits(dt.to_local()) == _bits(src)


def test_a_leaf_that_left_the_state_frees_its_staging_buffer(world1: None) -> None:
    """A leaf no longer in the state (a removed layer, an optimizer's state dropped) keeps no buffer alive: neither
    its staging buffer nor, for a DTensor, the wrapper staged around it (which the stager keeps from save to save)."""
    import gc
    import weakref

    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from resilient.checkpoint.format.state import local_tensor

    mesh = init_device_mesh("cpu", (1,))
    st = Stager()
    leaves = {"keep": torch.randn(64), "plain": torch.randn(32),
              "dt": distribute_tensor(torch.randn(16, 4), mesh, [Shard(0)])}
    first = st.stage(leaves, objects=False)
    again = st.stage(leaves, objects=False)
    assert again["dt"] is first["dt"] and again["plain"] is first["plain"]  # reused while the leaf stays
    gone = {k: weakref.ref(local_tensor(first[k])) for k in ("plain", "dt")}  # the buffers themselves
    del first, again
    st.stage({"keep": leaves["keep"]}, objects=False)
    gc.collect()
    assert [k for k, r in gone.items() if r() is not None] == []
    assert st.nbytes == 64 * 4
