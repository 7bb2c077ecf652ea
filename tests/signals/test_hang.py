"""Hang detection with real worker processes: SIGSTOP, a deadlock in communication, sections, learning."""
import signal
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from tests.signals.harness import kinds

LIGHT = str(Path(__file__).with_name("light_worker.py"))


def marks_reached(mark: Path, n: int):
    return lambda _ev: all((mark / f"rank{r}.step").exists() for r in range(n))


@pytest.mark.timeout(60)
def test_sigstopped_rank_inside_steps_is_reported_hung(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=1.0, initial_timeout=30.0)
    mark = tmp_path / "mark"
    mark.mkdir()
    procs = a.spawn(2, {"T_STEPS": "100000", "T_STEP_SLEEP": "0.005", "T_MARK_STEP": "5", "T_MARK_DIR": str(mark)},
                    script=LIGHT)
    a.pump(marks_reached(mark, 2), 30)
    procs[1].send_signal(signal.SIGSTOP)
    (mark / "go").touch()
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 20)
    hangs = kinds(evs, EventKind.HANG)
    # rank 0 keeps stepping: only the frozen rank is silent
    assert [e.rank for e in hangs] == [1]
    d = hangs[0].details
    assert d["process_state"] == "T" and d["suspect"] is True
    assert d["timeout"] == 1.0 and d["timeout_source"] == "configured" and d["local_rank"] == 1
    assert d["last_heartbeat_age"] >= 1.0 and d["step"] == 5 and d["pid"] == procs[1].pid
    assert hangs[0].attempt == 0 and hangs[0].node == "node0"
    # reported once per attempt: nothing more in twice the timeout, though rank 1 stays silent
    a.pump_for(2 * d["timeout"])
    assert len(kinds(a.events, EventKind.HANG)) == 1


@pytest.mark.timeout(90)
def test_rank_deadlocked_in_communication_is_reported_hung(make_agent):
    a = make_agent(heartbeat_timeout=2.0, initial_timeout=60.0)
    a.spawn(2, {"T_STEPS": "1000", "T_WORK": "0.005", **plan_env(WorkerFault(FaultHow.HANG_COLLECTIVE, rank=1, step=4, attempt=0))})
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 60)
    hangs = kinds(evs, EventKind.HANG)
    assert {e.rank for e in hangs} == {0, 1}  # both wait forever: nobody is stopped, both are named
    for e in hangs:
        assert e.details["process_state"] in ("S", "R") and e.details["step"] == 4
        assert e.details["suspect"] is True  # neither is behind the other


@pytest.mark.timeout(60)
def test_a_configured_timeout_overrides_a_longer_learned_one(make_agent, tmp_path):
    # steps of 0.5 s would learn 1.5 s: a configured 1.2 s is what a stop is held to, not a floor under it
    a = make_agent(heartbeat_timeout=1.2, initial_timeout=30.0)
    mark = tmp_path / "mark"
    mark.mkdir()
    procs = a.spawn(1, {"T_STEPS": "100000", "T_STEP_SLEEP": "0.5", "T_MARK_STEP": "8", "T_MARK_DIR": str(mark)},
                    script=LIGHT)
    a.pump(marks_reached(mark, 1), 30)
    assert a.monitor.config.learn_factor * a.monitor._max_gap > 1.2  # what would have been learned
    procs[0].send_signal(signal.SIGSTOP)
    (mark / "go").touch()
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 30)
    (h,) = kinds(evs, EventKind.HANG)
    assert h.details["timeout"] == 1.2 and h.details["timeout_source"] == "configured"


@pytest.mark.timeout(60)
def test_section_timeout_replaces_heartbeat_timeout(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=0.5, initial_timeout=30.0)
    # a section twice as long as the heartbeat timeout, within its own timeout: no hang
    a.spawn(1, {"T_STEPS": "6", "T_SECTION": "eval", "T_SECTION_AT": "2", "T_SECTION_TIMEOUT": "5",
                "T_SECTION_SLEEP": "1.0", "T_OUT": str(tmp_path)}, script=LIGHT)
    a.pump(lambda ev: a.all_exited(), 30)
    assert a.procs[0].returncode == 0 and (tmp_path / "rank0.done").exists()
    a.pump_for(1)
    assert not kinds(a.events, EventKind.HANG)
    a.stop()
    # a section stuck past its own timeout
    a.spawn(1, {"T_STEPS": "6", "T_SECTION": "ckpt", "T_SECTION_AT": "2", "T_SECTION_TIMEOUT": "0.7",
                "T_SECTION_SLEEP": "600"}, script=LIGHT)
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 30)
    (h,) = kinds(evs, EventKind.HANG)
    assert h.details["timeout_source"] == "section:ckpt" and h.details["section"] == "ckpt"
    assert h.details["timeout"] == 0.7 and h.attempt == 1


@pytest.mark.timeout(60)
def test_learned_timeout_detects_a_stop(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=None, initial_timeout=60.0, min_learned_timeout=0.5, learn_after=3)
    mark = tmp_path / "mark"
    mark.mkdir()
    procs = a.spawn(1, {"T_STEPS": "100000", "T_STEP_SLEEP": "0.01", "T_MARK_STEP": "10", "T_MARK_DIR": str(mark)},
                    script=LIGHT)
    a.pump(marks_reached(mark, 1), 30)
    timeout, source = a.monitor.heartbeat_timeout()
    assert source == "learned" and 0.5 <= timeout < 60
    procs[0].send_signal(signal.SIGSTOP)
    (mark / "go").touch()
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 30)
    (h,) = kinds(evs, EventKind.HANG)
    assert h.details["timeout_source"] == "learned" and h.details["process_state"] == "T"
    assert h.details["timeout"] == timeout
    # a stopped process is a hang for certain, not a long step: the next attempt is watched as tightly
    assert a.monitor.heartbeat_timeout() == (timeout, "learned")
    a.stop()
    # a step that only runs long (the rank sleeps, waiting for a file nobody writes) looks like a hang too: it may
    # have been a long step, so the next attempt waits twice as long
    mark = tmp_path / "mark1"
    mark.mkdir()
    a.spawn(1, {"T_STEPS": "100000", "T_STEP_SLEEP": "0.01", "T_MARK_STEP": "10", "T_MARK_DIR": str(mark)},
            script=LIGHT)
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 30)
    (h,) = kinds(evs, EventKind.HANG)
    assert h.details["timeout_source"] == "learned" and h.details["process_state"] != "T"
    assert h.details["timeout"] == timeout and h.attempt == 1
    assert a.monitor.heartbeat_timeout() == (2 * timeout, "learned")


@pytest.mark.timeout(180)
def test_start_up_watch_only_for_scripts_that_use_the_client(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=5.0, initial_timeout=0.3)
    # a script that never imports resilient is never called hung, however long it runs
    a.spawn(1, {"T_NO_CLIENT": "1", "T_STEPS": "1", "T_STEP_SLEEP": "1.0"}, script=LIGHT)
    a.pump(lambda ev: a.all_exited(), 30)
    a.pump_for(0.5)
    assert not kinds(a.events, EventKind.HANG)
    a.stop()
    # once the job is known to use the client, a rank silent since spawn is a start-up hang
    a.spawn(1, {"T_STEPS": "2"}, script=LIGHT)
    a.pump(lambda ev: a.all_exited(), 30)
    a.stop()
    a.spawn(1, {"T_NO_CLIENT": "1", "T_STEPS": "1", "T_STEP_SLEEP": "600"}, script=LIGHT)
    # the start-up timeout stretches to 3 x the longest start-up seen: on a loaded machine that is seconds
    learned = a.monitor.config.learn_factor * a.monitor._max_startup
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 30 + learned)
    (h,) = kinds(evs, EventKind.HANG)
    assert h.details["timeout_source"] == "initial" and h.details["step"] == -1 and h.attempt == 2
    assert h.details["timeout"] == pytest.approx(max(0.3, learned))


@pytest.mark.timeout(60)
def test_training_goes_on_when_the_monitor_goes_away(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=5.0)
    mark = tmp_path / "mark"
    mark.mkdir()
    procs = a.spawn(1, {"T_STEPS": "50", "T_STEP_SLEEP": "0.002", "T_MARK_STEP": "5", "T_MARK_DIR": str(mark),
                        "T_SIGPIPE_DFL": "1", "T_OUT": str(tmp_path)}, script=LIGHT)
    a.pump(marks_reached(mark, 1), 30)
    a.monitor.close()  # fail static: the helper dies, training does not
    (mark / "go").touch()
    assert procs[0].wait(30) == 0 and (tmp_path / "rank0.done").exists()
