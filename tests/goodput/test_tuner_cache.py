"""The interval tuner's cache beside the ledger (resilient/checkpoint/save/tuner_cache.py): a restarted rank 0 reads on
from where the last one stood and learns what reading the whole ledger teaches; a cache that does not match the
ledger (torn, a flipped byte, a ledger file replaced, cut, rewritten or gone, another run's) is not used."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from resilient.checkpoint.save.interval import IntervalTuner
from resilient.checkpoint.save.tuner_cache import CACHE_NAME, read_cache
from resilient.events import Event, EventKind

# rank 0's step line as resilient/worker/steps.py formats it (the tuner's reader sums these without an event each)
STEP_LINE = ('{"kind":"step","node":"n0","rank":0,"attempt":%d,"details":{"step":%d,"seconds":%r,'
             '"compute_seconds":%r},"wall":%r,"mono":%r,"schema":1}\n')
T0 = 1.7e9


def _event(kind: EventKind, wall: float, of_attempt: int, **details: object) -> str:
    ev = Event(kind, node="n0", rank=0, attempt=of_attempt, details=dict(details), wall=wall, mono=wall - T0)
    return json.dumps(ev.to_json(), separators=(",", ":")) + "\n"


def _grow(run: Path, first: int, n: int, *, attempt: int, writer: str = "events.jsonl") -> None:
    """Steps ``first`` .. ``first + n`` of 0.1–0.13 s, a save every 10 (blocking, local; every 50th uploaded)."""
    with open(run / writer, "a") as f:
        for s in range(first, first + n):
            wall = T0 + s * 0.2
            sec = 0.1 + (s % 7) * 0.005
            f.write(STEP_LINE % (attempt, s, sec, sec - 0.01, wall, wall - T0))
            if s % 10 == 0:
                f.write(_event(EventKind.CKPT_SAVE, wall + 0.01, attempt, step=s, blocking_seconds=0.02 + (s % 3) * 0.001))
                f.write(_event(EventKind.CKPT_TIER_DONE, wall + 0.15, attempt, step=s, tier="local", seconds=0.05))
            if s % 50 == 0:
                f.write(_event(EventKind.CKPT_TIER_DONE, wall + 0.18, attempt, step=s, tier="persistent",
                               seconds=0.3 + (s % 4) * 0.01))


def _restart(run: Path, at: int, attempt: int) -> None:
    with open(run / "events.jsonl", "a") as f:
        f.write(_event(EventKind.RESTART, T0 + at * 0.2 - 0.05, attempt - 1, attempt=attempt, cause="worker_failed"))


def _run_that_ran(tmp_path: Path) -> Path:
    """A run of 6,000 steps, one restart, two writers' files."""
    run = tmp_path / "run"
    run.mkdir()
    _grow(run, 0, 3000, attempt=0)
    _restart(run, 3000, 1)
    _grow(run, 3000, 3000, attempt=1, writer="events.host-7.jsonl")
    return run


def _rank0_ran_on(run: Path) -> IntervalTuner:
    """A rank 0 that started on ``run`` and looked at the ledger while it trained: it wrote the cache."""
    t = IntervalTuner.from_run_dir(run)
    assert not (run / CACHE_NAME).exists()  # not at the start: the whole job waits for that
    _grow(run, 6000, 500, attempt=1, writer="events.host-7.jsonl")
    t.follow_every_s = 0.0
    t.interval_steps()  # the save thread's question after a save: the tuner looks at the ledger
    assert not (run / CACHE_NAME).exists()  # not under the caller's lock
    assert t.write_cache() and (run / CACHE_NAME).exists()
    assert not t.write_cache()  # once per look that made it due
    return t


def _fresh(run: Path) -> IntervalTuner:
    """What reading the whole ledger teaches (the cache moved aside)."""
    aside = run.parent / "aside"
    (run / CACHE_NAME).rename(aside)
    try:
        return IntervalTuner.from_run_dir(run)
    finally:
        aside.rename(run / CACHE_NAME)


def _same(got: IntervalTuner, want: IntervalTuner) -> None:
    g, w = got.inputs(), want.inputs()
    assert g.keys() == w.keys()
    assert g.pop("ledger_bytes_read_at_start") == got._follower.bytes_read
    assert w.pop("ledger_bytes_read_at_start") == want._follower.bytes_read
    assert w.pop("ledger_cache_used") is False
    g.pop("ledger_cache_used")
    for k in w:
        assert g[k] == (w[k] if w[k] is None else pytest.approx(w[k], rel=1e-12)), k
    assert list(got._steps) == list(want._steps) and list(got._saves) == list(want._saves)
    assert list(got._uploads) == list(want._uploads)


@pytest.mark.parametrize("later", [40, 15000])  # a restart soon after the cache was written; one long after it
def test_a_restart_reads_on_from_the_cache_and_learns_what_the_whole_ledger_teaches(tmp_path: Path, later: int) -> None:
    run = _run_that_ran(tmp_path)
    _rank0_ran_on(run)
    cached_at = sum(p.stat().st_size for p in run.glob("events*.jsonl"))
    _restart(run, 6500, 2)
    _grow(run, 6500, later, attempt=2, writer="events.host-9.jsonl")
    total = sum(p.stat().st_size for p in run.glob("events*.jsonl"))
    got = IntervalTuner.from_run_dir(run)
    assert got._follower.bytes_read == total - cached_at  # only what was written since
    want = _fresh(run)
    assert want._follower.bytes_read == total
    _same(got, want)
    assert got.inputs()["interruptions"] == 2 and got.inputs()["save_interference_seconds"] is not None
    assert got.inputs()["ledger_cache_used"] is True


def test_a_restart_with_the_cache_goes_on_following_the_ledger(tmp_path: Path) -> None:
    run = _run_that_ran(tmp_path)
    _rank0_ran_on(run)
    got = IntervalTuner.from_run_dir(run)
    _grow(run, 6500, 3, attempt=2, writer="events.host-9.jsonl")
    assert [e.details["step"] for e in got._follower.read_new() if e.kind is EventKind.STEP] == [6500, 6501, 6502]


def _flip(p: Path, at: int) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= 0x01
    p.write_bytes(bytes(b))


def _rewrite_in_place(p: Path) -> None:
    """Same inode, same size, another digit in the last line: a file rewritten, not appended to (the cache checks
    the bytes just before its mark; what a file held long before is what the tuner learnt from, whatever it holds
    now)."""
    b = bytearray(p.read_bytes())
    i = b.rindex(b'"mono":') + len(b'"mono":')
    b[i] = ord("9") if b[i] != ord("9") else ord("8")
    with open(p, "r+b") as f:
        f.write(bytes(b))


def _replace(p: Path) -> None:
    """The same bytes in a new file under the old name (a copy renamed over it)."""
    shutil.copy(p, p.with_name("copy"))
    os.replace(p.with_name("copy"), p)


FAULTS = {
    "a flipped byte in the cache": (lambda run: _flip(run / CACHE_NAME, (run / CACHE_NAME).stat().st_size // 2),
                                    "checksum"),
    "a torn cache": (lambda run: os.truncate(run / CACHE_NAME, (run / CACHE_NAME).stat().st_size // 3), "checksum"),
    "a ledger file replaced": (lambda run: _replace(run / "events.jsonl"), "replaced"),
    "a ledger file cut short": (lambda run: os.truncate(run / "events.host-7.jsonl", 1000), "shorter"),
    "a ledger file rewritten in place": (lambda run: _rewrite_in_place(run / "events.host-7.jsonl"), "other bytes"),
    "a ledger file gone": (lambda run: (run / "events.host-7.jsonl").unlink(), "gone"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_cache_that_does_not_match_the_ledger_is_not_used(tmp_path: Path, fault: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    run = _run_that_ran(tmp_path)
    _rank0_ran_on(run)
    do, why = FAULTS[fault]
    do(run)
    with caplog.at_level(logging.INFO, logger="resilient.checkpoint.save.tuner_cache"):
        got = IntervalTuner.from_run_dir(run)
    assert any("not used" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text
    assert got._follower.bytes_read == sum(p.stat().st_size for p in run.glob("events*.jsonl"))
    _same(got, _fresh(run))


def test_another_runs_cache_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = _run_that_ran(tmp_path)
    _rank0_ran_on(run)
    other = tmp_path / "other"
    shutil.copytree(run, other)  # the same bytes in other files: the cache names the first run's
    with caplog.at_level(logging.INFO, logger="resilient.checkpoint.save.tuner_cache"):
        got = IntervalTuner.from_run_dir(other)
    assert "replaced" in caplog.text
    _same(got, _fresh(other))


def test_a_cache_of_the_right_shape_with_a_wrong_value_is_refused_by_name(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    import zlib

    run = _run_that_ran(tmp_path)
    _rank0_ran_on(run)
    p = run / CACHE_NAME
    body = json.loads(p.read_bytes().partition(b"\n")[2])
    body["sums"]["uptime"] = -1.0
    raw = json.dumps(body).encode()
    p.write_bytes(b"%08x\n" % zlib.crc32(raw) + raw)
    with caplog.at_level(logging.INFO, logger="resilient.checkpoint.save.tuner_cache"):
        assert read_cache(run, 256, 32) is None
    assert "sums.uptime: not a duration" in caplog.text


def test_a_temporary_file_left_by_a_killed_writer_is_removed_once_old(tmp_path: Path) -> None:
    run = _run_that_ran(tmp_path)
    old, new = run / f".{CACHE_NAME}.123.tmp", run / f".{CACHE_NAME}.456.tmp"
    for p in (old, new):
        p.write_bytes(b"half a cache")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    IntervalTuner.from_run_dir(run)
    assert not old.exists() and new.exists()  # a young one may be a live writer's


# ------------------------------------------------------------------------------------------ a real run
@pytest.mark.timeout(240)
def test_a_real_restart_of_rank_0_reads_on_from_the_cache_its_predecessor_wrote(tmp_path: Path) -> None:
    """``--ckpt-interval auto`` on the real stack: rank 0 is SIGKILLed at step 400 of its first attempt, after its
    tuner looked at the ledger while training (and so wrote the cache); the restarted rank 0's tuner reads on from
    it, which its first interval decision in the ledger says."""
    import subprocess
    import sys

    from resilient.drill.spec import FaultHow, WorkerFault, plan_env
    from resilient.events.follow import read_events
    from tests.goodput.conftest import finish, kill_group

    run_dir = tmp_path / "run"
    env = dict(os.environ, STEPS="600", HIDDEN="256", BATCH="64", OMP_NUM_THREADS="1",
               RESILIENT_CKPT_PRIOR_MTBF="1",  # saves every few dozen steps: the tuner is asked after each
               **plan_env(WorkerFault(FaultHow.KILL, rank=0, step=400, attempt=0)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--run-dir", str(run_dir), "--ckpt-local", str(run_dir / "ckpt"), "--ckpt-interval", "auto",
         str(Path(__file__).parent / "ckpt_train.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = finish(proc, timeout=200)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    evs = list(read_events(run_dir))
    first = {}
    for e in evs:
        if e.kind is EventKind.CKPT_INTERVAL:
            first.setdefault(e.attempt, e.details["inputs"])
    assert set(first) == {0, 1}, first
    assert first[0]["ledger_cache_used"] is False
    assert first[1]["ledger_cache_used"] is True, first[1]
    # the killed rank 0's own file alone holds more than the restart read: it read on from the cache
    attempt0 = {e.details["pids"]["0"] for e in evs if e.kind is EventKind.ATTEMPT_START and e.attempt == 0}
    (pid,) = attempt0
    (own,) = [p for p in run_dir.glob(f"events.*-{pid}.jsonl")]
    assert first[1]["ledger_bytes_read_at_start"] < own.stat().st_size
    assert (run_dir / CACHE_NAME).exists()


def _restored(run: Path, at: int, attempt: int, tier: str, writer: str, covered: bool | None = None) -> None:
    with open(run / writer, "a") as f:
        for rank in (0, 1):  # every rank writes its restore; one restart's is counted once
            extra = {} if covered is None else {"covered_by_snapshot": covered}
            ev = Event(EventKind.CKPT_RESTORE, node="n0", rank=rank, attempt=attempt,
                       details={"step": at - 1, "tier": tier, "seconds": 0.01, "bytes": 1, **extra},
                       wall=T0 + at * 0.2, mono=at * 0.2)
            f.write(json.dumps(ev.to_json(), separators=(",", ":")) + "\n")


def test_restarts_resumed_from_snapshots_are_learnt_from_the_ledger_and_the_cache_alike(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _grow(run, 0, 3000, attempt=0)
    _restart(run, 3000, 1)
    _restored(run, 3000, 1, "snapshot", "events.host-7.jsonl")  # before the cache is written
    _grow(run, 3000, 3000, attempt=1, writer="events.host-7.jsonl")
    _rank0_ran_on(run)
    _restart(run, 6500, 2)
    _restored(run, 6500, 2, "snapshot", "events.host-9.jsonl")  # after it
    _grow(run, 6500, 40, attempt=2, writer="events.host-9.jsonl")
    _restart(run, 6540, 3)
    _restored(run, 6540, 3, "local", "events.host-9.jsonl", covered=False)  # a restart the snapshots did not cover
    _grow(run, 6540, 40, attempt=3, writer="events.host-9.jsonl")
    _restart(run, 6580, 4)
    # from a disk step newer than every rank's snapshot by less than a snapshot interval: node memory covered it
    _restored(run, 6580, 4, "local", "events.host-9.jsonl", covered=True)
    _grow(run, 6580, 40, attempt=4, writer="events.host-9.jsonl")
    got = IntervalTuner.from_run_dir(run)
    assert got.inputs()["ledger_cache_used"] is True
    _same(got, _fresh(run))
    i = got.inputs()
    assert (i["interruptions"], i["interruptions_from_snapshots"]) == (4, 3)
    # only the restart that fell back to a disk tier shortens the interval
    assert i["mtbf_seconds"] == pytest.approx((got.prior_weight * got.prior_mtbf_s + i["uptime_seconds"])
                                              / (got.prior_weight + 1))


def test_a_cache_written_before_snapshot_restores_were_kept_is_read_as_restarts_that_needed_the_disk(
        tmp_path: Path) -> None:
    import zlib

    run = tmp_path / "run"
    run.mkdir()
    _grow(run, 0, 3000, attempt=0)
    _restart(run, 3000, 1)
    _restored(run, 3000, 1, "snapshot", "events.host-7.jsonl")
    _grow(run, 3000, 3000, attempt=1, writer="events.host-7.jsonl")
    _rank0_ran_on(run)
    p = run / CACHE_NAME
    body = json.loads(p.read_bytes().partition(b"\n")[2])
    del body["sums"]["snapshot_attempts"]  # as the version before wrote it
    raw = json.dumps(body).encode()
    p.write_bytes(b"%08x\n" % zlib.crc32(raw) + raw)
    got = IntervalTuner.from_run_dir(run)
    assert got.inputs()["ledger_cache_used"] is True
    assert (got.inputs()["interruptions"], got.inputs()["interruptions_from_snapshots"]) == (1, 0)
