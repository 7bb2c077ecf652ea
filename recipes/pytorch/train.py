"""A small GPT trained on the shipped corpus, written the way the README tells users to write training code.

    resilient-run --standalone --nproc-per-node 2 --max-restarts 5 recipes/pytorch/train.py --steps 200
    resilient-run ... --ckpt-local /mnt/localssd/ckpt --ckpt-persistent gs://bucket/run recipes/pytorch/train.py

What it shows, each a few lines:
* ``CheckpointManager.from_env()``: tiers from the launcher's flags (with none, a local tier under the run
  directory); ``restore`` before the loop, ``save`` every step (it saves when the interval says so);
* ``resilient.steps``: heartbeats, step times and goodput records; hang and straggler detection;
* ``ResumableSampler``: the data position is checkpoint state; after a restart, or a change of world size,
  training continues with exactly the samples not yet seen;
* ``on_scale``: when the job shrinks (a lost node, no spare) or grows back, gradient accumulation keeps the
  global batch, and the learning rate follows the global batch if accumulation cannot make it whole.

Data parallelism is DDP by default; ``--fsdp`` shards with FSDP2 (``fully_shard``) instead, and ``--tp N``
(with ``--fsdp``) adds tensor parallelism of each block's MLP over groups of N ranks, data parallelism over
the rest (a 2-D ``("dp", "tp")`` mesh, as torchtitan lays it out). Under FSDP2 and TP the state is
``DTensor``s, checkpointed and restored like plain tensors. It runs unchanged under ``python`` (one process),
``torchrun`` and ``resilient-run``.

``--compile`` runs the model under ``torch.compile`` and keeps its compile caches in the run directory
(``resilient.compile_cache``), so a restarted worker loads what the first attempt compiled instead of compiling
it again. ``BENCH_TIMELINE=FILE`` (benchmarks only) appends when each phase of start-up ended, one JSON line each.
"""

from __future__ import annotations

import json
import os
import time

_TIMELINE = os.environ.get("BENCH_TIMELINE")


def _mark(what: str, sync: object = None) -> None:
    """Benchmarks only: when a phase of start-up ended (wall clock); nothing at all without BENCH_TIMELINE."""
    if not _TIMELINE:
        return
    if sync is not None:
        sync()  # queued GPU work belongs to the phase that queued it
    rec = {"mark": what, "t": time.time(), "pid": os.getpid(),
           "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    if what == "script":
        try:  # when this process was created: its age from the kernel's start time (clock ticks since boot)
            start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
            age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
            rec["created"] = rec["t"] - age
        except (OSError, ValueError, IndexError):
            pass
    fd = os.open(_TIMELINE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


_mark("script")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import resilient  # noqa: E402
from resilient.data import ResumableSampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import GPT, CorpusWindows, GPTConfig, load_corpus  # noqa: E402

_mark("imports")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, whole job")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward on one rank")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate at --global-batch")
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism of the MLPs over this many ranks (with --fsdp; FSDP2 over the rest)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds a step (stands in for a bigger model)")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    ap.add_argument("--d-model", type=int, default=GPTConfig.d_model)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model; its compile caches survive restarts (resilient.compile_cache)")
    ap.add_argument("--init-group", action="store_true",
                    help="set up the process group even at world size 1 (as every rank of a multi-node job does)")
    a = ap.parse_args()
    for name in ("steps", "global_batch", "micro_batch", "log_every", "tp"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.tp > 1 and not a.fsdp:
        ap.error(f"--tp {a.tp} needs --fsdp: DDP does not take tensor-parallel (DTensor) parameters")
    return a


def accumulation(global_batch: int, micro_batch: int, world: int) -> tuple[int, float]:
    """Micro-batches per rank per step, and the learning-rate factor when the global batch cannot be kept."""
    accum = max(1, round(global_batch / (micro_batch * world)))
    return accum, (accum * micro_batch * world) / global_batch


def main() -> int:
    args = parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (args.init_group and "RANK" in os.environ)
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        _mark("group")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if world % args.tp:
        print(f"[train] --tp {args.tp} does not divide the world size {world}", file=sys.stderr, flush=True)
        return 2
    dp, dp_rank = world // args.tp, rank // args.tp  # data parallelism outermost, as init_device_mesh lays it out
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()  # at once rather than inside the first .to(device): the same work, measured apart
        _mark("cuda")

    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model)
    model = GPT(cfg).to(device)
    if distributed and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            if args.tp > 1:
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        wrapped = fully_shard(model, mesh=mesh["dp"])
    elif distributed:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = model
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gpu_sync = torch.cuda.synchronize if device.type == "cuda" else None
    cc = None
    if args.compile:
        from resilient import compile_cache

        cc = compile_cache.enable()  # before anything compiles; None outside resilient-run
        forward = torch.compile(wrapped)
    else:
        forward = wrapped
    _mark("model", gpu_sync)

    data = CorpusWindows(load_corpus(), cfg.seq_len)
    # the ranks of one tensor-parallel group see the same samples
    sampler = ResumableSampler(data, num_replicas=dp, rank=dp_rank, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=0)
    accum, lr_factor = accumulation(args.global_batch, args.micro_batch, dp)
    for g in optim.param_groups:
        g["lr"] = args.lr * lr_factor

    @resilient.on_scale
    def rescale(ev: resilient.ScaleEvent) -> None:
        # a lost node with no spare (or a node back): keep the global batch through accumulation
        nonlocal accum
        accum, factor = accumulation(args.global_batch, args.micro_batch, ev.new_dp_size)
        for g in optim.param_groups:
            g["lr"] = args.lr * factor
        if rank == 0:
            print(f"[train] world {ev.old_world_size} -> {ev.new_world_size}: accumulation {accum}, "
                  f"lr {args.lr * factor:.2e}", flush=True)

    ckpt = resilient.CheckpointManager.from_env()
    state = {"model": model, "optim": optim, "sampler": sampler}
    start = ckpt.restore(state)
    _mark("restored", gpu_sync)
    if rank == 0:
        kind = (f"FSDP2 x TP (dp {dp}, tp {args.tp})" if args.tp > 1 else "FSDP2") if args.fsdp else "DDP"
        print(f"[train] world {world}, {kind if distributed else 'single process'}, "
              f"{sum(p.numel() for p in model.parameters())} parameters, starting at step {start} "
              f"(epoch {sampler.epoch}, sample {sampler.consumed} of {len(data)})", flush=True)

    batches = iter(loader)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            return next(batches)

    loss_sum = torch.zeros((), device=device)
    for step in resilient.steps(start, args.steps, dp_size=dp):
        optim.zero_grad(set_to_none=True)
        loss_sum.zero_()
        for i in range(accum):
            x, y = (t.to(device) for t in next_batch())
            sync = i == accum - 1 or not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            ctx = wrapped.no_sync() if not sync else _null()
            with ctx:
                logits = forward(x)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / accum
                loss.backward()
            loss_sum += loss.detach()
        optim.step()
        if step - start < 4:
            _mark("step", gpu_sync)
            if cc is not None:  # what the first steps compiled, before their checkpoints: a restart finds it
                cc.maybe_save()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ckpt.save(step, state)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[train] step {step} loss {loss_sum.item():.4f}", flush=True)
    ckpt.wait(timeout=300)
    ckpt.close()
    if rank == 0:
        print(f"[train] done at step {args.steps}: loss {loss_sum.item():.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
