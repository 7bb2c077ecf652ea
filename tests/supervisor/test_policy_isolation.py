"""A policy file cannot hurt the supervisor: it runs in a process of its own, under memory, CPU and time limits.

Under the real launcher (the agent hosts the supervisor), a policy whose decide ends its process, loops forever,
allocates 20 GiB or forks is recorded in the ``action`` event and the default policy decides: the job goes on
and finishes. Each policy writes the pid it runs in before misbehaving, so the tests also show it never ran in
the agent. ``resilient policy check`` on the same files, and on files that misbehave at import, answers with
one line and exit status 2 in a bounded time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import REPO, child_env
from tests.cluster.test_policies import CRASH_ONCE, actions
from tests.supervisor.test_cli import run as policy_cli

PID = "import os\n\ndef _mark(event):\n    open(os.environ['POLICY_PID_FILE'], 'a').write(f'{os.getpid()}\\n')\n\n"
EXITS = PID + "def decide(event, view):\n    _mark(event)\n    os._exit(3)\n"
LOOPS = PID + "def decide(event, view):\n    _mark(event)\n    while True:\n        pass\n"
ALLOCATES = PID + "def decide(event, view):\n    _mark(event)\n    return bytearray(20 * 2**30)\n"
FORKS = (PID + "from resilient.supervisor.api import Restart\n\n"
         "def decide(event, view):\n    _mark(event)\n    os.fork()\n    return Restart(reason='forked')\n")

HARMFUL = [(EXITS, "exited with code 3"), (LOOPS, "did not decide within"),
           (ALLOCATES, "ran out of memory"), (FORKS, "forked")]
IDS = ["os_exit", "endless_loop", "20GiB", "fork"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("policy,why", HARMFUL, ids=IDS)
def test_harmful_policy_cannot_take_the_agent_down(tmp_path: Path, policy: str, why: str) -> None:
    out, pids = tmp_path / "out", tmp_path / "policy_pids"
    out.mkdir()
    (tmp_path / "policy.py").write_text(policy)
    agent = subprocess.Popen(
        [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
         "--run-dir", str(tmp_path / "run"), "--policy-timeout", "0.5", "--policy", str(tmp_path / "policy.py"),
         str(CRASH_ONCE), str(out)],
        cwd=REPO, env=child_env({"POLICY_PID_FILE": str(pids)}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        _, err = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
    assert agent.returncode == 0, err[-3000:]
    assert json.loads((out / "a1_r1.json").read_text())["sum"] == 2.0  # the restarted attempt trained on
    acts = actions(tmp_path)
    assert [a["action"] for a in acts] == ["restart"], acts  # the default policy's decision
    assert why in acts[0]["fallback"], acts[0]
    ran_in = {int(x) for x in pids.read_text().split()}
    assert ran_in and agent.pid not in ran_in, (ran_in, agent.pid)
    for pid in ran_in:  # no policy process outlives the job
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy,why", HARMFUL, ids=IDS)
def test_policy_check_refuses_a_harmful_decide_with_one_line(tmp_path: Path, policy: str, why: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "p.py").write_text(policy)
    monkeypatch.setenv("POLICY_PID_FILE", str(tmp_path / "pids"))  # inherited by the tool and the policy's process
    r = policy_cli("check", str(tmp_path / "p.py"), "--policy-timeout", "0.5", timeout=100)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and str(tmp_path / "p.py") in err and why in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body,why", [
    ("import os\nos._exit(3)\n", "exited with code 3 while loading"),
    ("x = bytearray(20 * 2**30)\n\ndef decide(event, view):\n    pass\n", "ran out of memory while loading"),
    ("import os\nos.fork()\n\ndef decide(event, view):\n    pass\n", "forked while loading"),
    ("while True:\n    pass\n", "did not load within"),
], ids=["os_exit", "20GiB", "fork", "endless_loop"])
def test_policy_check_refuses_a_harmful_import_with_one_line(tmp_path: Path, body: str, why: str) -> None:
    (tmp_path / "p.py").write_text(body)
    r = policy_cli("check", str(tmp_path / "p.py"), timeout=100)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and str(tmp_path / "p.py") in err and why in err, err


# a policy that maps a table of 2.5 GiB at import (address space, not touched memory: RLIMIT_AS counts it) and
# decides with it: past the default limit of 2048 MiB, within --policy-memory-mb 4096
BIG_TABLE = ("import mmap\nfrom resilient.supervisor.api import Restart\n\n_table = mmap.mmap(-1, 2560 << 20)\n\n"
             "def decide(event, view):\n    _table[0] = 1\n    return Restart(reason='decided with a big table')\n")


@pytest.mark.timeout(60)
def test_resilient_run_refuses_a_policy_past_the_memory_limit_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "policy.py").write_text(BIG_TABLE)
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--run-dir", str(tmp_path / "run"), "--policy", str(tmp_path / "policy.py"), str(CRASH_ONCE),
                        str(tmp_path)], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=50)
    err = r.stderr.strip()
    assert r.returncode == 2, err[-2000:]
    assert len(err.splitlines()) == 1 and "ran out of memory while loading" in err, err
    assert "2048 MiB" in err and "--policy-memory-mb" in err, err  # the limit and the flag that raises it
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(200)
def test_policy_memory_flag_is_the_limit_of_the_jobs_policy_process(tmp_path: Path) -> None:
    """The flag reaches both the check before the start and the policy process of the supervisor the agent hosts:
    the policy's own decision stands (no fallback)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "policy.py").write_text(BIG_TABLE)
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "2", "--run-dir", str(tmp_path / "run"),
                        "--policy", str(tmp_path / "policy.py"), "--policy-memory-mb", "4096", "--policy-timeout", "10", str(CRASH_ONCE), str(out)],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    acts = actions(tmp_path)
    assert [(a["action"], a["reason"], a.get("fallback")) for a in acts] == [
        ("restart", "decided with a big table", None)], acts


SPINS = ("import time\nfrom resilient.supervisor.api import Restart\n\ndef decide(event, view):\n"
         "    t = time.process_time()\n    while time.process_time() - t < 0.05:\n        pass\n"
         "    return Restart(reason='thought hard')\n")


@pytest.mark.timeout(120)
def test_policy_check_takes_the_jobs_limit_flags(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text(BIG_TABLE)
    (tmp_path / "spins.py").write_text(SPINS)
    r = policy_cli("check", str(tmp_path / "big.py"), timeout=100)
    assert r.returncode == 2 and "2048 MiB" in r.stderr, r.stderr[-2000:]
    r = policy_cli("check", str(tmp_path / "big.py"), "--policy-memory-mb", "4096", timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    r = policy_cli("check", str(tmp_path / "spins.py"), "--policy-timeout", "5", timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]  # every decision's CPU together stays far under 300 s
    r = policy_cli("check", str(tmp_path / "spins.py"), "--policy-timeout", "5", "--policy-cpu-seconds", "1",
                   timeout=100)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "SIGXCPU" in err and "CPU-time limit of 1 s" in err and "--policy-cpu-seconds" in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,flag", [
    (["-m", "resilient.run", "--standalone", "--policy-memory-mb", "0", str(CRASH_ONCE)], "--policy-memory-mb"),
    (["-m", "resilient.run", "--standalone", "--policy-cpu-seconds", "lots", str(CRASH_ONCE)], "--policy-cpu-seconds"),
    (["-m", "resilient.cli", "supervisor", "--rdzv-endpoint", "127.0.0.1:1", "--policy-cpu-seconds", "-3"],
     "--policy-cpu-seconds"),
    (["-m", "resilient.cli", "policy", "check", "policies/hot_swap_first.py", "--policy-memory-mb", "1.5"],
     "--policy-memory-mb"),
], ids=["run-zero", "run-word", "supervisor-negative", "check-fraction"])
def test_bad_policy_limits_are_one_line_naming_the_flag(tmp_path: Path, argv: list[str], flag: str) -> None:
    r = subprocess.run([sys.executable, *argv], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=50)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert r.returncode == 2 and len(lines) == 1 and flag in lines[0] and "whole number" in lines[0], r.stderr
