"""``examples/demo.py`` stopped by Ctrl-C once training runs: nothing it started is left (checked by session: the
demo's own, and the session of every node agent). SIGTERM while the nodes join: tests/cluster/test_demo.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from resilient.testing.procs import session_procs

ROOT = Path(__file__).resolve().parents[2]


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.endswith(b"}")]


def trained(run_dir: Path) -> bool:
    return any(e.get("kind") == "step" for e in ledger(run_dir))


def agent_sessions(run_dir: Path) -> set[int]:
    """The node agents: each was started in a session of its own, so its pid (named in the
    ledger as host:pid) is its session id."""
    host = socket.gethostname()
    return {int(e["node"].rsplit(":", 1)[1]) for e in ledger(run_dir)
            if e.get("kind") == "run_start" and e["node"].startswith(host + ":")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_demo_stopped_by_a_signal_leaves_nothing_running(tmp_path, sig):
    run = tmp_path / "run"
    steps = ["--steps", "4000", "--inject", "kill-node:1@500s"]  # no fault before the stop
    demo = subprocess.Popen([sys.executable, str(ROOT / "examples" / "demo.py"), *steps, "--run-dir", str(run)],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    sessions = {demo.pid}
    try:
        deadline = time.monotonic() + 200
        while not (trained(run) and len(agent_sessions(run)) == 3):
            assert demo.poll() is None, demo.stderr.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the demo never got to training"
            time.sleep(0.1)
        sessions |= agent_sessions(run)
        assert len(sessions) == 4, sessions  # the demo's, and node a's, node b's and the spare's
        # and the supervisor's: the demo's child that leads a session of its own and is no node
        sessions |= {c.pid for c in psutil.Process(demo.pid).children() if os.getsid(c.pid) == c.pid}
        assert len(sessions) == 5, sessions
        members = [p for sid in sessions for p in session_procs(sid)]
        # the demo, each agent and its fork server, the two workers
        assert len(members) >= 8, members
        demo.send_signal(sig)
        # its clean-up is bounded (agents get --term-timeout + 15 s, then every session is SIGKILLed): far less
        try:
            _, err = demo.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            demo.send_signal(signal.SIGUSR1)  # the demo prints every thread's stack: where it waits
            try:
                _, err = demo.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                err = b"(no stack printed)"
            raise AssertionError("the demo did not finish its clean-up within 150 s of the signal:\n"
                                 + err.decode(errors="replace")[-6000:])
        assert demo.returncode == 128 + sig, err.decode(errors="replace")
        left = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        left += [p for sid in sessions for p in session_procs(sid)]
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        for sid in sessions:
            for p in session_procs(sid):
                p.kill()
