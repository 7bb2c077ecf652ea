"""Honest productive time: the clean step time, checkpoint interference, step slowdown, clock offsets.

Hand-built ledgers with exact answers, then two real runs under ``resilient-run`` (a save every step and
one every 50 steps) whose background writes overlap the steps.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.checkpoint.save.interval import IntervalTuner, save_costs
from resilient.events.spans import background_spans
from resilient.events import Event, EventKind, Ledger, read_events
from resilient.goodput.api import CATEGORIES, Badput
from resilient.goodput.calculator import apply_clock_offsets, compute_report, report_for_run
from tests.goodput.conftest import finish, kill_group

K = EventKind


def ev(kind, wall, attempt=0, node="n0", rank=0, **details):
    return Event(kind=kind, node=node, rank=rank, attempt=attempt, details=details, wall=wall, mono=wall)


def assert_adds_up(rep):
    assert set(rep.badput_seconds) == set(CATEGORIES)
    assert rep.productive_seconds + math.fsum(rep.badput_seconds.values()) == pytest.approx(rep.wall_seconds)
    assert all(v >= -1e-12 for v in rep.badput_seconds.values())


def saving_run():
    """Clean step 1 s. Step 2 holds a 0.2 s save stall; its local write [5.2, 6.0] slows step 3 by 0.5 s and
    its upload [9.0, 10.5] slows step 6 by 0.3 s; step 4 is 0.2 s slow with nothing in flight."""
    return [
        ev(K.RUN_START, 0.0, attempt=None, rank=None),
        ev(K.ATTEMPT_START, 1.0, rank=None, world_size=2),
        ev(K.STEP, 3.0, step=0, seconds=2.0),  # [1, 3]: first step, 1 s of warm-up
        ev(K.STEP, 4.0, step=1, seconds=1.0),
        ev(K.CKPT_SAVE, 5.2, step=2, blocking_seconds=0.2),  # stall [5.0, 5.2]
        ev(K.STEP, 5.2, step=2, seconds=1.2),  # [4.0, 5.2]: 1 s of work + the stall; clean
        ev(K.CKPT_TIER_DONE, 6.0, step=2, tier="local", seconds=0.8),
        ev(K.STEP, 6.7, step=3, seconds=1.5),  # [5.2, 6.7] overlaps the write: 0.5 s interference
        ev(K.STEP, 7.9, step=4, seconds=1.2),  # nothing in flight: 0.2 s step slowdown
        ev(K.STEP, 8.9, step=5, seconds=1.0),
        ev(K.STEP, 10.2, step=6, seconds=1.3),  # overlaps the upload: 0.3 s interference
        ev(K.CKPT_TIER_DONE, 10.5, step=2, tier="persistent", seconds=1.5),
        ev(K.RUN_END, 11.0, attempt=None, rank=None, exit_code=0),
    ]


def test_interference_and_step_slowdown_known_answer():
    rep = compute_report(saving_run())
    b = rep.badput_seconds
    assert rep.attempts[0].clean_step_seconds == pytest.approx(1.0)
    assert rep.attempts[0].clean_step_source == "attempt"
    assert rep.productive_seconds == pytest.approx(7 * 1.0)  # steps × clean step time
    assert b[Badput.CHECKPOINT_INTERFERENCE.value] == pytest.approx(0.5 + 0.3)
    assert b[Badput.STEP_SLOWDOWN.value] == pytest.approx(0.2)
    assert b["checkpoint_save_stall"] == pytest.approx(0.2)
    assert b["startup"] == pytest.approx(1.0 + 1.0)
    assert b["other"] == pytest.approx(0.8)
    assert rep.goodput == pytest.approx(7 / 11)
    assert_adds_up(rep)


def test_excess_is_painted_around_a_stall_at_the_step_start():
    evs = [e for e in saving_run() if e.kind is not K.RUN_END]
    # step 7 [10.5, 12.5], after the upload: a save stall [10.5, 11.0] at its start (overlap mode: the hook
    # wait), 1.5 s of work of which 0.5 s beyond the clean step; no tier reported, so nothing ran behind it
    evs += [ev(K.CKPT_SAVE, 11.0, step=7, blocking_seconds=0.5), ev(K.STEP, 12.5, step=7, seconds=2.0),
            ev(K.RUN_END, 12.5, attempt=None, rank=None, exit_code=0)]
    rep = compute_report(evs)
    b = rep.badput_seconds
    assert b["checkpoint_save_stall"] == pytest.approx(0.2 + 0.5)
    assert b[Badput.STEP_SLOWDOWN.value] == pytest.approx(0.2 + 0.5)  # not hidden under the stall
    assert b["other"] == pytest.approx(0.3)  # 10.2 → 10.5, between steps
    assert rep.productive_seconds == pytest.approx(8 * 1.0)
    assert_adds_up(rep)


def test_clean_time_from_other_attempts_or_all_steps():
    # attempt 1 saves every step: each step overlaps a write; its clean time comes from attempt 0
    evs = saving_run()[:-1] + [ev(K.ATTEMPT_START, 11.0, attempt=1, rank=None, world_size=2),
                               ev(K.STEP, 12.0, attempt=1, step=7, seconds=1.0)]
    t = 12.0
    for s in range(8, 12):
        evs += [ev(K.CKPT_SAVE, t, attempt=1, step=s - 1, blocking_seconds=0.0),
                ev(K.CKPT_TIER_DONE, t + 1.4, attempt=1, step=s - 1, tier="local", seconds=1.4),
                ev(K.STEP, t + 1.4, attempt=1, step=s, seconds=1.4)]
        t += 1.4
    evs.append(ev(K.RUN_END, t, attempt=None, rank=None, exit_code=0))
    rep = compute_report(evs)
    a1 = rep.attempts[1]
    assert (a1.clean_step_seconds, a1.clean_step_source) == (pytest.approx(1.0), "run")
    assert a1.badput_seconds[Badput.CHECKPOINT_INTERFERENCE.value] == pytest.approx(4 * 0.4)
    assert_adds_up(rep)
    # no clean step anywhere: the median of the steps, and no interference can be claimed beyond it
    only = [e for e in evs if e.attempt == 1 or e.kind in (K.RUN_START, K.RUN_END)]
    rep = compute_report(only)
    assert rep.attempts[0].clean_step_source == "all_steps"
    assert rep.attempts[0].clean_step_seconds == pytest.approx(1.4)
    assert rep.badput_seconds[Badput.CHECKPOINT_INTERFERENCE.value] == pytest.approx(0.0, abs=1e-12)
    assert_adds_up(rep)


def test_save_cost_for_the_interval_tuner(tmp_path):
    costs = save_costs(saving_run())
    assert costs.clean_step_seconds == pytest.approx(1.0)
    assert costs.interference == [pytest.approx(0.8)]  # one save: its write and its upload
    assert costs.firsts == [True]
    # a second attempt whose first save (cold) cost 2 s of steps and its second 0.4 s
    second = [
        ev(K.ATTEMPT_START, 12.0, attempt=1, rank=None, world_size=2),
        ev(K.STEP, 14.0, attempt=1, step=3, seconds=2.0),  # warm-up
        ev(K.STEP, 15.0, attempt=1, step=4, seconds=1.0),
        ev(K.CKPT_SAVE, 15.0, attempt=1, step=4, blocking_seconds=0.2),
        ev(K.STEP, 18.0, attempt=1, step=5, seconds=3.0),  # [15, 18] under the cold write: 2 s over the clean step
        ev(K.CKPT_TIER_DONE, 18.0, attempt=1, step=4, tier="local", seconds=3.0),
        ev(K.STEP, 19.0, attempt=1, step=6, seconds=1.0),
        ev(K.CKPT_SAVE, 19.0, attempt=1, step=6, blocking_seconds=0.2),
        ev(K.STEP, 20.4, attempt=1, step=7, seconds=1.4),  # under the second write: 0.4 s over
        ev(K.CKPT_TIER_DONE, 20.4, attempt=1, step=6, tier="local", seconds=1.4),
        ev(K.STEP, 21.4, attempt=1, step=8, seconds=1.0),
    ]
    costs = save_costs(saving_run()[:-1] + second)
    assert costs.interference == [pytest.approx(0.8), pytest.approx(2.0), pytest.approx(0.4)]
    assert costs.firsts == [True, True, False]
    # the tuner takes what the next saves will cost: every attempt's first save is cold, left out
    with Ledger(tmp_path / "one") as led:
        for e in saving_run():
            led.write(e)
    t = IntervalTuner.from_run_dir(tmp_path / "one", prior_mtbf_s=3600, prior_weight=1e9)
    i = t.inputs()
    assert i["save_blocking_seconds"] == pytest.approx(0.2)
    assert i["save_interference_seconds"] is None  # its only save was cold: one step stands in
    assert t.save_seconds() == pytest.approx(0.2 + i["step_seconds"])
    with Ledger(tmp_path / "two") as led:
        for e in saving_run()[:-1] + second:
            led.write(e)
    t = IntervalTuner.from_run_dir(tmp_path / "two", prior_mtbf_s=3600, prior_weight=1e9)
    i = t.inputs()
    assert i["save_interference_seconds"] == pytest.approx(0.4)
    assert t.save_seconds() == pytest.approx(0.6)
    assert t.optimal_seconds() == pytest.approx(math.sqrt(2 * 0.6 * 3600) - 0.6, rel=1e-3)
    # without a ledger the tuner knows only the blocking part
    bare = IntervalTuner(prior_mtbf_s=3600)
    bare.observe_step(1.0)
    bare.observe_save(0.2)
    assert bare.save_seconds() == pytest.approx(0.2)


def test_bad_prior_mtbf_env_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_CKPT_PRIOR_MTBF", "soon")
    with pytest.raises(ValueError, match="RESILIENT_CKPT_PRIOR_MTBF='soon' is not a positive number"):
        IntervalTuner.from_run_dir(tmp_path)
    monkeypatch.setenv("RESILIENT_CKPT_PRIOR_MTBF", "1800")
    assert IntervalTuner.from_run_dir(tmp_path).prior_mtbf_s == 1800.0


def test_clock_offset_of_a_node_is_applied():
    # node b's clock runs 100 s ahead of the store host's; it recorded that when it joined
    evs = [
        ev(K.RUN_START, 0.0, attempt=None, node="a", rank=None),
        ev(K.NODE_JOINED, 0.3, attempt=None, node="b", rank=None, nproc=1),  # the supervisor's clock
        ev(K.RUN_START, 100.2, attempt=None, node="b", rank=None),
        ev(K.RENDEZVOUS_DONE, 100.5, attempt=None, node="b", rank=None, clock_offset=-100.0),
        ev(K.ATTEMPT_START, 1.0, node="a", rank=None, world_size=2),
        ev(K.ATTEMPT_START, 101.0, node="b", rank=None, world_size=2),
        *[ev(K.STEP, 2.0 + s, node="a", step=s, seconds=1.0) for s in range(8)],
        ev(K.RUN_END, 10.0, attempt=None, node="a", rank=None, exit_code=0),
        ev(K.RUN_END, 110.0, attempt=None, node="b", rank=None, exit_code=0),
    ]
    fixed = {(e.node, e.kind): e.wall for e in apply_clock_offsets(evs)}
    assert fixed[("b", K.RUN_START)] == pytest.approx(0.2) and fixed[("b", K.NODE_JOINED)] == 0.3
    rep = compute_report(evs)
    assert rep.wall_seconds == pytest.approx(10.0)  # not 110 s
    assert rep.productive_seconds == pytest.approx(8.0)
    assert_adds_up(rep)
    # nonsense offsets are ignored
    bad = [e if e.kind is not K.RENDEZVOUS_DONE else ev(K.RENDEZVOUS_DONE, 100.5, attempt=None, node="b",
                                                         rank=None, clock_offset=1e300) for e in evs]
    assert compute_report(bad).wall_seconds == pytest.approx(110.0)


def test_an_offset_within_its_own_error_is_not_applied_and_a_lost_node_stays_lost():
    # one host: node c measured +0.04 s with a 0.1 s round trip (noise); its last step, 0.01 s before the
    # supervisor saw it lost, must not move past the loss (the job would then look still in progress)
    evs = [
        ev(K.RUN_START, 0.0, attempt=None, node="a", rank=None),
        ev(K.RUN_START, 0.0, attempt=None, node="c", rank=None),
        ev(K.RENDEZVOUS_DONE, 0.5, attempt=None, node="c", rank=None, clock_offset=0.04, clock_rtt=0.1),
        ev(K.ATTEMPT_START, 1.0, node="a", rank=None, world_size=2),
        *[ev(K.STEP, 2.0 + s, node="c", step=s, seconds=1.0) for s in range(4)],
        ev(K.AGENT_LOST, 5.01, attempt=None, node="c", rank=None, reason="disconnected"),
        ev(K.RUN_END, 9.0, attempt=None, node="a", rank=None, exit_code=0),
    ]
    assert [e.wall for e in apply_clock_offsets(evs)] == [e.wall for e in evs]
    assert not compute_report(evs, now=100.0).in_progress
    # the same offset measured precisely (a 10 ms round trip) is applied
    precise = [e if e.kind is not K.RENDEZVOUS_DONE else ev(K.RENDEZVOUS_DONE, 0.5, attempt=None, node="c",
                                                            rank=None, clock_offset=0.04, clock_rtt=0.01)
               for e in evs]
    assert [e.wall for e in apply_clock_offsets(precise) if e.kind is K.STEP][0] == pytest.approx(2.04)


# ------------------------------------------------------------------------------------------ real runs
CKPT_TRAIN = Path(__file__).parent / "ckpt_train.py"


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """The same job saving every step (after 15 clean calibration steps) and every 50 steps, run side by side."""
    base = tmp_path_factory.mktemp("interference")
    env = dict(os.environ, STEPS="80", STATE_MB="12", CALIB_STEPS="15", HIDDEN="256", BATCH="256",
               OMP_NUM_THREADS="1")
    procs = {}
    for every in (1, 50):
        run_dir = base / f"every{every}"
        procs[every] = (run_dir, subprocess.Popen(
            [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir",
             str(run_dir), "--ckpt-local", str(run_dir / "ckpt"), "--ckpt-interval", str(every), str(CKPT_TRAIN)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for every, (run_dir, proc) in procs.items():
            out = finish(proc, timeout=150)
            assert proc.returncode == 0, out
    finally:
        for _, proc in procs.values():
            kill_group(proc)
    return {every: run_dir for every, (run_dir, _) in procs.items()}


@pytest.mark.timeout(240)
def test_real_runs_charge_interference_when_saves_overlap_steps(real_runs):
    reps = {every: report_for_run(d) for every, d in real_runs.items()}
    for every, rep in reps.items():
        assert_adds_up(rep)
        (a,) = rep.attempts
        assert a.clean_step_source == "attempt" and a.clean_step_seconds > 0
        # productive time is steps × clean step time at most
        assert rep.productive_seconds <= a.steps * a.clean_step_seconds + 1e-6
    assert reps[1].badput_seconds[Badput.CHECKPOINT_INTERFERENCE.value] > 0, reps[1].badput_seconds
    # Interference is charged only to steps that ran beside background checkpoint work, never more than
    # those steps lasted. (Which run pays the larger share is a timing outcome, not a property: the two runs
    # share two cores, so one run's writes slow the other's steps.)
    for every, d in real_runs.items():
        evs = list(read_events(d))
        bg = sorted(background_spans(evs))
        beside = sum(e.details["seconds"] for e in evs if e.kind is K.STEP
                     and any(a < e.wall and e.wall - e.details["seconds"] < b for a, b in bg))
        charged = reps[every].badput_seconds[Badput.CHECKPOINT_INTERFERENCE.value]
        assert charged <= beside + 1e-6, (every, charged, beside)
    # the tuner sees the same cost: one interference figure per finished save
    costs = save_costs(list(read_events(real_runs[1])))
    saves = {e.details["step"] for e in read_events(real_runs[1]) if e.kind is K.CKPT_SAVE}
    assert len(costs.interference) == len(saves) and sum(costs.interference) > 0
