"""Restarts that cannot work are not made: a script that raises at the same place on every attempt stops after the
second attempt, with the exception and its frame in the stop reason, whatever the restart budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers.procs import kill_sessions

REPO = Path(__file__).resolve().parents[2]

RAISES_AT_5 = '''
import os

import resilient


def train_step(step):
    if step == 5:
        raise ValueError(f"loss is nan at step {step}")


for step in resilient.steps(0, 20):
    train_step(step)
'''


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines() if ln.strip()]


@pytest.mark.timeout(180)
def test_a_crash_loop_stops_after_two_attempts(tmp_path: Path) -> None:
    script, run_dir = tmp_path / "raises.py", tmp_path / "run"
    script.write_text(RAISES_AT_5)
    p = subprocess.Popen([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                          "--max-restarts", "100", "--run-dir", str(run_dir), str(script)],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=150)
    finally:
        kill_sessions([p], timeout=30)
    assert p.returncode == 1, err[-3000:]
    evs = _events(run_dir)
    starts = [e["attempt"] for e in evs if e["kind"] == "attempt_start"]
    assert starts == [0, 1], (starts, err[-3000:])
    stops = [e["details"] for e in evs if e["kind"] == "action" and e["details"]["action"] == "stop"]
    assert len(stops) == 1, stops
    reason = stops[0]["reason"]
    assert "ValueError: loss is nan at step 5" in reason, reason
    assert f"{script}:9 in train_step" in reason, reason
    assert stops[0]["failure_class"] == "software", stops[0]
    assert "ValueError: loss is nan at step 5" in err and f"{script}:9 in train_step" in err, err[-3000:]
    # the recorded ledger replayed offline through the shipped default policy decides the same
    r = subprocess.run([sys.executable, "-m", "resilient.cli", "policy", "check", str(REPO / "policies" / "default.py"),
                        "--ledger", str(run_dir), "--max-restarts", "100", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["decisions"]
    assert [row["action"] for row in rows][-1] == "stop", rows
