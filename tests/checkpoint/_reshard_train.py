"""A job whose state is all ``DTensor`` (FSDP2 over ``dp``, optionally tensor parallelism over ``tp`` inside a
replica), run at one data-parallel size, then restored at another. Run by ``test_reshard.py`` under its
``Workers`` fixture (each "node" its own local tier: ``--local .../node{node}``).

The mesh is ``("dp", "tp")`` with dp outermost (a replica's ranks consecutive: rank // tp is the dp rank), or
a 1-D ``("dp",)`` mesh without ``--tp``. Each block has a LayerNorm and two Linear layers with biases (small
DTensors beside the large weights). After a restore, rank 0 writes the full (gathered) state it restored to
``<out>/restored.pt`` and compares it with ``--expect`` (the full state the previous run saved last): every
parameter and optimizer value must be equal. Each rank writes ``<out>/rank<r>.json``: the step it started at,
the sources of its files, what the restore read (``resharded``). After training, rank 0 writes the full
state of the last saved step to ``<out>/saved.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build(d: int, n: int, tp: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = Net(d, n)
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for b in model.blocks:
            fully_shard(b, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim, dp_mesh.get_local_rank(), dp_mesh.size()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, d: int, dp_rank: int, dp: int) -> None:
    g = torch.Generator().manual_seed(step)  # the global batch of the step; each dp rank takes its part
    x = torch.randn(8, d, generator=g)
    part = x.chunk(dp)[dp_rank]
    loss = model(part).pow(2).mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def _full(v: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.full_tensor().detach().clone()
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    sd = optim.state_dict()["state"]
    return {"model": {k: _full(v) for k, v in model.state_dict().items()},
            "optim": {i: {k: _full(v) for k, v in st.items()} for i, st in sorted(sd.items())}}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = [f"model.{k}" for k, v in a["model"].items() if not torch.equal(v, b["model"].get(k, torch.empty(0)))]
    if a["optim"].keys() != b["optim"].keys():
        bad.append(f"optim keys {sorted(a['optim'])} != {sorted(b['optim'])}")
    for i, st in a["optim"].items():
        for k, v in st.items():
            w = b["optim"].get(i, {}).get(k)
            if not (isinstance(w, torch.Tensor) and torch.equal(v, w)):
                bad.append(f"optim.{i}.{k}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, required=True, help="train until this step (exclusive)")
    ap.add_argument("--local", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--expect", default=None, help="the full state the restore must give (a saved.pt)")
    ap.add_argument("--persistent", default=None, help="a persistent tier, every save uploaded")
    ap.add_argument("--domains", default=None, help="comma-separated failure domain of each node (node = rank // "
                                                     "LOCAL_WORLD_SIZE): this rank's, set as its node's label")
    ap.add_argument("--block-kib", type=int, default=None,
                    help="the manifests' verification block (default 4096): a manifest records its block size, and a "
                         "smaller one lets a small state show what a large one does (runs of many blocks)")
    args = ap.parse_args()
    if args.block_kib:
        import resilient.checkpoint.save.manager as saving

        saving.BLOCK = args.block_kib << 10
    if args.domains:
        from resilient import env

        node = int(os.environ["RANK"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        os.environ[env.FAILURE_DOMAIN] = args.domains.split(",")[node]

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import resilient

    model, optim, dp_rank, dp = build(args.dim, args.blocks, args.tp, seed=0)
    state = {"model": model, "optim": optim}
    tiers = {"persistent": args.persistent, "persistent_every": "1"} if args.persistent else {}
    ck = resilient.CheckpointManager.from_env(local=args.local, interval="1", **tiers)
    start = ck.restore(state)
    info: dict[str, Any] = {"start": start, "world": dist.get_world_size(), "dp": dp}
    if ck.last_restore is not None and ck.last_restore.step is not None:
        info["sources"] = ck.last_restore.sources
        info["resharded"] = ck._restorer.resharded
    rc = 0
    if args.expect:
        got = full_state(model, optim)  # collective
        if rank == 0:
            torch.save(got, out / "restored.pt")
            bad = differences(torch.load(args.expect, weights_only=False), got)
            info["differences"] = bad
            n = len(got["model"]) + sum(len(s) for s in got["optim"].values())
            print(f"[reshard] restored at dp {dp}: {'bit-exact' if not bad else 'DIFFERS: ' + ', '.join(bad[:6])} "
                  f"({n} values)", flush=True)
            rc = 1 if bad else 0
    for step in range(start, args.steps):
        train_step(model, optim, step, args.dim, dp_rank, dp)
        ck.save(step, state)
    if not ck.wait(timeout=120, upload_timeout=120):
        raise SystemExit("checkpoint saves did not finish within 120 s")
    saved = full_state(model, optim)
    if rank == 0:
        torch.save(saved, out / "saved.pt")
    ck.close()
    (out / f"rank{rank}.json").write_text(json.dumps(info, default=str))
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
