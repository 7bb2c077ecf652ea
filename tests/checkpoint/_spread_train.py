"""A job of 2 nodes x 2 ranks (FSDP-style ``Shard(0)`` DTensors, updated in place) saving every step to node-local
tiers, each save waited for. ``--damage STEP``: before saving STEP, node 1's leader flips a byte of its copy of the
previous step's ``.metadata`` (a torn or rotted file). Rank 0 prints how many saves reached node 1 as ids."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local", required=True, help="the local tier, with {node}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--damage", type=int, default=None)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from resilient.checkpoint.save.manager import CheckpointManager

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    state = {f"w{i}": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) for i in range(6)}
    ck = CheckpointManager(local=a.local, interval=1, peer=False, keep_local=100)
    try:
        for step in range(a.steps):
            if step == a.damage and ck.node == 1 and ck.local_rank == 0:
                p = Path(a.local.format(node=1)) / f"step_{step - 1:08d}" / ".metadata"
                raw = bytearray(p.read_bytes())
                raw[len(raw) // 2] ^= 0xFF
                p.write_bytes(bytes(raw))
            dist.barrier()
            for v in state.values():
                v.to_local().add_(1)
            assert ck.save(step, state)
            assert ck.wait(60)
    finally:
        ck.close(timeout=60)
    if rank == 0:
        print(json.dumps({"spread_by_ids": ck.spread_by_ids}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
