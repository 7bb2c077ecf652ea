"""``--inject``: a drill's faults carried out for real by the launcher, each recorded as ``fault_injected``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import REPO, TRAIN, child_env, wait_for
from .test_node_loss import NPROC, WORLD, _listening, node_name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec,why", [("explode-worker@3s", "unknown fault"), ("kill-worker@soon", "cannot read"),
                                      ("kill-node@step3", "at a time"), ("kill-worker:7@1s", "only 2"),
                                      ("raise-worker:0@5s", "at a step")])
def test_bad_inject_spec_is_one_line_and_exit_2(tmp_path: Path, spec: str, why: str) -> None:
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                        "--run-dir", str(tmp_path / "run"), "--inject", spec, str(TRAIN), "--out", str(tmp_path)],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(200)
def test_inject_kill_and_hang_worker_then_slow_rank(tmp_path: Path) -> None:
    """Time-based faults by the agent (SIGKILL, SIGSTOP), an in-step one by resilient.steps (slow)."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "3", "--heartbeat-timeout", "3", "--run-dir", str(tmp_path / "run"),
                        "--ckpt-local", str(tmp_path / "ckpt"),
                        "--inject", "kill-worker:1@2s,hang-worker:0@5s,slow-rank:1@step2",
                        str(TRAIN), "--steps", "150", "--step-sleep", "0.05", "--out", str(out)],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = list(read_events(tmp_path / "run"))
    faults = [(e.details["fault"], e.details["target"]) for e in evs if e.kind == EventKind.FAULT_INJECTED]
    assert ("kill-worker", 1) in faults and ("hang-worker", 0) in faults and ("slow", 1) in faults, faults
    exits = [e for e in evs if e.kind == EventKind.WORKER_EXIT and e.rank == 1]
    assert exits and exits[0].details["signal"] == "SIGKILL"
    assert any(e.kind == EventKind.HANG and e.rank == 0 for e in evs)
    acts = [e.details["action"] for e in evs if e.kind == EventKind.ACTION]
    assert [a for a in acts if a not in ("start", "ignore")] == ["restart", "restart"], acts
    assert "ignore" in acts  # the slowed rank was flagged a straggler, and the default policy only records it


@pytest.mark.timeout(240)
def test_inject_kill_node_is_handled_by_a_spare(cluster_factory, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the ranks wait at the gate (no steps, no heartbeats: no hang must be declared) from step 6 until the spare
    # has taken the lost node's place: the job cannot end before the fault at 4 s however fast its steps are, nor
    # run steps only to fill the time; a run restored at the gate step waits there too
    c = cluster_factory("2", nproc=NPROC, flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout",
                                                 "20", "--heartbeat-timeout", "600", "--inject", "kill-node:1@4s"])
    gate = tmp_path / "gate"
    gate.mkdir()
    args = ["--steps", "12", "--step-sleep", "0.04", "--samples", "8192", "--out", str(out),  # one epoch at 4 ranks
            "--gate", str(gate), "--gate-step", "6", "--gate-on-resume"]
    first = c.start("a", args)
    wait_for(lambda: _listening(c.port) or first.proc.poll() is not None, 60, "the first agent to host the store")
    nodes = [first, c.start("b", args), c.start("spare", args)]
    wait_for(lambda: any(e.kind == EventKind.ACTION and e.details["action"] == "hot_swap" for e in c.events())
             or first.proc.poll() is not None, 120, "the spare to take the lost node's place")
    (gate / "go").touch()
    wait_for(lambda: sum(n.proc.poll() is not None for n in nodes) == 3, 200, "every agent to exit")
    evs = c.events()
    killed = [e for e in evs if e.kind == EventKind.FAULT_INJECTED and e.details["fault"] == "kill-node"]
    assert len(killed) == 1, [e.details for e in evs if e.kind == EventKind.FAULT_INJECTED]
    victim = next(n for n in nodes if node_name(n) == killed[0].node)
    assert victim.proc.returncode == -9
    assert all(n.proc.returncode == 0 for n in nodes if n is not victim), [n.output() for n in nodes]
    swaps = [e.details["action_args"] for e in evs if e.kind == EventKind.ACTION and e.details["action"] == "hot_swap"]
    assert len(swaps) == 1 and swaps[0]["node"] == node_name(victim)
    assert all((out / f"rank{r}.pt").exists() for r in range(WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
