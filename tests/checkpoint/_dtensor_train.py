"""A small deterministic job whose state is all or partly ``DTensor``: FSDP2, tensor parallelism, both (2-D),
or HSDP, on gloo. Run by ``test_dtensor.py`` under its ``Workers`` fixture or under ``resilient-run``.

    --layout fsdp      FSDP2 (``fully_shard``) over every rank
    --layout tp        tensor parallelism over every rank (norms and the head stay plain tensors)
    --layout fsdp_tp   FSDP2 over ``dp`` x tensor parallelism over ``tp`` (``--tp``, default 2)
    --layout hsdp      HSDP: replicated over 2 groups, sharded inside each

Each block has a LayerNorm (weight and bias) and two Linear layers with biases: small tensors, which every
real model has. The data of a step is drawn from a generator seeded by the step and the data-parallel rank,
so a resumed run sees what an uninterrupted one saw. At the end each rank writes ``<out>/rank<r>.pt`` with
the full (gathered) model and optimizer state.

``--check-restore``: after training, restore the last step into a freshly built model and optimizer (other
initial weights), check that they equal the trained ones bit for bit, take one more step on both and check
again (the restored optimizer state must be placed like its parameters). ``--dcp-load DIR``: load the model
of a saved step with plain ``dcp.load`` only, never importing ``resilient``, and write it to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(n_layer)))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build(layout: str, tp: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The model parallelised by ``layout``, its optimizer, and this rank's data-parallel index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)  # the same full weights on every rank, before sharding
    model = Net()
    dp_rank = rank
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for b in model.blocks:
            parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_rank = 0
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise SystemExit(f"--layout: unknown {layout!r}")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim, dp_rank


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def _full(v: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.full_tensor().detach().clone()  # collective: every rank calls it in the same order
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def full_state(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": {k: _full(v) for k, v in model.state_dict().items()}}
    if optim is not None:
        sd = optim.state_dict()["state"]
        out["optim"] = {i: {k: _full(v) for k, v in st.items()} for i, st in sorted(sd.items())}
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = [f"model.{k}" for k, v in a["model"].items()
           if not (isinstance(b["model"].get(k), torch.Tensor) and torch.equal(v, b["model"][k]))]
    for i, st in a.get("optim", {}).items():
        for k, v in st.items():
            w = b.get("optim", {}).get(i, {}).get(k)
            if not (isinstance(w, torch.Tensor) and torch.equal(v, w)):
                bad.append(f"optim.{i}.{k}")
    return bad


def dcp_load(args: argparse.Namespace) -> int:
    """A user's own ``dcp.load`` of a saved step: nothing of ``resilient`` is imported."""
    import torch.distributed.checkpoint as dcp

    model, _, _ = build(args.layout, args.tp, seed=99)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=args.dcp_load)
    model.load_state_dict(sd["model"])
    loaded = full_state(model, None)
    assert "resilient" not in sys.modules, sorted(m for m in sys.modules if m.startswith("resilient"))
    if dist.get_rank() == 0:
        torch.save(loaded, Path(args.out) / "loaded.pt")
    print(f"[dtensor] rank {dist.get_rank()} dcp.load ok; resilient imported: {'resilient' in sys.modules}",
          flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=("fsdp", "tp", "fsdp_tp", "hsdp"), required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local", default=None, help="local tier (default: the launcher's)")
    ap.add_argument("--persistent", default=None)
    ap.add_argument("--interval", default=None)
    ap.add_argument("--persistent-every", default=None)
    ap.add_argument("--settle-before", type=int, default=None, metavar="STEP",
                    help="before STEP, wait until no save is in flight (a planned fault then comes between saves)")
    ap.add_argument("--check-restore", action="store_true")
    ap.add_argument("--dcp-load", default=None, metavar="DIR")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dcp_load:
        rc = dcp_load(args)
        dist.destroy_process_group()
        # A plain torch process with DTensor state must not end through interpreter finalisation: DTensor's caches
        # keep the DeviceMesh, and with it the mesh's gloo groups and their threads, alive past
        # destroy_process_group(), and a gloo thread that releases a finished all-gather's tensors after shutdown
        # began takes the GIL, is ended by CPython with pthread_exit, and aborts the process (a core dump:
        # ~AsyncAllgatherCoalescedWork -> decref_pyobject -> take_gil -> pthread_exit -> std::terminate). resilient-run's
        # workers skip finalisation; this run never imports resilient, so it skips it itself (Known limits).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)

    import resilient
    from resilient import drill as faults

    rank = dist.get_rank()
    model, optim, dp_rank = build(args.layout, args.tp, seed=0)
    state = {"model": model, "optim": optim}
    overrides = {k: v for k, v in {"local": args.local, "persistent": args.persistent, "interval": args.interval,
                                   "persistent_every": args.persistent_every}.items() if v is not None}
    ck = resilient.CheckpointManager.from_env(**overrides)
    start = ck.restore(state)
    print(f"[dtensor] rank {rank} {args.layout} starting at step {start}", flush=True)
    faults.arm_checkpoint_faults(ck)
    # under resilient-run: heartbeats and step records; alone (the test's own ranks): a plain loop
    steps = resilient.steps(start, args.steps) if os.environ.get("TORCHELASTIC_RUN_ID") else range(start, args.steps)
    for step in steps:
        train_step(model, optim, step, dp_rank)
        ck.save(step, state)
        faults.after_save(step, ck)
        if step + 1 == args.settle_before:  # a step's planned fault fires as the loop hands out that step
            faults.settle(ck)
    if not ck.wait(timeout=120, upload_timeout=120):  # the last step's upload too: the tests read it back
        raise SystemExit("checkpoint saves and uploads did not finish within 120 s")
    trained = full_state(model, optim)
    rc = 0
    if args.check_restore:
        model2, optim2, _ = build(args.layout, args.tp, seed=1)
        assert differences(trained, full_state(model2, optim2)), "a fresh model must differ before the restore"
        got = ck.restore({"model": model2, "optim": optim2})
        assert got == args.steps, f"restored step {got - 1}, expected {args.steps - 1}"
        bad = differences(trained, full_state(model2, optim2))
        train_step(model, optim, args.steps, dp_rank)
        train_step(model2, optim2, args.steps, dp_rank)
        bad_after = differences(full_state(model, optim), full_state(model2, optim2))
        if bad or bad_after:
            print(f"[dtensor] rank {rank}: restored state differs: {bad[:8]}; after one more step: "
                  f"{bad_after[:8]}", flush=True)
            rc = 1
        else:
            print(f"[dtensor] rank {rank}: restore bit-exact ({len(trained['model'])} model tensors, "
                  f"{sum(len(s) for s in trained['optim'].values())} optimizer values; planned from "
                  f"{'its rank index' if 'index' in ck.last_restore.phases else '.metadata'})", flush=True)
    sender = ck._up.sender if ck._up is not None else None
    # whether this rank's uploads went from an upload process, and how often it died (the tests ask for it by env)
    upload_process = {"pid": sender.pid, "deaths": sender.deaths} if sender is not None else None
    ck.close()
    torch.save({**trained, "start": start, "restore": vars(ck.last_restore) if ck.last_restore else None,
                "upload_process": upload_process}, out / f"rank{rank}.pt")
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
