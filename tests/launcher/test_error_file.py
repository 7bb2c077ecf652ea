"""A worker's cause of death reaches its worker_exit event: the error file (torch elastic's format, written by
``@record`` or by the fork server) gives the exception type, first message line and frame; a failure class goes
with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient.launcher.api import WorkerExit
from resilient.launcher.exit import failure_cause, read_error_file

from .conftest import run_launcher

RAISES = '''
import sys
from torch.distributed.elastic.multiprocessing.errors import record


def check(step):
    if step == 1:
        raise ValueError(f"bad batch at step {step}\\nsecond line")


@record
def main():
    for step in range(3):
        check(step)


if __name__ == "__main__":
    main()
'''


def _worker_exits(run_dir: Path) -> list[dict]:
    evs = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines() if ln.strip()]
    return [e for e in evs if e["kind"] == "worker_exit"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_worker_exit_carries_exception_and_frame(tmp_path: Path, start: str) -> None:
    script, run_dir = tmp_path / "raises.py", tmp_path / "run"
    script.write_text(RAISES)
    extra = ["--worker-launch", "spawn"] if start == "spawn" else []
    r = run_launcher(["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--run-dir", str(run_dir),
                      *extra, str(script)],
                     tmp_path, timeout=100)
    assert r.returncode == 1, r.stderr[-3000:]
    exits = _worker_exits(run_dir)
    assert exits, r.stderr[-3000:]
    d = exits[0]["details"]
    assert d["exc_type"] == "ValueError", d
    assert d["message"] == "bad batch at step 1", d
    assert d["frame"] == f"{script}:8 in check", d
    assert d["failure_class"] == "software", d
    # the restart line says why
    assert f"failed (exitcode: 1): ValueError: bad batch at step 1 at {script}:8 in check" in r.stderr, r.stderr[-3000:]


def test_error_file_formats(tmp_path: Path) -> None:
    old = tmp_path / "old.json"  # the message as a plain string (torch's other accepted format)
    old.write_text(json.dumps({"message": "KeyError: 'x'"}))
    assert read_error_file(str(old)) == {"exc_type": "KeyError", "message": "'x'"}
    torn = tmp_path / "torn.json"
    torn.write_text('{"message": {"mess')
    assert read_error_file(str(torn)) == {}
    assert read_error_file(str(tmp_path / "none.json")) == {}
    assert read_error_file(None) == {}


def test_oom_kill_is_resource() -> None:
    ex = WorkerExit(local_rank=0, rank=0, pid=1, exit_code=-9, wall=0.0)
    assert failure_cause(ex, 4, 5) == {"oom_kill": True, "failure_class": "resource"}
    assert failure_cause(ex, 4, 4) == {"oom_kill": False, "failure_class": "transient"}
    assert failure_cause(ex, None, 4) == {"failure_class": "transient"}  # counter unreadable: not known
