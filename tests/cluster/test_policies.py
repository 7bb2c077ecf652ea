"""Policies under the real launcher: a broken one is refused before anything starts; one that raises, hangs or
returns nonsense is overruled by the default policy (and the ledger says so); one that stops, stops; agents
beyond ``--nnodes`` MAX wait as spares without disturbing the job (nvidia-resiliency-ext#348)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import REPO, child_env, wait_for
from .test_node_loss import _listening, node_name

CRASH_ONCE = REPO / "tests" / "launcher" / "scripts" / "crash_once.py"

RAISES = "def decide(event, view):\n    raise RuntimeError('policy bug')\n"
HANGS = "import time\n\ndef decide(event, view):\n    time.sleep(60)\n"
NONSENSE = "def decide(event, view):\n    return 'restart please'\n"
STOPS = ("from resilient.supervisor.api import Stop\n\n"
         "def decide(event, view):\n    return Stop(reason='no second chances')\n")


def launch(tmp: Path, policy: str | None, *flags: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "2", "--run-dir", str(tmp / "run"), *flags]
    if policy is not None:
        (tmp / "policy.py").write_text(policy)
        cmd += ["--policy", str(tmp / "policy.py")]
    return subprocess.run([*cmd, str(CRASH_ONCE), str(out)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=150)


def actions(tmp: Path) -> list[dict]:
    return [e.details for e in read_events(tmp / "run") if e.kind == EventKind.ACTION and e.details["action"] != "start"]


@pytest.mark.timeout(60)
def test_policy_with_a_syntax_error_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "policy.py").write_text("def decide(event, view)\n    return None\n")
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--run-dir", str(tmp_path / "run"), "--policy", str(tmp_path / "policy.py"), str(CRASH_ONCE),
                        str(tmp_path)], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 2
    assert f"{tmp_path / 'policy.py'}:1" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_policy_without_decide_is_refused(tmp_path: Path) -> None:
    (tmp_path / "policy.py").write_text("x = 1\n")
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--policy", str(tmp_path / "policy.py"), str(CRASH_ONCE), str(tmp_path)],
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "decide" in r.stderr, r.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("policy,why", [(RAISES, "policy bug"), (HANGS, "policy-timeout"),
                                        (NONSENSE, "not an Action")])
def test_broken_policy_is_overruled_by_the_default(tmp_path: Path, policy: str, why: str) -> None:
    r = launch(tmp_path, policy, "--policy-timeout", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "a1_r1.json").read_text())["sum"] == 2.0
    acts = actions(tmp_path)
    assert [a["action"] for a in acts] == ["restart"], acts
    assert acts[0].get("fallback") and why.lower() in acts[0]["fallback"].lower(), acts[0]


@pytest.mark.timeout(200)
def test_policy_that_stops_ends_the_job_with_its_reason(tmp_path: Path) -> None:
    r = launch(tmp_path, STOPS)
    assert r.returncode == 1
    assert "rank 1" in r.stderr or "local_rank: 1" in r.stderr, r.stderr[-3000:]  # torchrun's failure table
    acts = actions(tmp_path)
    assert [a["action"] for a in acts] == ["stop"] and acts[0]["reason"] == "no second chances"
    end = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.RUN_END]
    assert end and "no second chances" in end[0].details["reason"]


@pytest.mark.timeout(330)
def _spares(evs: list) -> set[str]:
    """The nodes the supervisor holds as spares: one that joined after the job formed has a node_joined line, one
    that joined with the first two (agents started together) is among the first assignment's spares instead."""
    out = {e.node for e in evs if e.kind == EventKind.NODE_JOINED and e.details.get("spare")}
    for e in evs:
        if e.kind == EventKind.ACTION and isinstance(e.details.get("assignment"), dict):
            out |= set(e.details["assignment"].get("spares") or ())
    return out


def test_more_agents_than_max_wait_as_spares_and_never_disturb_the_job(cluster_factory, tmp_path: Path) -> None:
    # one worker per node: the point is agents beyond --nnodes MAX waiting as spares, not the worker count
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "1", "--node-timeout", "20"])
    out, gate = tmp_path / "out", tmp_path / "go"
    out.mkdir()
    # the job forms as soon as two agents joined and then lasts a second: under load the third agent's start-up
    # outlasted the whole job, and it waited --rendezvous-timeout for a store that had gone with the job. The
    # workers wait at a gate until the third agent joined as a spare.
    script = tmp_path / "gated.py"
    script.write_text("import runpy, sys, time\nfrom pathlib import Path\nend = time.monotonic() + 120\n"
                      f"while not Path({str(gate)!r}).exists() and time.monotonic() < end:\n    time.sleep(0.01)\n"
                      f"runpy.run_path({str(CRASH_ONCE)!r}, run_name='__main__')\n")
    c.agent_cmd = lambda local, script_args, extra: [  # type: ignore[method-assign]
        sys.executable, "-m", "resilient.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{c.port}", "--local-addr", "127.0.0.1", "--run-dir", str(c.run_dir),
        *c.flags, str(script), str(out)]
    first = c.start("n0", [])
    wait_for(lambda: _listening(c.port) or first.proc.poll() is not None, 60, "the first agent to host the store")
    nodes = [first] + [c.start(f"n{i}", []) for i in (1, 2)]  # three agents for two places
    wait_for(lambda: _spares(c.events()) or any(n.proc.poll() is not None for n in nodes), 120,
             "the third agent to join as a spare")
    gate.touch()
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 150, "the job to end")
    assert [n.proc.returncode for n in nodes] == [0, 0, 0], [n.output() for n in nodes]
    evs = list(read_events(c.run_dir))
    started = {e.node for e in evs if e.kind == EventKind.ATTEMPT_START}
    assert len(started) == 2, started  # one agent never ran workers: the spare
    spare = ({node_name(n) for n in nodes} - started).pop()
    assert any(e.kind == EventKind.RUN_END and e.node == spare and e.details["exit_code"] == 0 for e in evs)
    for rank in (0, 1):
        assert json.loads((out / f"a1_r{rank}.json").read_text())["sum"] == 2.0
