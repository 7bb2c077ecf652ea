"""transformers.Trainer (a tiny GPT-2, 2 ranks on gloo) under the real ``resilient-run``: a preemption notice,
the same command run again, then a rank SIGKILLed; resumed from our tiers each time, ending with the same
weights as an uninterrupted run."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from resilient.drill.spec import FaultHow, WorkerFault, plan_env  # noqa: E402

from .conftest import HERE, assert_long_eval_was_no_hang, assert_same_weights, resilient_run, restores  # noqa: E402

SCRIPT = HERE / "hf_train.py"
KILL_AT = 8
STOP = 5  # the preempted attempt's last step: the last of epoch 0 (48 samples / (4 × 2 ranks): 6 steps an epoch)


@pytest.mark.timeout(300)
def test_hf_trainer_preempted_then_killed_resumes_exactly_from_our_tiers(tmp_path: Path) -> None:
    ref, hit = tmp_path / "ref", tmp_path / "hit"
    ref.mkdir(), hit.mkdir()
    # the fork server imports the Trainer and the model once for every worker of both attempts (a third of
    # the CPU time of this test without it)
    flags = ["--ckpt-interval", "3", "--preload", "transformers.trainer,transformers.models.gpt2.modeling_gpt2"]
    # the first run is preempted after STOP; the rerun (the same command, as a scheduler's requeue) loses rank 1
    faults = plan_env(WorkerFault(FaultHow.PREEMPT, rank=1, step=STOP),
                      WorkerFault(FaultHow.KILL, rank=1, step=KILL_AT))

    def interrupted() -> list[subprocess.CompletedProcess[str]]:
        first = resilient_run(hit, SCRIPT, ["--out", "out"], [*flags, "--max-restarts", "2"], faults)
        if first.returncode != 75:
            return [first]
        return [first, resilient_run(hit, SCRIPT, ["--out", "out"], [*flags, "--max-restarts", "2"], faults)]

    with cf.ThreadPoolExecutor(2) as ex:
        fa = ex.submit(resilient_run, ref, SCRIPT, ["--out", "out"], flags)
        fb = ex.submit(interrupted)
        a, runs = fa.result(), fb.result()
    assert a.returncode == 0, a.stderr[-4000:]
    assert "done at step 12, restored from None" in a.stdout
    assert runs[0].returncode == 75, ("expected exit 75 (preempted)", runs[0].stderr[-4000:])
    assert len(runs) == 2 and runs[1].returncode == 0, runs[-1].stderr[-4000:]
    got = restores(hit / "run")
    assert {d["rank"] for d in got} == {0, 1}
    # the rerun is a new launch: its start comes from disk (the snapshots went with the first launch's agent); after
    # the kill both ranks restore from one tier, their snapshots when both hold the newer step
    assert all(d["tier"] == "local" for d in got if d["attempt"] == 0), got
    assert len({d["tier"] for d in got if d["attempt"] == 1}) == 1 and all(
        d["tier"] in ("local", "snapshot") for d in got), got
    assert sorted({d["step"] for d in got if d["attempt"] == 0}) == [STOP], got  # the rerun's start
    after_kill = [d for d in got if d["attempt"] == 1]
    assert {d["rank"] for d in after_kill} == {0, 1} and all(STOP <= d["step"] < KILL_AT for d in after_kill), got
    assert f"done at step 12, restored from {after_kill[0]['step'] + 1}" in runs[1].stdout
    assert not list((hit / "out").glob("checkpoint-*")), "the Trainer wrote its own checkpoint"
    assert_same_weights(ref / "out" / "final.pt", hit / "out" / "final.pt")


@pytest.mark.timeout(300)
def test_an_evaluation_longer_than_the_learned_step_timeout_is_no_hang(tmp_path: Path) -> None:
    # steps of tens of ms teach the agent a hang timeout of max(1 s, 3 × the longest step); the Trainer's
    # evaluation at step 8 takes about 2 s on each rank. The integration marks it as a section of its own.
    flags = ["--preload", "transformers.trainer,transformers.models.gpt2.modeling_gpt2"]
    r = resilient_run(tmp_path, SCRIPT, ["--out", "out", "--eval-every", "8", "--eval-seconds", "0.5"], flags)
    assert_long_eval_was_no_hang(r, tmp_path / "run")
