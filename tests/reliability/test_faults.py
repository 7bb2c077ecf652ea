"""resilient.drill: the spec parser refuses bad input in one line, and every in-worker fault is
carried out for real (a real process, real signals, real files) and recorded in the ledger first."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.drill.spec import FaultHow, FaultKind, FaultSpec, FaultSpecError, WorkerFault, parse_inject, plan_env
from resilient.drill.worker import InjectedFault, fail_at
from tests._helpers.wait import wait_for

REPO = Path(__file__).resolve().parents[2]


def test_parse_inject_reads_times_steps_targets_and_is_seeded():
    got = parse_inject("kill-worker@30s,hang-worker@60s,kill-node@90s,slow-rank:1@0s,raise-worker:0@step12",
                       seed=7, world_size=4, nnodes=2)
    kinds = [f.kind for f in got]
    assert kinds[:4] == [FaultKind.RAISE_WORKER, FaultKind.SLOW_RANK, FaultKind.KILL_WORKER, FaultKind.HANG_WORKER]
    assert got[1] == FaultSpec(FaultKind.SLOW_RANK, 1, at_seconds=0.0)
    node = [f for f in got if f.kind == FaultKind.KILL_NODE][0]
    assert node.at_seconds == 90 and 0 <= node.target < 2
    assert all(f.target is not None and f.target < 4 for f in got if f.kind != FaultKind.KILL_NODE)
    again = parse_inject("kill-worker@30s,hang-worker@60s,kill-node@90s,slow-rank:1@0s,raise-worker:0@step12",
                         seed=7, world_size=4, nnodes=2)
    assert got == again  # same seed, same drill


@pytest.mark.parametrize("spec, needle", [
    ("", "needs a list"),
    ("explode@3s", "unknown fault 'explode'"),
    ("kill-worker@soon", "cannot read 'kill-worker@soon'"),
    ("kill-worker:9@1s", "targets 9, but there are only 2"),
])
def test_bad_specs_are_one_clear_line(spec, needle):
    with pytest.raises(FaultSpecError) as e:
        parse_inject(spec, world_size=2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fault_spec_validates_itself():
    with pytest.raises(FaultSpecError, match="exactly one of a time"):
        FaultSpec(FaultKind.KILL_WORKER)
    with pytest.raises(FaultSpecError, match="finite"):
        FaultSpec(FaultKind.KILL_WORKER, at_seconds=float("nan"))
    with pytest.raises(FaultSpecError, match="cannot read"):
        WorkerFault.decode("kill:rank=x:step=1")


def test_raise_and_slow_in_process_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path))
    with pytest.raises(InjectedFault):
        fail_at(0, 3, "raise", current_rank=0, current_step=3)
    fail_at(0, 3, "raise", current_rank=1, current_step=3)  # another rank: nothing
    fail_at(0, 3, FaultHow.RAISE, current_rank=0, current_step=4)  # another step: nothing
    fail_at(0, 2, "slow", current_rank=0, current_step=2, seconds=0.0)
    fail_at(0, 2, "slow", current_rank=0, current_step=5, seconds=0.0)  # slow stays, recorded once
    evs = [e for e in read_events(tmp_path) if e.kind == EventKind.FAULT_INJECTED]
    assert [(e.details["fault"], e.details["at"]) for e in evs] == [("raise", "step3"), ("slow", "step2")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, expect", [("kill", -signal.SIGKILL), ("stop", "stopped"), ("wipe-tier", 0)])
def test_worker_faults_happen_for_real_and_the_ledger_says_so_first(tmp_path, how, expect):
    tier = tmp_path / "local"
    (tier / "step_1").mkdir(parents=True)
    code = ("import sys\nfrom resilient.drill.worker import maybe_fail\n"
            "for s in range(10):\n    maybe_fail(s)\nprint('done', flush=True)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="1", TORCHELASTIC_RESTART_COUNT="0",
               RESILIENT_RUN_DIR=str(tmp_path / "run"), RESILIENT_CKPT_LOCAL=str(tier),
               **plan_env(WorkerFault(FaultHow(how), rank=1, step=4)))
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if expect == "stopped":
            import psutil

            wait_for(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED, 30, "the worker to be stopped")
            os.kill(p.pid, signal.SIGCONT)
            expect = 0
        out, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == expect
    assert ("done" in out) == (expect == 0)
    evs = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.FAULT_INJECTED]
    assert [(e.details["fault"], e.details["target"], e.details["at"]) for e in evs] == [(how, 1, "step4")]
    assert tier.exists() == (how != "wipe-tier")
