"""The launcher's closing lines on checkpoints from a follower of the run (resilient.launcher.report.CheckpointFollower):
real ledger files written by real Ledger writers (a worker's in another process), read as the run grows, give at
exit what reading the whole run gives."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import random
from pathlib import Path

import pytest

from resilient.events import Event, EventKind, Ledger
from resilient.goodput.checkpoints import CheckpointTally, checkpoint_summary
from resilient.launcher.exit import Ending
from resilient.launcher.report import CheckpointFollower, close_checkpoints
from tests._helpers.wait import wait_for

NODE = "host:1"
STORE = "gs://bucket/run"


def _worker(run_dir: str, steps: list[int], fail: int | None = None, late: float | None = None) -> None:
    """A worker process (a ledger file of its own): a save per step, its tiers done, step lines between; with
    ``late``, first a save of step 99 stamped with that wall time."""
    led = Ledger(run_dir, node=NODE)
    if late is not None:
        led.write(Event(EventKind.CKPT_SAVE, node=NODE, rank=0, details={"step": 99}, wall=late))
    for s in steps:
        led.emit(EventKind.STEP, rank=0, step=s, seconds=0.1)
        led.emit(EventKind.CKPT_SAVE, rank=0, step=s, blocking_seconds=0.01)
        if s == fail:
            led.emit(EventKind.CKPT_TIER_FAILED, rank=0, step=s, tier="local", error="No space left on device")
            led.emit(EventKind.CKPT_SAVE_FAILED, rank=0, step=s, error="No space left on device")
            continue
        led.emit(EventKind.CKPT_TIER_DONE, rank=0, step=s, tier="local", seconds=0.01)
        if s % 2 == 0:
            led.emit(EventKind.CKPT_TIER_DONE, rank=0, step=s, tier="persistent", seconds=0.2)
    led.close()


def _in_process(run_dir: Path, *args: object) -> None:
    p = multiprocessing.get_context("fork").Process(target=_worker, args=(str(run_dir), *args))
    p.start()
    p.join(60)
    assert p.exitcode == 0


def _close(run_dir: Path, agent: Ledger, follower: CheckpointFollower | None) -> tuple[int, list[str]]:
    """close_checkpoints as the agent calls it at its exit: the exit code and the lines it printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        end = close_checkpoints(Ending(0, "succeeded"), agent, run_dir, NODE, STORE, lambda: None, follower)
    return end.code, err.getvalue().splitlines()


def _whole(run_dir: Path) -> dict:
    """The summary of this node's last launch, read from the whole run as the exit reads it without a follower."""
    from resilient.events.follow import read_events

    evs = list(read_events(run_dir))
    mine = [i for i, e in enumerate(evs) if e.kind is EventKind.RUN_START and e.node == NODE]
    return checkpoint_summary(evs[mine[-1]:] if mine else evs).to_json()


def test_followed_while_the_run_grows_gives_what_reading_the_whole_run_gives(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    agent.emit(EventKind.RUN_START)  # an earlier launch of this node in the same directory: not this launch's
    _in_process(tmp_path, [1, 2, 3])
    f = CheckpointFollower(tmp_path, NODE)  # what the agent makes before its RUN_START
    start = agent.emit(EventKind.RUN_START)
    agent.write(Event(EventKind.RUN_START, node="host:2"))  # another node's launch starts no tally here
    _in_process(tmp_path, [10, 11, 12], 11)
    assert f.poll() > 0  # a look while the run goes on
    # written late by another writer, stamped before this launch began: in wall order, the launch before's
    _in_process(tmp_path, [], None, start.wall - 1)
    _in_process(tmp_path, [13, 14, 15])
    agent.emit(EventKind.CKPT_RESTORE_MISSING, attempted_steps=[12, 13])
    summary = f.finish()
    assert summary is not None and summary.to_json() == _whole(tmp_path)
    assert summary.attempted == [10, 11, 12, 13, 14, 15] and summary.failed == [11]
    followed = _close(tmp_path, agent, f)
    assert followed == _close(tmp_path, agent, None)
    code, lines = followed
    # the newest step (15) is not on the persistent tier: the run's exit says so, and exits 73
    assert code == 73 and any("6 save(s)" in ln for ln in lines) and any("failed save" in ln for ln in lines)


def test_the_thread_follows_and_a_line_still_being_written_at_exit_is_not_counted(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    f = CheckpointFollower(tmp_path, NODE, interval=0.02)
    agent.emit(EventKind.RUN_START)
    f.start()
    _in_process(tmp_path, [1, 2, 3, 4])
    # RUN_START, then per step a save and its tier(s): 4 saves, 4 local, 2 persistent
    wait_for(lambda: f.added == 10, 30, "the follower's thread to read the worker's 10 checkpoint records")
    line = json.dumps(Event(EventKind.CKPT_TIER_DONE, node=NODE, rank=0,
                            details={"step": 5, "tier": "local"}).to_json()).encode()
    with open(agent.path, "ab") as fh:
        fh.write(line[:40])  # a writer cut off mid-line: no record yet
    summary = f.finish()
    assert summary is not None and summary.to_json() == _whole(tmp_path)
    assert summary.newest("local") == 4


def test_a_failed_look_leaves_the_exit_to_read_the_whole_run(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    f = CheckpointFollower(tmp_path, NODE)
    agent.emit(EventKind.RUN_START)
    _in_process(tmp_path, [1, 2])
    bad = tmp_path / "events.zz.jsonl"
    bad.mkdir()  # a ledger's name on something that cannot be read as one
    f.poll()
    assert f.failed is not None and f.finish() is None
    bad.rmdir()
    followed = _close(tmp_path, agent, f)
    assert followed == _close(tmp_path, agent, None) and any("2 save(s)" in ln for ln in followed[1])


def test_from_the_start_the_last_run_start_of_this_node_begins_the_launch(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    agent.emit(EventKind.RUN_START)
    _in_process(tmp_path, [1, 2, 3])
    agent.emit(EventKind.RUN_START)
    _in_process(tmp_path, [7])
    agent.write(Event(EventKind.RUN_START, node="host:2"))
    _in_process(tmp_path, [8])
    f = CheckpointFollower(tmp_path, NODE, from_start=True)
    summary = f.finish()
    assert summary is not None and summary.attempted == [7, 8] and summary.to_json() == _whole(tmp_path)


def test_a_tally_fed_in_any_order_sums_up_as_the_run_sorted_by_wall() -> None:
    kinds = [EventKind.CKPT_SAVE, EventKind.CKPT_TIER_DONE, EventKind.CKPT_SAVE_FAILED, EventKind.CKPT_TIER_FAILED,
             EventKind.CKPT_STOP, EventKind.CKPT_RESTORE_MISSING, EventKind.STEP]
    for seed in range(300):
        r = random.Random(seed)
        evs = [Event(r.choice(kinds), node=NODE, rank=r.choice([0, 1, None]), wall=1000.0 + i,
                     details={"step": r.choice([r.randrange(6), "x", None]),
                              "tier": r.choice(["local", "persistent", "snapshot"]),
                              "error": r.choice(["e1", "e2"]), "message": r.choice(["m1", "m2"]),
                              "state_undefined": r.random() < 0.2, "attempted_steps": r.choice([None, [1, 2]]),
                              "skipped": r.random() < 0.2})
               for i in range(r.randrange(40))]
        want = checkpoint_summary(evs)
        r.shuffle(evs)
        tally = CheckpointTally()
        for ev in evs:
            tally.add(ev)
        got = tally.summary()
        assert (got.to_json(), got.lines(), got.rank0, got.first_error) == \
            (want.to_json(), want.lines(), want.rank0, want.first_error), seed


def test_a_bad_interval_is_refused_with_its_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval.*-1"):
        CheckpointFollower(tmp_path, NODE, interval=-1)
