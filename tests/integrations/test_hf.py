"""transformers.Trainer (a tiny GPT-2, 2 ranks on gloo) under the real ``resilient-run``: a rank SIGKILLed
mid-run, resumed from our tiers, ending with the same weights as an uninterrupted run."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from resilient.testing.faults import FaultHow, WorkerFault, plan_env  # noqa: E402

from .conftest import HERE, assert_same_weights, resilient_run, restores  # noqa: E402

SCRIPT = HERE / "hf_train.py"
KILL_AT = 8


@pytest.mark.timeout(300)
def test_hf_trainer_killed_rank_resumes_exactly_from_our_tiers(tmp_path: Path) -> None:
    ref, hit = tmp_path / "ref", tmp_path / "hit"
    ref.mkdir(), hit.mkdir()
    # the fork server imports the Trainer and the model once for every worker of both attempts (a third of
    # the CPU time of this test without it)
    flags = ["--ckpt-interval", "3", "--preload", "transformers.trainer,transformers.models.gpt2.modeling_gpt2"]
    with cf.ThreadPoolExecutor(2) as ex:
        fa = ex.submit(resilient_run, ref, SCRIPT, ["--out", "out"], flags)
        fb = ex.submit(resilient_run, hit, SCRIPT, ["--out", "out"], [*flags, "--max-restarts", "2"],
                       plan_env(WorkerFault(FaultHow.KILL, rank=1, step=KILL_AT)))
        a, b = fa.result(), fb.result()
    assert a.returncode == 0, a.stderr[-4000:]
    assert b.returncode == 0, b.stderr[-4000:]
    assert "done at step 12, restored from None" in a.stdout
    got = restores(hit / "run")
    assert {d["rank"] for d in got} == {0, 1}
    assert all(d["tier"] == "local" and 2 <= d["step"] < KILL_AT for d in got), got
    assert f"done at step 12, restored from {got[0]['step'] + 1}" in b.stdout
    assert not list((hit / "out").glob("checkpoint-*")), "the Trainer wrote its own checkpoint"
    assert_same_weights(ref / "out" / "final.pt", hit / "out" / "final.pt")
