"""LedgerTail: each call returns only what was appended since the last, a torn last line waits for its
newline, ``contains`` decodes only the lines a follower wants (the supervisor follows checkpoint boundaries of
a ledger every other node writes to as well), and ``kinds`` keeps only those (the interval tuner's follower)."""
from __future__ import annotations

import json

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger
from resilient.events.follow import LedgerTail


def test_new_events_only_and_a_torn_line_waits(tmp_path):
    led = Ledger(tmp_path, node="n")
    tail = LedgerTail(tmp_path)
    led.emit(EventKind.STEP, rank=0, step=1, seconds=0.1)
    assert [e.kind for e in tail.read_new()] == [EventKind.STEP]
    assert tail.read_new() == []
    raw = json.dumps(Event(EventKind.STEP, node="n", details={"step": 2}).to_json())
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(raw[:10])  # a writer cut mid-line
        f.flush()
        assert tail.read_new() == []
        f.write(raw[10:] + "\n")
    assert [e.details["step"] for e in tail.read_new()] == [2]


def test_contains_skips_other_lines_undecoded(tmp_path):
    led = Ledger(tmp_path, node="n")
    tail = LedgerTail(tmp_path)
    led.emit(EventKind.STEP, rank=0, step=1, seconds=0.1)
    led.emit(EventKind.CKPT_TIER_DONE, rank=0, step=9, tier="local")
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write("this line is not JSON and must not even be looked at\n")
    got = tail.read_new(contains=b'"ckpt_tier_done"')
    assert [(e.kind, e.details["step"]) for e in got] == [(EventKind.CKPT_TIER_DONE, 9)]
    assert tail.skipped == 0  # the garbage line was never decoded
    assert tail.read_new() == []  # and the position moved past everything


def test_kinds_keeps_only_those_kinds(tmp_path):
    led = Ledger(tmp_path, node="n")
    tail = LedgerTail(tmp_path)
    led.emit(EventKind.STEP, rank=0, step=1, seconds=0.1)
    led.emit(EventKind.LOG, message="x")
    led.emit(EventKind.RESTART, attempt=1)
    assert [e.kind for e in tail.read_new(None, kinds={EventKind.STEP, EventKind.RESTART})] == \
        [EventKind.STEP, EventKind.RESTART]
    assert tail.read_new() == []
