"""resilient.topology(): the data-parallel layout read from a worker's environment, and the DeviceMesh it builds
(on a real gloo group of 4 processes)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

import resilient
from resilient import env
from resilient.topology import Topology, topology


def _env(rank: int, world: int, **extra: object) -> dict[str, str]:
    e = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    e.update({k: str(v) for k, v in extra.items()})
    return e


def test_replicas_of_two_nodes_of_two_workers() -> None:
    # 8 ranks, replicas of 2 nodes x 2 workers: rank 5 is in replica 1 (ranks 4..7), at position 1
    t = topology(_env(5, 8, **{env.DP_SIZE: 2, env.DP_RANK: 1, env.NODES_PER_REPLICA: 2}))
    assert t == Topology(rank=5, world_size=8, dp_rank=1, dp_size=2, nodes_per_replica=2, ranks_per_replica=4)
    assert t.replica_ranks == (4, 5, 6, 7)
    assert t.replica_rank == 1
    assert t.dp_group_ranks == (1, 5)
    assert t.mesh_shape(tp=2, pp=2) == (2, 2, 2)


def test_without_replicas_every_rank_is_one() -> None:
    for e in (_env(3, 4), _env(3, 4, **{env.DP_SIZE: 4, env.DP_RANK: 3})):
        t = topology(e)
        assert (t.dp_rank, t.dp_size, t.ranks_per_replica, t.nodes_per_replica) == (3, 4, 1, None)
        assert t.replica_ranks == (3,) and t.dp_group_ranks == (0, 1, 2, 3)
        assert t.mesh_shape() == (4,)
    assert resilient.topology is topology and resilient.Topology is Topology


def test_bad_inputs_name_the_numbers() -> None:
    t = topology(_env(0, 8, **{env.DP_SIZE: 2, env.DP_RANK: 0, env.NODES_PER_REPLICA: 2}))
    with pytest.raises(ValueError, match=r"tp=3 make 3 ranks but a replica has 4 .*product is 4"):
        t.mesh_shape(tp=3)
    with pytest.raises(ValueError, match=r"none make 1 ranks but a replica has 4"):
        t.mesh_shape()
    with pytest.raises(ValueError, match="'dp' is the outer dimension"):
        t.mesh_shape(dp=4)
    with pytest.raises(ValueError, match=r"RESILIENT_DP_SIZE=3 does not divide WORLD_SIZE=8"):
        topology(_env(0, 8, **{env.DP_SIZE: 3}))
    with pytest.raises(ValueError, match=r"rank 5 is in replica 1 .* not 0"):
        topology(_env(5, 8, **{env.DP_SIZE: 2, env.DP_RANK: 0}))
    with pytest.raises(ValueError, match=r"a world of 6 ranks is not 2 replicas of 4 ranks"):
        Topology(rank=0, world_size=6, dp_rank=0, dp_size=2, nodes_per_replica=2, ranks_per_replica=4)


def _mesh_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(_env(rank, world, **{env.DP_SIZE: 2, env.DP_RANK: rank // 2, env.NODES_PER_REPLICA: 1}))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t = resilient.topology()
    mesh = t.mesh("cpu", tp=2)
    sums = {}
    for dim in ("dp", "tp"):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=mesh.get_group(dim))  # the sum of the ranks in this rank's group of that dim
        sums[dim] = x.item()
    Path(out, f"{rank}.json").write_text(json.dumps({
        "shape": list(mesh.mesh.shape), "names": list(mesh.mesh_dim_names), "sums": sums,
        "dp_peers": list(t.dp_group_ranks), "replica": list(t.replica_ranks)}))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_mesh_on_a_real_gloo_group(tmp_path: Path) -> None:
    world = 4
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_mesh_rank, args=(r, world, init, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    for r in range(world):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["shape"] == [2, 2] and got["names"] == ["dp", "tp"]
        # dp outermost: replica i holds ranks 2i, 2i+1 (the tp group); dp peers share the position in the replica
        replica = [r // 2 * 2, r // 2 * 2 + 1]
        peers = [r % 2, r % 2 + 2]
        assert got["replica"] == replica and got["dp_peers"] == peers
        assert got["sums"] == {"tp": float(sum(replica)), "dp": float(sum(peers))}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
