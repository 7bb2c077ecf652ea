"""Lightning DDP (gloo, 2 ranks) under the real ``resilient-run``: a rank SIGKILLed mid-run, and preemption
notices that stop the job at either step the ranks can agree on; the job resumes from our tiers (Lightning
writes no checkpoint of its own here) and ends bit-exact with an uninterrupted run."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from resilient.drill.spec import FaultHow, WorkerFault, plan_env  # noqa: E402

from .conftest import HERE, assert_long_eval_was_no_hang, assert_same_weights, resilient_run, restores  # noqa: E402

SCRIPT = HERE / "lightning_train.py"
KILL_AT = 8
# 96 samples / (8 × 2 ranks): epochs of 6 steps. A notice seen at step 10 stops the job after step 12 (the
# usual step: the first rank to look was at the start of step 11) or after step 11 (a rank saw it while saving
# step 10). Step 11 is the last of epoch 1: Lightning resumes after it without starting epoch 2 the way an
# uninterrupted run does (that resume once ended with different weights). The drill picks the step.
EARLY_STOP, USUAL_STOP = 11, 12
FLAGS = ["--ckpt-interval", "3"]


def _preempted_then_rerun(job: Path, faults: dict[str, str]) -> list[subprocess.CompletedProcess[str]]:
    first = resilient_run(job, SCRIPT, ["--out", "out"], [*FLAGS, "--max-restarts", "2"], faults)
    if first.returncode != 75:
        return [first]
    return [first, resilient_run(job, SCRIPT, ["--out", "out"], [*FLAGS, "--max-restarts", "2"], faults)]  # requeue


@pytest.mark.timeout(300)
def test_lightning_ddp_killed_and_preempted_resumes_bit_exact_from_our_tiers(tmp_path: Path) -> None:
    ref, early, usual = tmp_path / "ref", tmp_path / "early", tmp_path / "usual"
    for d in (ref, early, usual):
        d.mkdir()
    # early: rank 1 killed at step 8 (resumed from an interval save), then a notice that stops after step 11 in
    # the restarted attempt; usual: a notice that stops after step 12
    early_faults = plan_env(WorkerFault(FaultHow.KILL, rank=1, step=KILL_AT),
                            WorkerFault(FaultHow.PREEMPT, rank=1, step=EARLY_STOP, attempt=1))
    usual_faults = plan_env(WorkerFault(FaultHow.PREEMPT, rank=0, step=USUAL_STOP))
    with cf.ThreadPoolExecutor(3) as ex:
        fa = ex.submit(resilient_run, ref, SCRIPT, ["--out", "out"], FLAGS)
        fe = ex.submit(_preempted_then_rerun, early, early_faults)
        fu = ex.submit(_preempted_then_rerun, usual, usual_faults)
        a, runs_e, runs_u = fa.result(), fe.result(), fu.result()
    assert a.returncode == 0, a.stderr[-4000:]
    assert "restored from None" in a.stdout
    for job, runs, stop in ((early, runs_e, EARLY_STOP), (usual, runs_u, USUAL_STOP)):
        assert runs[0].returncode == 75, (f"{job.name}: expected exit 75 (preempted)", runs[0].stderr[-4000:])
        assert len(runs) == 2 and runs[1].returncode == 0, runs[-1].stderr[-4000:]
        assert f"restored from {stop + 1}" in runs[1].stdout, runs[1].stdout[-2000:]
        got = restores(job / "run")
        assert {d["rank"] for d in got} == {0, 1}, got
        # the rerun (a new launch) starts from disk: the first launch's snapshots went with its agent; the restore
        # after the kill comes from one tier for both ranks, their snapshots when both hold the newer step
        assert all(d["tier"] == "local" for d in got if d["step"] == stop), got
        assert all(d["tier"] in ("local", "snapshot") for d in got), got
        assert all(len({d["tier"] for d in got if d["attempt"] == a}) == 1 for a in {d["attempt"] for d in got}), got
        steps = sorted({d["step"] for d in got})
        if job is early:
            assert len(steps) == 2 and 2 <= steps[0] < KILL_AT and steps[1] == stop, got
        else:
            assert steps == [stop], got
        assert not list(job.rglob("*.ckpt")), "Lightning wrote its own checkpoint"
    for job in (ref, early, usual):  # trainer.save_checkpoint() after fit: a collective save of the last step
        assert (job / "ckpt" / "step_00000013" / "COMMITTED").exists()
    for job in (early, usual):
        assert_same_weights(ref / "out" / "final.pt", job / "out" / "final.pt")


@pytest.mark.timeout(300)
def test_a_validation_longer_than_the_learned_step_timeout_is_no_hang(tmp_path: Path) -> None:
    # steps of a few ms teach the agent a hang timeout of max(1 s, 3 × the longest step); the validation at step 8
    # takes about 2 s (4 batches of 0.5 s on each rank). The integration marks it as a section of its own.
    r = resilient_run(tmp_path, SCRIPT, ["--out", "out", "--val-every", "8", "--val-seconds", "0.5"], FLAGS)
    assert_long_eval_was_no_hang(r, tmp_path / "run")
