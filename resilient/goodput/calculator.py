"""Ledger → :class:`~resilient.goodput.api.GoodputReport`.

Every instant between the run's first event and its end (or *now*, for a run in progress) is
given to exactly one category, by painting intervals onto the time line in layers of rising
precedence; the categories therefore add up to the wall time by construction.

Layers, lowest first:

0. ``other``: the whole run (what nothing else claims: gaps between steps, teardown after the
   last step, time between two separate launches into the same run directory).
1. ``startup``: a launch (RUN_START) or an attempt's spawn (ATTEMPT_START) to the start of its
   first step; an attempt that never stepped is startup until its fault. ``recovery``: a fault's
   detection to the next attempt's spawn. After a final fault (no restart follows): ``other``.
2. ``waiting_for_spares``: from an ACTION with ``action`` in ``wait_for_spares``/``wait`` to the
   next ACTION, RESTART, SCALE, ATTEMPT_START or RUN_END.
3. ``wasted_progress`` for the partial step in flight when the fault happened (last step's end to
   the fault), ``detection`` from the fault to its detection. The fault instant is the detecting
   event's time minus its ``detect_seconds`` (HANG: ``last_heartbeat_age``; else RESTART's
   ``detect_seconds``), never before the last recorded step.
4. Steps, ``[wall - seconds, wall]`` of each STEP record: ``productive``, or ``wasted_progress`` if
   the step was redone later.
5. A kept step is productive for at most the attempt's *clean step time*: the median step (its save
   stall taken out) among the steps that overlapped no background checkpoint work (a save's write
   from its CKPT_SAVE to its tiers' CKPT_TIER_DONE/FAILED, and each tier's ``[wall - seconds, wall]``:
   local write, peer replication, persistent upload); the first step of an attempt is not a clean
   sample. Without a clean step in the attempt, the other attempts' clean steps give it; without any,
   the median of all its steps (``AttemptReport.clean_step_source`` says which). A step's time beyond
   it goes, from the step's start and around its save stall, to: ``startup`` for an attempt's first
   step (compilation, warm-up); ``checkpoint_interference`` when the step overlapped background
   checkpoint work (a background write competes with training for CPU and memory bandwidth; the rank
   doing it is also the one a straggler detector then flags); ``straggler_slowdown`` once a STRAGGLER
   was reported in the attempt; ``step_slowdown`` otherwise. So productive
   time is steps × clean step time (less for steps faster than it).
6. ``checkpoint_restore``: ``[wall - seconds, wall]`` of each CKPT_RESTORE.
7. ``checkpoint_save_stall``: ``[wall - blocking_seconds, wall]`` of each CKPT_SAVE.

Clock skew: an agent may record ``clock_offset`` (seconds to add to its node's clock to read the clock
of the rendezvous store's host, measured when it joined; an offset within half its ``clock_rtt`` is
measurement error and taken as 0) in the details of an event it writes (not a STEP record: a worker's step
lines never carry one, and are read as numbers alone). Every
event of that node is then shifted by the latest offset it recorded at or before the event (the first
one for earlier events), except the kinds the supervisor writes on the store host's own clock
(``node_joined``, ``agent_lost``, ``action``). Offsets beyond a day are ignored as nonsense.

Job-level view: events from every node are merged on wall time; the same step or save reported by
several ranks or nodes is counted once because overlapping intervals are a union, not a sum.

Relation to ml-goodput-measurement (Google's JAX/TPU library), which this follows where it can:

* Same: goodput = productive time ÷ job time; job time runs from the first start to the last end,
  or to *now* while the job runs; a step recorded again means a disruption, and everything from the
  first recording of that step to the restart is lost (here split finer into wasted progress,
  detection and recovery); the first step after each (re)start carries start-up badput beyond the
  normal step time (theirs: beyond an "ideal" step time; ours: the attempt's median); checkpoint save
  badput is the *blocking* part of a save only; ``other`` takes what no category explains.
* Different: we record step *ends* with durations rather than step starts, so gaps between steps are
  ``other`` instead of productive. Save stalls inside a step are taken out of that step's productive
  time (theirs subtracts save badput from goodput after the fact). Their TPU-initialisation, training
  preparation and data-loading buckets are all ``startup`` here; detection, recovery, straggler
  slowdown and waiting for spares are our own categories, taken from the agent's and detectors'
  events. While a run is in progress the step in flight is counted productive for at most the
  attempt's median step time (theirs: all time since the last step start), so a dead run that never
  wrote RUN_END does not look productive forever. A job launched again into the same run directory
  (a second RUN_START after a RUN_END) starts a new session; the time between sessions is ``other``.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from resilient.events.spans import background_spans, overlap_seconds, stall_spans
from resilient.events.api import Event, EventKind
from resilient.events.follow import read_ledgers
from resilient.goodput.columns import NO_ATTEMPT, ReportInputs, StepColumns, detail_number
from resilient.goodput.paint import LayeredPainter
from resilient.goodput.api import (
    CATEGORIES,
    PRODUCTIVE,
    AttemptReport,
    Badput,
    EmptyLedgerError,
    GoodputError,
    GoodputReport,
    Segment,
    TimelineArrays,
)

logger = logging.getLogger(__name__)

# Events that mean the workers of an attempt are gone or must go.
_FAULT_KINDS = {EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST}
# Events that may end an attempt without being a fault themselves (supervisor decisions, notices).
_BOUNDARY_KINDS = {EventKind.RESTART, EventKind.ACTION, EventKind.PREEMPTION_NOTICE, EventKind.HOST_UNHEALTHY,
                   EventKind.GPU_UNHEALTHY, EventKind.SCALE, EventKind.ATTEMPT_END}
_WAIT_ACTIONS = {"wait_for_spares", "wait"}
# written by the supervisor on the store host's clock, whatever node they name
_HOST_CLOCK_KINDS = {EventKind.NODE_JOINED, EventKind.AGENT_LOST, EventKind.ACTION}
_MAX_CLOCK_OFFSET = 86400.0

# paint layers (see the module docstring)
_L_BASE, _L_PHASE, _L_WAIT, _L_FAULT, _L_STEP, _L_STEP_EXCESS, _L_RESTORE, _L_SAVE = range(8)


_num = detail_number


def _int_or_none(v: object) -> int | None:
    """An attempt number from a detail field, whatever was written there (hashable, or None)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return int(v)
    return None


def _is_fault(ev: Event) -> bool:
    if ev.kind is EventKind.WORKER_EXIT:
        code = ev.details.get("exit_code")
        return code not in (0, None) or bool(ev.details.get("signal"))
    return ev.kind in _FAULT_KINDS


@dataclass
class _Attempt:
    session: int
    attempt: int
    start: float
    world_size: int | None = None
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # its steps, in time order
    events: list[Event] = field(default_factory=list)  # its other events


def _clock_offsets(events: Iterable[Event]) -> dict[str, list[tuple[float, float]]]:
    """Each node's recorded clock offsets, as sorted (wall, offset) pairs (see the module docstring)."""
    offsets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        if ev.kind in _HOST_CLOCK_KINDS or "clock_offset" not in ev.details:
            continue
        off = _num(ev.details, "clock_offset", math.nan)
        if math.isnan(off) or abs(off) > _MAX_CLOCK_OFFSET:
            logger.debug("clock_offset %r of node %s ignored", ev.details.get("clock_offset"), ev.node)
            continue
        rtt = _num(ev.details, "clock_rtt", 0.0)
        if not math.isnan(rtt) and abs(off) <= rtt / 2 + 1e-3:
            # within the measurement's own error (the supervisor answers when its loop next polls, so on one
            # host the estimate sits right at rtt/2; +1 ms for rounding): the clocks cannot be told apart, and
            # shifting by noise would only reorder the node's last events around its loss
            off = 0.0
        offsets[ev.node].append((ev.wall, off))
    for lst in offsets.values():
        lst.sort()
    return offsets


def _shift(evs: list[Event], offsets: dict[str, list[tuple[float, float]]]) -> list[Event]:
    if not offsets:
        return evs
    out = []
    for ev in evs:
        lst = offsets.get(ev.node) if ev.node is not None else None
        if not lst or ev.kind in _HOST_CLOCK_KINDS:
            out.append(ev)
            continue
        i = max(0, bisect.bisect_right(lst, (ev.wall, math.inf)) - 1)
        off = lst[i][1]
        out.append(dataclasses.replace(ev, wall=ev.wall + off) if off else ev)
    return out


def apply_clock_offsets(events: Iterable[Event]) -> list[Event]:
    """The events with each node's recorded ``clock_offset`` applied (see the module docstring)."""
    evs = list(events)
    return _shift(evs, _clock_offsets(evs))


def _shift_steps(steps: StepColumns, offsets: dict[str, list[tuple[float, float]]]) -> np.ndarray:
    wall = steps.wall.copy()
    for code, node in enumerate(steps.nodes):
        lst = offsets.get(node) if node is not None else None
        if not lst:
            continue
        mine = np.flatnonzero(steps.node == code)
        at = np.array([w for w, _ in lst])
        off = np.array([o for _, o in lst])[np.maximum(0, np.searchsorted(at, wall[mine], side="right") - 1)]
        wall[mine] = np.where(off != 0, wall[mine] + off, wall[mine])
    return wall


def _paint_around(a: float, b: float, amount: float, holes: Sequence[tuple[float, float]], hole_ends: Sequence[float]) -> list[tuple[float, float]]:
    """The pieces of ``[a, b]`` that ``amount`` seconds from its start take, skipping the ``holes`` (save stalls,
    painted above), so that the step's productive, stalled and excess parts add up to the step."""
    out = []
    t = a
    i = bisect.bisect_right(hole_ends, a)
    while amount > 0 and t < b:
        if i < len(holes) and holes[i][0] <= t:
            t = max(t, holes[i][1])
            i += 1
            continue
        end = min(b, holes[i][0] if i < len(holes) else b, t + amount)
        if end <= t:  # an amount below the clock's resolution at t
            break
        out.append((t, end))
        amount -= end - t
        t = end
    return out


def _meets(spans: Sequence[tuple[float, float]], ends: Sequence[float], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether a span of ``spans`` (sorted, disjoint) starts before ``b`` among those ending after ``a``: where
    :func:`overlap_seconds` has anything to add up."""
    if not spans:
        return np.zeros(len(a), dtype=bool)
    starts = np.array([s for s, _ in spans])
    i = np.searchsorted(np.asarray(ends), a, side="right")
    inside = i < len(spans)
    return inside & (starts[np.minimum(i, len(spans) - 1)] < b)


def _median(x: np.ndarray) -> float:
    """statistics.median's value (the mean of the middle two for an even count)."""
    s = np.sort(x)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (float(s[n // 2 - 1]) + float(s[n // 2])) / 2


class _Order:
    """The merged order of a run's events, ``sorted(events, key=wall)`` of the events in the order they were
    added: other events and step rows compared by (wall, place added)."""

    def __init__(self, wall: np.ndarray, seq: np.ndarray):
        self.wall, self.seq = wall, seq

    def steps_before(self, wall: float, seq: int) -> int:
        lo = int(np.searchsorted(self.wall, wall, side="left"))
        hi = int(np.searchsorted(self.wall, wall, side="right"))
        return lo + int(np.searchsorted(self.seq[lo:hi], seq))


@dataclass
class _Session:
    others: list[Event]
    others_seq: list[int]
    lo: int  # its steps: rows [lo, hi) of the sorted step columns
    hi: int

    def first_wall(self, wall: np.ndarray) -> float:
        cands = [self.others[0].wall] if self.others else []
        if self.hi > self.lo:
            cands.append(float(wall[self.lo]))
        return min(cands)

    def last_wall(self, wall: np.ndarray) -> float:
        cands = [self.others[-1].wall] if self.others else []
        if self.hi > self.lo:
            cands.append(float(wall[self.hi - 1]))
        return max(cands)


def _sessions(others: list[Event], seqs: list[int], order: _Order, n_steps: int) -> list[_Session]:
    """Split at a RUN_START after the previous launch ended: a separate launch into the same run directory."""
    out = [_Session([], [], 0, n_steps)]
    started: set[str] = set()
    ended: set[str] = set()
    for ev, q in zip(others, seqs):
        if ev.kind is EventKind.RUN_START and ended and started <= ended:
            cut = order.steps_before(ev.wall, q)
            if out[-1].others or cut > out[-1].lo:
                out[-1].hi = cut
                out.append(_Session([], [], cut, n_steps))
                started, ended = set(), set()
        out[-1].others.append(ev)
        out[-1].others_seq.append(q)
        if ev.kind is EventKind.RUN_START:
            started.add(ev.node)
        elif ev.kind is EventKind.RUN_END:
            ended.add(ev.node)
    return out


def _ended(s: _Session, order: _Order, steps: StepColumns) -> bool:
    """A launch has ended when every node that announced RUN_START has written RUN_END (a node that left
    early, e.g. scaled down, does not end the job)."""
    started = {e.node for e in s.others if e.kind is EventKind.RUN_START}
    ended = {e.node for e in s.others if e.kind is EventKind.RUN_END}
    if not ended:
        return False
    # a lost node (SIGKILLed, cut off) never writes RUN_END: its loss ends it, unless it was heard from again
    last: dict[str, tuple[Event, int]] = {}
    for e, q in zip(s.others, s.others_seq):
        last[e.node] = (e, q)
    codes = {n: i for i, n in enumerate(steps.nodes)}
    lost = set()
    for node, (e, q) in last.items():
        if e.kind is not EventKind.AGENT_LOST:
            continue
        code = codes.get(node)
        after = max(s.lo, order.steps_before(e.wall, q))
        if code is None or not (steps.node[after:s.hi] == code).any():
            lost.add(node)
    return started <= ended | lost


def _attempts(si: int, s: _Session, steps: StepColumns, wall: np.ndarray) -> list[_Attempt]:
    starts: dict[int, _Attempt] = {}
    for ev in s.others:
        if ev.kind is EventKind.ATTEMPT_START:
            k = ev.attempt if ev.attempt is not None else _int_or_none(ev.details.get("attempt", len(starts)))
            if k is None:
                k = len(starts)
            a = starts.get(k)
            if a is None:
                starts[k] = a = _Attempt(si, k, ev.wall)
            a.start = min(a.start, ev.wall)
            ws = ev.details.get("world_size")
            if isinstance(ws, int):
                a.world_size = max(a.world_size or 0, ws)
    rows = np.arange(s.lo, s.hi)
    s_first = s.first_wall(wall)
    if not starts:
        # a ledger without agent events (e.g. a plain worker): attempts from the workers' attempt field
        if len(rows):
            ks = steps.attempt[rows]
            ks = np.where(ks == NO_ATTEMPT, 0, ks)  # `attempt or 0`
            t0s = wall[rows] - steps.seconds[rows]
            uniq, first, which = np.unique(ks, return_index=True, return_inverse=True)
            earliest = np.full(len(uniq), np.inf)
            np.minimum.at(earliest, which, t0s)
            for j in np.argsort(first, kind="stable"):  # in the order the attempts first appear
                starts[int(uniq[j])] = _Attempt(si, int(uniq[j]), float(earliest[j]))
        if not starts:
            starts[0] = _Attempt(si, 0, s_first)
        first_att = min(starts.values(), key=lambda a: a.start)
        first_att.start = min(first_att.start, s_first)
        for a in starts.values():  # a step's start may predate the first record; the run starts there
            a.start = max(a.start, s_first)
    ordered = sorted(starts.values(), key=lambda a: a.start)
    by_num = {a.attempt: a for a in ordered}
    begins = [a.start for a in ordered]
    for ev in s.others:
        # the latest attempt spawned at or before this event
        owner = ordered[max(0, bisect.bisect_right(begins, ev.wall) - 1)]
        owner.events.append(ev)
        if ev.kind is EventKind.SCALE:
            # an attempt's size is fixed at spawn; SCALE only fills it in when ATTEMPT_START did not say
            target = by_num.get(ev.attempt) if ev.attempt is not None else None
            ws = ev.details.get("new_world_size")
            if isinstance(ws, int) and target is not None and target.world_size is None:
                target.world_size = ws
    if len(rows):
        # a step record names its attempt; one that does not (or names none spawned) goes by its time
        owner = np.maximum(0, np.searchsorted(np.array(begins), wall[rows], side="right") - 1)
        index = {id(a): i for i, a in enumerate(ordered)}
        named = sorted((k, index[id(a)]) for k, a in by_num.items() if -(2**63) < k < 2**63)
        if named:
            keys = np.array([k for k, _ in named], dtype=np.int64)
            to = np.array([i for _, i in named], dtype=np.int64)
            att = steps.attempt[rows]
            pos = np.minimum(np.searchsorted(keys, att), len(keys) - 1)
            hit = (att != NO_ATTEMPT) & (keys[pos] == att)
            owner[hit] = to[pos[hit]]
        by_owner = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[by_owner], np.arange(len(ordered) + 1))
        for i, a in enumerate(ordered):
            a.rows = rows[by_owner[bounds[i]:bounds[i + 1]]]
    return ordered


def _step_int(v: float) -> int:
    return int(v) if math.isfinite(v) else 0


def compute_report(events: Iterable[Event] | ReportInputs, *, now: float | None = None,
                   in_progress_step_cap: bool = True, timeline: bool | Literal["arrays"] = True,
                   _reference: bool = False) -> GoodputReport:
    """The goodput report of the events of one run directory (any order, any number of nodes).

    ``now`` (wall seconds) is the end of a run still in progress; default: the current time. ``events`` may be
    a :class:`~resilient.goodput.columns.ReportInputs` that holds them (a live collector's). ``timeline=False``
    leaves ``timeline`` and ``timeline_arrays`` empty (the figures need no time line); ``"arrays"`` fills only
    ``timeline_arrays`` (what the plot draws from: no object a segment, two segments a step).
    ``_reference`` takes every step through the one-at-a-time code (tests compare the two).
    """
    inp = events if isinstance(events, ReportInputs) else ReportInputs(events)
    raw = inp.steps()
    offsets = _clock_offsets(inp.others)
    others_shifted = _shift(inp.others, offsets)
    by_time = sorted(range(len(others_shifted)), key=lambda i: (others_shifted[i].wall, inp.others_seq[i]))
    others = [others_shifted[i] for i in by_time]
    others_seq = [inp.others_seq[i] for i in by_time]
    shifted = _shift_steps(raw, offsets)
    idx = np.lexsort((raw.seq, shifted))
    steps = raw.take(idx)
    wall = shifted[idx]
    n = len(wall)
    if not others and not n:
        raise EmptyLedgerError("the ledger holds no events: is this the run directory, and has the run started?")
    order = _Order(wall, steps.seq)
    sessions = _sessions(others, others_seq, order, n)
    in_progress = not _ended(sessions[-1], order, steps)
    t0 = min(x for x in (others[0].wall if others else math.inf, float(wall[0]) if n else math.inf))
    t1 = max(x for x in (others[-1].wall if others else -math.inf, float(wall[-1]) if n else -math.inf))
    if in_progress:
        t1 = max(t1, time.time() if now is None else now)
    cats = [PRODUCTIVE, *CATEGORIES]
    painter = LayeredPainter(t0, t1, cats, base=Badput.OTHER.value)

    # A step record is kept iff no later record goes back to its step number or before (a rollback).
    has_step = ~np.isnan(steps.step)
    numbered = np.flatnonzero(has_step)
    nums = steps.step[numbered]
    low_after = np.append(np.minimum.accumulate(nums[::-1])[::-1][1:], math.inf) if len(nums) else nums
    redone = np.zeros(n, dtype=bool)
    redone[numbered] = nums >= low_after

    # when training was blocked by a save, and when checkpoint work ran behind it
    stalls = stall_spans(others)
    stall_ends = [e for _, e in stalls]
    bg = background_spans(others)
    bg_ends = [e for _, e in bg]
    secs = steps.seconds
    s_start = wall - secs
    # a step's seconds less the save stalls inside it (never below 0: the stall is measured on wall clock values
    # where a float's resolution is ~0.2 µs), and whether background checkpoint work ran during it; the overlap
    # is added up one step at a time only for the steps a span meets (the rest have none)
    net = np.maximum(0.0, secs)
    overlapped = np.zeros(n, dtype=bool)
    in_stall = np.ones(n, dtype=bool) if _reference else _meets(stalls, stall_ends, s_start, wall)
    for i in np.flatnonzero(in_stall).tolist():
        net[i] = max(0.0, secs[i] - overlap_seconds(s_start[i], wall[i], stalls, stall_ends))
    in_bg = np.ones(n, dtype=bool) if _reference else _meets(bg, bg_ends, s_start, wall)
    for i in np.flatnonzero(in_bg).tolist():
        overlapped[i] = overlap_seconds(s_start[i], wall[i], bg, bg_ends) > 0
    all_atts = [_attempts(si, s, steps, wall) for si, s in enumerate(sessions)]
    clean_of: dict[int, np.ndarray] = {}  # id(attempt) → its clean samples
    for atts in all_atts:
        for att in atts:
            sample = att.rows[1:] if len(att.rows) > 1 else att.rows
            clean_of[id(att)] = net[sample[~overlapped[sample]]]
    run_clean = np.concatenate(list(clean_of.values())) if clean_of else np.empty(0)

    attempt_reports: list[AttemptReport] = []
    disruptions = 0
    attempt_cuts: list[tuple[float, AttemptReport]] = []
    paint_rows: list[np.ndarray] = []  # steps in the order they are painted, with what their excess is set against
    paint_clean: list[np.ndarray] = []
    paint_first: list[np.ndarray] = []
    paint_straggler: list[np.ndarray] = []
    for si, sess in enumerate(sessions):
        sev = sess.others
        s_first = sess.first_wall(wall)
        s_ended = _ended(sess, order, steps)
        s_end = sess.last_wall(wall) if s_ended else t1
        run_end = next((e for e in reversed(sev) if e.kind is EventKind.RUN_END), None)
        atts = all_atts[si]
        counted_fault = False
        for k, att in enumerate(atts):
            nxt = atts[k + 1] if k + 1 < len(atts) else None
            a_start = s_first if k == 0 else att.start
            bound = nxt.start if nxt else s_end
            rows = att.rows
            source: str | None = None
            if len(clean_of[id(att)]):
                clean, source = _median(clean_of[id(att)]), "attempt"
            elif len(rows) and len(run_clean):
                clean, source = _median(run_clean), "run"
            elif len(rows):
                sample = rows[1:] if len(rows) > 1 else rows
                clean, source = _median(net[sample]), "all_steps"
            else:
                clean = 0.0
            first_start = float(s_start[rows[0]]) if len(rows) else None
            last_end = float(wall[rows[-1]]) if len(rows) else None
            rep = AttemptReport(session=si, attempt=att.attempt, start=a_start, end=bound,
                                world_size=att.world_size, steps=len(rows),
                                steps_redone=int(redone[rows].sum()),
                                clean_step_seconds=clean if source else None, clean_step_source=source)
            if len(rows):
                rep.first_step = _step_int(float(steps.step[rows[0]]))
                rep.last_step = _step_int(float(steps.step[rows[-1]]))

            # where the attempt ended: first fault, else a boundary event if another attempt follows
            floor = last_end if last_end is not None else att.start
            faults = [e for e in att.events if _is_fault(e) and att.start <= e.wall < bound]
            restart = next((e for e in att.events if e.kind is EventKind.RESTART), None)
            detect_ev = faults[0] if faults else None
            if detect_ev is None and nxt is not None:
                detect_ev = next((e for e in att.events if e.kind in _BOUNDARY_KINDS and e.wall >= floor), None)
            detect = None
            fault = None
            if detect_ev is not None or nxt is not None:
                detect = max(detect_ev.wall if detect_ev is not None else bound, floor)
                # how long the fault went unnoticed: the detector's own figure first
                lag = 0.0
                if detect_ev is not None and "detect_seconds" in detect_ev.details:
                    lag = _num(detect_ev.details, "detect_seconds")
                elif detect_ev is not None and detect_ev.kind is EventKind.HANG:
                    lag = _num(detect_ev.details, "last_heartbeat_age")
                elif restart is not None:
                    lag = _num(restart.details, "detect_seconds")
                fault = min(max(detect - lag, floor), detect)
                disruptions += 1
                counted_fault = True
                rep.fault_wall, rep.detect_wall = fault, detect
                rep.end_reason = (f"fault:{detect_ev.kind.value}" if detect_ev is not None and _is_fault(detect_ev)
                                  else "restart")
                if restart is not None:
                    rep.restart_cause = str(restart.details.get("cause")) if restart.details.get("cause") else None
            elif nxt is None and s_ended:
                code = run_end.details.get("exit_code") if run_end is not None else None
                rep.end_reason = "completed" if code in (0, None) else "stopped"
            attempt_reports.append(rep)
            attempt_cuts.append((a_start, rep))

            # layer 1: startup / recovery / after a final fault
            if first_start is not None:
                painter.paint(a_start, first_start, _L_PHASE, Badput.STARTUP.value)
            else:
                painter.paint(a_start, fault if fault is not None else bound, _L_PHASE, Badput.STARTUP.value)
            if detect is not None:
                # no next attempt: still recovering if the run goes on or a restart was ordered
                recovering = nxt is not None or restart is not None or not s_ended
                after = Badput.RECOVERY.value if recovering else Badput.OTHER.value
                painter.paint(detect, bound, _L_PHASE, after)
            elif last_end is not None and nxt is None and not s_ended and in_progress_step_cap:
                # the step in flight of a running attempt: productive for at most one normal step
                painter.paint(last_end, min(bound, last_end + clean), _L_PHASE, PRODUCTIVE)

            # layer 2: waiting for spares
            wait_from = None
            for e in att.events:
                is_wait = e.kind is EventKind.ACTION and str(e.details.get("action")) in _WAIT_ACTIONS
                if wait_from is not None and (e.kind in (EventKind.ACTION, EventKind.RESTART, EventKind.SCALE,
                                                         EventKind.ATTEMPT_START, EventKind.RUN_END)):
                    painter.paint(wait_from, e.wall, _L_WAIT, Badput.WAITING_FOR_SPARES.value)
                    wait_from = None
                if is_wait:
                    wait_from = e.wall
            if wait_from is not None:
                painter.paint(wait_from, bound, _L_WAIT, Badput.WAITING_FOR_SPARES.value)

            # layer 3: the partial step lost, and the detection delay
            if fault is not None and detect is not None:
                if last_end is not None:
                    painter.paint(last_end, fault, _L_FAULT, Badput.WASTED_PROGRESS.value)
                painter.paint(fault, detect, _L_FAULT, Badput.DETECTION.value)

            if len(rows):
                paint_rows.append(rows)
                paint_clean.append(np.full(len(rows), clean))
                first = np.zeros(len(rows), dtype=bool)
                first[0] = True
                paint_first.append(first)
                straggler_from = min((e.wall for e in att.events if e.kind is EventKind.STRAGGLER), default=math.inf)
                paint_straggler.append(np.full(len(rows), straggler_from))

        if s_ended and not counted_fault and run_end is not None:
            code = run_end.details.get("exit_code")
            if code not in (0, None):
                disruptions += 1

    # layers 4, 5: steps, and their time beyond the clean step time
    if paint_rows:
        _paint_steps(painter, np.concatenate(paint_rows), np.concatenate(paint_clean), np.concatenate(paint_first),
                     np.concatenate(paint_straggler), s_start, wall, net, overlapped, redone, stalls, stall_ends,
                     _reference)

    # layers 6, 7: checkpoint restore and save stalls, whichever attempt they belong to
    for ev in others:
        if ev.kind is EventKind.CKPT_RESTORE:
            painter.paint(ev.wall - _num(ev.details, "seconds"), ev.wall, _L_RESTORE,
                          Badput.CHECKPOINT_RESTORE.value)
        elif ev.kind is EventKind.CKPT_SAVE:
            painter.paint(ev.wall - _num(ev.details, "blocking_seconds"), ev.wall, _L_SAVE,
                          Badput.CHECKPOINT_SAVE_STALL.value)

    cut_points = [c for c, _ in attempt_cuts]
    swept = painter.sweep(cut_points, ordered=_reference)
    seconds = swept.seconds
    # each segment belongs to the attempt whose row it starts in
    starts_sorted = sorted(range(len(attempt_cuts)), key=lambda i: attempt_cuts[i][0])
    cut_walls = np.array([attempt_cuts[i][0] for i in starts_sorted])
    owner = (np.array(starts_sorted, dtype=np.int64)[np.maximum(0, np.searchsorted(cut_walls, swept.start,
                                                                                   side="right") - 1)]
             if len(cut_walls) else np.full(len(seconds), -1, dtype=np.int64))
    ncat = len(cats)
    totals = _sums(seconds, swept.code, ncat)
    per_attempt = _sums(seconds, owner * ncat + swept.code, len(attempt_cuts) * ncat)
    for idx, (_, rep) in enumerate(attempt_cuts):
        sums = per_attempt[idx * ncat:(idx + 1) * ncat]
        rep.productive_seconds = sums[0]
        rep.badput_seconds = {c: sums[j] for j, c in enumerate(cats) if j}
    # each attempt's row runs to the next row's start (or the end)
    ordered = [attempt_cuts[i][1] for i in starts_sorted]
    for a, b in zip(ordered, ordered[1:]):
        a.end = b.start
    if ordered:
        ordered[-1].end = t1

    wall_seconds = t1 - t0
    productive = totals[0]
    badput = {c: totals[j] for j, c in enumerate(cats) if j}
    goodput = min(1.0, max(0.0, productive / wall_seconds)) if wall_seconds > 0 else 0.0
    # every node may report the same restart: count each (launch, new attempt) once
    restarts = len({(si, e.attempt, _int_or_none(e.details.get("attempt"))) for si, s in enumerate(sessions)
                    for e in s.others if e.kind is EventKind.RESTART})
    segments = ([Segment(a, b, cats[c]) for a, b, c in zip(swept.start.tolist(), swept.end.tolist(),
                                                           swept.code.tolist())] if timeline is True else [])
    return GoodputReport(
        goodput=goodput, wall_seconds=wall_seconds, productive_seconds=productive, badput_seconds=badput,
        disruptions=disruptions, attempts=ordered, start_wall=t0, end_wall=t1, in_progress=in_progress,
        restarts=restarts, sessions=len(sessions),
        last_step=_step_int(float(steps.step[numbered[-1]])) if len(numbered) else None,
        steps_recorded=len(numbered), steps_redone=int(redone.sum()), timeline=segments,
        timeline_arrays=TimelineArrays(swept.start, swept.end, swept.code) if timeline else None,
    )


def _sums(seconds: np.ndarray, key: np.ndarray, nkeys: int) -> list[float]:
    """Exact sums (math.fsum) of ``seconds`` by ``key`` (0 to nkeys - 1)."""
    by = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[by], np.arange(nkeys + 1))
    return [math.fsum(seconds[by[bounds[j]:bounds[j + 1]]].tolist()) for j in range(nkeys)]


def _paint_steps(painter: LayeredPainter, rows: np.ndarray, clean: np.ndarray, first: np.ndarray,
                 straggler_from: np.ndarray, s_start: np.ndarray, wall: np.ndarray, net: np.ndarray,
                 overlapped: np.ndarray, redone: np.ndarray, stalls: Sequence[tuple[float, float]],
                 stall_ends: Sequence[float], reference: bool) -> None:
    """Each step ``[wall - seconds, wall]`` productive (or wasted, if redone later), then its time beyond the
    clean step time painted from its start and around its save stalls, in the category that explains it."""
    a, b = s_start[rows], wall[rows]
    kept = ~redone[rows]
    painter.paint_many(a, b, _L_STEP, np.where(kept, painter.code(PRODUCTIVE),
                                                painter.code(Badput.WASTED_PROGRESS.value)))
    excess = net[rows] - clean
    # before straggler: the rank doing the checkpoint work is the one the detector flags
    why = np.select([first, overlapped[rows], b >= straggler_from],
                    [painter.code(Badput.STARTUP.value), painter.code(Badput.CHECKPOINT_INTERFERENCE.value),
                     painter.code(Badput.STRAGGLER_SLOWDOWN.value)], painter.code(Badput.STEP_SLOWDOWN.value))
    want = kept & (excess > 0)
    around = want & (np.ones(len(rows), dtype=bool) if reference else _meets(stalls, stall_ends, a, b))
    # a step no stall meets takes its excess as one piece from its start; the rest go around their stalls
    pos = [np.flatnonzero(want & ~around)]
    ea = a[pos[0]]
    eb = np.minimum(b[pos[0]], ea + excess[pos[0]])
    pieces_a, pieces_b, piece_no = [ea], [eb], [np.zeros(len(ea), dtype=np.int64)]
    for i in np.flatnonzero(around).tolist():
        got = _paint_around(float(a[i]), float(b[i]), float(excess[i]), stalls, stall_ends)
        if got:
            pos.append(np.full(len(got), i))
            pieces_a.append(np.array([p for p, _ in got]))
            pieces_b.append(np.array([q for _, q in got]))
            piece_no.append(np.arange(len(got)))
    at, no = np.concatenate(pos), np.concatenate(piece_no)
    by = np.lexsort((no, at))  # the order the steps are painted in, each step's pieces in order
    painter.paint_many(np.concatenate(pieces_a)[by], np.concatenate(pieces_b)[by], _L_STEP_EXCESS, why[at[by]])


def report_for_run(run_dir: str | os.PathLike[str], *, now: float | None = None,
                   timeline: bool | Literal["arrays"] = True) -> GoodputReport:
    """Read the run's ledger, every writer's file (a truncated last line and malformed lines are skipped,
    and counted in ``skipped_lines``), and compute its report. Rank 0's step lines are read into columns, not
    events."""
    inputs = ReportInputs()
    try:
        read = read_ledgers([run_dir], into=inputs)
    except FileNotFoundError:
        raise EmptyLedgerError(f"no ledger in {run_dir}: expected {os.path.join(run_dir, 'events.jsonl')} and its "
                               "writers' events.*.jsonl; pass the --run-dir the job was launched with") from None
    if not len(inputs) and read.skipped:
        raise GoodputError(f"{read.path} is not a ledger: none of its {read.lines} line(s) is an event")
    rep = compute_report(inputs, now=now, timeline=timeline)
    rep.skipped_lines = read.skipped
    rep.ledger_incomplete = read.incomplete
    return rep
