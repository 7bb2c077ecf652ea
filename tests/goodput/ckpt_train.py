"""A small job on the real stack: resilient.steps, CheckpointManager (local tier), gloo. Faults come from
``RESILIENT_FAULTS`` (resilient.drill), carried out by resilient.steps. Used to check the goodput
report against real checkpointer events.

``STATE_MB`` adds a buffer of that many MiB to the saved state (a larger save, so its background write
competes with the steps); ``CALIB_STEPS`` steps are taken before the first save (a clean reference when
every later step saves); ``HIDDEN``/``BATCH`` size the step's work."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import resilient


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    hidden, batch = int(os.environ.get("HIDDEN", "32")), int(os.environ.get("BATCH", "8"))
    model = torch.nn.Linear(hidden, hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}
    mb = float(os.environ.get("STATE_MB", "0"))
    if mb > 0:
        state["extra"] = {"buf": torch.randn(int(mb * (1 << 20)) // 4)}
    calib = int(os.environ.get("CALIB_STEPS", "0"))
    ckpt = resilient.CheckpointManager.from_env()
    start = ckpt.restore(state)
    for step in resilient.steps(start, int(os.environ.get("STEPS", "30"))):
        loss = model(torch.randn(batch, hidden)).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        if step >= calib:
            ckpt.save(step, state)
    ckpt.close(timeout=60)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
