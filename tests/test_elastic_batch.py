"""resilient.data.ElasticBatch and ResumableSampler.next_global_batch: the same global batch, the same global
sample order and the same gradients at any data-parallel size, across size changes restored from the
sampler's state_dict()."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from resilient.data import ElasticBatch, MicroBatch, ResumableSampler
from tests._helpers.gcs import free_port


def _step(eb: ElasticBatch, d: int, start: int = 0, samples: int | None = None) -> list[list[MicroBatch]]:
    return [eb.micro_batches(d, r, start=start, samples=samples) for r in range(d)]


@pytest.mark.parametrize("g,mb", [(12, 3), (10, 3), (7, 2), (5, 5), (1, 4)])
def test_every_size_takes_the_whole_global_batch_once(g: int, mb: int) -> None:
    eb = ElasticBatch(g, mb)
    for d in range(1, g + 1):
        per_rank = _step(eb, d, start=100)
        accum = eb.accum_steps(d)
        assert accum == -(-g // (mb * d))
        assert all(len(mbs) == accum for mbs in per_rank)  # every rank runs every micro-step, empty or not
        taken = []
        for m in range(accum):
            sizes = [len(per_rank[r][m]) for r in range(d)]
            assert max(sizes) <= mb and max(sizes) - min(sizes) <= 1
            if m < accum - 1:
                assert sizes == [mb] * d
            for r in range(d):
                taken.extend(per_rank[r][m].positions)
                assert per_rank[r][m].loss_scale == d / g
        # the step's positions in order: micro-step by micro-step, rank by rank
        assert taken == list(range(100, 100 + g))


def test_an_empty_micro_batch_is_marked() -> None:
    eb = ElasticBatch(10, 3)  # d=4: 12 slots per micro-step, so one micro-step of 10: ranks get 3, 3, 2, 2
    assert [len(m[0]) for m in _step(eb, 4)] == [3, 3, 2, 2]
    last = [m[-1] for m in _step(ElasticBatch(7, 2), 3)]  # 6 + 1: the last micro-step has one sample
    assert [mb.empty for mb in last] == [False, True, True]


def test_bad_inputs_name_the_numbers() -> None:
    for g, mb in ((0, 1), (4, 0), (4, -2)):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            ElasticBatch(g, mb)
    with pytest.raises(ValueError, match=r"data-parallel size 5 exceeds the global batch 4"):
        ElasticBatch(4, 1).accum_steps(5)
    with pytest.raises(ValueError, match=r"global batch 12 is not a multiple of micro_batch 2 x data-parallel "
                                         r"size 5 = 10"):
        ElasticBatch(12, 2, even=True).check(5)
    ElasticBatch(12, 2, even=True).check(3)
    with pytest.raises(ValueError, match=r"global batch 100 at data-parallel size 1 with micro_batch 1 needs 100 "
                                         r"accumulation steps, over max_accum_steps=10"):
        ElasticBatch(100, 1, max_accum_steps=10).micro_batches(1, 0)
    with pytest.raises(ValueError, match=r"dp_rank 2 is not in \[0, 2\)"):
        ElasticBatch(4, 1).micro_batches(2, 2)


# ------------------------------------------------------------------ a run that changes size mid-epoch

N, DIM, G, MB = 53, 3, 8, 2  # 53 samples: 6 full global steps and a tail of 5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(N, DIM, generator=gen, dtype=torch.float64),
            torch.randn(N, generator=gen, dtype=torch.float64))


def _uninterrupted(x: torch.Tensor, y: torch.Tensor) -> tuple[list[list[int]], list[torch.Tensor]]:
    """One process, the whole global batch at once, loss = mean over the step's samples."""
    order = ResumableSampler(N, num_replicas=1, rank=0, seed=3).permutation()
    w = torch.zeros(DIM, dtype=torch.float64, requires_grad=True)
    steps, grads = [], []
    for s in range(0, N, G):
        idx = order[s:s + G]
        loss = ((x[idx] @ w - y[idx]) ** 2).mean()
        (g,) = torch.autograd.grad(loss, w)
        with torch.no_grad():
            w -= 0.1 * g
        steps.append(idx)
        grads.append(g)
    return steps, grads


def _elastic(x: torch.Tensor, y: torch.Tensor,
             sizes: list[tuple[int, int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """d ranks per phase, each its own sampler restored from the previous phase's state_dict(); a rank's
    gradient accumulates its micro-batches' scaled SUM losses, then the ranks' gradients are averaged (as
    DDP's all-reduce does)."""
    state = None
    w = torch.zeros(DIM, dtype=torch.float64)
    steps, grads = [], []
    eb = ElasticBatch(G, MB)
    for d, n_steps in sizes:
        samplers = [ResumableSampler(N, num_replicas=1, rank=0, seed=3) for _ in range(d)]
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        for _ in range(n_steps):
            rank_grads, seen = [], []
            plans = [s.next_global_batch(eb, dp_size=d, dp_rank=r) for r, s in enumerate(samplers)]
            if not plans[0]:
                break
            for plan in plans:
                wr = w.clone().requires_grad_(True)
                for mb in plan:
                    idx = list(mb.indices)
                    seen.extend(idx)
                    (((x[idx] @ wr - y[idx]) ** 2).sum() * mb.loss_scale).backward()
                rank_grads.append(wr.grad if wr.grad is not None else torch.zeros_like(w))
            g = torch.stack(rank_grads).sum(0) / d
            w -= 0.1 * g
            steps.append(seen)
            grads.append(g)
        states = {str(s.state_dict()) for s in samplers}
        assert len(states) == 1  # every rank holds the same position
        state = samplers[0].state_dict()
    return steps, grads


def test_size_changes_mid_epoch_keep_order_samples_and_gradients() -> None:
    x, y = _data()
    want_steps, want_grads = _uninterrupted(x, y)
    # 4 -> 2 -> 3 -> 4 over one epoch: 2 steps at each size, the rest (and the short tail) at 4
    got_steps, got_grads = _elastic(x, y, [(4, 2), (2, 2), (3, 2), (4, 10)])
    assert len(got_steps) == len(want_steps) == 7
    # same samples in each global step (the global order), every sample of the epoch once
    assert [sorted(s) for s in got_steps] == [sorted(s) for s in want_steps]
    flat = [i for s in got_steps for i in s]
    assert sorted(flat) == list(range(N))
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (a, b)


def test_drop_last_skips_the_short_tail() -> None:
    s = ResumableSampler(N, num_replicas=1, rank=0, drop_last=True)
    eb = ElasticBatch(G, MB)
    n = 0
    while s.next_global_batch(eb, dp_size=3, dp_rank=0):
        n += 1
    assert n == N // G and s.state_dict()["consumed"] == N // G * G


def test_the_sampler_iterator_stays_exact_across_size_changes() -> None:
    """The DistributedSampler-like path: each phase's d ranks iterate a few rounds, the state goes through
    state_dict(); the samples taken, in lockstep order, are the epoch's permutation, each once."""
    order = ResumableSampler(N, num_replicas=1, rank=0, seed=5).permutation()
    state, taken = None, []
    for d, rounds in [(4, 3), (2, 4), (3, 2), (4, 100)]:
        samplers = [ResumableSampler(N, num_replicas=d, rank=r, seed=5) for r in range(d)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        its = [iter(s) for s in samplers]
        for _ in range(rounds):
            got = [next(it, None) for it in its]
            taken.extend(i for i in got if i is not None)
            if all(i is None for i in got):
                break
        state = samplers[0].state_dict()
        if state["consumed"] < N:  # mid-epoch every rank holds the same position (at the tail, rank 0 the end)
            assert all(s.state_dict() == state for s in samplers)
    assert taken == order and state["consumed"] == N


def test_the_sampler_defaults_to_the_launchers_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient import env

    # 8 ranks in replicas of 4 (--nodes-per-replica 2, 2 workers each): rank 6 is in replica 1 of 2
    layout = {"RANK": "6", "WORLD_SIZE": "8", env.DP_SIZE: "2", env.DP_RANK: "1", env.NODES_PER_REPLICA: "2"}
    for k, v in layout.items():
        monkeypatch.setenv(k, v)
    s = ResumableSampler(10)
    assert (s.num_replicas, s.rank) == (2, 1)
    monkeypatch.delenv(env.DP_SIZE)
    monkeypatch.delenv(env.DP_RANK)
    s = ResumableSampler(10)
    assert (s.num_replicas, s.rank) == (8, 6)  # outside resilient-run: the ranks, as DistributedSampler


# ------------------------------------------------------------------ the same, on a real gloo group with DDP

PHASES = [(4, 2), (2, 2), (3, 2), (4, 10)]  # (data-parallel size, steps): 4 -> 2 -> 3 -> 4 over the epoch


def _ddp_rank(rank: int, init: str, out: str) -> None:
    """One rank of 4. Each phase trains on a group of its first d ranks with DDP (fp64); between phases the
    state goes through a file as through a checkpoint: rank 0 saves the weights and the sampler's state_dict(),
    every rank of the next phase restores them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # 4 processes on a few cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    groups = {d: dist.new_group(list(range(d))) for d in sorted({d for d, _ in PHASES})}  # every rank makes each
    x, y = _data()
    eb = ElasticBatch(G, MB)
    ckpt = Path(out, "ckpt.pt")
    log: dict[str, list] = {"grads": [], "indices": []}
    model = torch.nn.Linear(DIM, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    sampler = ResumableSampler(N, num_replicas=1, rank=0, seed=3)
    for i, (d, n_steps) in enumerate(PHASES):
        if i:
            saved = torch.load(ckpt)
            model.weight.data.copy_(saved["w"])
            sampler = ResumableSampler(N, num_replicas=1, rank=0, seed=3)
            sampler.load_state_dict(saved["sampler"])
        if rank < d:
            ddp = DDP(model, process_group=groups[d])
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for _ in range(n_steps):
                plan = sampler.next_global_batch(eb, dp_size=d, dp_rank=rank)
                if not plan:
                    break
                opt.zero_grad()
                for m, mb in enumerate(plan):
                    idx = list(mb.indices)
                    with ddp.no_sync() if m < len(plan) - 1 else contextlib.nullcontext():
                        pred = ddp(x[idx]).squeeze(1)  # an empty micro-batch still runs, with a zero loss
                        (((pred - y[idx]) ** 2).sum() * mb.loss_scale).backward()
                log["indices"].append(idx_of(plan))
                log["grads"].append(model.weight.grad.squeeze(0).tolist())
                opt.step()
            if rank == 0:  # ranks past d sit this phase out (a dropped replica)
                torch.save({"w": model.weight.detach().clone(), "sampler": sampler.state_dict()}, ckpt)
        dist.barrier()  # the checkpoint is written before anyone restores it
    Path(out, f"{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


def idx_of(plan: list[MicroBatch]) -> list[int]:
    return [i for mb in plan for i in mb.indices]


@pytest.mark.timeout(180)
def test_ddp_over_size_changes_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    # one fresh interpreter imports torch and this module, then forks each rank: not one import per rank
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", __name__])  # DDP's first use imports torch._dynamo
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_ddp_rank, args=(r, init, str(tmp_path))) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * 4
    logs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    x, y = _data()
    want_steps, want_grads = _uninterrupted(x, y)
    # rank 0 trains in every phase: its (all-reduced) gradient is the step's
    assert len(logs[0]["grads"]) == len(want_grads) == 7
    for got, want in zip(logs[0]["grads"], want_grads):
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-12), (got, want)
    # each step's samples, over the ranks that trained in it: the uninterrupted step's, every sample once
    sizes = [d for d, n in PHASES for _ in range(n)][:7]
    pos = [0] * 4
    seen = []
    for step, d in enumerate(sizes):
        taken = []
        for r in range(d):
            taken.extend(logs[r]["indices"][pos[r]])
            pos[r] += 1
        assert sorted(taken) == sorted(want_steps[step])
        seen.extend(taken)
    assert sorted(seen) == list(range(N)) and pos == [len(lg["indices"]) for lg in logs]
