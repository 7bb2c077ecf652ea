"""``resilient policy check`` run as a subprocess, on the scenario table and on a real ledger file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "resilient.cli", "policy", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_scenarios_table_for_a_shipped_policy() -> None:
    r = run("check", "policies/hot_swap_first.py")
    assert r.returncode == 0, r.stderr
    assert "node_lost_with_spare" in r.stdout and "hot_swap" in r.stdout
    assert "0 differ from what the hot_swap_first policy does" in r.stdout
    assert r.stderr == ""


def test_scenarios_json_records_fallbacks() -> None:
    r = run("check", "policies/default.py", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["differing"] == 0
    by = {s["scenario"]: s for s in out["scenarios"]}
    assert "RuntimeError: policy bug" in by["policy_raises"]["decisions"][0]["fallback"]
    assert by["repeated_crash_swap"]["decisions"][-1]["action_args"] == {"action": "hot_swap", "reason": by[
        "repeated_crash_swap"]["decisions"][-1]["reason"], "node": "b", "spare": "s", "cool_down": 600.0}


def test_a_user_policy_is_compared_with_the_default(tmp_path: Path) -> None:
    p = tmp_path / "always_stop.py"
    p.write_text("from resilient.supervisor.api import Stop\n\ndef decide(event, view):\n    return Stop(reason='no')\n")
    r = run("check", str(p), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["differing"] > 0
    crash = next(s for s in out["scenarios"] if s["scenario"] == "worker_crash_restart")
    assert crash["decisions"][0]["action"] == "stop" and crash["differences"]


def test_bad_policy_file_one_line_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "broken.py"
    p.write_text("def decide(event, view)\n    return None\n")
    r = run("check", str(p))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"{p}:1" in r.stderr and "syntax error" in r.stderr
    r = run("check", str(tmp_path / "missing.py"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr


def test_bad_ledger_one_line_exit_2(tmp_path: Path) -> None:
    r = run("check", "policies/default.py", "--ledger", str(tmp_path / "nope" / "events.jsonl"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no ledger" in r.stderr
    (tmp_path / "events.jsonl").write_text("")
    r = run("check", "policies/default.py", "--ledger", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no events" in r.stderr
    r = run("check", "policies/default.py", "--nnodes", "3:1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--nnodes" in r.stderr


def _ledger(run_dir: Path) -> None:
    t = 1.7e9
    evs = [
        Event(EventKind.RUN_START, node="a", details={"nnodes": "1:2", "nproc_per_node": 2}, wall=t),
        Event(EventKind.RUN_START, node="b", details={"nnodes": "1:2", "nproc_per_node": 2}, wall=t + 0.1),
        Event(EventKind.RENDEZVOUS_DONE, node="b", details={"group_rank": 1, "group_world_size": 2}, wall=t + 1),
        Event(EventKind.RENDEZVOUS_DONE, node="a", details={"group_rank": 0, "group_world_size": 2}, wall=t + 1),
        Event(EventKind.ATTEMPT_START, node="a", attempt=0, details={"attempt": 0, "local_world_size": 2,
                                                                     "group_rank": 0}, wall=t + 2),
        Event(EventKind.STEP, node="a", rank=0, attempt=0, details={"step": 1, "seconds": 0.1}, wall=t + 3),
        Event(EventKind.WORKER_EXIT, node="b", rank=3, attempt=0, details={"exit_code": -9, "signal": "SIGKILL"},
              wall=t + 10),
        Event(EventKind.WORKER_EXIT, node="a", rank=0, attempt=0, details={"exit_code": 1}, wall=t + 10.2),
        Event(EventKind.ACTION, node="a", details={"action": "restart"}, wall=t + 10.3),
        Event(EventKind.CKPT_TIER_DONE, node="a", rank=0, attempt=1, details={"step": 20, "tier": "local"}, wall=t + 15),
        Event(EventKind.AGENT_LOST, node="b", details={"reason": "disconnected"}, wall=t + 20),
        Event(EventKind.NODE_JOINED, node="c", details={"nproc": 2, "spare": True}, wall=t + 30),
        Event(EventKind.CKPT_TIER_DONE, node="a", rank=0, attempt=2, details={"step": 40, "tier": "local"}, wall=t + 40),
    ]
    with Ledger(run_dir) as led:
        for e in evs:
            led.write(e)


def test_replays_a_recorded_ledger(tmp_path: Path) -> None:
    _ledger(tmp_path)
    r = run("check", "policies/default.py", "--ledger", str(tmp_path / "events.jsonl"), "--json")
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)["decisions"]
    got = [(d["event"], d["action"], d["members"], d["pending"]) for d in ds]
    assert got == [
        ("worker_exit b rank 3", "restart", ["a", "b"], False),  # a's exit of the same attempt: decided once
        ("agent_lost b", "scale_down", ["a"], False),
        ("node_joined c", "scale_up", None, True),
        ("ckpt_tier_done a rank 0", "scale_up", ["a", "c"], False),  # the next local checkpoint
    ]
    assert [round(d["time"], 1) for d in ds] == [10.0, 20.0, 30.0, 40.0]
    r = run("check", "policies/scale_down_first.py", "--ledger", str(tmp_path))
    assert r.returncode == 0 and "scale_down" in r.stdout and "scale_up" in r.stdout
