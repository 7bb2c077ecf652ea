"""``resilient goodput`` on a ledger written by a real run under the real launcher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events import read_events
from resilient.events.follow import ledger_files, parse_line
from resilient.goodput.api import CATEGORIES
from resilient.goodput.calculator import report_for_run
from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from tests.goodput.conftest import finish, kill_group, launch

pytestmark = pytest.mark.timeout(180)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", *args], capture_output=True, text=True,
                          timeout=120)


def test_json_report_of_a_real_crash_and_restart(crashed_run):
    res = run_cli(str(crashed_run), "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    for key in ("goodput", "wall_seconds", "productive_seconds", "badput_seconds", "disruptions", "attempts"):
        assert key in d
    assert set(d["badput_seconds"]) == set(CATEGORIES)
    assert math.fsum([d["productive_seconds"], *d["badput_seconds"].values()]) == pytest.approx(d["wall_seconds"])
    assert 0 < d["goodput"] < 1
    assert d["disruptions"] == 1 and d["restarts"] == 1 and not d["in_progress"]
    assert [a["attempt"] for a in d["attempts"]] == [0, 1]
    a0, a1 = d["attempts"]
    assert a0["end_reason"] == "fault:worker_exit" and a1["end_reason"] == "completed"
    assert a1["first_step"] == 20 and a1["last_step"] == 39  # resumed after the save of step 19
    assert a0["last_step"] in (21, 22) and d["steps_redone"] == a0["last_step"] - 19
    assert a0["world_size"] == a1["world_size"] == 2
    for cat in ("startup", "wasted_progress", "recovery", "checkpoint_save_stall", "checkpoint_restore"):
        assert d["badput_seconds"][cat] > 0, cat


def test_table_and_plot(crashed_run, tmp_path):
    png = tmp_path / "timeline.png"
    res = run_cli(str(crashed_run), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert "goodput" in res.stdout and "wasted_progress" in res.stdout and "fault:worker_exit" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_report_mid_run_with_a_truncated_last_line(crashed_run, tmp_path):
    """Cut the real ledger in the middle of attempt 1, mid-line, as a crash of the writer would."""
    evs = list(read_events(crashed_run))
    restore_at = next(i for i, e in enumerate(evs) if e.kind.value == "ckpt_restore")
    cut_wall, torn = evs[restore_at + 4].wall, evs[restore_at + 5]
    for src in ledger_files(crashed_run):  # each writer's file cut at the same instant; the next event's torn
        kept = b""
        for line in src.read_bytes().splitlines(keepends=True):
            ev = parse_line(line)
            if ev is not None and ev.wall > cut_wall:
                kept += line[:17] if ev == torn else b""
                break
            kept += line
        (tmp_path / src.name).write_bytes(kept)
    now = cut_wall + 0.5
    rep = report_for_run(tmp_path, now=now)
    assert rep.in_progress and rep.end_wall == now and rep.disruptions == 1
    assert rep.productive_seconds + rep.badput_total_seconds == pytest.approx(rep.wall_seconds)
    assert rep.attempts[-1].end_reason == "running"
    res = run_cli(str(tmp_path), "--json", "--now", str(now))
    assert res.returncode == 0 and json.loads(res.stdout)["in_progress"] is True


def test_missing_run_dir_is_a_clear_error(tmp_path):
    res = run_cli(str(tmp_path / "nope"))
    assert res.returncode == 2 and "no ledger" in res.stderr


def test_a_run_split_over_several_run_dirs_reads_as_one(crashed_run, tmp_path):
    """Nodes that each keep their own --run-dir: the real run's writers split over two directories, as two nodes'
    would be. Both directories together give the report of the whole run; the same directory twice counts once; a
    directory without a ledger is named."""
    import shutil

    files = ledger_files(crashed_run)
    assert len(files) >= 2, files  # the launcher's file and its workers'
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    for d in (a, b):
        d.mkdir()
    for i, f in enumerate(files):
        shutil.copy(f, (a if i % 2 == 0 else b) / f.name)
    whole = json.loads(run_cli(str(crashed_run), "--json").stdout)
    res = run_cli(str(a), str(b), str(a), "--json")
    assert res.returncode == 0, res.stderr
    split = json.loads(res.stdout)
    for key in ("goodput", "wall_seconds", "restarts", "disruptions", "steps_recorded", "steps_redone", "last_step"):
        assert split[key] == whole[key], key
    assert split["badput_seconds"] == whole["badput_seconds"]
    alone = run_cli(str(a), "--json")  # one node's directory alone is not the run
    assert alone.returncode != 0 or json.loads(alone.stdout)["steps_recorded"] != whole["steps_recorded"]
    res = run_cli(str(a), str(tmp_path / "nope"))
    assert res.returncode == 2 and f"no ledger in {tmp_path / 'nope'} " in res.stderr, res.stderr


def test_report_of_a_run_with_the_real_checkpointer(tmp_path):
    """resilient.steps + CheckpointManager under resilient-run, rank 1 SIGKILLed: the report must agree with
    what the checkpointer says it restored."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, STEPS="30", **plan_env(WorkerFault(FaultHow.KILL, rank=1, step=17, attempt=0)))
    proc = subprocess.Popen([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "1", "--run-dir", str(run_dir), "--ckpt-local", str(run_dir / "ckpt"),
                             "--ckpt-interval", "5", str(Path(__file__).parent / "ckpt_train.py")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    restored = [e for e in read_events(run_dir) if e.kind.value == "ckpt_restore"]
    assert restored, "the checkpointer did not restore after the restart"
    r_step = int(restored[0].details["step"])
    rep = report_for_run(run_dir)
    assert rep.disruptions == 1 and rep.restarts == 1 and not rep.in_progress
    a0, a1 = rep.attempts
    assert a0.last_step in (15, 16) and a1.first_step == r_step + 1 and a1.last_step == 29  # killed at 17
    assert rep.steps_redone == a0.last_step - r_step
    assert rep.badput_seconds["checkpoint_restore"] > 0 and rep.badput_seconds["checkpoint_save_stall"] > 0
    assert rep.productive_seconds + rep.badput_total_seconds == pytest.approx(rep.wall_seconds)


def test_report_of_a_real_hang(tmp_path):
    """Rank 1 SIGSTOPs itself: the agent's hang detector fires, the job restarts; the silent time is detection."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, steps=20, save_every=5, extra_args=("--heartbeat-timeout", "2"),
                  extra_env=plan_env(WorkerFault(FaultHow.STOP, rank=1, step=12, attempt=0)))  # a hang: alive, silent
    try:
        out = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    evs = list(read_events(run_dir))
    hang = next(e for e in evs if e.kind.value == "hang")
    rep = report_for_run(run_dir)
    a0 = rep.attempts[0]
    assert a0.end_reason == "fault:hang" and rep.disruptions == 1 and rep.restarts == 1
    assert a0.detect_wall == pytest.approx(hang.wall)
    assert rep.badput_seconds["detection"] == pytest.approx(a0.detect_wall - a0.fault_wall)
    assert a0.detect_wall - a0.fault_wall <= hang.details["last_heartbeat_age"] + 1e-5  # wall-clock float precision
    assert rep.badput_seconds["detection"] > 0
    assert rep.attempts[1].first_step == 10 and rep.attempts[1].last_step == 19
    assert rep.productive_seconds + rep.badput_total_seconds == pytest.approx(rep.wall_seconds)
