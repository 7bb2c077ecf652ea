"""The last step is durable: a run that finishes puts its final saved step on the persistent tier before the launcher
exits 0, even when that step is not one ``--ckpt-persistent-every`` uploads; when the store cannot take it, the exit
status says so (NOT_DURABLE_EXIT_CODE) and the ledger records it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.launcher.api import NOT_DURABLE_EXIT_CODE, PREEMPTED_EXIT_CODE
from tests._helpers.wait import wait_for

from .conftest import REPO, _child_env
from .test_e2e_launcher import resilient_run
from .test_failed_saves import events, full_disk  # noqa: F401 - full_disk: a dead store that refuses every write
from .test_reliability import tiny_disk  # noqa: F401 - the fixture full_disk fills


def committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "COMMITTED").exists())


@pytest.mark.timeout(300)
def test_final_step_lands_committed_on_the_persistent_tier(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    # saves at steps 1, 3, 5, 7, 9; every 3rd save (step 5) is uploaded on schedule; 9 only because it is the last
    r = resilient_run(tmp_path, ["--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-persistent", f"file://{bucket}",
                                 "--ckpt-interval", "2", "--ckpt-persistent-every", "3", "--upload-grace", "60"],
                      ["--steps", "10", "--out", str(tmp_path / "out")], {}, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert committed(bucket) == [5, 9], sorted(p.name for p in bucket.iterdir())
    run = tmp_path / "run"
    up = sorted(d["step"] for d in events(run, EventKind.CKPT_TIER_DONE) if d["tier"] == "persistent")
    assert up == [5, 9], up
    assert not events(run, EventKind.CKPT_NOT_DURABLE)
    assert "checkpoints: 5 save(s); local 5 step(s), newest 9; persistent 2 step(s), newest 9" in r.stderr, \
        r.stderr[-3000:]


@pytest.mark.timeout(300)
def test_final_step_the_store_refuses_makes_the_exit_status_say_so(tmp_path: Path, full_disk: Path) -> None:
    # the persistent tier is a store with no space left: the final step (5) cannot land there
    r = resilient_run(tmp_path, ["--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-persistent", f"file://{full_disk}/b",
                                 "--ckpt-interval", "2", "--ckpt-persistent-every", "10", "--upload-grace", "5"],
                      ["--steps", "6", "--out", str(tmp_path / "out")], {}, timeout=240)
    assert r.returncode == NOT_DURABLE_EXIT_CODE, r.stderr[-4000:]
    assert (tmp_path / "out" / "rank0.pt").exists()  # training itself finished
    run = tmp_path / "run"
    nd = events(run, EventKind.CKPT_NOT_DURABLE)
    assert len(nd) == 1 and nd[0]["step"] == 5 and nd[0]["persistent_step"] is None, nd
    assert nd[0]["exit_code"] == NOT_DURABLE_EXIT_CODE
    failed = [d for d in events(run, EventKind.CKPT_TIER_FAILED) if d["tier"] == "persistent" and d["step"] == 5]
    assert failed, events(run, EventKind.CKPT_TIER_FAILED)
    assert "the newest saved step 5 is not on the persistent tier" in r.stderr, r.stderr[-3000:]
    end = [e for e in read_events(run) if e.kind == EventKind.RUN_END][-1]
    assert end.details["exit_code"] == NOT_DURABLE_EXIT_CODE and "not durable" in end.details["reason"]


@pytest.mark.timeout(300)
def test_preempted_step_the_store_refuses_keeps_75_and_says_so(tmp_path: Path, full_disk: Path) -> None:
    run = tmp_path / "run"
    # examples/train.py trains in resilient.steps(): a RUN_DIR/preempt notice ends its loop after an agreed step,
    # which is saved whatever the interval and then offered to the persistent tier (here: a store with no space)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run),
           "--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-persistent", f"file://{full_disk}/b",
           "--ckpt-interval", "1000", "--upload-grace", "5",
           str(REPO / "examples" / "train.py"), "--steps", "100000", "--dim", "8", "--hidden", "16", "--batch", "4"]
    p = subprocess.Popen(cmd, cwd=REPO, env=_child_env({}), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    try:
        wait_for(lambda: (run / "events.jsonl").exists() and any(e.kind == EventKind.STEP for e in read_events(run)),
                 120, "a step record", p)
        (run / ".preempt").write_text("")
        os.replace(run / ".preempt", run / "preempt")
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == PREEMPTED_EXIT_CODE, err[-4000:]  # still requeued
    saved = [e.details["step"] for e in read_events(run) if e.kind == EventKind.CKPT_SAVE]
    assert len(saved) == 1, saved  # the preempted step only
    nd = events(run, EventKind.CKPT_NOT_DURABLE)
    assert len(nd) == 1 and nd[0]["step"] == saved[0] and nd[0]["exit_code"] == PREEMPTED_EXIT_CODE, nd
    assert f"preempted (exit {PREEMPTED_EXIT_CODE} kept, so that the job is requeued), but the newest saved step " \
           f"{saved[0]} is not on the persistent tier" in err, err[-3000:]
