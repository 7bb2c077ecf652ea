"""End to end through the real launcher (``python -m resilient.run``): hang → restart → resume,
straggler and full-disk events in the run's ledger."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from tests._helpers.wait import wait_for
from tests.signals.harness import REPO, WORKER

LIGHT = str(Path(__file__).with_name("light_worker.py"))


def launch(tmp_path, args, env):
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    e.update({"PYTHONPATH": REPO, **env})
    return subprocess.Popen([sys.executable, "-m", "resilient.run", "--standalone", *args],
                            cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

# rank 1 waits in dist.recv at step 4 of attempt 0 for a message no peer sends
STUCK = plan_env(WorkerFault(FaultHow.HANG_COLLECTIVE, rank=1, step=4, attempt=0))


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def of(evs, kind):
    return [e for e in evs if e.kind == kind]


@pytest.mark.timeout(150)
def test_frozen_rank_is_detected_restarted_and_training_resumes(tmp_path, procs):
    mark, run, out = tmp_path / "mark", tmp_path / "run", tmp_path / "out"
    mark.mkdir()
    out.mkdir()
    p = launch(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "2",
                          "--run-dir", str(run), WORKER],
               {"T_STEPS": "15", "T_WORK": "0.01", "T_MARK_STEP": "5", "T_MARK_DIR": str(mark), "T_OUT": str(out)})
    procs.append(p)
    wait_for(lambda: all((mark / f"rank{r}.step").exists() for r in (0, 1)), 90, "both ranks at step 5", p)
    frozen = int((mark / "rank1.step").read_text())
    os.kill(frozen, signal.SIGSTOP)
    (mark / "go").touch()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    evs = list(read_events(run))
    hangs = of(evs, EventKind.HANG)
    assert hangs and hangs[0].rank == 1 and hangs[0].details["suspect"] is True
    assert hangs[0].details["process_state"] == "T" and hangs[0].attempt == 0
    assert [e.details.get("cause") for e in of(evs, EventKind.RESTART)] == ["hung"]
    # attempt 1 trained every step to the end
    assert [e.details["step"] for e in of(evs, EventKind.STEP) if e.attempt == 1] == list(range(15))
    assert all((out / f"rank{r}.done").exists() for r in (0, 1))
    # the frozen process did not survive the restart
    with pytest.raises(ProcessLookupError):
        os.kill(frozen, 0)


@pytest.mark.timeout(150)
def test_rank_stuck_in_communication_is_detected_and_restarted(tmp_path, procs):
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    p = launch(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "2",
                          "--run-dir", str(run), WORKER],
               {"T_STEPS": "12", "T_WORK": "0.01", **STUCK, "T_OUT": str(out)})
    procs.append(p)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    evs = list(read_events(run))
    hangs = of(evs, EventKind.HANG)
    assert hangs and hangs[0].attempt == 0 and hangs[0].details["step"] == 4
    assert hangs[0].details["process_state"] in ("S", "R")  # alive and waiting, not stopped
    assert [e.details.get("cause") for e in of(evs, EventKind.RESTART)] == ["hung"]
    assert [e.details["step"] for e in of(evs, EventKind.STEP) if e.attempt == 1] == list(range(12))
    assert all((out / f"rank{r}.done").exists() for r in (0, 1))


@pytest.mark.timeout(150)
def test_slow_rank_shows_as_straggler_in_the_ledger(tmp_path, procs):
    run = tmp_path / "run"
    p = launch(tmp_path, ["--nproc-per-node", "2", "--run-dir", str(run), WORKER],
               {"T_STEPS": "35", "T_WORK": "0.03", "T_SLOW_RANK": "1", "T_SLOW_EXTRA": "0.03", "T_SLOW_FROM": "5"})
    procs.append(p)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    found = of(list(read_events(run)), EventKind.STRAGGLER)
    assert {e.rank for e in found} == {1}, [(e.rank, e.details) for e in found]
    assert min(e.details["step"] for e in found) <= 25


@pytest.mark.timeout(90)
def test_full_local_tier_is_reported(tmp_path, procs):
    local = tmp_path / "local"
    local.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(local)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?); the fallocate variant is in test_health.py")
    try:
        with open(local / "fill", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        run = tmp_path / "run"
        p = launch(tmp_path, ["--nproc-per-node", "1", "--run-dir", str(run), "--ckpt-local", str(local), LIGHT],
                   {"T_STEPS": "40", "T_STEP_SLEEP": "0.05"})
        procs.append(p)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        (e,) = [e for e in read_events(run) if e.kind == EventKind.HOST_UNHEALTHY and e.details["check"] == "disk_free"]
        assert e.details["path"] == str(local) and e.details["value"] < e.details["threshold"]
    finally:
        subprocess.run(["umount", "-l", str(local)], capture_output=True)
