"""A model-parallel training worker for the straggler tests: FSDP2 or a 2-D (dp × tp) DTensor job on gloo.

Configured by environment:
  T_MODE         "fsdp2_async": FSDP2 over all ranks, its all-gathers issued async (waited on ``Work.wait``);
                 "tp2d": a (dp, tp) mesh of replicas of T_TP ranks; each step a DTensor reduction over tp
                 (functional collectives, waited on first use) and a gradient average over dp (FSDP2)
  T_STEPS        number of steps
  T_WORK         seconds of own work per step (a sleep: the machine's other load does not change it)
  T_TP_SKEW      tp2d: tp position p works T_WORK * (1 + p * T_TP_SKEW) (tp ranks hold different shards)
  T_SLOW_RANK    global rank that sleeps T_SLOW_EXTRA more seconds per step from step T_SLOW_FROM
"""
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate

import resilient


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = os.environ["T_MODE"]
    n = int(os.environ.get("T_STEPS", "30"))
    work = float(os.environ.get("T_WORK", "0.02"))
    skew = float(os.environ.get("T_TP_SKEW", "0"))
    slow_rank = int(os.environ.get("T_SLOW_RANK", "-1"))
    slow_extra = float(os.environ.get("T_SLOW_EXTRA", "0"))
    slow_from = int(os.environ.get("T_SLOW_FROM", "0"))
    torch.manual_seed(0)
    if mode == "tp2d":
        tp = int(os.environ.get("T_TP", "2"))
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        fsdp_mesh, my_work = mesh["dp"], work * (1 + mesh["tp"].get_local_rank() * skew)
    else:
        mesh = fsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        my_work = work
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    if mode == "fsdp2_async":
        for m in model.modules():
            if hasattr(m, "_set_unshard_async_op"):
                m._set_unshard_async_op(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in resilient.steps(0, n):
        time.sleep(my_work)
        if rank == slow_rank and step >= slow_from:
            time.sleep(slow_extra)
        x = torch.randn(8, 32)
        if mode == "tp2d":
            # a tensor-parallel partial sum made whole over the replica's tp ranks (DTensor → funcol)
            part = DTensor.from_local(x, mesh["tp"], [Partial()])
            x = part.redistribute(mesh["tp"], [Replicate()]).to_local() / mesh["tp"].size()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # ends as resilient-run's workers do: no finalisation, so no gloo exit abort (README, Known limits)
    from resilient.worker import exit_safety

    exit_safety.finish(0)
