"""DDP resumed from a checkpoint after a SIGKILL, against an uninterrupted run, at worlds 2 and 4 (real ranks on
gloo, the checkpoint tiers of ``CheckpointManager``, ``examples/ckpt_train.py --ddp``).

Plain DDP is bit-exact at world 2 only: it rebuilds its gradient buckets after each process's first step, which
moves gradients within the flat tensors that gloo's ring all-reduce sums, and from three ranks on that changes
the order of the summands. ``resilient.ddp.make_exact`` sums in rank order whatever the layout: bit-exact at
every world size (see the module's docstring).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from tests.checkpoint.conftest import TRAIN, Workers, ok
from tests.checkpoint.test_distributed import assert_bit_exact, final

ARGS = ["--steps", "12", "--interval", "4", "--ddp"]


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.close()


def killed_and_resumed(tmp: Path, workers: Workers, world: int, flags: list[str]) -> tuple[list[dict], list[dict]]:
    """(uninterrupted, resumed): the last rank is SIGKILLed after the save of step 7; the rerun resumes at 8."""
    ref, run = tmp / "ref", tmp / "run"
    ok(workers.run(TRAIN, [*ARGS, *flags, "--local", str(ref / "ckpt"), "--out", str(ref / "out")], world,
                   timeout=150))
    args = [*ARGS, *flags, "--local", str(run / "ckpt"), "--out", str(run / "out")]
    first = workers.run(TRAIN, args, world, env=plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=world - 1, step=7)),
                        timeout=150)
    assert first[world - 1].returncode == -9, first[world - 1].output[-3000:]
    ok(workers.run(TRAIN, args, world, timeout=150))
    res = final(run / "out", world)
    assert [r["start"] for r in res] == [8] * world
    return final(ref / "out", world), res


@pytest.mark.timeout(600)
def test_ddp_made_exact_resumes_bit_exact(tmp_path: Path, workers: Workers) -> None:
    """make_exact at world 4, where plain DDP is not exact (test_plain_ddp_at_world_4_is_not_exact): the rank-order
    hook has no path of its own per world size, and world 2 is bit-exact without it
    (test_plain_ddp_is_exact_at_world_2), so a world-2 run of the hook would check nothing more."""
    ref, res = killed_and_resumed(tmp_path, workers, 4, ["--ddp-exact"])
    assert_bit_exact(ref, res)


@pytest.mark.timeout(600)
def test_plain_ddp_is_exact_at_world_2(tmp_path: Path, workers: Workers) -> None:
    ref, res = killed_and_resumed(tmp_path, workers, 2, [])
    assert_bit_exact(ref, res)


@pytest.mark.timeout(600)
def test_plain_ddp_at_world_4_is_not_exact(tmp_path: Path, workers: Workers) -> None:
    """What the README documents: without make_exact the world-4 resume ends with other weights (by rounding)."""
    ref, res = killed_and_resumed(tmp_path, workers, 4, [])
    diffs = [(ra["model"][k] - rb["model"][k]).abs().max().item() for ra, rb in zip(ref, res) for k in ra["model"]
             if ra["model"][k].is_floating_point()]
    # rounding in the first resumed step, which AdamW's normalisation then carries into the weights
    assert max(diffs) > 0, "plain DDP resumed bit-exact at world 4: the README's caveat is stale"
    assert torch.equal(res[0]["model"]["0.weight"], res[3]["model"]["0.weight"])  # replicas still agree
