"""Preemption of one node is not a node loss: SIGTERM to one of two agents (its scheduler's notice). The notice
reaches the supervisor as a preemption; every rank of the job stops after one agreed step and saves it; then a
spare takes the preempted node's place, or the job shrinks without it (``--nnodes MIN:MAX``), or, with neither,
every node exits 75 (the scheduler's requeue code) and the rerun resumes. Real agents (each in its own session),
real workers, real SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.launcher.api import PREEMPTED_EXIT_CODE

from .conftest import wait_for
from .test_node_loss import (GATE_STEP, STEPS, _start_job, assert_same, final, node_name,  # noqa: F401
                             reference_world, NPROC, WORLD, at_gate)

AGREED = GATE_STEP + 2  # released from the gate after step 4, b's ranks propose "the step after the next" (6)
# the gates are pauses, not hangs (a fixed --heartbeat-timeout beyond any of them); at --nnodes 1:2 the job must
# form on both nodes, however long the second agent takes to start under load (it forms at once when both joined)
LAST_CALL = 300


def _gated(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """The gate directory, the output directory and the script's arguments: ranks pause at GATE_STEP."""
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    return gate, out, ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]


def _actions(c) -> list[dict]:
    return [e.details for e in c.events() if e.kind == EventKind.ACTION]


def _preempt_b_at_the_gate(c, gate: Path, b, decided: str) -> None:
    """Every rank waits at the gate (step 4 saved); b's agent gets SIGTERM; once the supervisor has decided on
    its notice, the ranks go on: b's propose the last step, a's read it from the attempt's store."""
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    b.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: any(d.get("cause") == "preemption_notice" and d.get("action") == decided for d in _actions(c))
             or b.proc.poll() is not None, 60, f"the supervisor's {decided} on b's preemption notice")
    (gate / "go").touch()


def _no_loss_or_failure(c, b) -> None:
    evs = c.events()
    notices = [e for e in evs if e.kind == EventKind.PREEMPTION_NOTICE]
    assert notices and notices[0].node == node_name(b), notices
    acts = _actions(c)
    assert not [d for d in acts if d["action"] in ("restart", "stop")], acts  # not a failure, not a node loss
    assert not [e for e in evs if e.kind == EventKind.WORKER_EXIT and e.details.get("exit_code")], "a rank failed"
    # every rank of the job stopped after the agreed step, saved (it marks that it did)
    marks = sorted(p.name for p in (c.run_dir / "preempted").iterdir())
    assert marks == [f"attempt0.rank{r}" for r in range(WORLD)], marks
    assert all((c.run_dir / "preempted" / m).read_text() == str(AGREED) for m in marks)


@pytest.mark.timeout(300, func_only=True)
def test_preempted_node_is_swapped_for_a_spare_after_the_agreed_save(cluster_factory, tmp_path: Path,
                                                                     reference_world) -> None:
    c = cluster_factory("2", nproc=NPROC, flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout",
                                                 "20", "--heartbeat-timeout", "300"])
    gate, out, args = _gated(tmp_path)
    a, b = _start_job(c, args)
    spare = c.start("spare", args)
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 60,
             "the spare to join")
    _preempt_b_at_the_gate(c, gate, b, "hot_swap")
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b, spare)), 150, "the job to end")
    assert b.proc.returncode == PREEMPTED_EXIT_CODE, b.output()
    assert a.proc.returncode == 0, a.output()
    assert spare.proc.returncode == 0, spare.output()
    _no_loss_or_failure(c, b)
    swaps = [d for d in _actions(c) if d["action"] == "hot_swap"]
    assert [d.get("pending", False) for d in swaps] == [True, False], swaps  # decided at the notice, done after
    assert swaps[-1]["action_args"]["node"] == node_name(b)
    assert swaps[-1]["action_args"]["spare"] == node_name(spare)
    evs = c.events()
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(spare)]
    assert restores and restores[-1].details["step"] == AGREED, restores  # nothing lost: the agreed step
    assert_same(reference_world, final(out, WORLD))
    # what a user reads: a spare joining is routine (INFO), and no dict repr in the restart line
    assert "WARNING resilient.supervisor.loop: supervisor: ignore" not in a.text()
    assert "hot_swap {" not in a.text() and f"hot_swap node={node_name(b)} spare={node_name(spare)}" in a.text()
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(300)
def test_preempted_node_without_a_spare_scales_down(cluster_factory, tmp_path: Path) -> None:
    c = cluster_factory("1:2", nproc=NPROC,
                        flags=["--max-restarts", "3", "--node-timeout", "20", "--heartbeat-timeout", "300",
                               "--rdzv-conf", f"last_call_timeout={LAST_CALL}"])
    gate, out, args = _gated(tmp_path)
    a, b = _start_job(c, args)
    _preempt_b_at_the_gate(c, gate, b, "scale_down")
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b)), 150, "the job to end")
    assert b.proc.returncode == PREEMPTED_EXIT_CODE, b.output()
    assert a.proc.returncode == 0, a.output()
    _no_loss_or_failure(c, b)
    downs = [d for d in _actions(c) if d["action"] == "scale_down"]
    assert [d.get("pending", False) for d in downs] == [True, False], downs
    evs = c.events()
    worlds = [e.details["world_size"] for e in evs if e.kind == EventKind.ATTEMPT_START]
    assert worlds == [WORLD, WORLD, NPROC], worlds
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(a)]
    assert restores and restores[-1].details["step"] == AGREED, restores
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(360, func_only=True)
def test_preempted_node_with_no_way_out_every_node_exits_75_and_the_rerun_resumes(cluster_factory, tmp_path: Path,
                                                                                  reference_world) -> None:
    c = cluster_factory("2", nproc=NPROC,
                        flags=["--max-restarts", "3", "--node-timeout", "20", "--heartbeat-timeout", "300"])
    gate, out, args = _gated(tmp_path)
    a, b = _start_job(c, args)
    _preempt_b_at_the_gate(c, gate, b, "ignore")
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b)), 150, "both agents to exit")
    assert b.proc.returncode == PREEMPTED_EXIT_CODE, b.output()
    assert a.proc.returncode == PREEMPTED_EXIT_CODE, a.output()  # requeued like b, not "node lost: no spare"
    _no_loss_or_failure(c, b)
    assert "lost: no spare" not in a.text()
    # the scheduler requeues the job: the same command on both nodes resumes after the agreed step
    before = len(c.events())
    a2, b2 = _start_job(c, args)
    wait_for(lambda: all(n.proc.poll() is not None for n in (a2, b2)), 150, "the rerun to end")
    assert a2.proc.returncode == 0, a2.output()
    assert b2.proc.returncode == 0, b2.output()
    restores = [e for e in c.events()[before:] if e.kind == EventKind.CKPT_RESTORE]
    assert restores and {e.details["step"] for e in restores} == {AGREED}, restores
    assert_same(reference_world, final(out, WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(300)
def test_preempted_supervisor_host_every_node_exits_75(cluster_factory, tmp_path: Path) -> None:
    """The preempted node hosts the supervisor (node 0's agent, the default): nothing can take its place once it
    goes, so the job ends as preempted: both exit 75 after the agreed step, saved on every rank."""
    c = cluster_factory("1:2", nproc=NPROC,
                        flags=["--max-restarts", "3", "--node-timeout", "20", "--heartbeat-timeout", "300",
                               "--rdzv-conf", f"last_call_timeout={LAST_CALL}"])
    gate, out, args = _gated(tmp_path)
    a, b = _start_job(c, args)
    _preempt_b_at_the_gate(c, gate, a, "scale_down")  # decided, but the supervisor leaves with a
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b)), 150, "both agents to exit")
    assert a.proc.returncode == PREEMPTED_EXIT_CODE, a.output()
    assert b.proc.returncode == PREEMPTED_EXIT_CODE, b.output()  # not "the job's store stayed unreachable" (69)
    marks = sorted(p.name for p in (c.run_dir / "preempted").iterdir())
    assert marks == [f"attempt0.rank{r}" for r in range(WORLD)], marks
    assert all((c.run_dir / "preempted" / m).read_text() == str(AGREED) for m in marks)
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
