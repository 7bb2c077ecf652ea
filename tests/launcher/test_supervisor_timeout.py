"""Nothing waits forever: an agent that needs a decision while no supervisor can be reached (dead, or hung
with SIGSTOP) exits within --supervisor-timeout with SUPERVISOR_UNREACHABLE_EXIT_CODE and one line naming the
cause, so that the scheduler requeues the job; while its workers are healthy it trains on (fail static)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.launcher.exit import SUPERVISOR_UNREACHABLE_EXIT_CODE
from tests.cluster.conftest import Cluster
from tests.cluster.test_node_loss import _listening
from tests._helpers.wait import wait_for

SECRET = {"RESILIENT_JOB_SECRET": "s3cret-for-tests-0123456789abcdef"}
BOUND = 8.0  # --supervisor-timeout of the agents
NODE_TIMEOUT = 5.0  # the agents' store calls give up after max(5, --node-timeout) seconds


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # one worker per node: the point is the agents' bounded wait for a decision, not the worker count
    c = Cluster(tmp_path / "c", "2", flags=["--heartbeat-timeout", "600", "--node-timeout", str(NODE_TIMEOUT),
                                             "--supervisor-timeout", str(BOUND)])
    c.tmp.mkdir(parents=True)
    yield c
    for n in c.nodes:  # a stopped supervisor must be let go before it can be killed and reaped
        try:
            os.kill(n.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    c.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_agents_that_need_a_decision_exit_within_the_bound_when_no_supervisor_answers(
        cluster: Cluster, tmp_path: Path, fault: str) -> None:
    c = cluster
    sup = c.start_supervisor(["--max-restarts", "3", "--node-timeout", str(NODE_TIMEOUT), "--last-call-timeout", "0"],
                             env=SECRET)
    wait_for(lambda: _listening(c.port) or sup.proc.poll() is not None, 60, "the supervisor to listen")
    assert sup.proc.poll() is None, f"the supervisor exited: {sup.output()}"
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", "8", "--out", str(out), "--gate", str(gate), "--gate-step", "2"]
    a, b = c.start("a", args, env=SECRET), c.start("b", args, env=SECRET)
    wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 120, "both ranks at the gate")
    os.kill(sup.proc.pid, getattr(signal, fault))  # hung (its kernel still accepts connections) or dead
    t_fault = time.monotonic()
    # both nodes' workers die: each agent needs a decision now (a rank whose peer died fails in its next
    # collective, but then may block on its round's store, which the hung supervisor hosts, until its hang watch
    # fires: killed here, so that the test measures the bound, not the hang watch)
    for r in (0, 1):
        os.kill(int((gate / f"at-{r}").read_text()), signal.SIGKILL)
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "both agents to give up")
    took = time.monotonic() - t_fault
    for n in (a, b):
        assert n.proc.returncode == SUPERVISOR_UNREACHABLE_EXIT_CODE, n.output()
        text = n.text()
        assert text.count("no supervisor reachable at") == 1, n.output()  # one line naming the cause
        assert "workers failed and it needed a decision" in text, n.output()
        assert "waiting up to 8 s (--supervisor-timeout)" in text, n.output()
    # the bound, plus one store call that was under way when the supervisor went (it gives up after
    # max(5, --node-timeout)), plus the exit itself (closing the fork server, the ledger) on a loaded machine
    assert took < BOUND + NODE_TIMEOUT + 20, took
    print(f"fault {fault}: both agents exited {SUPERVISOR_UNREACHABLE_EXIT_CODE} {took:.1f} s after it")
    if fault == "SIGSTOP":
        # woken, the supervisor finds both nodes gone: nothing of the job is left to act, nothing acts twice
        os.kill(sup.proc.pid, signal.SIGCONT)
        wait_for(lambda: sup.proc.poll() is not None, 60, "the woken supervisor to end the job")
        attempts = [e for e in c.events() if e.kind.value == "attempt_start"]
        assert {e.attempt for e in attempts} == {0}, attempts
