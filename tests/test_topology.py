"""resilient.topology(): the data-parallel layout read from a worker's environment, and the DeviceMesh it builds
(on a real gloo group of 4 processes)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

import resilient
from resilient import env
from resilient.launcher.api import AgentConfig, NodeRole, NodeRound, WorkerCommand
from resilient.launcher.workers import worker_env
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import Assignment
from resilient.topology import Topology, topology
from tests._helpers.gcs import free_port

REPO = Path(__file__).resolve().parents[1]
DUMP_ENV = REPO / "tests" / "launcher" / "scripts" / "dump_env.py"


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
    with pytest.raises(ValueError, match=r"a replica has 4 ranks \(2 node\(s\) x 2 workers\): name its inner "
                                         r"dimensions, e.g. mesh\(device_type, tp=4\)"):
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
    # one fresh interpreter imports torch and this module, then forks each rank: not one import per rank
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    init = f"tcp://127.0.0.1:{free_port()}"
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


# ------------------------------------------------------------------ what resilient-run hands its workers

def _round_env(nodes: list[str], node: str, k: int | None, nproc: int, tmp: Path,
               action: dict | None = None) -> list[dict[str, str]]:
    a = Assignment(round=1, attempt=1, members=tuple(nodes), spares=(), nproc={n: nproc for n in nodes},
                   world_size=nproc * len(nodes), previous_world_size=None, nodes_per_replica=k)
    plan = {"assignment": a.to_json(), "action": action or {"action": "start"}}
    nr = NodeRound.active_in(a, plan, node, 0)
    cfg = AgentConfig(command=WorkerCommand("train.py"), nproc_per_node=nproc, run_id="r",
                      supervisor=SupervisorConfig(min_nodes=1, max_nodes=len(nodes), nproc_per_node=nproc))
    return [worker_env(cfg, nr, lr, 1, ("127.0.0.1", 1), run_dir=tmp, node=node, ckpt_local=None,
                       monitor_socket=None, drill_env={}) for lr in range(nproc)]


@pytest.mark.parametrize("k,want_dp", [(None, [[0, 1], [2, 3], [4, 5], [6, 7]]),
                                       (1, [[0, 0], [1, 1], [2, 2], [3, 3]]), (2, [[0, 0], [0, 0], [1, 1], [1, 1]])])
def test_worker_env_lays_replicas_out_dp_outermost(tmp_path: Path, k: int | None, want_dp: list) -> None:
    nodes = ["a", "b", "c", "d"]
    dp_size = {None: 8, 1: 4, 2: 2}[k]
    for i, node in enumerate(nodes):
        envs = _round_env(nodes, node, k, 2, tmp_path)
        assert [int(e["RANK"]) for e in envs] == [2 * i, 2 * i + 1]
        assert [int(e[env.DP_RANK]) for e in envs] == want_dp[i]
        assert {e[env.DP_SIZE] for e in envs} == {str(dp_size)}
        assert {e.get(env.NODES_PER_REPLICA) for e in envs} == {None if k is None else str(k)}
        for e in envs:  # the worker side reads back what was written
            t = topology(e)
            assert (t.dp_size, t.dp_rank, t.nodes_per_replica) == (dp_size, int(e[env.DP_RANK]), k)


def test_node_round_carries_the_previous_size_and_the_reason(tmp_path: Path) -> None:
    a = Assignment(round=2, attempt=2, members=("a", "b"), spares=(), nproc={"a": 2, "b": 2}, world_size=4,
                   previous_world_size=8, nodes_per_replica=2)
    plan = {"assignment": a.to_json(), "action": {"action": "scale_down", "reason": "node c lost"}}
    nr = NodeRound.active_in(a, plan, "b", 0)
    assert (nr.role, nr.group_rank, nr.base_rank, nr.nodes_per_replica) == (NodeRole.ACTIVE, 1, 2, 2)
    assert nr.previous_dp_size == 2 and nr.reason == "node c lost"  # 8 ranks were 2 replicas of 2 x 2
    plan["assignment"]["previous_dp_size"] = 3  # the supervisor's own figure wins
    assert NodeRound.active_in(Assignment.from_json(plan["assignment"]), plan, "b", 0).previous_dp_size == 3
    e = _round_env(["a", "b"], "a", 2, 2, tmp_path, action={"action": "scale_up", "reason": "c returned"})[0]
    assert e[env.ROUND_REASON] == "c returned"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("k", [2])  # without the flag: test_worker_env_lays_replicas_out_dp_outermost (no processes)
def test_real_agents_give_workers_their_replica(tmp_path: Path, k: int | None) -> None:
    """2 agents x 2 workers on one rendezvous, with --nodes-per-replica 2 (one replica of 4 ranks): each
    worker's environment, as the worker script wrote it."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    e = {kk: v for kk, v in os.environ.items() if not kk.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    flags = [] if k is None else ["--nodes-per-replica", str(k)]
    cmd = [sys.executable, "-m", "resilient.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "replicas", "--local-addr", "127.0.0.1",
           "--run-dir", str(tmp_path / "run"), *flags, str(DUMP_ENV), str(out)]
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    try:
        logs = [a.communicate(timeout=150)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], logs
    for rank in range(4):
        we = json.loads((out / f"env_{rank}.json").read_text())["env"]
        if k is None:
            assert (we[env.DP_SIZE], we[env.DP_RANK], we.get(env.NODES_PER_REPLICA)) == ("4", str(rank), None)
        else:
            assert (we[env.DP_SIZE], we[env.DP_RANK], we[env.NODES_PER_REPLICA]) == ("1", "0", "2")
        t = topology(we)
        assert t.ranks_per_replica == (1 if k is None else 4)
        assert t.replica_ranks == ((rank,) if k is None else (0, 1, 2, 3))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
