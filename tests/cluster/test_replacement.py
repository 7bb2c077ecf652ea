"""``--replacement-wait``: a node lost with no spare while ``--nnodes`` MIN forbids shrinking waits for a node to
join in its place (torchrun's agents wait for a replacement up to the rendezvous join timeout), and the job
stops once the wait is over, not before. Real agents, a real SIGKILL of a whole node, a new agent started in its
place as a scheduler would (same flags, a new host name: here a new pid)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind

from .conftest import REPO, child_env, wait_for
from .test_node_loss import GATE_STEP, NPROC, STEPS, WORLD, _start_job, assert_same, at_gate, final, node_name
from .test_node_loss import reference_world  # noqa: F401  (the fixture)


def _node_lost_at_the_gate(cluster_factory, tmp_path: Path, wait_s: float, lose: str = "b") -> tuple:
    """A 2-node job, no spare, ``--nnodes 2``, every rank at the gate, then node ``lose`` SIGKILLed whole (agent,
    fork server, workers, local disk; "a" hosts the store and the supervisor). Returns the cluster, both nodes (a,
    b), the gate and the script's arguments."""
    c = cluster_factory("2", flags=["--max-restarts", "3", "--node-timeout", "20", "--replacement-wait", str(wait_s),
                                    "--heartbeat-timeout", "300"], nproc=NPROC)  # the gate is a pause, not a hang
    gate = tmp_path / "gate"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(tmp_path / "out"), "--gate", str(gate), "--gate-step", str(GATE_STEP)]
    a, b = _start_job(c, args)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    (a if lose == "a" else b).kill()
    return c, a, b, gate, args


def _actions(c) -> list[dict]:
    return [e.details for e in c.events() if e.kind == EventKind.ACTION]


@pytest.mark.timeout(300, func_only=True)
def test_lost_node_is_replaced_by_a_node_started_later_bit_exact(cluster_factory, tmp_path: Path,
                                                                 reference_world) -> None:  # noqa: F811
    """No spare and --nnodes 2: node b SIGKILLed at the gate; the supervisor waits (an ``ignore`` naming the
    wait), the survivors' failing collectives are held for that decision, a node started afterwards joins, takes
    b's ranks from the surviving tiers, and the job ends equal to an uninterrupted run."""
    c, a, b, gate, args = _node_lost_at_the_gate(cluster_factory, tmp_path, 240.0)
    waiting = wait_for(lambda: [d for d in _actions(c) if d.get("action") == "ignore"
                                and "--replacement-wait" in str(d.get("reason"))], 60, "the decision to wait")
    assert not [d for d in _actions(c) if d.get("action") == "stop"], _actions(c)
    (gate / "go").touch()  # the survivors fail in their next collective: held for the waiting decision
    new = c.start("new", args)
    wait_for(lambda: a.proc.poll() is not None and new.proc.poll() is not None, 180, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert new.proc.returncode == 0, new.output()
    swaps = [d for d in _actions(c) if d.get("action") == "hot_swap"]
    assert [(d["action_args"]["node"], d["action_args"]["spare"]) for d in swaps] == [(node_name(b), node_name(new))], \
        _actions(c)
    assert waiting and not [d for d in _actions(c) if d.get("action") in ("stop", "restart")], _actions(c)
    evs = c.events()
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(new)]
    assert restores and restores[-1].details["step"] == GATE_STEP and restores[-1].details["tier"] in ("peer", "persistent")
    assert_same(reference_world, final(tmp_path / "out", WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(240, func_only=True)
def test_no_node_joins_within_the_wait_the_job_stops_naming_it(cluster_factory, tmp_path: Path) -> None:
    """The replacement never comes: the job stops once --replacement-wait has passed since the loss, its reason
    naming the flag, and the survivor's agent exits non-zero (a job that "succeeds" without its ranks would be
    the worst kind of failure)."""
    wait_s = 4.0
    c, a, b, _, _ = _node_lost_at_the_gate(cluster_factory, tmp_path, wait_s)
    wait_for(lambda: a.proc.poll() is not None, 120, "the survivor to end")
    assert a.proc.returncode != 0, a.output()
    evs = c.events()
    lost = next(e for e in evs if e.kind == EventKind.AGENT_LOST and e.node == node_name(b))
    acts = [e for e in evs if e.kind == EventKind.ACTION and e.details["action"] != "start"]
    assert [e.details["action"] for e in acts] == ["ignore", "stop"], [e.details for e in acts]
    assert "--replacement-wait" in acts[0].details["reason"]
    assert "no spare" in acts[1].details["reason"], acts[1].details
    # not before the wait (the supervisor's clock; its passes come every fraction of a second)
    assert acts[1].wall - lost.wall >= wait_s - 0.05, (lost.wall, acts[1].wall)
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(360, func_only=True)
def test_lost_host_with_no_spare_is_replaced_after_the_succession_bit_exact(cluster_factory, tmp_path: Path,
                                                                           reference_world) -> None:  # noqa: F811
    """The node lost is the one hosting the store and the supervisor (the default set-up, no standalone
    supervisor), with no spare and --nnodes 2: node b takes both over, waits --replacement-wait from its own first
    decision on the loss, a node started afterwards finds the job through the endpoint (the successor's pointer
    there), is swapped in for the host, and the job ends equal to an uninterrupted run."""
    c, host, b, gate, args = _node_lost_at_the_gate(cluster_factory, tmp_path, 240.0, lose="a")
    waiting = wait_for(lambda: [d for d in _actions(c) if d.get("action") == "ignore"
                                and "--replacement-wait" in str(d.get("reason"))] or b.proc.poll() is not None, 90,
                       "the successor's decision to wait")
    assert b.proc.poll() is None, b.output()
    assert not [d for d in _actions(c) if d.get("action") == "stop"], _actions(c)
    (gate / "go").touch()  # b's workers fail in their next collective: held for the waiting decision
    new = c.start("new", args)
    wait_for(lambda: b.proc.poll() is not None and new.proc.poll() is not None, 240, "the job to end")
    assert b.proc.returncode == 0, b.output()
    assert new.proc.returncode == 0, new.output()
    assert "the job moved to" in new.text(), new.output()
    evs = c.events()
    taken = [e for e in evs if e.kind == EventKind.LOG and "succession" in e.details]
    assert [(t.details["succession"]["from"], t.details["succession"]["to"]) for t in taken] == \
        [(node_name(host), node_name(b))], [t.details for t in taken]
    swaps = [d for d in _actions(c) if d.get("action") == "hot_swap"]
    assert [(d["action_args"]["node"], d["action_args"]["spare"]) for d in swaps] == \
        [(node_name(host), node_name(new))], _actions(c)
    assert waiting and not [d for d in _actions(c) if d.get("action") in ("stop", "restart")], _actions(c)
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(new)]
    assert restores and all(e.details["step"] == GATE_STEP for e in restores), [e.details for e in restores]
    assert_same(reference_world, final(tmp_path / "out", WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.parametrize("bad", ["-1", "inf", "nan"])
def test_a_bad_replacement_wait_is_refused_naming_the_flag(tmp_path: Path, bad: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--replacement-wait", bad, "--run-dir", str(tmp_path / "run"), str(script)],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "the script ran" not in r.stdout, r.stdout[-2000:]
    assert "--replacement-wait" in r.stderr and bad in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_replacement_wait_flag_and_variable_in_both_commands(monkeypatch) -> None:
    from resilient import env
    from resilient.launcher.args import parse
    from resilient.supervisor import standalone

    script = "tests/cluster/train.py"
    assert parse(["--standalone", script]).supervisor.replacement_wait == 0.0
    assert parse(["--standalone", "--replacement-wait", "600", script]).supervisor.replacement_wait == 600.0
    base = ["--rdzv-endpoint", "127.0.0.1:29400", "--nnodes", "2", "--run-dir", "/tmp/never-made"]
    assert standalone.parse([*base, "--replacement_wait", "90"]).supervisor.replacement_wait == 90.0
    monkeypatch.setenv(env.REPLACEMENT_WAIT, "45")
    assert parse(["--standalone", script]).supervisor.replacement_wait == 45.0
