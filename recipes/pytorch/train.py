"""A small GPT trained on the shipped corpus, written the way the README tells users to write training code.

    resilient-run --standalone --nproc-per-node 2 --max-restarts 5 recipes/pytorch/train.py --steps 200
    resilient-run ... --ckpt-local /mnt/localssd/ckpt --ckpt-persistent gs://bucket/run recipes/pytorch/train.py

What it shows, each a few lines:
* ``CheckpointManager.from_env()``: tiers from the launcher's flags (with none, a local tier under the run
  directory); ``restore`` before the loop, ``save`` every step (it saves when the interval says so);
* ``resilient.steps``: heartbeats, step times and goodput records; hang and straggler detection;
* ``ResumableSampler``: the data position is checkpoint state; after a restart, or a change of world size,
  training continues with exactly the samples not yet seen;
* ``ElasticBatch``: every step trains on the same ``--global-batch`` samples, in the same order, whatever the
  data-parallel size: the size only changes how many micro-batches (gradient accumulation) each replica runs;
  each micro-batch's summed loss is scaled so the gradient is the uninterrupted run's;
* ``on_scale``: when the job shrinks (a lost node, no spare) or grows back, the global batch stays and so does
  the learning rate; ``lr_for`` is the rule for a run restarted with another global batch (linear or sqrt).

Data parallelism is DDP by default; ``--fsdp`` shards with FSDP2 (``fully_shard``) instead, and ``--tp N``
(FSDP2 implied) adds tensor parallelism of each block's MLP over groups of N ranks, data parallelism over
the rest (a 2-D ``("dp", "tp")`` mesh, as torchtitan lays it out). Under FSDP2 and TP the state is
``DTensor``s, checkpointed and restored like plain tensors. It runs unchanged under ``python`` (one process),
``torchrun`` and ``resilient-run``.

Replicas that span nodes (``resilient-run --nodes-per-replica K``): the mesh comes from
``resilient.topology().mesh(device, tp=N)``, with ``N`` the ranks of a replica (K nodes x their workers), so
tensor parallelism fills a replica and FSDP2 shards across the replicas; losing a node drops its replica and
the job goes on with fewer replicas, the same global batch and more accumulation steps:

    resilient-run --nnodes 2:4 --nproc-per-node 2 --nodes-per-replica 2 ... recipes/pytorch/train.py --tp 4

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
from resilient.data import ElasticBatch, ResumableSampler  # noqa: E402
from resilient.env import WorkerEnv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import GPT, CorpusWindows, GPTConfig, load_corpus  # noqa: E402

_mark("imports")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, whole job")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward on one rank")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate at --lr-batch sequences per step")
    ap.add_argument("--lr-batch", type=int, default=None,
                    help="the global batch --lr was tuned for (default: --global-batch); another --global-batch "
                         "scales it by --lr-scaling")
    ap.add_argument("--lr-scaling", choices=("linear", "sqrt", "none"), default="linear",
                    help="how the learning rate follows the global batch (linear: Goyal et al.; sqrt: for Adam)")
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw",
                    help="sgd: momentum 0.9; rounding differences stay rounding differences (AdamW's normalised "
                         "update turns a sign flip in a near-zero gradient into a full step)")
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism of the MLPs over this many ranks (FSDP2 over the rest); under "
                         "--nodes-per-replica, the ranks of a replica")
    ap.add_argument("--samples", type=int, default=0,
                    help="train on the first N windows of the corpus only (0: all), so an epoch is a few steps")
    ap.add_argument("--record", action="store_true",
                    help="write each step's loss and the samples each replica trained on under RUN_DIR/recipe "
                         "(for tests and benches)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds a step (stands in for a bigger model)")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    ap.add_argument("--d-model", type=int, default=GPTConfig.d_model)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model; its compile caches survive restarts (resilient.compile_cache)")
    ap.add_argument("--init-group", action="store_true",
                    help="set up the process group even at world size 1 (as every rank of a multi-node job does)")
    a = ap.parse_args()
    a.lr_batch = a.global_batch if a.lr_batch is None else a.lr_batch
    for name in ("steps", "global_batch", "micro_batch", "log_every", "tp", "lr_batch"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.samples < 0:
        ap.error(f"--samples must be >= 0, got {a.samples}")
    a.fsdp = a.fsdp or a.tp > 1  # DDP does not take tensor-parallel (DTensor) parameters
    return a


def lr_for(args: argparse.Namespace, global_batch: int) -> float:
    """The learning rate for a global batch. A change of data-parallel size keeps the global batch (more or
    fewer accumulation steps), so it keeps the learning rate; only a run restarted with another
    ``--global-batch`` moves it: linearly with the batch (SGD, Goyal et al. 2017) or with its square root
    (Adam-type optimizers, Malladi et al. 2022)."""
    ratio = global_batch / args.lr_batch
    return args.lr * {"linear": ratio, "sqrt": ratio ** 0.5, "none": 1.0}[args.lr_scaling]


class RecipeInputError(ValueError):
    """A setting the job cannot run with (a mesh that does not fit, a global batch the data-parallel size cannot
    make). Under resilient-run it is raised, so the worker's error file names it and the supervisor stops the job
    at its second identical failure instead of restarting it until the budget is spent (the size that caused it
    may be one a scale-down chose); elsewhere it is one line and exit 2."""


def _bad_input(message: str) -> int:
    if WorkerEnv.from_env() is not None:
        raise RecipeInputError(message)
    print(f"[train] {message}", file=sys.stderr, flush=True)
    return 2


# The default process group, referenced from Python until main() has returned (see the end of this file). DDP's
# reducer holds the group too; were the reducer its last holder, the model freed as main() returns would destroy the
# group while holding the GIL, joining gloo's threads, and one of them may still need the GIL to free the tensors of
# the last collective: a deadlock (seen with gdb) that stalled about half of bench/goodput.py's fault-free torchrun
# runs, whose last step ends on a dcp.save; none in 10 runs since. Freed through its Python object, the group lets go
# of the GIL first (torch binds ProcessGroup with a holder that does).
_GROUP: list[object] = []


def main() -> int:
    args = parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (args.init_group and "RANK" in os.environ)
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        _GROUP.append(dist.group.WORLD)
        _mark("group")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    topo = resilient.topology()
    if topo.nodes_per_replica is not None:
        # a replica spans nodes: it holds the model-parallel ranks, and the replicas are the data parallelism
        try:
            topo.mesh_shape(tp=args.tp)
        except ValueError as e:
            return _bad_input(f"--tp {args.tp}: {e}")
        dp, dp_rank = topo.dp_size, topo.dp_rank
    else:
        if world % args.tp:
            return _bad_input(f"--tp {args.tp} does not divide the world size {world}")
        dp, dp_rank = world // args.tp, rank // args.tp  # data parallelism outermost, as init_device_mesh lays it out
    batch = ElasticBatch(args.global_batch, args.micro_batch)
    try:
        batch.check(dp)
    except ValueError as e:
        return _bad_input(str(e))
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

        if topo.nodes_per_replica is not None:
            mesh = topo.mesh(device.type, tp=args.tp)  # ("dp", "tp"): dp = the replicas there are now
        else:
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
    if args.optim == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
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
    n_samples = min(args.samples, len(data)) if args.samples else len(data)
    # the global order of the epoch; the ranks of one replica (tensor parallelism) take the same samples
    sampler = ResumableSampler(n_samples, num_replicas=dp, rank=dp_rank, seed=0)
    for g in optim.param_groups:
        g["lr"] = lr_for(args, args.global_batch)

    @resilient.on_scale
    def rescale(ev: resilient.ScaleEvent) -> None:
        # fewer or more replicas: ElasticBatch keeps the global batch (accumulation steps change), so the
        # learning rate stays what lr_for gives for it; a rule for another global batch would go here
        for g in optim.param_groups:
            g["lr"] = lr_for(args, args.global_batch)
        if rank == 0:
            print(f"[train] data-parallel size {ev.old_dp_size} -> {ev.new_dp_size} "
                  f"({getattr(ev, 'reason', None) or 'no reason given'}): {batch.accum_steps(ev.new_dp_size)} "
                  f"accumulation steps, global batch {args.global_batch}, lr {lr_for(args, args.global_batch):.2e}",
                  flush=True)

    ckpt = resilient.CheckpointManager.from_env()
    state = {"model": model, "optim": optim, "sampler": sampler}
    start = ckpt.restore(state)
    _mark("restored", gpu_sync)
    if rank == 0:
        kind = (f"FSDP2 x TP (dp {dp}, tp {args.tp})" if args.tp > 1 else "FSDP2") if args.fsdp else "DDP"
        print(f"[train] world {world}, {kind if distributed else 'single process'}, "
              f"{sum(p.numel() for p in model.parameters())} parameters, starting at step {start} "
              f"(epoch {sampler.epoch}, sample {sampler.consumed} of {n_samples}; data-parallel size {dp}, "
              f"{batch.accum_steps(dp)} accumulation steps of {args.micro_batch})", flush=True)
    record = Record.open(rank, world, dp, dp_rank) if args.record and distributed else None

    def step_batches() -> list:
        micro = sampler.next_global_batch(batch, dp, dp_rank)
        if not micro:  # the epoch is over: the next one, in its own order
            sampler.set_epoch(sampler.epoch + 1)
            micro = sampler.next_global_batch(batch, dp, dp_rank)
        return micro

    loss_sum = torch.zeros((), device=device)
    for step in resilient.steps(start, args.steps, dp_size=dp):
        optim.zero_grad(set_to_none=True)
        loss_sum.zero_()
        micro = step_batches()
        for i, mb in enumerate(micro):
            # an empty micro-batch (a size that does not divide the global batch) still runs: the gradient
            # collective needs every rank; its loss is zero
            idx = list(mb.indices) or [0]
            x = torch.stack([data[j][0] for j in idx]).to(device)
            y = torch.stack([data[j][1] for j in idx]).to(device)
            sync = i == len(micro) - 1 or not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            ctx = wrapped.no_sync() if not sync else _null()
            with ctx:
                logits = forward(x)
                per_sample = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view(len(idx), -1).mean(1)
                # the summed loss times dp/global_batch: averaged over the replicas, the global batch's mean
                loss = per_sample.sum() * (mb.loss_scale if not mb.empty else 0.0)
                loss.backward()
            loss_sum += loss.detach() / dp
        optim.step()
        if distributed:  # the global batch's mean loss, the same at every size (every replica's share summed)
            dist.all_reduce(loss_sum)
            loss_sum /= world // dp  # the ranks of one replica hold the same share
        if record is not None:
            record.step(step, loss_sum.item(), [j for mb in micro for j in mb.indices])
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


class Record:
    """``--record``: RUN_DIR/recipe/loss.jsonl (rank 0: each step's loss) and samples-dp{R}.jsonl (the first rank
    of each replica: the samples it trained on), each line tagged with the attempt (rank 0's start time, the
    same on every rank of an attempt), so a step redone after a restore is read from its last attempt."""

    def __init__(self, rank: int, dp: int, dp_rank: int, attempt: float, loss: Path | None, samples: Path | None):
        self.rank, self.dp, self.dp_rank, self.attempt = rank, dp, dp_rank, attempt
        self.loss, self.samples = loss, samples

    @classmethod
    def open(cls, rank: int, world: int, dp: int, dp_rank: int) -> Record:
        from resilient import env

        d = Path(os.environ[env.RUN_DIR]) / "recipe"
        d.mkdir(parents=True, exist_ok=True)
        t = torch.tensor([time.time()], dtype=torch.float64)
        dist.broadcast(t, 0)
        first_of_replica = rank % (world // dp) == 0
        return cls(rank, dp, dp_rank, float(t.item()), d / "loss.jsonl" if rank == 0 else None,
                   d / f"samples-dp{dp_rank}.jsonl" if first_of_replica else None)

    def step(self, step: int, loss: float, indices: list[int]) -> None:
        base = {"step": step, "attempt": self.attempt, "dp_size": self.dp, "t": time.time()}
        if self.loss is not None:
            _append(self.loss, {**base, "loss": loss})
        if self.samples is not None:
            _append(self.samples, {**base, "dp_rank": self.dp_rank, "samples": indices})


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    code = main()
    _GROUP.clear()  # the model is gone with main()'s frame: the group is freed here, without the GIL (see _GROUP)
    sys.exit(code)
