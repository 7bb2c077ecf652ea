"""The bounded-call helper: answers in time, abandons overrunning calls, and caps the threads left behind."""

from __future__ import annotations

import threading
import time

import pytest

from resilient.bounded import BoundedCaller, CallBusy


def test_result_and_exception_pass_through():
    c = BoundedCaller("t")
    assert c.call(lambda: 7, 5, "seven") == 7
    with pytest.raises(KeyError):
        c.call(lambda: {}["x"], 5, "missing")
    assert c.abandoned() == 0


def test_overrunning_calls_are_capped_and_released_when_they_return():
    gate = threading.Event()
    c = BoundedCaller("store", max_abandoned=2)
    calls = []

    def hang():
        calls.append(1)
        gate.wait(30)

    for _ in range(2):
        with pytest.raises(TimeoutError, match="no answer within"):
            c.call(hang, 0.05, "dead store")
    assert c.abandoned() == 2
    with pytest.raises(CallBusy, match="2 earlier call"):
        c.call(hang, 0.05, "dead store")
    assert len(calls) == 2  # the third call never started a thread
    gate.set()
    for t in threading.enumerate():
        if t.name == "resilient-store":
            t.join(10)
    assert c.abandoned() == 0
    assert c.call(lambda: "back", 5, "store back") == "back"


def test_serial_refuses_while_an_earlier_call_runs():
    gate = threading.Event()
    c = BoundedCaller("policy", serial=True)
    with pytest.raises(TimeoutError):
        c.call(lambda: gate.wait(30), 0.05, "decide")
    with pytest.raises(CallBusy):
        c.call(lambda: 1, 5, "decide")
    gate.set()
    for t in threading.enumerate():
        if t.name == "resilient-policy":
            t.join(10)
    assert c.call(lambda: 1, 5, "decide") == 1


def test_bad_cap_is_refused():
    with pytest.raises(ValueError, match="max_abandoned=0"):
        BoundedCaller("x", max_abandoned=0)


def test_with_probe_a_call_beyond_the_cap_goes_out_one_at_a_time_and_an_answer_opens_the_way():
    left_behind = threading.Event()  # the calls that overran return only when this is set
    c = BoundedCaller("tier", max_abandoned=2, probe=True)
    started = []

    def hang():  # a call to the service while it is down
        started.append(1)
        left_behind.wait(30)

    def up():  # a call to the service while it is up
        started.append(1)
        return "answer"

    for _ in range(2):
        with pytest.raises(TimeoutError, match="no answer within"):
            c.call(hang, 0.05, "dead store")
    # at the cap: a probe goes out; while it is in flight no second call does
    release = threading.Event()
    box = []
    t = threading.Thread(target=lambda: box.append(c.call(lambda: release.wait(10) and "slow answer", 5, "probe")))
    t.start()
    deadline = time.monotonic() + 10
    while not c._probing:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(CallBusy, match="2 earlier call"):
        c.call(up, 1, "beside the probe")
    release.set()
    t.join(10)
    # the probe answered: the service is back, calls go through while the two left behind still run
    assert box == ["slow answer"]
    assert [c.call(up, 1, "after the probe") for _ in range(3)] == ["answer"] * 3
    assert c.abandoned() == 2
    # down again: the next call overruns, then one probe, then nothing past twice the cap
    for what in ("down again", "probe"):
        with pytest.raises(TimeoutError, match="no answer within"):
            c.call(hang, 0.05, what)
    assert c.abandoned() == 4
    n = len(started)
    with pytest.raises(CallBusy, match="4 earlier call"):
        c.call(up, 1, "at twice the cap")
    assert len(started) == n  # refused without a thread
    left_behind.set()
    for th in threading.enumerate():
        if th.name == "resilient-tier":
            th.join(10)
    assert c.abandoned() == 0 and c.call(up, 1, "back") == "answer"


def test_probe_and_serial_do_not_mix():
    with pytest.raises(ValueError, match="cannot probe"):
        BoundedCaller("policy", max_abandoned=1, serial=True, probe=True)
