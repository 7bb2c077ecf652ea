"""A policy that ignores everything cannot stall a real job.

An agent stops its node's workers before it reports their exit or hang; an ``Ignore`` for such an event would
leave every node waiting for a plan that never comes. The core refuses it (the ledger's ``action`` event says
why in ``fallback``) and the default policy decides: the job restarts and finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers.procs import kill_sessions
from tests.cluster.conftest import REPO, child_env
from tests.cluster.test_policies import CRASH_ONCE, actions

IGNORES = ("from resilient.supervisor.api import Ignore\n\n"
           "def decide(event, view):\n    return Ignore(reason='ignore everything')\n")


@pytest.mark.timeout(200)
def test_a_policy_that_ignores_a_crash_does_not_stall_the_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "policy.py").write_text(IGNORES)
    agent = subprocess.Popen(
        [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
         "--run-dir", str(tmp_path / "run"), "--policy", str(tmp_path / "policy.py"), str(CRASH_ONCE), str(out)],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        _, err = agent.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        raise AssertionError("the job did not finish in 150 s: it waits for a decision after the crash") from None
    finally:
        kill_sessions([agent], timeout=30)
    assert agent.returncode == 0, err[-3000:]
    assert json.loads((out / "a1_r1.json").read_text())["sum"] == 2.0  # the restarted attempt trained on
    acts = actions(tmp_path)
    assert [a["action"] for a in acts] == ["restart"], acts  # the default policy's decision
    assert "already stopped its workers" in acts[0]["fallback"], acts[0]
