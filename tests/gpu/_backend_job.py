"""A small training job whose default process group has the backend the command line names, checkpointed by
``CheckpointManager``: the job behind the communicator checks (a job whose main backend is NCCL keeps the
checkpointer's traffic on gloo groups of its own, over host memory).

The same script runs on a GPU (``--device cuda --backend cuda:nccl,cpu:gloo``, ``tests/gpu/test_nccl_job.py``)
and on CPU (``--device cpu --backend cpu:gloo``, or ``--backend cuda:gloo``: a default group that, like a
plain NCCL one, has no backend for host tensors, so any of our collectives that strayed onto it would fail;
``tests/checkpoint/test_backend_string.py``). Only the device differs.

    --device cuda|cpu     where the model and optimizer state live
    --backend STR         the default group's backend string (``init_process_group(STR)``)
    --ddp                 wrap the model in DDP: the gradients go over the default group (NCCL on a GPU)
    --steps N --out DIR   train N steps; per-rank records in ``DIR/rank<r>.jsonl``
    --local DIR --persistent URL --interval N   tiers and interval (default: the launcher's)

Records, one JSON line each: ``groups`` (the default group's backend and those of the checkpointer's own
groups), ``save`` (the step and a SHA-256 digest of the model and optimizer state that step saved),
``restore`` (the restored step and the digest of the state right after ``restore``), ``done``. A test
compares a restore's digest with the save's digest of the same step: equal means bit-exact.
Every rank trains the same replica on the same data (with ``--ddp`` the gradients are averaged as well),
so that no state of this job is a per-rank value.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes (host copies), model then optimizer state."""
    h = hashlib.sha256()

    def add(name: str, v: Any) -> None:
        h.update(name.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous().reshape(-1)  # a 0-d tensor (AdamW's step) has no byte view
            h.update(f"{t.dtype}{tuple(v.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())

    for k, v in sorted(model.state_dict().items()):
        add(f"model.{k}", v)
    for i, st in sorted(optim.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            add(f"optim.{i}.{k}", v)
    return h.hexdigest()


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 1)  # the same batch on every rank and in every attempt
    return torch.randn(16, 64, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local", default=None)
    ap.add_argument("--persistent", default=None)
    ap.add_argument("--interval", default=None)
    ap.add_argument("--persistent-every", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"rank{rank}.jsonl", "a")

    def record(event: str, **kw: Any) -> None:
        log.write(json.dumps({"event": event, "rank": rank, "attempt": attempt, **kw}) + "\n")
        log.flush()

    import resilient
    from resilient import drill as faults

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(device)
    net: torch.nn.Module = model
    if args.ddp:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda"
                                                        else None)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    overrides = {k: v for k, v in {"local": args.local, "persistent": args.persistent, "interval": args.interval,
                                   "persistent_every": args.persistent_every}.items() if v is not None}
    ck = resilient.CheckpointManager.from_env(**overrides)
    # the checkpointer's own groups (private attributes: read here only to show which backend carries them)
    record("groups", default=str(dist.get_backend()),
           ours=str(dist.get_backend(ck._pg)) if ck._pg is not None else None,
           upload=str(dist.get_backend(ck._pg_up)) if ck._pg_up is not None else None)
    start = ck.restore(state)
    if start > 0:
        record("restore", step=start - 1, digest=digest(model, optim),
               tier=ck.last_restore.tier if ck.last_restore else None)
    faults.arm_checkpoint_faults(ck)
    steps = resilient.steps(start, args.steps) if os.environ.get("TORCHELASTIC_RUN_ID") else range(start, args.steps)
    for step in steps:
        x, y = batch(step, device)
        loss = torch.nn.functional.mse_loss(net(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if ck.save(step, state):
            record("save", step=step, digest=digest(model, optim))
        faults.after_save(step, ck)
    if not ck.wait(timeout=120, upload_timeout=120):
        raise SystemExit("checkpoint saves did not finish within 120 s")
    ck.close()
    record("done", steps=args.steps, start=start)
    log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
