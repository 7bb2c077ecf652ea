"""``examples/demo.py``'s second act: a 2-node job and a warm spare; node 1 is SIGKILLed whole by ``--inject``, its
disk deleted, the spare takes its place and restores the lost rank from the peer tier; the demo shows it from the
ledger and both remaining agents end with 0. Also: the goodput of a run with a lost node ends."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from resilient.events import Event, EventKind
from resilient.goodput.calculator import compute_report

from .conftest import REPO


def _ev(kind: EventKind, wall: float, node: str, **details) -> Event:
    return Event(kind=kind, node=node, details=details, wall=wall, mono=wall)


def test_goodput_of_a_run_whose_lost_node_never_wrote_run_end_has_ended() -> None:
    K = EventKind
    evs = [_ev(K.RUN_START, 0.0, "a"), _ev(K.RUN_START, 0.5, "b"), _ev(K.ATTEMPT_START, 1.0, "a"),
           _ev(K.AGENT_LOST, 5.0, "b", reason="disconnected"), _ev(K.RUN_START, 5.5, "spare"),
           _ev(K.RUN_END, 9.0, "spare", exit_code=0), _ev(K.RUN_END, 10.0, "a", exit_code=0)]
    rep = compute_report(evs, now=1000.0)
    assert not rep.in_progress and rep.end_wall == 10.0 and rep.wall_seconds == 10.0
    # a node lost by timeout that was heard from again has not ended until it says so
    back = evs[:4] + [_ev(K.LOG, 6.0, "b", message="back")] + evs[4:]
    assert compute_report(back, now=1000.0).in_progress


def _sessions_left(sids: set[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) in sids and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


@pytest.mark.timeout(300)
def test_demo_second_act_node_lost_and_replaced_by_a_warm_spare(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    demo = subprocess.Popen([sys.executable, str(REPO / "examples" / "demo.py"), "--steps", "40", "--node-steps",
                             "400", "--kill-at", "8", "--run-dir", str(run)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    sids = {demo.pid}
    try:
        out, _ = demo.communicate(timeout=280)
        text = out.decode(errors="replace")
        evs = [json.loads(line) for line in (run / "nodes" / "events.jsonl").read_text().splitlines()]
        host = socket.gethostname()
        sids |= {int(e["node"].rsplit(":", 1)[1]) for e in evs if e["kind"] == "run_start"
                 and e["node"].startswith(host + ":")}
        assert demo.returncode == 0, text[-6000:]
        act2 = text[text.index("act 2: a node lost"):]
        assert "agents exited: a 0, b SIGKILL, spare 0" in act2, act2[-4000:]
        kill = [e for e in evs if e["kind"] == "fault_injected"]
        assert [e["details"]["fault"] for e in kill] == ["kill-node"]
        assert re.search(r"fault_injected +kill-node:1@8s on node b ", act2), act2[-4000:]
        assert re.search(r"agent_lost +node b \(\S+\), reason \"disconnected\"", act2), act2[-4000:]
        assert re.search(r"action hot_swap +b \(\S+\) → spare spare ", act2), act2[-4000:]
        assert re.search(r"ckpt_restore +rank 1 on the spare: step \d+ from tier \"peer\"", act2), act2[-4000:]
        assert re.search(r"kill → first step after the swap: \d+\.\d\d s", act2), act2[-4000:]
        # the goodput report of the second run: ended, one disruption handled by one restart
        assert re.search(r"goodput [\d.]+% of .* \(ended\) · 1 disruption\(s\) · 1 restart\(s\) · last step 399",
                         act2), act2[-4000:]
        assert "deleted its local tier ckpt-local-b" in act2
        assert not (run / "nodes" / "ckpt-local-b").exists()  # the lost node's disk
        assert (run / "nodes" / "goodput.png").exists()
        assert len(sids) == 4, sids  # the demo's session and one per node
        assert not _sessions_left(sids)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)
            demo.wait(90)
        for p in _sessions_left(sids):
            p.kill()
