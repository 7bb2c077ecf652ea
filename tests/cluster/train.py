"""A deterministic data-parallel job for multi-node tests: checkpoints every step, pauses at a gate.

``--gate DIR --gate-step S [S2 ...]``: once the save of step S is complete on every tier, each rank writes
``DIR/at-<rank>`` and waits (bounded) for ``DIR/go`` (for later gate steps: ``at-S2-<rank>``, ``go-S2``): the test kills a node exactly there, mid-run, with a
known newest checkpoint. The gate is passed once per run (a restored run starts after S).
At the end each rank writes ``<out>/rank<r>.pt`` (model, optimizer, RNG, data position) and, when the world
changed, a line in ``<out>/scale.jsonl`` for each ``on_scale`` call; ``<out>/rows-<rank>.jsonl`` lists the
sample indices each step consumed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import resilient
from resilient.checkpoint.manager import CheckpointManager
from resilient.data import ResumableSampler


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gate", default=None)
    ap.add_argument("--gate-step", type=int, nargs="*", default=[4])
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend work per step")
    ap.add_argument("--samples", type=int, default=4096)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the data set is a fixed table; the sampler decides which rows each rank sees
    table = torch.randn(args.samples, 20, generator=torch.Generator().manual_seed(7))
    sampler = ResumableSampler(args.samples, num_replicas=world, rank=rank, shuffle=True, seed=3)

    def scaled(ev) -> None:
        with open(out / "scale.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "rank": rank, "old": ev.old_world_size,
                                "new": ev.new_world_size}) + "\n")

    resilient.on_scale(scaled)
    state = {"model": model, "optim": optim, "sampler": sampler}
    ck = CheckpointManager.from_env(interval="1")
    start = ck.restore(state)
    batch = 8
    it = iter(sampler)
    for step in resilient.steps(start, args.steps):
        idx = [next(it) for _ in range(batch)]
        with open(out / f"rows-{rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": step, "world": world, "rank": rank, "idx": idx}) + "\n")
        x, y = table[idx, :16], table[idx, 16:]
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        optim.step()
        ck.save(step, state)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.gate and step in args.gate_step:
            ck.wait()
            gate = Path(args.gate)
            tag = "" if step == args.gate_step[0] else f"-{step}"
            (gate / f"at{tag}-{rank}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while not (gate / f"go{tag}").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    ck.wait()
    ck.close()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "start": start,
                "restore": vars(ck.last_restore) if ck.last_restore else None}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
