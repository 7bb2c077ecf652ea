"""Agents read a plan from the store when the supervisor's notice announces it, not at every pass.

A real 2-node job under the default set-up (the first agent hosts the store and the supervisor): the other agent's
reads of the store for a plan, by what made it look (the ``plan_looks`` of its ``run_end`` event). A worker of
that node SIGKILLed at a gate makes the supervisor decide a restart: the agent takes that plan because its notice
announced it, and between notices it reads the store once a ``PLAN_LOOK_S`` at most, where it used to read at every
pass of its loop (``--monitor-interval``, 0.1 s): at 512 nodes those reads doubled the supervisor's CPU at rest.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.launcher.control import PLAN_LOOK_S

from .conftest import wait_for
from .test_node_loss import _start_job, at_gate, node_name


@pytest.mark.timeout(240, func_only=True)
def test_the_agent_reads_plans_when_announced_and_rarely_otherwise(cluster_factory, tmp_path: Path) -> None:
    c = cluster_factory("2", flags=["--max-restarts", "2", "--monitor-interval", "0.1"])
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    # steps of 0.3 s: the gate is reached well past the first second of node b's connection, when it reads the
    # store often (see control._LOOK_AFTER_CONNECT_S), so the restart's plan can only come through the notice or the
    # timer
    a, b = _start_job(c, ["--steps", "9", "--out", str(out), "--gate", str(gate), "--gate-step", "6",
                          "--step-sleep", "0.3"])
    wait_for(lambda: at_gate(gate, 2) or a.proc.poll() is not None or b.proc.poll() is not None, 90,
             "both ranks at the gate")
    starts = [e for e in c.events() if e.kind == EventKind.ATTEMPT_START and e.node == node_name(b)]
    (pid,) = starts[-1].details["pids"].values()
    os.kill(pid, signal.SIGKILL)  # a decision: the job restarts from step 6, past the gate
    wait_for(lambda: sum(e.kind == EventKind.ATTEMPT_START and e.node == node_name(b) for e in c.events()) >= 2,
             90, "node b's workers restarted")
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to end")
    assert a.proc.returncode == 0 and b.proc.returncode == 0, c.describe()
    mine = [e for e in c.events() if e.node == node_name(b)]
    (begin,) = [e for e in mine if e.kind == EventKind.RUN_START]
    (end,) = [e for e in mine if e.kind == EventKind.RUN_END]
    looks = end.details["plan_looks"]
    # the restart's plan was announced, and read because it was
    assert looks.get("announced", 0) >= 1, looks
    assert "hosting" not in looks, looks  # b is not the host: its reads are the notice path's
    # between notices the store is read once a PLAN_LOOK_S at most (at every 0.1-s pass, as before, would be about
    # five times that over the run)
    seconds = end.mono - begin.mono
    assert looks.get("timer", 0) <= seconds / PLAN_LOOK_S + 2, (looks, seconds)
    # and in the first second of its connection (a plan published before the supervisor took its hello) once a
    # --monitor-interval
    assert looks.get("connected", 0) <= 1.0 / 0.1 + 1, looks
