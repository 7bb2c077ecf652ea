"""A job whose nodes never all arrive stops after torchrun's rendezvous ``join_timeout`` with an error that says who
came and what to do, instead of holding its node silently forever (found when a bench's spare node arrived after
the job's only other node had gone: it hosted a fresh store and waited with no end)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.launcher.args import LaunchError, parse
from tests._helpers.gcs import free_port

from .conftest import run_launcher

SCRIPT = "train.py"


@pytest.mark.timeout(120)
def test_a_job_missing_a_node_stops_at_join_timeout(tmp_path: Path) -> None:
    script, run_dir = tmp_path / "never.py", tmp_path / "run"
    script.write_text("raise SystemExit('a worker started: the job must not have formed')\n")
    t0 = time.monotonic()
    r = run_launcher(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "lonely", "--local-addr", "127.0.0.1",
                      "--rdzv-conf", "join_timeout=3", "--run-dir", str(run_dir), str(script)], tmp_path, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "join_timeout (3 s" in r.stderr and "1 of --nnodes MIN 2" in r.stderr, r.stderr[-3000:]
    assert "a worker started" not in r.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    stops = [e for e in events if e["kind"] == "action" and e["details"].get("action") == "stop"]
    assert len(stops) == 1 and "join_timeout" in stops[0]["details"]["reason"], stops
    assert not [e for e in events if e["kind"] == "attempt_start"]
    assert [e["details"]["exit_code"] for e in events if e["kind"] == "run_end"] == [1]
    assert took > 3, took  # not before the timeout


@pytest.mark.parametrize("conf, needle", [
    ("join_timeout=abc", "join_timeout must be a positive"),
    ("join_timeout=0", "join_timeout must be a positive"),
    ("join_timeout=inf", "join_timeout must be a positive"),
    ("last_call_timeout=-1", "last_call_timeout must be a non-negative"),
])
def test_bad_rendezvous_durations_are_named(tmp_path: Path, conf: str, needle: str) -> None:
    (tmp_path / SCRIPT).write_text("")
    with pytest.raises(LaunchError, match=needle):
        parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
               "--rdzv-conf", conf, "--run-dir", str(tmp_path / "r"), str(tmp_path / SCRIPT)])
    assert not (tmp_path / "r").exists()


def test_standalone_supervisor_rejects_a_bad_join_timeout(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "resilient.cli", "supervisor", "--rdzv-endpoint", "127.0.0.1:29400",
                        "--nnodes", "2", "--run-dir", str(tmp_path / "run"), "--join-timeout", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--join-timeout" in r.stderr, (r.returncode, r.stderr[-2000:])
