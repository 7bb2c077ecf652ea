"""``examples/demo.py`` stopped by SIGTERM once training runs: nothing it started is left (checked by session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def session_members(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def trained(ledger: Path) -> bool:
    if not ledger.exists():
        return False
    return any(json.loads(line).get("kind") == "step" for line in ledger.read_bytes().splitlines()
               if line.endswith(b"}"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_demo_stopped_by_a_signal_leaves_nothing_running(tmp_path, sig):
    run = tmp_path / "run"
    demo = subprocess.Popen([sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "4000",
                             "--run-dir", str(run)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not trained(run / "events.jsonl"):
            assert demo.poll() is None, demo.stderr.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the demo never started training"
            time.sleep(0.1)
        members = session_members(demo.pid)
        assert len(members) >= 4  # the demo, the GCS server, the agent, workers
        demo.send_signal(sig)
        _, err = demo.communicate(timeout=90)
        assert demo.returncode == 128 + sig, err.decode(errors="replace")
        left = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        left += session_members(demo.pid)
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        for p in session_members(demo.pid):
            p.kill()
