"""``make demo`` (``examples/demo.py``): the recipe's GPT on 2 nodes and a warm spare; a worker SIGKILLed, a worker
frozen and a whole node SIGKILLed through ``--inject``; the spare takes the lost node's place and restores its rank;
a second node SIGKILLed with no spare left drops its replica (scale down) and a fresh node for it is added back
(scale up);
the demo prints each fault as the ledger shows it and ends with the goodput report and its timeline, leaving no
process behind, also when stopped by SIGTERM. Also: the goodput of a run with a lost node ends."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from resilient.events import Event, EventKind, read_events
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


class Demo:
    """``examples/demo.py`` in a session of its own, its output read line by line as it comes."""

    def __init__(self, run: Path, *flags: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
        env["PYTHONPATH"] = str(REPO)
        self.run = run
        self.proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "demo.py"), "--run-dir", str(run),
                                      *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.sids = {self.proc.pid}  # the demo's session and, once they are named, the supervisor's and the nodes'

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._q.put(raw.decode(errors="replace"))
        self._q.put(None)

    def _take(self, line: str) -> None:
        self.lines.append(line)
        m = re.search(r"(?:node \w+|supervisor) started \((?:agent )?pid (\d+), a session of its own", line)
        if m:
            self.sids.add(int(m[1]))  # started with start_new_session: its pid is its session's id

    def wait_line(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s:\n{self.text[-4000:]}")
            if line is None:
                raise AssertionError(f"the demo ended without a line matching {pattern!r}:\n{self.text[-4000:]}")
            self._take(line)
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        while (line := self._q.get(timeout=10)) is not None:
            self._take(line)
        return code

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for p in _sessions_left(self.sids):
            p.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,why", [(["--inject", "kill-worker@soon"], "cannot read 'kill-worker@soon'"),
                                       (["--steps", "0"], "--steps must be at least 1"),
                                       (["--run-dir", "{keep}"], "holds no earlier run")])
def test_demo_bad_input_is_one_line_and_exit_2_and_deletes_nothing(tmp_path: Path, flags: list[str], why: str) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    flags = [f.format(keep=keep) for f in flags]
    if "--run-dir" not in flags:
        flags += ["--run-dir", str(tmp_path / "run")]
    r = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), *flags], cwd=REPO, capture_output=True,
                       text=True, timeout=50)
    assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (keep / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_demo_quick_loses_a_worker_a_hang_and_a_node_and_ends_with_the_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    demo = Demo(run, "--quick", "--seed", "7")
    try:
        code = demo.finish(280)
        text = demo.text
        assert code == 0, text[-6000:]
        # the demo's, the supervisor's, one per node (the node brought back included)
        assert len(demo.sids) == 6, (demo.sids, text[-3000:])
        evs = [e.to_json() for e in read_events(run)]  # every writer's file
        injected = sorted(e["details"]["fault"] for e in evs if e["kind"] == "fault_injected")
        assert injected == ["hang-worker", "kill-node", "kill-node", "kill-worker"], injected
        # each fault was seen for what it is, and training went on after each
        kinds = {e["kind"] for e in evs}
        assert {"worker_exit", "hang", "agent_lost"} <= kinds, kinds
        swaps = [e for e in evs if e["kind"] == "action" and e["details"]["action"] == "hot_swap"]
        assert len(swaps) == 1, [e["details"] for e in evs if e["kind"] == "action"]
        spare = swaps[0]["details"]["action_args"]["spare"]
        assert any(e["kind"] == "ckpt_restore" and e["node"] == spare for e in evs)
        summary = json.loads((run / "demo.json").read_text())
        assert summary["problems"] == [] and summary["hot_swap"]["lost"] != summary["hot_swap"]["spare"], summary
        assert [f["kind"] for f in summary["faults"]] == ["kill-worker", "hang-worker", "kill-node", "kill-node",
                                                          "node-back"], summary
        assert [f.get("action") for f in summary["faults"][2:]] == ["hot_swap", "scale_down", "scale_up"], summary
        assert all(f["first_step_s"] > 0 for f in summary["faults"]), summary
        # the scale-up is recorded when decided and again when carried out at a checkpoint boundary
        assert len(summary["scale_down"]) == 1, summary
        assert any("checkpoint boundary" in r for r in summary["scale_up"]), summary
        # the lost node's disk went with it; the persistent tier (file:// by default) holds complete steps
        assert not (run / f"ckpt-local-{summary['hot_swap']['lost']}").exists()
        assert any((run / "persistent").glob("step_*/COMMITTED")), list((run / "persistent").iterdir())
        # a line per fault as it happened, then the table, the report and the timeline
        for pat in (r"FAULT +kill-worker:\d@5s on node \w: SIGKILL rank \d", r"FAULT +hang-worker:\d@13s",
                    r"FAULT +kill-node:1@21s on node \w: SIGKILL the whole node", r"detected a hang: rank \d",
                    r"ACTION +supervisor: hot_swap", r"restored rank 1 on node \w: step \d+ from peer",
                    r"node kill → first step after the swap: \d+\.\d\d s",
                    r"ACTION +supervisor: scale_down", r"ACTION +supervisor: scale_up",
                    r"node kill with no spare → first step with one replica fewer: \d+\.\d\d s",
                    r"node back → first step with the replica added again: \d+\.\d\d s",
                    # the report's own figures are checked in goodput.json below: the printed line is rich's
                    # to wrap (its width depends on where the output goes)
                    r"goodput [\d.]+% of "):
            assert re.search(pat, text), (pat, [ln for ln in text.splitlines() if "goodput" in ln], text[-5000:])
        report = json.loads((run / "goodput.json").read_text())
        assert report["last_step"] == 419 and not report["in_progress"] and report["disruptions"] >= 4, report
        png = run / "goodput.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert not _sessions_left(demo.sids)
    finally:
        demo.close()


@pytest.mark.timeout(120)
def test_demo_stopped_by_sigterm_leaves_no_process(tmp_path: Path) -> None:
    """Stopped while the nodes join (their fork servers importing torch: the moment with the most processes
    coming and going), with the persistent tier on the bundled GCS server: the server goes too."""
    demo = Demo(tmp_path / "run", "--quick", "--gcs")
    try:
        for _ in range(3):
            demo.wait_line(r"node \w: agent up", 90)
        gcs = [p for p in psutil.Process(demo.proc.pid).children() if "fake-gcs-server" in " ".join(p.cmdline())]
        assert gcs, "no GCS server among the demo's children"
        demo.proc.send_signal(signal.SIGTERM)
        code = demo.finish(60)
        assert code == 128 + signal.SIGTERM, demo.text[-4000:]
        assert "demo: stopped by SIGTERM; the supervisor, the agents and the GCS server were stopped" in demo.text, demo.text[-3000:]
        assert len(demo.sids) == 5
        assert not _sessions_left(demo.sids)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in gcs)
    finally:
        demo.close()
