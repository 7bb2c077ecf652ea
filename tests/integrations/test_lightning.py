"""Lightning DDP (gloo, 2 ranks) under the real ``resilient-run``: a rank SIGKILLed mid-run, then a preemption
notice; the job resumes from our tiers both times (Lightning writes no checkpoint of its own here) and ends
bit-exact with an uninterrupted run."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from resilient.testing.faults import FaultHow, WorkerFault, plan_env  # noqa: E402

from .conftest import HERE, assert_same_weights, resilient_run, restores  # noqa: E402

SCRIPT = HERE / "lightning_train.py"
KILL_AT = 8
NOTICE_AT = 10  # noticed at the next step's start: the ranks agree to stop after the one after it, saved
STOP = NOTICE_AT + 2  # whatever the interval


@pytest.mark.timeout(300)
def test_lightning_ddp_killed_then_preempted_resumes_bit_exact_from_our_tiers(tmp_path: Path) -> None:
    ref, hit = tmp_path / "ref", tmp_path / "hit"
    ref.mkdir(), hit.mkdir()
    flags = ["--ckpt-interval", "3"]
    drill = plan_env(WorkerFault(FaultHow.KILL, rank=1, step=KILL_AT))

    def interrupted() -> list[subprocess.CompletedProcess[str]]:
        args = ["--out", "out", "--notice-at", str(NOTICE_AT)]
        first = resilient_run(hit, SCRIPT, args, [*flags, "--max-restarts", "2"], drill)
        if first.returncode != 75:
            return [first]
        return [first, resilient_run(hit, SCRIPT, args, [*flags, "--max-restarts", "2"], drill)]  # the requeue

    with cf.ThreadPoolExecutor(2) as ex:  # both jobs at once: half the wall time on a small machine
        fa = ex.submit(resilient_run, ref, SCRIPT, ["--out", "out"], flags)
        fb = ex.submit(interrupted)
        a, runs = fa.result(), fb.result()
    assert a.returncode == 0, a.stderr[-4000:]
    assert "restored from None" in a.stdout
    assert runs[0].returncode == 75, ("expected exit 75 (preempted)", runs[0].stderr[-4000:])
    assert runs[1].returncode == 0, runs[1].stderr[-4000:]
    got = restores(hit / "run")
    assert {d["rank"] for d in got} == {0, 1} and all(d["tier"] == "local" for d in got), got
    steps = sorted({d["step"] for d in got})
    # the first rank to see the notice proposes the step after the one it is in: which one depends on where
    # each rank was when rank 0 wrote the file (STOP under no load, one less when rank 1 looked first)
    assert len(steps) == 2 and 2 <= steps[0] < KILL_AT and steps[1] in (STOP - 1, STOP), got
    assert f"restored from {steps[1] + 1}" in runs[1].stdout
    assert not list(hit.rglob("*.ckpt")), "Lightning wrote its own checkpoint"
    for job in (ref, hit):  # trainer.save_checkpoint() after fit: a collective save of the last step
        assert (job / "ckpt" / "step_00000013" / "COMMITTED").exists()
    assert_same_weights(ref / "out" / "final.pt", hit / "out" / "final.pt")
