"""``examples/demo.py`` stopped by Ctrl-C once training runs: nothing it started is left (checked by session: the
demo's own, and the session of every node agent). SIGTERM while the nodes join: tests/cluster/test_demo.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from resilient.events import read_events
from tests._helpers.wait import wait_for
from tests._helpers.procs import session_procs

ROOT = Path(__file__).resolve().parents[2]


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [e.to_json() for e in read_events(run_dir)]  # every writer's file


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
    # stderr to a file, not a pipe: a process that outlives the demo holding the pipe must not block the test (it
    # is looked for below, by session)
    err_path = tmp_path / "demo.err"
    errf = open(err_path, "wb")
    demo = subprocess.Popen([sys.executable, str(ROOT / "examples" / "demo.py"), *steps, "--run-dir", str(run)],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)
    errf.close()
    sessions = {demo.pid}
    try:
        deadline = time.monotonic() + 200
        while not (trained(run) and len(agent_sessions(run)) == 3):
            assert demo.poll() is None, err_path.read_text(errors="replace")
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
            demo.wait(timeout=150)
        except subprocess.TimeoutExpired:
            alive = [(p.pid, p.name(), " ".join(p.cmdline())[:120]) for sid in sessions for p in session_procs(sid)]
            demo.send_signal(signal.SIGUSR1)  # the demo prints every thread's stack: where it waits
            wait_for(lambda: "most recent call first" in err_path.read_text(errors="replace"), 10,
                     "the demo's stacks")
            raise AssertionError(f"the demo did not finish its clean-up within 150 s of the signal (alive in its "
                                 f"sessions: {alive}):\n" + err_path.read_text(errors="replace")[-6000:])
        err = err_path.read_bytes()
        assert demo.returncode == 128 + sig, err.decode(errors="replace")
        left = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        left += [p for sid in sessions for p in session_procs(sid)]
        assert not left, [(p.pid, p.name()) for p in left]
        # nothing anywhere still holds the demo's stderr (a child that inherited it and left its sessions)
        holders = []
        for p in psutil.process_iter(["pid"]):
            try:
                if any(f.path == str(err_path) for f in p.open_files()):
                    holders.append((p.pid, p.name(), " ".join(p.cmdline())[:160]))
            except psutil.Error:
                pass
        assert not holders, holders
    finally:
        for sid in sessions:
            for p in session_procs(sid):
                p.kill()
