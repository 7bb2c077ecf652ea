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
