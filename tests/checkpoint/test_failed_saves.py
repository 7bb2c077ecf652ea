"""A save that fails is loud: one line per save, a stop after ``--ckpt-max-failed-saves`` in a row, the failures in
the ledger and the closing summary, and a restart that finds nothing although the run saved says so.

The failing tier is a real full filesystem (a tmpfs filled to its last byte): every write of a save gets ENOSPC.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.api import CheckpointConfigError, CheckpointSavesFailedError
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.launcher.api import CKPT_FAILED_EXIT_CODE
from resilient.drill.spec import FaultHow, WorkerFault, plan_env

from .conftest import REPO, _child_env
from .test_e2e_launcher import injected, resilient_run
from .test_reliability import tiny_disk  # noqa: F401 - the fixture full_disk fills

TRAIN_STEPS = REPO / "examples" / "train.py"  # uses resilient.steps(): its runs have a goodput report


@pytest.fixture
def full_disk(tiny_disk: Path) -> Iterator[Path]:  # noqa: F811
    """The 20 MB tmpfs with no byte left: directories and empty files can still be made (so resilient-run's
    writability check passes, as on a real disk that filled up), every write of data fails with ENOSPC."""
    with open(tiny_disk / "filler", "wb") as f:
        block = b"\0" * (1 << 20)
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass
    try:
        with open(tiny_disk / "probe", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        pytest.fail("the tmpfs still takes writes")
    except OSError:
        pass
    yield tiny_disk


def events(run_dir: Path, kind: EventKind) -> list[dict]:
    return [e.details | {"rank": e.rank, "attempt": e.attempt} for e in read_events(run_dir) if e.kind == kind]


def save_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "checkpoint of step" in ln and "reached no tier" in ln]


@pytest.mark.timeout(300)
def test_saves_failing_every_time_stop_the_job_with_their_own_code(tmp_path: Path, full_disk: Path) -> None:
    r = resilient_run(tmp_path, ["--max-restarts", "2", "--ckpt-local", str(full_disk / "ckpt"), "--ckpt-interval", "2",
                                 "--ckpt-max-failed-saves", "3"],
                      ["--steps", "40", "--out", str(tmp_path / "out")], {}, timeout=240)
    run = tmp_path / "run"
    assert r.returncode == CKPT_FAILED_EXIT_CODE, r.stderr[-4000:]
    # one line per failed save, from rank 0 only, and no traceback on the terminal
    lines = save_lines(r.stderr)
    assert [ln.split("checkpoint of step ")[1].split(" ")[0] for ln in lines] == ["1", "3", "5"], r.stderr[-4000:]
    assert "No space left on device" in lines[0]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    # the traceback went to the log file, once per rank process
    tb = (run / "logs" / "checkpoint-errors.log").read_text()
    assert tb.count("step 1:\nTraceback") >= 1 and "step 3:" not in tb, tb[:2000]
    # the cause, named on the terminal and in the ledger
    assert f"the job stopped (exit {CKPT_FAILED_EXIT_CODE})" in r.stderr
    assert f"local tier {full_disk / 'ckpt'}" in r.stderr
    assert [d["step"] for d in events(run, EventKind.CKPT_SAVE_FAILED)] == [1, 3, 5]
    stop = events(run, EventKind.CKPT_STOP)
    assert len(stop) == 1 and stop[0]["steps"] == [1, 3, 5] and stop[0]["tier"] == "local", stop
    end = events(run, EventKind.RUN_END)[-1]
    assert end["exit_code"] == CKPT_FAILED_EXIT_CODE and "checkpoint saves failed" in end["reason"], end
    # a real stop: one attempt, no restart, and the script never reached its end
    assert len(events(run, EventKind.ATTEMPT_START)) == 1
    assert not events(run, EventKind.RESTART)
    assert not (tmp_path / "out" / "rank0.pt").exists()
    # the closing summary says which saves failed
    assert "checkpoints: 3 failed save(s) (reached no tier): steps 1, 3, 5" in r.stderr


@pytest.mark.timeout(300)
def test_max_failed_saves_0_trains_on_and_the_reports_list_the_failed_saves(tmp_path: Path, full_disk: Path) -> None:
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir",
           str(tmp_path / "run"), "--ckpt-local", str(full_disk / "ckpt"), "--ckpt-interval", "2",
           str(TRAIN_STEPS), "--steps", "10", "--dim", "8", "--hidden", "16", "--batch", "4"]
    r = subprocess.run(cmd, cwd=REPO, env=_child_env({"RESILIENT_CKPT_MAX_FAILED_SAVES": "0"}), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[train] done" in r.stdout
    assert len(save_lines(r.stderr)) == 5 and "training goes on without checkpoints" in save_lines(r.stderr)[0]
    assert "checkpoints: 5 failed save(s) (reached no tier): steps 1, 3, 5, 7, 9; first error: local: " in r.stderr
    assert not events(tmp_path / "run", EventKind.CKPT_STOP)
    rep = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(tmp_path / "run"), "--json"],
                         cwd=REPO, env=_child_env({}), capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    ck = json.loads(rep.stdout)["checkpoints"]
    assert ck["failed"]["steps"] == [1, 3, 5, 7, 9] and "No space left" in ck["failed"]["first_error"], ck
    assert ck["tiers"] == {}, ck
    table = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(tmp_path / "run")],
                           cwd=REPO, env=_child_env({}), capture_output=True, text=True, timeout=120)
    assert "5 failed save(s) (reached no tier): steps 1, 3, 5, 7, 9" in table.stdout, table.stdout


@pytest.mark.parametrize("flag,env", [(["--ckpt-max-failed-saves", "-1"], {}),
                                      (["--ckpt-max-failed-saves", "two"], {}),
                                      (["--ckpt-max-failed-saves=1.5"], {}),
                                      ([], {"RESILIENT_CKPT_MAX_FAILED_SAVES": "-3"})])
def test_bad_max_failed_saves_is_one_line_and_exit_2(tmp_path: Path, flag: list[str], env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir",
                        str(tmp_path / "run"), *flag, str(REPO / "examples" / "ckpt_train.py"), "--out", "x"],
                       cwd=REPO, env=_child_env(env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "pynvml" not in ln and "import pynvml" not in ln]
    assert len(lines) == 1 and "max-failed-saves" in lines[0].lower().replace("_", "-"), r.stderr
    assert ">= 0" in lines[0], r.stderr  # what a good value is
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.timeout(300)
def test_restart_that_finds_no_checkpoint_says_so(tmp_path: Path) -> None:
    # rank 1 deletes the node's local tier once step 3 is saved, then dies: the restart finds no checkpoint (no
    # snapshots in node memory either: they would restore it)
    r = resilient_run(tmp_path, ["--max-restarts", "1", "--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-interval", "2",
                                 "--ckpt-snapshot", "off"],
                      ["--steps", "8", "--out", str(tmp_path / "out")],
                      plan_env(WorkerFault(FaultHow.LOSE_DISK, rank=1, step=3)), timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "run"
    assert injected(run) == ["lose-disk"]
    missing = events(run, EventKind.CKPT_RESTORE_MISSING)
    assert len(missing) == 1 and missing[0]["attempt"] == 1, missing
    assert missing[0]["attempted_steps"] == [1, 3] and missing[0]["done"]["local"] == [1, 3], missing
    assert missing[0]["tiers"]["local"] == str(tmp_path / "ckpt"), missing
    line = [ln for ln in r.stderr.splitlines() if "restore: no checkpoint found" in ln]
    assert len(line) == 1 and "steps 1, 3" in line[0] and str(tmp_path / "ckpt") in line[0], r.stderr[-4000:]
    assert "a restart found no checkpoint although steps 1, 3 were saved before" in r.stderr


def test_wait_is_false_after_a_failed_save_and_alone_the_stop_raises(tmp_path: Path, full_disk: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith(("RESILIENT_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(k)
    with pytest.raises(CheckpointConfigError, match="max_failed_saves=-1"):
        CheckpointManager(local=tmp_path / "ok", max_failed_saves=-1)
    model = torch.nn.Linear(4, 4)
    ck = CheckpointManager(local=full_disk / "ckpt", interval=1, peer=False, max_failed_saves=2)
    try:
        assert ck.last_save_reached_a_tier is None  # no save yet
        assert ck.save(0, {"model": model})
        assert ck.wait(60) is False  # the save reached no tier
        assert ck.last_save_reached_a_tier is False  # a failed save, not a timeout
        assert ck.last_saved_step is None
        assert ck.save(1, {"model": model})  # the second failure in a row: the next save stops
        with pytest.raises(CheckpointSavesFailedError, match=r"2 checkpoint saves in a row reached no tier") as e:
            ck.save(2, {"model": model})
        assert e.value.steps == [0, 1] and e.value.tier == "local" and "No space left" in (e.value.error or "")
    finally:
        ck.close(timeout=60)
    good = CheckpointManager(local=tmp_path / "good", interval=1, peer=False)
    try:
        good.save(0, {"model": model})
        assert good.wait(60) is True and good.last_saved_step == 0 and good.last_save_reached_a_tier is True
    finally:
        good.close(timeout=60)



@pytest.mark.timeout(120)
def test_full_disk_and_dead_store_count_as_failed_saves(tmp_path: Path, full_disk: Path, gcs,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the local tier is full, so each save goes to the persistent tier as an upload of its in-memory copy, and that
    # store is dead (its server killed): no save reaches a tier. Each counts as failed once its upload failed, and
    # max_failed_saves of them stop the job as a full disk alone does
    for k in [k for k in os.environ if k.startswith(("RESILIENT_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(k)
    gcs.make_bucket("dead")
    gcs.stop()
    model = torch.nn.Linear(4, 4)
    ck = CheckpointManager(local=full_disk / "ckpt", persistent="gs://dead/run", interval=1, persistent_every=1,
                           peer=False, max_failed_saves=2, persistent_timeout_s=2, upload_retries=0,
                           upload_grace_s=60, restore_probe_s=1)
    try:
        with pytest.raises(CheckpointSavesFailedError, match=r"2 checkpoint saves in a row reached no tier") as e:
            for step in range(6):
                assert ck.save(step, {"model": model})
                # the save went out as an upload (the local write failed): wait() is False once that upload failed
                assert ck.wait(60) is False and ck.last_save_reached_a_tier is False
        assert step == 3, step  # counted at the next save after each upload failed: saves 0 and 1, stop at 3
        assert e.value.steps == [0, 1] and e.value.tier == "persistent", (e.value.steps, e.value.tier)
        assert "its upload failed after the local write failed" in (e.value.error or ""), e.value.error
    finally:
        ck.close(timeout=60)



def _on_a_stopped_store(full_disk: Path, gcs, monkeypatch: pytest.MonkeyPatch, bucket: str,  # type: ignore[no-untyped-def]
                        persistent_timeout_s: float) -> CheckpointManager:
    """A manager saving every step to a full disk and uploading every save to ``bucket`` of ``gcs``, whose server
    is then stopped (SIGSTOP: the caller resumes it); a single failed save that counts stops it."""
    for k in [k for k in os.environ if k.startswith(("RESILIENT_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(k)
    gcs.make_bucket(bucket)
    ck = CheckpointManager(local=full_disk / "ckpt", persistent=f"gs://{bucket}/run", interval=1, persistent_every=1,
                           peer=False, max_failed_saves=1, persistent_timeout_s=persistent_timeout_s,
                           upload_retries=0, upload_grace_s=60, restore_probe_s=1)
    os.kill(gcs.proc.pid, signal.SIGSTOP)
    return ck


@pytest.mark.timeout(120)
def test_an_upload_that_fails_after_a_newer_save_reached_a_tier_is_reported_not_counted(
        tmp_path: Path, full_disk: Path, gcs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # step 0 goes out only as an upload (full disk) to a store that hangs (SIGSTOP); the disk is freed and step 1
    # reaches the local tier while that upload still waits; then the upload fails. Step 0 reached no tier (reported),
    # but the failed saves "in a row" are those after the newest save that reached one: none, so no stop
    model = torch.nn.Linear(4, 4)
    ck = _on_a_stopped_store(full_disk, gcs, monkeypatch, "hung", persistent_timeout_s=5)
    try:
        assert ck.save(0, {"model": model})
        assert ck.wait(60, upload_timeout=0) is False  # saved as a queued upload, which is still waiting
        (full_disk / "filler").unlink()
        assert ck.save(1, {"model": model})
        assert ck.wait(60) is True  # both uploads failed, but step 1 is on the local tier: a saved step
        assert ck.last_saved_step == 1
        with caplog.at_level(logging.WARNING, logger="resilient.checkpoint.save.manager"):
            assert ck.save(2, {"model": model})
            assert ck.wait(60, upload_timeout=0) in (True, False)
            assert ck.save(3, {"model": model})  # no stop: nothing failed after step 1
        lines = [r.getMessage() for r in caplog.records if "checkpoint of step 0 failed" in r.getMessage()]
        # step 0's upload either started and failed, or (the upload thread kept off a core until step 1 was asked
        # for) was dropped for step 1's before it started: reported either way
        assert len(lines) == 1 and ("its upload failed" in lines[0] or "dropped before it started" in lines[0]) \
            and "step 1 has since reached a tier" in lines[0], lines
    finally:
        os.kill(gcs.proc.pid, signal.SIGCONT)
        ck.close(timeout=60)


@pytest.mark.timeout(120)
def test_a_queued_upload_replaced_by_a_newer_one_before_it_started_is_reported_not_counted(
        tmp_path: Path, full_disk: Path, gcs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # every save goes out only as an upload (full disk). Step 0's upload hangs on a stopped store while steps 1 and
    # 2 are asked for; the store resumes, and the uploader takes the newest, 2, dropping 1 before it started. Step 1
    # reached no tier and is reported; it is not counted (max_failed_saves=1 would stop the job): step 2 stands for it
    model = torch.nn.Linear(4, 4)
    ck = _on_a_stopped_store(full_disk, gcs, monkeypatch, "slow", persistent_timeout_s=60)
    stopped = True
    try:
        with caplog.at_level(logging.WARNING, logger="resilient.checkpoint.save.manager"):
            assert ck.save(0, {"model": model})
            deadline = time.monotonic() + 30
            while ck._up._up_current != 0:  # step 0's upload has started (and waits on the stopped store)
                assert time.monotonic() < deadline, "step 0's upload never started"
                time.sleep(0.01)
            for step in (1, 2):
                assert ck.save(step, {"model": model})
                assert ck.wait(60, upload_timeout=0) in (True, False)
            os.kill(gcs.proc.pid, signal.SIGCONT)
            stopped = False
            assert ck.wait(60) is True  # steps 0 and 2 landed
            for step in (3, 4):  # no stop: nothing counted failed
                assert ck.save(step, {"model": model})
                assert ck.wait(60) is True
        assert ck._up.superseded == {1: 2}, ck._up.superseded
        lines = [r.getMessage() for r in caplog.records if "checkpoint of step" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("checkpoint of step 1 failed") \
            and "dropped before it started, for step 2's" in lines[0], lines
    finally:
        if stopped:
            os.kill(gcs.proc.pid, signal.SIGCONT)
        ck.close(timeout=60)


@pytest.mark.timeout(300)
def test_full_disk_and_full_store_stop_the_job(tmp_path: Path, full_disk: Path) -> None:
    # the same under resilient-run, with the persistent tier on a full filesystem too (a shared volume that filled
    # up): the job stops with its own code after --ckpt-max-failed-saves saves that reached no tier, where it used to
    # train on to the end and exit 0 with no checkpoint anywhere
    r = resilient_run(tmp_path, ["--max-restarts", "2", "--ckpt-local", str(full_disk / "ckpt"), "--ckpt-interval", "2",
                                 "--ckpt-persistent", f"file://{full_disk}/store", "--ckpt-persistent-every", "1",
                                 "--ckpt-max-failed-saves", "3"],
                      ["--steps", "100000", "--out", str(tmp_path / "out")], {}, timeout=240)
    run = tmp_path / "run"
    assert r.returncode == CKPT_FAILED_EXIT_CODE, r.stderr[-4000:]
    failed = events(run, EventKind.CKPT_SAVE_FAILED)
    assert len(failed) >= 3 and all(d["tier"] == "persistent" for d in failed), failed
    assert "No space left on device" in failed[0]["error"], failed
    stop = events(run, EventKind.CKPT_STOP)
    assert len(stop) == 1 and stop[0]["tier"] == "persistent" and len(stop[0]["steps"]) == 3, stop
    assert f"the job stopped (exit {CKPT_FAILED_EXIT_CODE})" in r.stderr
    assert "persistent tier file://" in r.stderr, r.stderr[-4000:]
    assert len(events(run, EventKind.ATTEMPT_START)) == 1 and not events(run, EventKind.RESTART)
