"""Nodes that share nothing but the network: each agent has a run directory of its own (and the supervisor too), so
the supervisor can learn the job's checkpoint boundaries only from what the agents send it. A spare joining a job
below ``--nnodes`` MAX is taken in at the next boundary, not after ``scale_up_wait``, and the job ends bit-exact.

The run on a shared run directory, where the agent hosting the supervisor forwards them the same way (the supervisor
reads no ledger), is covered by ``test_node_loss.py::test_scale_down_then_back_up_with_on_scale_and_exact_samples``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.supervisor.config import SupervisorConfig

from .conftest import wait_for
from .test_drill import assert_same, check_samples, kept_steps, replay
from .test_node_loss import _listening, at_gate, node_name

STEPS = 12
SECRET = {"RESILIENT_JOB_SECRET": "s3cret-for-tests-0123456789abcdef"}


def _events(run_dir: Path) -> list:
    try:
        return list(read_events(run_dir))
    except FileNotFoundError:
        return []


def _scale_up(run_dir: Path):
    """The scale-up carried out (the decision that names the new round), or None."""
    return next((e for e in _events(run_dir) if e.kind == EventKind.ACTION and e.details.get("action") == "scale_up"
                 and e.details.get("assignment")), None)


@pytest.mark.timeout(150, func_only=True)
def test_spare_taken_in_at_the_next_boundary_when_every_node_has_its_own_run_dir(cluster_factory,
                                                                                 tmp_path: Path) -> None:
    # the supervisor on its own host, so that rank 0's node is never the supervisor's: without the agents'
    # forwarding its run directory holds no checkpoint boundary at all. One worker a node: the replay of a
    # schedule of worlds 1 and 2 is bit-exact (a sum of two gradients commutes)
    wait_limit = SupervisorConfig(1, 2, 1).scale_up_wait  # what a scale-up with no boundary seen waits (60 s)
    c = cluster_factory("1:2", nproc=1, flags=["--heartbeat-timeout", "300"])  # the gates are no hangs
    sup = c.start_supervisor(["--max-restarts", "3", "--node-timeout", "20", "--last-call-timeout", "0"], env=SECRET)
    wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
    assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", "3", "8",
            "--gate-on-resume", "--step-sleep", "0.05"]
    dirs = {n: c.tmp / f"run-{n}" for n in ("a", "b")}
    a = c.start("a", args, extra=["--run-dir", str(dirs["a"])], env=SECRET)
    wait_for(lambda: at_gate(gate, 1) or a.proc.poll() is not None, 90, "node a's rank at the first gate")
    b = c.start("b", args, extra=["--run-dir", str(dirs["b"])], env=SECRET)
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(b) for e in _events(c.run_dir))
             or b.proc.poll() is not None, 90, "node b to join")
    joined = next(e for e in _events(c.run_dir) if e.kind == EventKind.NODE_JOINED and e.node == node_name(b))
    (gate / "go").touch()
    # well within scale_up_wait after the join: a scale-up carried out only when that ran out fails here
    wait_for(lambda: _scale_up(c.run_dir) is not None or a.proc.poll() is not None, wait_limit * 0.75,
             "the scale-up to be carried out at a checkpoint boundary")
    up = _scale_up(c.run_dir)
    assert up is not None, a.output()
    assert "checkpoint boundary" in json.dumps(up.details), up.details
    print(f"spare's arrival to the scale-up: {up.wall - joined.wall:.2f} s")
    (gate / "go-8").touch()
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b)), 90, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert b.proc.returncode == 0, b.output()
    wait_for(lambda: sup.proc.poll() is not None, 30, "the supervisor to exit with the job")
    assert sup.proc.returncode == 0, sup.output()
    # each node's ledger holds its own workers' records; the supervisor's holds no checkpoint record (what the agents
    # sent it went to its decisions, not into its ledger), so no report counts a boundary twice
    sup_evs = _events(c.run_dir)
    assert not [e for e in sup_evs if e.kind == EventKind.CKPT_TIER_DONE]
    worlds = [e.details["world_size"] for d in dirs.values() for e in _events(d) if e.kind == EventKind.ATTEMPT_START]
    assert sorted(set(worlds)) == [1, 2], worlds
    acts = [(e.details["action"], bool(e.details.get("assignment"))) for e in sup_evs if e.kind == EventKind.ACTION]
    assert {k for k, _ in acts} - {"ignore"} == {"start", "scale_up"}, acts
    assert acts.count(("scale_up", True)) == 1, acts
    steps, _ = kept_steps(out, STEPS)
    assert [s["world"] for s in steps][0] == 1 and steps[-1]["world"] == 2, [s["world"] for s in steps]
    check_samples(steps)
    replayed = replay(steps, tmp_path / "replay")
    for r in range(2):
        d = torch.load(out / f"rank{r}.pt", weights_only=False)
        assert_same(replayed, {"model": d["model"], "optim": d["optim"]}, f"rank {r} against the replay")
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(300, func_only=True)
def test_a_node_back_with_its_own_run_dir_runs_on_scale_like_the_others(cluster_factory, tmp_path: Path) -> None:
    # each node its own run directory: node b trains in world 2 (its record says 2), is lost, the job goes on alone
    # (world 1), and b comes back with the same run directory. In the grown world every rank must see 1 -> 2; b's
    # ranks read their own, stale record (2 -> 2) and skipped on_scale, where a callback scales the learning rate
    c = cluster_factory("1:2", nproc=1, flags=["--max-restarts", "4", "--node-timeout", "20", "--heartbeat-timeout",
                                               "300", "--rdzv-conf", "last_call_timeout=300"])
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", "16", "--out", str(out), "--gate", str(gate), "--gate-step", "4", "8", "12",
            "--gate-on-resume", "--step-sleep", "0.05"]
    dirs = {n: c.tmp / f"run-{n}" for n in ("a", "b")}
    a = c.start("a", args, extra=["--run-dir", str(dirs["a"])])
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "node a to host the store")
    b = c.start("b", args, extra=["--run-dir", str(dirs["b"])])
    wait_for(lambda: at_gate(gate, 2) or a.proc.poll() is not None, 90, "both ranks at the first gate")
    assert json.loads((dirs["b"] / "world.json").read_text())["world_size"] == 2  # what b comes back with
    b.kill()
    (gate / "go").touch()
    wait_for(lambda: at_gate(gate, 1, "-8") or a.proc.poll() is not None, 90, "node a to go on alone")
    back = c.start("b-back", args, extra=["--run-dir", str(dirs["b"])])
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(back) for e in _events(dirs["a"]))
             or back.proc.poll() is not None, 90, "node b to join again")
    (gate / "go-8").touch()
    wait_for(lambda: _scale_up(dirs["a"]) is not None or a.proc.poll() is not None, 150, "the scale-up")
    (gate / "go-12").touch()
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, back)), 150, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert back.proc.returncode == 0, back.output()
    scale = [json.loads(x) for x in (out / "scale.jsonl").read_text().splitlines()]
    assert {(d["old"], d["new"]) for d in scale} == {(2, 1), (1, 2)}, scale
    assert sorted(d["rank"] for d in scale if (d["old"], d["new"]) == (1, 2)) == [0, 1], scale
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
