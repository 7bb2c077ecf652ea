"""Followers of a run space their looks by the number of writers' files (``STAT_SECONDS`` a file): on a shared
volume with thousands of them a quiet look is thousands of stats, and the supervisor looked at every pass of its
loop (20 a second), rank 0's tuner every second. A few files change nothing: the base period stands."""

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


@pytest.mark.timeout(60)
def test_supervisor_reads_the_ledger_at_every_pass_for_a_few_files_and_spaced_for_thousands(tmp_path: Path) -> None:
    from resilient.events.ledger import Ledger
    from resilient.supervisor import transport as T
    from resilient.supervisor.config import SupervisorConfig
    from resilient.supervisor.core import SupervisorCore
    from resilient.supervisor.loop import LoopConfig, SupervisorLoop

    def boundary(run: Path, step: int) -> None:
        _write(run / "events.n0-r0.jsonl", step, EventKind.CKPT_TIER_DONE, tier="local")

    for files, spaced in ((4, False), (1000, True)):
        run = _run(tmp_path, files, f"run{files}")
        store = T.connect_store("127.0.0.1", 0, 10.0, is_master=True)
        job = f"spacing{files}"
        assert T.claim_job(store, job, hosting=True, timeout=10.0) == job
        cfg = SupervisorConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=1, node_timeout=600.0)
        loop = SupervisorLoop(LoopConfig(core=cfg, last_call=0.0, advertise_addr="127.0.0.1", linger=0.0),
                              store, T.Signer(b"k" * 32, job), Ledger(run, node="supervisor"), SupervisorCore(cfg))
        try:
            tail = loop._tail
            assert tail is not None
            loop.step(100.0)  # the first pass looks
            boundary(run, 1)
            loop.step(100.0 + 0.05)  # the next pass (the loop's tick)
            read_at_next_pass = tail.last_read > 0
            assert read_at_next_pass is not spaced, (files, tail.last_read)
            if spaced:
                loop.step(100.0 + 1000 * STAT_SECONDS + 0.01)  # once the spacing has passed, the boundary is read
                assert tail.last_read > 0
        finally:
            loop.presence.close()
