"""Arithmetic of the calculator on hand-made ledgers with known answers, and properties on random ones."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.events import Event, EventKind, Ledger, read_events
from resilient.goodput.api import CATEGORIES, EmptyLedgerError
from resilient.goodput.calculator import compute_report, report_for_run

K = EventKind


def ev(kind, wall, attempt=None, node="n0", rank=None, details=None, **kw):
    return Event(kind=kind, node=node, rank=rank, attempt=attempt, details={**(details or {}), **kw}, wall=wall,
                 mono=wall)


def write(run_dir, events):
    with Ledger(run_dir) as led:
        for e in events:
            led.write(e)


def assert_adds_up(rep):
    assert set(rep.badput_seconds) == set(CATEGORIES)
    total = rep.productive_seconds + math.fsum(rep.badput_seconds.values())
    assert total == pytest.approx(rep.wall_seconds, rel=1e-9, abs=1e-9)
    assert 0.0 <= rep.goodput <= 1.0
    assert all(v >= -1e-12 for v in rep.badput_seconds.values())
    for a in rep.attempts:
        assert a.productive_seconds + math.fsum(a.badput_seconds.values()) == pytest.approx(a.wall_seconds, abs=1e-9)


def steady_run():
    return [
        ev(K.RUN_START, 0.0),
        ev(K.ATTEMPT_START, 1.0, attempt=0, world_size=2),
        ev(K.STEP, 6.0, attempt=0, rank=0, step=0, seconds=4.0),  # [2, 6]: 2 s of it is warm-up
        ev(K.STEP, 8.0, attempt=0, rank=0, step=1, seconds=2.0),
        ev(K.CKPT_SAVE, 10.0, attempt=0, rank=0, step=2, blocking_seconds=0.5),
        ev(K.CKPT_SAVE, 10.0, attempt=0, rank=1, step=2, blocking_seconds=0.5),  # same save, other rank
        ev(K.STEP, 10.0, attempt=0, rank=0, step=2, seconds=2.0),
        ev(K.STEP, 12.0, attempt=0, rank=0, step=3, seconds=2.0),
        ev(K.STEP, 14.0, attempt=0, rank=0, step=4, seconds=2.0),
        ev(K.RUN_END, 15.0, exit_code=0),
    ]


def test_steady_run_known_answer():
    rep = compute_report(steady_run())
    assert rep.wall_seconds == 15.0 and not rep.in_progress
    assert rep.productive_seconds == pytest.approx(9.5)
    b = rep.badput_seconds
    assert b["startup"] == pytest.approx(4.0)  # launch → first step (2 s) + first-step warm-up (2 s)
    assert b["checkpoint_save_stall"] == pytest.approx(0.5)  # two ranks, one stall
    assert b["other"] == pytest.approx(1.0)  # teardown after the last step
    assert rep.goodput == pytest.approx(9.5 / 15)
    assert rep.disruptions == 0 and rep.last_step == 4
    assert [a.end_reason for a in rep.attempts] == ["completed"]
    assert_adds_up(rep)


def crash_run():
    return [
        ev(K.RUN_START, 0.0),
        ev(K.ATTEMPT_START, 1.0, attempt=0, world_size=2),
        ev(K.STEP, 3.0, attempt=0, rank=0, step=0, seconds=1.0),
        ev(K.STEP, 4.0, attempt=0, rank=0, step=1, seconds=1.0),
        ev(K.CKPT_SAVE, 4.0, attempt=0, rank=0, step=1, blocking_seconds=0.0),
        ev(K.STEP, 5.0, attempt=0, rank=0, step=2, seconds=1.0),
        ev(K.STEP, 6.0, attempt=0, rank=0, step=3, seconds=1.0),
        ev(K.WORKER_EXIT, 7.0, attempt=0, rank=1, exit_code=-9, signal="SIGKILL"),
        ev(K.WORKER_EXIT, 7.2, attempt=0, rank=0, exit_code=-9, signal="SIGKILL"),  # torn down by the agent
        ev(K.RESTART, 7.5, attempt=0, details={"attempt": 1}, cause="worker_exit", detect_seconds=0.5),
        ev(K.ATTEMPT_START, 8.0, attempt=1, world_size=2),
        ev(K.CKPT_RESTORE, 9.5, attempt=1, rank=0, step=1, tier="local", seconds=1.0),
        ev(K.STEP, 11.0, attempt=1, rank=0, step=2, seconds=1.0),
        ev(K.STEP, 12.0, attempt=1, rank=0, step=3, seconds=1.0),
        ev(K.STEP, 13.0, attempt=1, rank=0, step=4, seconds=1.0),
        ev(K.RUN_END, 13.0, exit_code=0),
    ]


def test_crash_and_restart_known_answer():
    rep = compute_report(crash_run())
    b = rep.badput_seconds
    assert rep.wall_seconds == 13.0
    assert rep.productive_seconds == pytest.approx(5.0)  # steps 0, 1 then 2, 3, 4
    assert b["wasted_progress"] == pytest.approx(2.5)  # steps 2, 3 redone + 0.5 s of the step in flight
    assert b["detection"] == pytest.approx(0.5)
    assert b["recovery"] == pytest.approx(1.0)
    assert b["checkpoint_restore"] == pytest.approx(1.0)
    assert b["startup"] == pytest.approx(3.0)  # 2 s at launch, 1 s after the restart besides the restore
    assert b["other"] == pytest.approx(0.0, abs=1e-12)
    assert rep.disruptions == 1 and rep.restarts == 1 and rep.steps_redone == 2
    a0, a1 = rep.attempts
    assert (a0.attempt, a1.attempt) == (0, 1)
    assert a0.end_reason == "fault:worker_exit" and a0.fault_wall == 6.5 and a0.detect_wall == 7.0
    assert a0.steps_redone == 2 and a1.first_step == 2 and a1.last_step == 4
    assert a0.productive_seconds == pytest.approx(2.0) and a1.productive_seconds == pytest.approx(3.0)
    assert a0.end == a1.start == 8.0
    assert_adds_up(rep)


def test_hang_detection_uses_heartbeat_age():
    evs = [
        ev(K.RUN_START, 0.0),
        ev(K.ATTEMPT_START, 0.0, attempt=0),
        ev(K.STEP, 2.0, attempt=0, step=0, seconds=1.0),
        ev(K.HANG, 12.0, attempt=0, last_heartbeat_age=10.0, timeout=10.0),
        ev(K.RUN_END, 13.0, exit_code=1),
    ]
    rep = compute_report(evs)
    assert rep.badput_seconds["detection"] == pytest.approx(10.0)
    assert rep.badput_seconds["other"] == pytest.approx(1.0)  # final failure: no restart
    assert rep.disruptions == 1 and rep.attempts[0].end_reason == "fault:hang"
    assert_adds_up(rep)


def test_straggler_and_waiting_for_spares():
    evs = [
        ev(K.RUN_START, 0.0),
        ev(K.ATTEMPT_START, 0.0, attempt=0),
        ev(K.STEP, 1.0, attempt=0, step=0, seconds=1.0),
        ev(K.STEP, 2.0, attempt=0, step=1, seconds=1.0),
        ev(K.STEP, 3.0, attempt=0, step=2, seconds=1.0),
        ev(K.STRAGGLER, 3.0, attempt=0, score=0.33, threshold=0.75),
        ev(K.STEP, 6.0, attempt=0, step=3, seconds=3.0),  # 2 s beyond the median
        ev(K.AGENT_LOST, 6.5, attempt=0, peer="n1"),
        ev(K.ACTION, 7.0, action="wait_for_spares", reason="below min nodes"),
        ev(K.RESTART, 10.0, details={"attempt": 1}, cause="agent_lost", detect_seconds=0.5),
        ev(K.ATTEMPT_START, 11.0, attempt=1),
        ev(K.STEP, 12.0, attempt=1, step=4, seconds=1.0),
        ev(K.RUN_END, 12.0, exit_code=0),
    ]
    rep = compute_report(evs)
    b = rep.badput_seconds
    assert b["straggler_slowdown"] == pytest.approx(2.0)
    assert b["waiting_for_spares"] == pytest.approx(3.0)  # 7 → 10
    assert b["detection"] == pytest.approx(0.5)
    assert b["recovery"] == pytest.approx(1.5)  # 6.5 → 7 and 10 → 11
    assert b["wasted_progress"] == pytest.approx(0.0)  # step 3 was saved; the fault hit between steps
    assert rep.productive_seconds == pytest.approx(5.0)
    assert_adds_up(rep)


def test_in_progress_run_counts_to_now(tmp_path):
    evs = [
        ev(K.RUN_START, 0.0),
        ev(K.ATTEMPT_START, 0.0, attempt=0),
        ev(K.STEP, 2.0, attempt=0, step=0, seconds=1.0),
        ev(K.STEP, 3.0, attempt=0, step=1, seconds=1.0),
    ]
    rep = compute_report(evs, now=10.0)
    assert rep.in_progress and rep.wall_seconds == 10.0
    # the step in flight counts for one normal step time, the silence after it does not
    assert rep.productive_seconds == pytest.approx(3.0)
    assert rep.badput_seconds["startup"] == pytest.approx(1.0)
    assert rep.badput_seconds["other"] == pytest.approx(6.0)
    assert [a.end_reason for a in rep.attempts] == ["running"]
    assert_adds_up(rep)


def test_truncated_last_line_and_run_dir(tmp_path):
    write(tmp_path, crash_run()[:-1])  # no RUN_END: in progress
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(json.dumps(ev(K.RUN_END, 13.0, exit_code=0).to_json()).encode()[:25])  # crash mid-write
    assert len(list(read_events(tmp_path))) == len(crash_run()) - 1
    rep = report_for_run(tmp_path, now=14.0)
    assert rep.in_progress and rep.wall_seconds == 14.0
    assert rep.productive_seconds == pytest.approx(6.0)  # 5 + the step in flight (1 s)
    assert rep.disruptions == 1
    assert_adds_up(rep)


def test_relaunch_into_same_run_dir_is_a_new_session():
    first = steady_run()
    second = [
        ev(K.RUN_START, 100.0),
        ev(K.ATTEMPT_START, 100.0, attempt=0),
        ev(K.STEP, 102.0, attempt=0, step=4, seconds=1.0),  # redoes step 4
        ev(K.STEP, 103.0, attempt=0, step=5, seconds=1.0),
        ev(K.RUN_END, 103.0, exit_code=0),
    ]
    rep = compute_report(first + second)
    assert rep.sessions == 2 and len(rep.attempts) == 2
    assert rep.steps_redone == 1
    assert rep.badput_seconds["other"] == pytest.approx(1.0 + 85.0)  # teardown + the gap between launches
    assert_adds_up(rep)


def test_two_nodes_job_level_view():
    """Both nodes report the same attempt; a node leaving early does not end the run; world size per attempt."""
    evs = [
        ev(K.RUN_START, 0.0, node="a"), ev(K.RUN_START, 0.5, node="b"),
        ev(K.ATTEMPT_START, 1.0, attempt=0, node="a", world_size=8),
        ev(K.ATTEMPT_START, 1.2, attempt=0, node="b", world_size=8),
        ev(K.STEP, 3.0, attempt=0, step=0, seconds=1.0),
        ev(K.STEP, 4.0, attempt=0, step=1, seconds=1.0),
        ev(K.WORKER_EXIT, 5.0, attempt=0, node="b", exit_code=1),
        ev(K.RUN_END, 5.5, node="b", exit_code=1),  # node b is gone for good
        ev(K.RESTART, 5.6, attempt=1, node="a", cause="failed"),
        ev(K.SCALE, 5.7, node="a", old_world_size=8, new_world_size=4),
        ev(K.ATTEMPT_START, 6.0, attempt=1, node="a", world_size=4),
        ev(K.STEP, 8.0, attempt=1, step=2, seconds=1.0),
    ]
    rep = compute_report(evs, now=9.0)
    assert rep.in_progress and rep.sessions == 1 and rep.wall_seconds == 9.0
    assert [a.world_size for a in rep.attempts] == [8, 4]
    assert rep.attempts[0].start == 0.0 and rep.attempts[1].start == 6.0
    assert rep.disruptions == 1 and rep.restarts == 1
    assert_adds_up(rep)
    done = compute_report([*evs, ev(K.RUN_END, 9.0, node="a", exit_code=0)])
    assert not done.in_progress and done.attempts[-1].end_reason == "completed"


def test_empty_ledger(tmp_path):
    with pytest.raises(EmptyLedgerError):
        report_for_run(tmp_path)
    (tmp_path / "events.jsonl").write_text("")
    with pytest.raises(EmptyLedgerError):
        report_for_run(tmp_path)


KINDS = [K.RUN_START, K.ATTEMPT_START, K.STEP, K.STEP, K.STEP, K.CKPT_SAVE, K.CKPT_RESTORE, K.WORKER_EXIT,
         K.HANG, K.RESTART, K.STRAGGLER, K.ACTION, K.AGENT_LOST, K.SCALE, K.RUN_END, K.CKPT_TIER_DONE]


@st.composite
def ledgers(draw):
    n = draw(st.integers(1, 40))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(KINDS))
        wall = draw(st.floats(0, 1000, allow_nan=False))
        attempt = draw(st.one_of(st.none(), st.integers(0, 3)))
        secs = draw(st.floats(0, 50, allow_nan=False))
        details = {
            K.STEP: {"step": draw(st.integers(0, 20)), "seconds": secs},
            K.CKPT_SAVE: {"step": 1, "blocking_seconds": secs},
            K.CKPT_RESTORE: {"step": 1, "seconds": secs},
            K.WORKER_EXIT: {"exit_code": draw(st.sampled_from([0, 1, -9]))},
            K.HANG: {"last_heartbeat_age": secs},
            K.RESTART: {"attempt": draw(st.integers(1, 3)), "detect_seconds": secs},
            K.ACTION: {"action": draw(st.sampled_from(["wait_for_spares", "restart"]))},
            K.RUN_END: {"exit_code": draw(st.sampled_from([0, 1]))},
            K.ATTEMPT_START: {"world_size": draw(st.integers(1, 8))},
        }.get(kind, {})
        out.append(ev(kind, wall, attempt=attempt, node=draw(st.sampled_from(["a", "b"])), details=details))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ledgers(), st.floats(0, 2000, allow_nan=False))
def test_property_categories_sum_to_wall(events, now):
    rep = compute_report(events, now=now)
    assert_adds_up(rep)
    assert rep.end_wall - rep.start_wall == rep.wall_seconds
    segs = rep.timeline
    assert all(s.end > s.start for s in segs)
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))


@pytest.mark.parametrize("events", [crash_run(), steady_run()[:2], [ev(K.STEP, 5.0, step=0, seconds=1.0)]],
                         ids=["crash", "no-steps", "steps-only"])
def test_plot_any_ledger(tmp_path, events):
    from resilient.goodput.plot import plot_timeline

    rep = compute_report(events, now=20.0)
    plot_timeline(events, rep, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
