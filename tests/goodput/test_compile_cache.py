"""Compile caches survive a real restart under resilient-run: attempt 1 finds cache hits, not misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient import compile_cache
from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from tests.goodput.conftest import finish, kill_group

WORKER = Path(__file__).parent / "compile_worker.py"


@pytest.mark.timeout(240)
def test_restarted_worker_reuses_the_compile_cache(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, **plan_env(WorkerFault(FaultHow.KILL, rank=0, step=3, attempt=0)))
    proc = subprocess.Popen([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                             "--max-restarts", "1", "--run-dir", str(run_dir), str(WORKER)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = finish(proc, timeout=220)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    first = json.loads((run_dir / "counters-0.json").read_text())
    second = json.loads((run_dir / "counters-1.json").read_text())
    # attempt 0 compiled from nothing; attempt 1 started with an empty local cache too, yet hit
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not first["restored"]
    assert second["restored"]
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert (run_dir / compile_cache.DIRNAME / "artifacts-rank0.bin").stat().st_size > 0
    assert (run_dir / compile_cache.DIRNAME / "inductor-rank0.tar.gz").stat().st_size > 0


def test_restore_of_nothing_and_of_garbage(tmp_path, monkeypatch):
    assert compile_cache.restore(tmp_path) is None
    (tmp_path / "artifacts-rank0.bin").write_bytes(b"not a cache")
    assert compile_cache.restore(tmp_path, rank=3) is None  # falls back to rank 0's blob, which is unusable
    monkeypatch.delenv("RESILIENT_RUN_DIR", raising=False)
    assert compile_cache.enable(save_at_exit=False) is None  # not under resilient-run: nothing to do
    cc = compile_cache.enable(tmp_path, save_at_exit=False)
    assert cc is not None and cc.restored is None and cc.maybe_save() is None  # nothing compiled yet
