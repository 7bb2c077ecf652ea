"""After every way a job can end, nothing of it is left running: no worker, fork server, async writer,
uploader or monitor. Checked by Unix session: the launcher starts its own session, and everything it
starts (directly or not) inherits it."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers.wait import wait_for
from tests._helpers.procs import kill_sessions, session_procs

SCRIPT = Path(__file__).with_name("scripts") / "train.py"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launch", ["fork-server", "spawn"])
@pytest.mark.parametrize("end", ["success", "failure", "sigint", "sigterm", "sigkill"])
def test_nothing_of_the_job_outlives_it(tmp_path, launch, end):
    out = tmp_path / "out"
    out.mkdir()
    mode = {"success": "ok", "failure": "fail"}.get(end, "wait")
    steps = "8" if mode == "ok" else "100000"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--worker-launch", launch,
           "--term-timeout", "10", "--run-dir", str(tmp_path / "run"), "--ckpt-local", str(tmp_path / "local"),
           "--ckpt-persistent", f"file://{tmp_path / 'persistent'}", "--ckpt-interval", "2",
           # a rank that raises gives its pending uploads the grace before it exits (its peer never joins them):
           # 60 s by default, waited out in full. A short grace takes the same path (uploads abandoned at exit,
           # the upload thread stopped), which is what must leave nothing behind
           "--upload-grace", "3",
           str(SCRIPT), str(out), mode, steps]
    errf = open(tmp_path / "launcher.err", "w")  # a file, not a pipe: an orphan holding it must not block us
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=errf)
    sid = p.pid  # a new session's id is its leader's pid
    try:
        if end in ("sigint", "sigterm", "sigkill"):
            wait_for(lambda: all((out / f"ready_{r}").exists() for r in (0, 1)), 90, "workers training")
            assert len(session_procs(sid)) >= 3  # the agent and its workers (and fork server) are seen
            p.send_signal({"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[end])
        p.wait(timeout=100)
        err = (tmp_path / "launcher.err").read_text()
        if end == "success":
            assert p.returncode == 0, err[-3000:]
        elif end == "sigkill":
            assert p.returncode == -signal.SIGKILL
        else:
            assert p.returncode != 0, err[-3000:]
        wait_for(lambda: not session_procs(sid), 20,
                 f"every process of the job to end ({[(q.pid, q.name()) for q in session_procs(sid)]})")
    finally:
        kill_sessions([p])
        errf.close()
