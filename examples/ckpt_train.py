"""A small deterministic training job with resilient checkpointing.

Run it alone, under torchrun, or under resilient-run (which sets RESILIENT_CKPT_*):

    python examples/ckpt_train.py --steps 40 --local /tmp/ckpt --out /tmp/result
    resilient-run --nproc-per-node 2 --ckpt-local /tmp/ckpt examples/ckpt_train.py --steps 40 --out /tmp/r

Every rank draws its batch from its own generator (a per-rank RNG saved in the checkpoint) and keeps
its own data position, so a resumed run is bit-exact with an uninterrupted one only if per-rank state
comes back per rank. At the end each rank writes ``<out>/rank<r>.pt`` with the model, the optimizer
state, its RNG state and its data position.

Fault injection for tests goes through ``resilient.drill`` (``RESILIENT_FAULTS``, see
``plan_env``): checkpoint-phase faults (``kill-after-save``, ``kill-mid-write``, ``kill-mid-upload``,
``lose-disk``) and the per-step ones (``kill``, ``stop``, ``raise``, ...), each for one rank, step and attempt.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


class RankRNG:
    """A per-rank generator: its state differs on every rank, the checkpoint must keep each one."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["state"])


class DataPos:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["pos"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True, help="directory for the final per-rank state files")
    ap.add_argument("--local", default=None, help="local tier (default: $RESILIENT_CKPT_LOCAL)")
    ap.add_argument("--persistent", default=None)
    ap.add_argument("--interval", default=None)
    ap.add_argument("--persistent-every", default=None)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--snapshot-budget", type=float, default=None,
                    help="share of step time a snapshot in node memory may cost (sets --ckpt-snapshot auto's cadence)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--settle-before", type=int, default=None, metavar="STEP",
                    help="before STEP, wait until no save is in flight (a planned fault then comes between saves)")
    ap.add_argument("--ddp", action="store_true",
                    help="wrap in DDP (bit-exact resume only up to 2 ranks: DDP rebuilds its gradient buckets "
                         "after the first iteration of each process, which changes gloo's summation order)")
    ap.add_argument("--ddp-exact", action="store_true",
                    help="with --ddp: sum gradients in rank order (resilient.ddp.make_exact): bit-exact at any size")
    args = ap.parse_args(argv)

    from resilient.checkpoint.save.manager import CheckpointManager
    from resilient import drill as faults

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(1234)  # same initial model on every rank
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.BatchNorm1d(args.hidden),
                                torch.nn.ReLU(), torch.nn.Linear(args.hidden, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() and args.ddp else model
    if args.ddp_exact and ddp is not model:
        from resilient.ddp import make_exact

        make_exact(ddp)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng, data = RankRNG(1000 + rank), DataPos()
    state = {"model": model, "optim": optim, "rng": rng, "data": data}

    overrides = {k: v for k, v in {"local": args.local, "persistent": args.persistent,
                                   "interval": args.interval, "persistent_every": args.persistent_every,
                                   "snapshot_budget": args.snapshot_budget}.items()
                 if v is not None}
    if args.overlap:
        overrides["overlap"] = True
    ck = CheckpointManager.from_env(**overrides)
    start = ck.restore(state)

    faults.arm_checkpoint_faults(ck)
    for step in range(start, args.steps):
        x = torch.randn(8, 16, generator=rng.gen)
        y = torch.randn(8, 4, generator=rng.gen)
        data.pos += 8
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optim.zero_grad()
        loss.backward()
        if dist.is_initialized() and not args.ddp:
            # one flat all-reduce in a fixed layout: the same summation order in every attempt
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        optim.step()
        ck.save(step, state)
        faults.after_save(step, ck)
        faults.maybe_fail(step)
        if step + 1 == args.settle_before:
            faults.settle(ck)
    ck.wait()
    ck.close()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "rng": rng.gen.get_state(),
                "pos": data.pos, "start": start, "restore": vars(ck.last_restore) if ck.last_restore else None},
               out / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
