"""A small job on the real stack: resilient.steps, CheckpointManager (local tier), gloo. Faults come from
``RESILIENT_FAULTS`` (resilient.testing.faults), carried out by resilient.steps. Used to check the goodput
report against real checkpointer events."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import resilient


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}
    ckpt = resilient.CheckpointManager.from_env()
    start = ckpt.restore(state)
    for step in resilient.steps(start, int(os.environ.get("STEPS", "30"))):
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        ckpt.save(step, state)
    ckpt.close(timeout=60)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
