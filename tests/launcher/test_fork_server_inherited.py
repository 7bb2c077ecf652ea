"""The fork server forked from the agent (which imported torch already, for its store) instead of started by exec:
a node imports torch once. It and its workers must hold nothing of the agent's: no descriptor (the agent's log
file, its sockets: a worker's flush or close must never reach them), signal handler, log handler or warnings hook;
and a worker's end must run the exit hooks its imports registered before the fork (weakref finalizers, logging's
flush), as a fresh interpreter's does. With the fast exit off it is started by exec, as before."""
import json
import os
import subprocess
import sys

import pytest

from tests.launcher.conftest import SCRIPTS, run_launcher

DRIVER = str(SCRIPTS / "inherit_driver.py")
STATE = str(SCRIPTS / "fresh_state.py")


def _drive(tmp_path, env=None):
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, DRIVER, str(tmp_path), STATE], env=e, capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    driver = json.loads((tmp_path / "driver.json").read_text())
    state = json.loads((tmp_path / "state_0.json").read_text())
    assert driver["worker_exit"] == 0, r.stderr[-3000:]
    return driver, state


def _holds_nothing_of_the_agent(state, agent_files):
    for fd, where in state["fds"].items():
        assert not where.startswith("socket:"), (fd, where)  # the agent's end of the server's socket, its stores
        if where.startswith("/"):
            assert where == "/dev/null", (fd, where)
        assert not any(where.endswith(f) for f in agent_files), (fd, where)
    assert state["root_handlers"] == [] and state["root_level"] == 30  # as a fresh interpreter: WARNING, no handler
    assert state["showwarning"] == "warnings"  # not routed into the agent's logging
    assert set(state["signals"].values()) == {"default"}, state["signals"]
    assert state["wakeup_fd"] == -1
    assert state["comm"] == os.path.basename(sys.executable)[:15]


def _ended_with_the_imports_exit_hooks(out, state, rank=0):
    # the exit hooks the imports registered before the fork ran at the worker's end, as in a fresh interpreter
    assert not os.path.exists(state["tempdir"]), "weakref.finalize's exit hook never ran in the worker"
    assert (out / f"worker_{rank}.log").read_text().strip() == "flushed at exit", "logging's exit flush never ran"


@pytest.mark.timeout(180)
def test_server_forked_from_the_agent_holds_nothing_of_it(tmp_path):
    driver, state = _drive(tmp_path)
    assert driver["kind"] == "_ChildProc"
    srv = state["server"]
    assert srv["pid"] == driver["server"] and srv["parent"] == driver["agent"]
    assert srv["comm"] == "resilient-fork"
    assert any(a.endswith("inherit_driver.py") for a in srv["cmdline"]), srv["cmdline"]  # forked, not exec'd
    _holds_nothing_of_the_agent(state, ("agent.jsonl", "agent.txt"))
    # bytes the agent held in a file object when it forked were written once, by the agent: the worker's end (which
    # flushes every open file object) met a descriptor that is /dev/null now
    assert (tmp_path / "agent.txt").read_text() == "AGENT\n"
    _ended_with_the_imports_exit_hooks(tmp_path, state)


@pytest.mark.timeout(180)
def test_with_the_fast_exit_off_the_server_is_started_by_exec(tmp_path):
    driver, state = _drive(tmp_path, {"RESILIENT_FAST_EXIT": "0"})
    assert driver["kind"] == "Popen"
    assert "resilient.launcher.zygote" in state["server"]["cmdline"]
    assert (tmp_path / "agent.txt").read_text() == "AGENT\n"
    _ended_with_the_imports_exit_hooks(tmp_path, state)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [1, 2])  # 1: no OMP_NUM_THREADS=1 from the launcher, so numpy's BLAS would start threads
def test_resilient_run_workers_come_from_a_server_forked_from_the_agent(tmp_path, nproc):
    out = tmp_path / "out"
    out.mkdir()
    r = run_launcher(["--standalone", "--nproc-per-node", str(nproc), "--run-dir", str(tmp_path / "run"), STATE, str(out)],
                     cwd=tmp_path, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(nproc):
        state = json.loads((out / f"state_{rank}.json").read_text())
        srv = state["server"]
        assert srv["comm"] == "resilient-fork" and "resilient.run" in srv["cmdline"], srv
        _holds_nothing_of_the_agent(state, ("agent.jsonl", "events.jsonl"))
        assert state["path0"] == str(SCRIPTS)  # as `python script`
        assert "OPENBLAS_NUM_THREADS" not in state["env"]  # the user's environment, not the agent's import's
        _ended_with_the_imports_exit_hooks(out, state, rank)
