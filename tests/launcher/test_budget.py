"""One restart budget, the supervisor's: under ``resilient supervisor`` (default --max-restarts 3) an agent left at
torchrun's default (0) shows the supervisor's budget to its workers and in its log, not its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers.gcs import free_port
from tests._helpers.procs import kill_sessions

from .conftest import run_launcher

BUDGET_SCRIPT = '''
import os, sys
out = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"attempt{attempt}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_MAX_RESTARTS"])
sys.exit(1 if attempt == "0" else 0)
'''


@pytest.mark.timeout(240)
def test_agents_show_the_standalone_supervisors_budget(tmp_path: Path) -> None:
    script, out, run_dir = tmp_path / "budget.py", tmp_path / "out", tmp_path / "run"
    script.write_text(BUDGET_SCRIPT)
    out.mkdir()
    port = free_port()
    endpoint = ["--rdzv-endpoint", f"127.0.0.1:{port}"]
    sup_log = tmp_path / "supervisor.log"
    with open(sup_log, "wb") as f:  # --max-restarts left at its default
        sup = subprocess.Popen([sys.executable, "-m", "resilient.cli", "supervisor", *endpoint, "--nnodes", "1",
                                "--rdzv-id", "budget", "--run-dir", str(run_dir), "--advertise-addr", "127.0.0.1"],
                               stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the agent's --max-restarts left at torchrun's default; it joins the supervisor's store
        r = run_launcher(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d", *endpoint,
                          "--rdzv-id", "budget", "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1",
                          "--run-dir", str(run_dir), str(script), str(out)], tmp_path, timeout=180)
        assert r.returncode == 0, r.stderr[-4000:]
        sup.wait(timeout=60)
    finally:
        kill_sessions([sup])
    assert (out / "attempt0").read_text() == "3" and (out / "attempt1").read_text() == "3"
    assert "attempt 1 of at most 3" in r.stderr, r.stderr[-4000:]
