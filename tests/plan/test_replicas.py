"""``resilient plan`` with replicas (``--nodes-per-replica``): the real core drops and adds whole replicas, the
data-parallel size over time is reported, and a dropped replica's idle nodes are lost capacity."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from resilient.plan.api import ClusterConfig, Figures, PlanInputError, PlannedFault
from resilient.plan.cli import main
from resilient.plan.sim import simulate

POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.py"


def figures() -> Figures:
    return Figures(step_s=1.0, save_stall_s=0.0, startup_s=5.0, launch_s=10.0,
                   detect_s={"worker_exit": 2.0, "hang": 4.0, "agent_lost": 6.0},
                   recovery_s={"restart": 3.0, "hot_swap": 7.0, "scale_down": 7.0, "scale_up": 7.0},
                   restore_s={"local": 1.0, "peer": 2.0, "persistent": 9.0})


def test_a_lost_node_drops_its_replica_until_a_repaired_node_makes_one_again() -> None:
    """4 nodes in replicas of 2, no spare, a node lost at 50 s: the job trains on one replica (half the planned
    capacity idle) until the lost node is back from repair (0.05 h = 180 s) and, with the benched one, grows the
    job back at the next checkpoint."""
    c = ClusterConfig(nodes=4, min_nodes=2, nodes_per_replica=2, gpus_per_node=1, ckpt_interval=10, steps=400,
                      failures_per_node_day=0, repair_hours=0.05)
    loss = [PlannedFault(50.0, "agent_lost", 3)]
    r = simulate(c, figures(), POLICY, trials=1, faults=loss)
    assert r.actions == {"scale_down": 1.0, "scale_up_decided": 1.0, "scale_up": 1.0}, r.actions
    assert set(r.dp_size_seconds) == {2, 1}
    # at half size from the scale-down's first step to the scale-up's checkpoint: about the repair time
    assert 150 < r.dp_size_seconds[1] < 200, r.dp_size_seconds
    # the idle half of each step at one replica is lost capacity, not productive time
    assert r.badput_seconds["waiting_for_spares"] == pytest.approx(r.dp_size_seconds[1] / 2, rel=0.1)
    assert r.productive_seconds + sum(r.badput_seconds.values()) == pytest.approx(r.wall_seconds)
    # without replicas the same loss shrinks the job by one node, and a smaller job counts as productive as before
    plain = simulate(replace(c, nodes_per_replica=None), figures(), POLICY, trials=1, faults=loss)
    assert plain.actions["scale_down"] == 1.0 and plain.badput_seconds["waiting_for_spares"] == 0.0
    assert set(plain.dp_size_seconds) == {4, 3}


def test_a_spare_keeps_the_replica_whole() -> None:
    c = ClusterConfig(nodes=4, min_nodes=2, nodes_per_replica=2, gpus_per_node=1, spares=1, ckpt_interval=10,
                      steps=200, failures_per_node_day=0)
    r = simulate(c, figures(), POLICY, trials=1, faults=[PlannedFault(50.0, "agent_lost", 0)])
    assert r.actions == {"hot_swap": 1.0} and set(r.dp_size_seconds) == {2}
    assert r.badput_seconds["waiting_for_spares"] == 0.0


def test_nodes_not_a_multiple_of_the_replica_are_refused(capsys) -> None:
    with pytest.raises(PlanInputError, match="--min-nodes 3 is not a multiple of --nodes-per-replica 2"):
        ClusterConfig(nodes=4, min_nodes=3, nodes_per_replica=2)
    assert main(["--nodes", "6", "--nodes-per-replica", "4", "--days", "1", "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--min-nodes 6 and --nodes 6 are not a multiple of --nodes-per-replica 4" in err
    assert len(err.splitlines()) == 1


def test_cli_reports_the_data_parallel_size(capsys) -> None:
    argv = ["--nodes", "8", "--min-nodes", "4", "--nodes-per-replica", "4", "--failures-per-node-day", "2",
            "--days", "1", "--trials", "1", "--seed", "3"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["nodes_per_replica"] == 4 and set(out["result"]["dp_size_seconds"]) <= {"1", "2"}
    assert main(argv) == 0
    assert "replicas of 4 node(s); data-parallel size over the training time: 2 replica(s)" in capsys.readouterr().out
