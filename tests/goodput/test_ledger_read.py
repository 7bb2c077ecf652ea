"""Reading a long run's ledger without decoding every line: rank 0's STEP lines (most of any ledger) are decoded
by one match of their writer's format, and a reader that names the kinds it wants passes the others over
undecoded. Both shortcuts must give exactly what json.loads and the event check give, line for line, on a
real run's ledger and on hostile lines; a reader of some kinds must get what a full read filtered would; the
interval tuner reads a ledger in slices and learns the same as from one read."""
from __future__ import annotations

import json
import shutil

import numpy as np

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.checkpoint.save import interval as interval_mod
from resilient.checkpoint.save.interval import IntervalTuner
from resilient.events.api import EventKind
from resilient.events.follow import (_STEP_LINE, LedgerTail, StepTally, event_from_json, parse_line, read_events,
                                     read_ledgers)
from resilient.goodput import cli as goodput_cli
from resilient.goodput.calculator import compute_report, report_for_run
from resilient.goodput.checkpoints import CHECKPOINT_SUMMARY_KINDS
from resilient.goodput.columns import ReportInputs


def _slow(raw: bytes):
    """The decoding every line had before: json.loads and the event check."""
    try:
        return event_from_json(json.loads(raw))
    except (ValueError, RecursionError):
        return None


def _same(a, b) -> bool:
    """Equal events, and equal types of every field and detail (0 == 0.0 would hide an int for a float)."""
    if a is None or b is None:
        return a is b
    va, vb = vars(a), vars(b)
    return va == vb and all(type(va[k]) is type(vb[k]) for k in va) and \
        all(type(a.details[k]) is type(b.details[k]) for k in a.details)


def test_a_real_runs_step_lines_take_the_fast_path_and_decode_as_json_would(crashed_run):
    lines = b"".join(p.read_bytes() for p in sorted(crashed_run.glob("events*.jsonl"))).splitlines(keepends=True)
    steps = [raw for raw in lines if b'"kind":"step"' in raw]
    assert len(steps) >= 40  # the run's 40 steps, and those redone after the kill
    # the formatter of resilient/worker/steps.py and the reader's match must agree, or every line is slow again
    assert all(_STEP_LINE.fullmatch(raw) for raw in steps), [r for r in steps if not _STEP_LINE.fullmatch(r)][:1]
    for raw in lines:
        assert _same(parse_line(raw), _slow(raw)), raw


_num = st.one_of(st.floats(allow_nan=False, allow_infinity=False).map(repr), st.integers(-10**6, 10**6).map(str),
                 st.sampled_from(["1e999", "-1e999", "0", "-0", "-0.0", "1E5", "1.5e-7", "01", "1.", ".5", "9" * 5000,
                                  "true", "null", '"1"', "NaN", "Infinity"]))
_node = st.one_of(st.just("null"), st.text(max_size=8).map(json.dumps),
                  st.text(max_size=8).map(lambda s: json.dumps(s, ensure_ascii=False)),
                  st.sampled_from(['"a\\"b"', '"tab\there"', '"\\u00e9"']))
_int = st.one_of(st.integers(-5, 10**20).map(str), st.sampled_from(["null", "1.0", "true", "-0", "9" * 5000]))


@settings(max_examples=400, deadline=None)
@given(node=_node, rank=_int, attempt=_int, step=_int, seconds=_num, compute=_num, wall=_num, mono=_num,
       schema=_int, tail=st.sampled_from(["\n", "", "\r\n", " \n", "\x0c\n", "x\n"]))
def test_step_shaped_lines_of_any_value_decode_as_json_would(node, rank, attempt, step, seconds, compute, wall,
                                                              mono, schema, tail, tmp_path_factory):
    raw = ('{"kind":"step","node":%s,"rank":%s,"attempt":%s,"details":{"step":%s,"seconds":%s,'
           '"compute_seconds":%s},"wall":%s,"mono":%s,"schema":%s}%s'
           % (node, rank, attempt, step, seconds, compute, wall, mono, schema, tail)).encode()
    assert _same(parse_line(raw), _slow(raw)), raw
    # read into a report's columns (the line as numbers where it matches the formatter's format), it keeps what
    # adding the decoded event keeps
    path = tmp_path_factory.mktemp("line") / "events.jsonl"
    path.write_bytes(raw)
    fed = ReportInputs()
    read_ledgers([path], into=fed)
    ev = _slow(raw) if raw.endswith(b"\n") else None
    added = ReportInputs([ev] if ev is not None else [])
    assert fed.others == added.others and len(fed) == len(added)
    a, b = fed.steps(), added.steps()
    for col in ("wall", "seconds", "step", "attempt", "seq"):
        assert np.array_equal(getattr(a, col), getattr(b, col), equal_nan=True), (col, raw)
    assert [a.nodes[i] for i in a.node] == [b.nodes[i] for i in b.node]


def test_a_report_read_into_columns_is_the_report_of_the_events(crashed_run, tmp_path, capsys):
    run = _mixed_run(crashed_run, tmp_path)
    events = list(read_events(run))
    fed = ReportInputs()
    read_ledgers([run], into=fed)
    assert fed.step_count == sum(e.kind is EventKind.STEP for e in events) >= 40
    assert not any(e.kind is EventKind.STEP and "compute_seconds" in e.details for e in fed.others)
    now = max(e.wall for e in events) + 1.0
    want = compute_report(events, now=now).to_json(timeline=True)
    got = report_for_run(run, now=now).to_json(timeline=True)
    assert got.pop("skipped_lines") == 3 and want.pop("skipped_lines") == 0  # _mixed_run's three bad lines
    assert got == want
    # the command: its report alone reads columns, with --plot it reads events; both print the same figures
    outs = []
    for extra in ([], ["--plot", str(tmp_path / "t.png")]):
        assert goodput_cli.main([str(run), "--json", "--timeline", "--now", repr(now), *extra]) == 0
        text = capsys.readouterr().out
        outs.append(json.loads(text[:text.rindex("}") + 1]))
    assert outs[0] == outs[1] and outs[0]["goodput"] == want["goodput"]


def _mixed_run(crashed_run, tmp_path):
    """A real run's ledger, and lines a reader of some kinds must not lose or invent: a kind that is not the first
    key, spaces around it, an unknown kind, a line that only names a kind inside its details, and garbage."""
    run = tmp_path / "run"
    shutil.copytree(crashed_run, run)
    t = max(e.wall for e in read_events(run)) + 1  # after the run: writers' files are merged on wall time
    extra = [  # each with a mono: a line without gets the reading's clock, different at each read
        {"wall": t + 1, "mono": 1.0, "kind": "ckpt_save", "details": {"step": 77, "blocking_seconds": 0.1}},
        {"kind": "restart", "details": {"attempt": 9}, "wall": t + 2, "mono": 2.0},
        {"kind": "no_such_kind", "wall": t + 3, "mono": 3.0},
        {"node": "x", "details": {"kind": "ckpt_save"}, "kind": "step", "wall": t + 4, "mono": 4.0},
        {"node": "x", "details": {"kind": "step", "step": 79}, "kind": "ckpt_save", "wall": t + 4.5, "mono": 4.5},
        {"kind": "action", "details": {"action": "start"}, "wall": t + 5, "mono": 5.0},
    ]
    with open(run / "events.jsonl", "a") as f:
        for d in extra:
            f.write(json.dumps(d) + "\n")
        f.write(' {  "kind" :  "ckpt_tier_done" , "details": {"step": 78, "tier": "local"}, "wall": %r, "mono": 6.0}\n'
                % (t + 6))
        f.write('{"kind":"ckpt_save", "wall": "not a number"}\n')
        f.write("not json at all\n")
    return run


@pytest.mark.parametrize("kinds", [
    frozenset({EventKind.RUN_START, *CHECKPOINT_SUMMARY_KINDS}),  # what every exit reads
    frozenset({EventKind.ACTION}),  # what a restarted supervisor reads
    frozenset({EventKind.STEP, EventKind.RESTART}),
    frozenset({EventKind.RUN_END, EventKind.CKPT_SAVE, EventKind.CKPT_TIER_DONE, EventKind.CKPT_SAVE_FAILED}),
])
def test_a_reader_of_some_kinds_gets_what_a_full_read_filtered_would(crashed_run, tmp_path, kinds):
    run = _mixed_run(crashed_run, tmp_path)
    full = [e for e in read_events(run) if e.kind in kinds]
    assert full  # each set finds something, or the comparison proves nothing
    assert list(read_events(run, kinds=kinds)) == full
    tail = LedgerTail(run)
    assert [e for e in tail.read_new(max_bytes=None, kinds=kinds)] == full


_RECENT_DEFAULT = interval_mod._RECENT_BYTES


def _tuner_of_every_event(run) -> IntervalTuner:
    """What the tuner learnt at a restart before: every event of the ledger observed in turn."""
    t = IntervalTuner()
    t._follower = interval_mod._LedgerFollower(run)
    t._follower.read_new(max_bytes=None)
    t._follow(force=True)
    restarts = set()
    for ev in read_events(run):
        if ev.kind is EventKind.STEP:
            t.observe_step(float(ev.details.get("seconds", 0.0)))
        elif ev.kind is EventKind.CKPT_SAVE:
            t.observe_save(float(ev.details.get("blocking_seconds", 0.0)))
        elif ev.kind is EventKind.CKPT_TIER_DONE and ev.details.get("tier") == "persistent":
            t.observe_upload(float(ev.details.get("seconds", 0.0)))
        elif ev.kind is EventKind.RESTART:
            restarts.add((ev.attempt, ev.details.get("attempt")))
    for _ in restarts:
        t.observe_interruption()
    return t


@pytest.mark.parametrize("recent", [_RECENT_DEFAULT, 2000, 0])  # all read as events / most steps summed / all summed
def test_the_tuner_sums_old_steps_reads_in_slices_and_learns_what_every_event_would(crashed_run, tmp_path,
                                                                                     monkeypatch, recent):
    run = _mixed_run(crashed_run, tmp_path)
    want = _tuner_of_every_event(run)
    monkeypatch.setattr(interval_mod, "_START_SLICE_BYTES", 300)  # a slice of about one line
    monkeypatch.setattr(interval_mod, "_RECENT_BYTES", recent)
    got = IntervalTuner.from_run_dir(run)
    g, w = got.inputs(), want.inputs()
    assert g.keys() == w.keys()
    # what the start read: the whole ledger, no cache beside it (the tuner observed by hand read nothing itself)
    assert (g.pop("ledger_bytes_read_at_start"), g.pop("ledger_cache_used")) == (got._follower.bytes_read, False)
    assert got._follower.bytes_read == sum(p.stat().st_size for p in run.glob("events*.jsonl"))
    del w["ledger_bytes_read_at_start"], w["ledger_cache_used"]
    # what the follower learns of interference comes from the newest lines read as events: from fewer than the
    # follower keeps when _RECENT_BYTES is cut below its default, so only the rest is compared then
    learnt = {"clean_step_seconds", "save_interference_seconds", "save_cost_seconds", "optimal_seconds",
              "interval_steps"}
    for k in w if recent == _RECENT_DEFAULT else w.keys() - learnt:  # the sums are taken in another order: to the last bits
        assert g[k] == (w[k] if w[k] is None else pytest.approx(w[k], rel=1e-12)), k
    # the same steps (fewer than the window holds here; their order across writers' files is the slices')
    assert sorted(got._steps) == sorted(want._steps)
    assert want.inputs()["interruptions"] == 2  # the SIGKILL, and the restart line added
    if recent == 0:
        # every step in its writer's format was only summed: the one STEP event is the line written otherwise
        assert [e.details for e in got._follower.events if e.kind is EventKind.STEP] == [{"kind": "ckpt_save"}]
    # the follower goes on from where the start ended: a save written later is seen, none read twice
    before = len(got._follower.events)
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "ckpt_save", "wall": 2e9, "details": {"step": 99}}) + "\n")
    assert [e.details["step"] for e in got._follower.read_new()] == [99]
    assert len(got._follower.events) == before + 1


def test_a_step_tally_leaves_out_what_is_no_duration_and_keeps_the_newest():
    t = StepTally(recent_max=2)
    for s in (0.5, -1.0, float("inf"), float("nan"), 0.25, 1.0):
        t.add(s)
    assert (t.count, t.seconds, list(t.recent)) == (3, 1.75, [0.25, 1.0])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.binary(max_size=60) | st.sampled_from([b'{"kind":"step"', b'{"kind":"ckpt_save"}']),
                      max_size=8))
def test_any_bytes_decode_as_json_would(lines):
    for raw in lines:
        ev = parse_line(raw)
        assert _same(ev, _slow(raw))
