"""Lightning DDP (gloo, 2 ranks) under the real ``resilient-run``: a rank SIGKILLed mid-run; the job resumes
from our tiers (Lightning writes no checkpoint of its own here) and ends bit-exact with an uninterrupted run."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from resilient.testing.faults import FaultHow, WorkerFault, plan_env  # noqa: E402

from .conftest import HERE, assert_same_weights, resilient_run, restores  # noqa: E402

SCRIPT = HERE / "lightning_train.py"
KILL_AT = 8


@pytest.mark.timeout(300)
def test_lightning_ddp_killed_resumes_bit_exact_from_our_tiers(tmp_path: Path) -> None:
    # (a preemption notice in the middle of this run is not tested here: when the ranks agreed to stop
    # one step earlier than usual (the notice seen during a save), the rerun was not bit-exact: an open bug)
    ref, hit = tmp_path / "ref", tmp_path / "hit"
    ref.mkdir(), hit.mkdir()
    flags = ["--ckpt-interval", "3"]
    drill = plan_env(WorkerFault(FaultHow.KILL, rank=1, step=KILL_AT))
    with cf.ThreadPoolExecutor(2) as ex:  # both jobs at once: half the wall time on a small machine
        fa = ex.submit(resilient_run, ref, SCRIPT, ["--out", "out"], flags)
        fb = ex.submit(resilient_run, hit, SCRIPT, ["--out", "out"], [*flags, "--max-restarts", "2"], drill)
        a, b = fa.result(), fb.result()
    assert a.returncode == 0, a.stderr[-4000:]
    assert "restored from None" in a.stdout
    assert b.returncode == 0, b.stderr[-4000:]
    got = restores(hit / "run")
    assert {d["rank"] for d in got} == {0, 1} and all(d["tier"] == "local" for d in got), got
    steps = sorted({d["step"] for d in got})
    assert len(steps) == 1 and 2 <= steps[0] < KILL_AT, got
    assert not list(hit.rglob("*.ckpt")), "Lightning wrote its own checkpoint"
    for job in (ref, hit):  # trainer.save_checkpoint() after fit: a collective save of the last step
        assert (job / "ckpt" / "step_00000013" / "COMMITTED").exists()
    assert_same_weights(ref / "out" / "final.pt", hit / "out" / "final.pt")
