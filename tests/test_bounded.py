"""The bounded-call helper: answers in time, abandons overrunning calls, and caps the threads left behind."""

from __future__ import annotations

import threading

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
