"""CUDA save staging and restore onto the GPU, on a real GPU: a CUDA state saves and restores bit-exact (plain
tensors, mixed dtypes, a tensor larger than the restore's ring buffers, a non-contiguous target, a DTensor);
``save()`` returns only once the copy is done and after the work queued before it (values changed on the GPU
right after it returns do not reach the checkpoint, values computed right before it do); the second save
allocates no host memory; restore holds only its ring of pinned buffers.

CUDA only: the CPU parts (the staging path unchanged, the arena's layout, the chunked copier with CPU targets)
are tested in tests/checkpoint/test_staging_device.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resilient.checkpoint import CheckpointManager

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (staging to pinned "
                                 "memory on a side stream, restore through pinned buffers)"),
              pytest.mark.timeout(120)]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return {"big": torch.randn(5 << 20, generator=g, device="cuda"),  # 20 MiB: several of restore's ring buffers
            "w": torch.randn(33, 7, generator=g, device="cuda"),
            "h": torch.randn(129, 3, generator=g, device="cuda").to(torch.bfloat16),
            "i": torch.randint(0, 1 << 30, (17,), generator=g, device="cuda"),
            "t": torch.randn(6, 8, generator=g, device="cuda").t(),  # staged from a non-contiguous source
            "z": torch.empty(0, 5, device="cuda"), "s": torch.tensor(3.25, device="cuda")}


def _fresh(st: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 7) for k, v in st.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        assert a[k].device == b[k].device and a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].cpu().reshape(-1).view(torch.uint8), b[k].cpu().reshape(-1).view(torch.uint8)), k


def test_cuda_state_round_trip_is_bit_exact(tmp_path: Path) -> None:
    st = _state()
    with CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False) as ck:
        ck.save(0, {"m": st}, force=True)
        assert ck.wait(60)
        want = {k: v.clone() for k, v in st.items()}
        fresh = _fresh(st)
        assert ck.restore({"m": fresh}) == 1
        _equal(fresh, want)
        # a non-contiguous GPU target: bytes land in row-major order through the same pinned buffers
        nc = {**_fresh(st), "w": torch.zeros(7, 33, device="cuda").t()}
        assert ck.restore({"m": nc}) == 1 and not nc["w"].is_contiguous()
        _equal(nc, want)


def test_save_returns_after_the_copy_and_after_the_work_before_it(tmp_path: Path) -> None:
    st = _state()
    a = torch.randn(2048, 2048, device="cuda")
    with CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False) as ck:
        for _ in range(20):  # a busy training stream: the copy must wait for what was queued before save()
            a = torch.tanh(a @ a)
        st["big"][: a.numel()].copy_(a.reshape(-1))  # computed right before save()
        want = {k: v.clone() for k, v in st.items()}
        ck.save(0, {"m": st}, force=True)
        with torch.no_grad():
            for v in st.values():
                v.add_(1)  # right after save() returns
        assert ck.wait(60)
        fresh = _fresh(st)
        ck.restore({"m": fresh})
        _equal(fresh, want)


def test_second_save_allocates_no_host_memory(tmp_path: Path) -> None:
    st = _state()
    with CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False) as ck:
        ck.save(0, {"m": st}, force=True)
        assert ck.wait(60)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        before = stats() if stats is not None else None
        ptrs = {k: b.data_ptr() for k, b in ck._stager._arena.buffers.items()}
        assert ck._stager.allocations == 1
        ck.save(1, {"m": st}, force=True)
        assert ck.wait(60)
        assert ck._stager.allocations == 1
        assert {k: b.data_ptr() for k, b in ck._stager._arena.buffers.items()} == ptrs
        assert all(b.is_pinned() for b in ck._stager._arena.buffers.values() if b.numel())
        if before is not None:
            after = stats()
            key = next((k for k in ("num_host_alloc", "allocations.current") if k in before), None)
            if key is not None:
                assert after[key] == before[key], (key, before, after)
        # one copy of the state in host memory: the arena holds the state's bytes, aligned, nothing more
        state_bytes = sum(v.nbytes for v in st.values())
        assert state_bytes <= ck._stager.nbytes <= state_bytes + 512 * len(st)


def test_restore_holds_only_its_ring_of_pinned_buffers(tmp_path: Path) -> None:
    from resilient.checkpoint.restore import device, load

    st = {"a": torch.randn(32 << 20, device="cuda"), "b": torch.randn(32 << 20, device="cuda")}  # 256 MiB
    with CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False) as ck:
        ck.save(0, {"m": st}, force=True)
        assert ck.wait(60)
        want = {k: v.clone() for k, v in st.items()}
        device.release_pool()
        fresh = {k: torch.zeros_like(v) for k, v in st.items()}
        ck.restore({"m": fresh})
        _equal(fresh, want)
        kept = sum(b.numel() for bufs in device._pool.values() for b in bufs)
        # the rings (restore's reader threads', DCP's path's), never a copy of the state
        assert 0 < kept <= load.THREADS * 2 * 8 * load.PIECE + device.NBUF * device.CHUNK < 256 << 20


def test_dtensor_on_cuda_round_trip(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(1000, 37, device="cuda")
        st = {"d": distribute_tensor(full, mesh, [Shard(0)])}
        with CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False) as ck:
            ck.save(0, {"m": st}, force=True)
            assert ck.wait(60)
            with torch.no_grad():
                st["d"].to_local().mul_(2)  # new values, the same layout: the second save takes the short path
            want = st["d"].to_local().clone()
            ck.save(1, {"m": st}, force=True)
            assert ck._stager.allocations == 1  # the DTensor's local shard keeps its buffer too
            assert ck.wait(60)
            planner = ck._planners["local"]
            assert (planner.short_saves, planner.records.hits) == (1, 1)  # plan, metadata and records reused
            fresh = {"d": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
            assert ck.restore({"m": fresh}) == 2
            assert torch.equal(fresh["d"].to_local(), want)
    finally:
        dist.destroy_process_group()


def test_fresh_optimizer_state_lands_on_the_gpu(tmp_path: Path) -> None:
    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).cuda()
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    model, opt = make()
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    with CheckpointManager(local=tmp_path / "ckpt", interval=1, peer=False) as ck:
        ck.save(0, {"model": model, "optim": opt}, force=True)
        assert ck.wait(60)
        model2, opt2 = make()  # a restarted process: the optimizer's state is empty
        assert ck.restore({"model": model2, "optim": opt2}) == 1
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        for key in ("exp_avg", "exp_avg_sq"):
            got = opt2.state[p2][key]
            assert got.is_cuda and torch.equal(got, opt.state[p][key]), key
