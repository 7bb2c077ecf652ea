"""A restore that finds no usable step says what is missing: the error carries the steps, ranks, files and tiers,
the ledger gets a ``state_undefined`` record with them, and the class is ``state_unrecoverable``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resilient.checkpoint.api import NoRestorableStepError
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.supervisor.classify import FailureClass, classify


@pytest.mark.timeout(60)
def test_missing_shards_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    ck = CheckpointManager(local=tmp_path / "local", interval=1)
    for step in (0, 1):
        ck.save(step, {"t": torch.arange(100.0) + step})
    ck.close()
    for step in (0, 1):  # the data file of every step is gone: its manifest and commit marker remain
        (tmp_path / "local" / f"step_{step:08d}" / "__0_0.distcp").unlink()
    with pytest.raises(NoRestorableStepError) as info:
        CheckpointManager(local=tmp_path / "local", interval=1).restore({"t": torch.zeros(100)})
    e = info.value
    assert e.details["steps"] == [1, 0], e.details
    assert e.details["tiers"] == ["local", "peer"], e.details  # the tiers this manager has
    assert e.details["why"]["1"] == {"missing": "files", "ranks": [0], "files": ["__0_0.distcp"],
                                     "tiers": ["local"]}, e.details
    first = str(e).splitlines()[0]
    assert "step 1: files of rank(s) 0 (__0_0.distcp) on no tier (looked at local)" in first, first
    assert "persistent tier" in first and "older checkpoint directory" in first, first
    recs = [ev for ev in read_events(tmp_path / "run")
            if ev.kind is EventKind.CKPT_TIER_FAILED and ev.details.get("state_undefined")]
    assert len(recs) == 1, recs
    assert recs[0].details["restore"] == e.details
    assert classify(EventKind.CKPT_TIER_FAILED, recs[0].details) is FailureClass.STATE_UNRECOVERABLE
    assert classify(EventKind.WORKER_EXIT, {"exc_type": type(e).__name__, "message": first}) \
        is FailureClass.STATE_UNRECOVERABLE
