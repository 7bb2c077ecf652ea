"""A deterministic data-parallel job for multi-node tests: checkpoints every step, pauses at a gate.

``--gate DIR --gate-step S [S2 ...]``: once the save of step S is complete on every tier, each rank writes
``DIR/at-<rank>`` and waits (bounded) for ``DIR/go`` (for later gate steps: ``at-S2-<rank>``, ``go-S2``): the test kills a node exactly there, mid-run, with a
known newest checkpoint. The gate is passed once per run (a restored run starts after S).
At the end each rank writes ``<out>/rank<r>.pt`` (model, optimizer, RNG, data position) and, when the world
changed, a line in ``<out>/scale.jsonl`` for each ``on_scale`` call; ``<out>/rows-<rank>.jsonl`` lists the
sample indices each step consumed.

``--gate-on-resume``: a run restored right after a gate step waits at that gate too (before its first step),
so that a gate is never skipped whatever step a fault made the job restore.
``--fsdp``: the model sharded over every rank by FSDP2 (``fully_shard``: parameters and optimizer moments are
``Shard(0)`` DTensors, gradients reduce-scattered); ``rank<r>.pt`` then holds each rank's local shards.
``--replay SCHEDULE``: no process group; replays a JSON list of steps ``{"step", "world", "idx": [rank0 rows,
rank1 rows, ...]}`` in one process with the same arithmetic as the ranks' (per-rank gradients summed in rank
order, divided by the world size) and writes ``<out>/replay.pt``: the state a job with that world-size
schedule must end with, bit for bit.
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
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.data import ResumableSampler


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gate", default=None)
    ap.add_argument("--gate-step", type=int, nargs="*", default=[4])
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend work per step")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--gate-on-resume", action="store_true")
    ap.add_argument("--replay", default=None, help="JSON schedule to replay in this process (no process group)")
    ap.add_argument("--fsdp", action="store_true", help="shard the model over every rank with FSDP2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replay:
        return replay(args, out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, optim, table = build(args, world if args.fsdp else 0)
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

    def gate_wait(step: int) -> None:
        gate = Path(args.gate)
        tag = "" if step == args.gate_step[0] else f"-{step}"
        # written whole, then renamed: the tests read the pid as soon as the name exists
        tmp = gate / f".at{tag}-{rank}.tmp"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, gate / f"at{tag}-{rank}")
        deadline = time.monotonic() + 120
        while not (gate / f"go{tag}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    if args.gate and args.gate_on_resume and start - 1 in args.gate_step:
        gate_wait(start - 1)  # restored at a gate step: the gate still holds this attempt
    for step in resilient.steps(start, args.steps):
        idx = [next(it) for _ in range(batch)]
        with open(out / f"rows-{rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": step, "world": world, "rank": rank, "idx": idx}) + "\n")
        x, y = table[idx, :16], table[idx, 16:]
        if args.fsdp:
            local_grad(model, x, y)  # FSDP2 reduce-scatters the mean gradient into each rank's shard
            optim.step()
        else:
            flat = local_grad(model, x, y)
            dist.all_reduce(flat)
            flat /= world
            apply_grad(model, optim, flat)
        ck.save(step, state)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.gate and step in args.gate_step:
            ck.wait()
            gate_wait(step)
    ck.wait()
    ck.close()
    torch.save({"model": _local(model.state_dict()), "optim": _local(optim.state_dict()), "start": start,
                "restore": vars(ck.last_restore) if ck.last_restore else None}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _local(v):
    """``v`` with each DTensor as its local shard (a plain tensor, comparable with ``torch.equal``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.to_local().clone()
    if isinstance(v, dict):
        return {k: _local(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_local(x) for x in v]
    return v


def build(args: argparse.Namespace, fsdp_world: int = 0):
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if fsdp_world:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (fsdp_world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the data set is a fixed table; the sampler decides which rows each rank sees
    table = torch.randn(args.samples, 20, generator=torch.Generator().manual_seed(7))
    return model, optim, table


def local_grad(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's gradient, flattened (the buffer the ranks all-reduce)."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    for p in model.parameters():
        p.grad = None  # what optim.zero_grad() does
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def apply_grad(model: torch.nn.Module, optim: torch.optim.Optimizer, flat: torch.Tensor) -> None:
    off = 0
    for p in model.parameters():
        p.grad.copy_(flat[off:off + p.grad.numel()].view_as(p.grad))
        off += p.grad.numel()
    optim.step()


def replay(args: argparse.Namespace, out: Path) -> int:
    model, optim, table = build(args)
    schedule = json.loads(Path(args.replay).read_text())
    for i, s in enumerate(schedule):
        if s["step"] != i or len(s["idx"]) != s["world"]:
            raise SystemExit(f"replay: step {i} of the schedule is malformed: {s}")
        grads = [local_grad(model, table[idx, :16], table[idx, 16:]) for idx in s["idx"]]
        flat = grads[0].clone()
        for g in grads[1:]:
            flat += g  # two ranks: a + b, as the all-reduce adds them (addition of two commutes exactly)
        flat /= s["world"]
        apply_grad(model, optim, flat)
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "steps": len(schedule)}, out / "replay.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
