from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from tests._helpers.procs import kill_sessions

HERE = Path(__file__).parent
TOY = HERE / "toy_train.py"


def launch(run_dir: Path, *, steps: int, save_every: int, crash_at: int = -1, extra_args: tuple[str, ...] = (),
           extra_env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.Popen:
    """Start the real ``resilient-run`` on the toy job; the caller waits for or kills it."""
    # rank 1 SIGKILLs itself at step crash_at in attempt 0
    faults = plan_env(WorkerFault(FaultHow.KILL, rank=1, step=crash_at, attempt=0)) if crash_at >= 0 else {}
    env = dict(os.environ, TOY_STEPS=str(steps), TOY_SAVE_EVERY=str(save_every), **faults, **(extra_env or {}))
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "2", "--run-dir", str(run_dir), *extra_args, str(TOY)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"resilient-run did not finish in {timeout} s:\n{out.decode(errors='replace')}")
    return out.decode(errors="replace")


def kill_group(proc: subprocess.Popen) -> None:
    """Nothing of the run outlives the test: its session and process tree are SIGKILLed."""
    kill_sessions([proc], timeout=30)


@pytest.fixture(scope="session")
def crashed_run(tmp_path_factory) -> Path:
    """A real 2-rank run where rank 1 is SIGKILLed at step 23 and the launcher restarts it from step 20."""
    run_dir = tmp_path_factory.mktemp("crashed_run")
    proc = launch(run_dir, steps=40, save_every=5, crash_at=23)
    try:
        out = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    return run_dir
