"""A small but real data-parallel training job, written the way users write theirs.

It trains a 2-layer MLP classifier with DDP (gloo on CPU, NCCL on GPU) on a synthetic but learnable
task, checkpoints through ``resilient.CheckpointManager`` (tiers from the launcher's flags), reports
progress through ``resilient.steps`` and rescales the learning rate when the world size changes.

    resilient-run --standalone --nproc-per-node 2 --ckpt-local /tmp/ckpt --ckpt-interval 20 \\
        examples/train.py --steps 300

It also runs unchanged under plain torchrun or ``python examples/train.py`` (one process).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import resilient


class Batches:
    """Deterministic synthetic data, sharded by rank, with a resumable position (a Stateful)."""

    def __init__(self, rank: int, world: int, batch: int, dim: int, classes: int):
        self.rank, self.world, self.batch, self.dim = rank, world, batch, dim
        g = torch.Generator().manual_seed(0)
        self.teacher = torch.randn(dim, classes, generator=g)
        self.pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.pos * self.world + self.rank)
        x = torch.randn(self.batch, self.dim, generator=g)
        y = (x @ self.teacher).argmax(dim=1)
        self.pos += 1
        return x, y

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["pos"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (stands in for a bigger model)")
    args = ap.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr * world)
    data = Batches(rank, world, args.batch, args.dim, 10)

    @resilient.on_scale
    def rescale(ev: resilient.ScaleEvent) -> None:
        # linear scaling rule: keep the per-sample learning rate when data parallelism changes
        for group in optim.param_groups:
            group["lr"] = args.lr * ev.new_world_size

    ckpt = resilient.CheckpointManager.from_env() if os.environ.get("RESILIENT_CKPT_LOCAL") else None
    state = {"model": model, "optim": optim, "data": data}
    start = ckpt.restore(state) if ckpt else 0
    if rank == 0:
        print(f"[train] world={world} starting at step {start}", flush=True)

    loss = torch.zeros(())
    for step in resilient.steps(start, args.steps):
        x, y = data.next()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if ckpt:
            ckpt.save(step, state)
        if rank == 0 and step % 50 == 0:
            print(f"[train] step {step} loss {loss.item():.4f}", flush=True)
    if ckpt:
        ckpt.wait(timeout=300)
        ckpt.close()
    if rank == 0:
        print(f"[train] done: final loss {loss.item():.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
