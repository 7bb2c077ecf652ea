"""Followers of a run space their looks by the number of writers' files (``STAT_SECONDS`` a file): on a shared
volume with thousands of them a quiet look is thousands of stats, and rank 0's tuner looked every second. A few
files change nothing: the base period stands. (The supervisor, which looked at every pass of its loop, now reads no
ledger: each agent forwards its own node's checkpoint boundaries, see ``tests/cluster/test_node_loss.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient.checkpoint.save.interval import IntervalTuner
from resilient.events.api import Event, EventKind
from resilient.events.follow import STAT_SECONDS, LedgerTail


def _write(path: Path, step: int, kind: EventKind = EventKind.STEP, **details: object) -> None:
    ev = Event(kind, node="n0", rank=0, details={"step": step, "seconds": 0.1, **details}, wall=1.7e9 + step,
               mono=float(step))
    with open(path, "a") as f:
        f.write(json.dumps(ev.to_json(), separators=(",", ":")) + "\n")


def _run(tmp_path: Path, files: int, name: str = "run") -> Path:
    run = tmp_path / name
    run.mkdir()
    for i in range(files):
        _write(run / f"events.n{i}-r0.jsonl", 0)
    return run


@pytest.mark.timeout(60)
def test_spacing_grows_with_the_files_followed_and_never_below_the_base(tmp_path: Path) -> None:
    tail = LedgerTail(_run(tmp_path, 1000))
    assert tail.spacing(1.0) == 1.0  # nothing looked at yet
    tail.read_new()
    assert tail.files == 1000
    assert tail.spacing(1.0) == pytest.approx(1000 * STAT_SECONDS) and tail.spacing(1.0) > 1.0
    assert tail.spacing(0.0) == pytest.approx(1000 * STAT_SECONDS)
    assert tail.spacing(30.0) == 30.0
    few = LedgerTail(_run(tmp_path, 4, "few"))
    few.read_new()
    assert few.spacing(0.05) == 0.05  # a job of a few writers looks as often as before


@pytest.mark.timeout(60)
def test_tuner_looks_again_only_after_the_spacing_unless_forced(tmp_path: Path) -> None:
    run = _run(tmp_path, 1000)  # 2 s between looks
    tuner = IntervalTuner.from_run_dir(run)
    follower = tuner._follower
    assert follower is not None and follower.spacing(tuner.follow_every_s) == pytest.approx(1000 * STAT_SECONDS)
    tuner.follow_every_s = 0.0  # a look at every call, but for the spacing
    tuner._follow(force=True)
    read = follower.bytes_read
    _write(run / "events.n0-r0.jsonl", 1, EventKind.CKPT_SAVE, blocking_seconds=0.01)
    tuner._follow()  # within 2 s of the last look (two calls in a row): no look
    assert follower.bytes_read == read
    tuner._follow(force=True)
    assert follower.bytes_read > read
    # a run of a few writers' files: the tuner's own period (1 s) stands, as before
    t2 = IntervalTuner.from_run_dir(_run(tmp_path, 1, "small"))
    assert t2._follower is not None and t2._follower.spacing(t2.follow_every_s) == t2.follow_every_s

