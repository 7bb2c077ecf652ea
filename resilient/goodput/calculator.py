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
measurement error and taken as 0) in the details of an event it writes. Every
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
import heapq
import logging
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from resilient.events.spans import background_spans, overlap_seconds, stall_spans
from resilient.events.api import Event, EventKind
from resilient.events.follow import read_ledger
from resilient.goodput.api import (
    CATEGORIES,
    PRODUCTIVE,
    AttemptReport,
    Badput,
    EmptyLedgerError,
    GoodputError,
    GoodputReport,
    Segment,
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


def _num(d: dict, key: str, default: float = 0.0) -> float:
    v = d.get(key, default)
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):  # 10**400 is valid JSON
        return default
    return f if math.isfinite(f) else default


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
    steps: list[Event] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


class _Painter:
    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi
        self._iv: list[tuple[float, float, int, int, str]] = []

    def paint(self, start: float, end: float, layer: int, category: str) -> None:
        s, e = max(start, self.lo), min(end, self.hi)
        if e > s:
            self._iv.append((s, e, layer, len(self._iv), category))

    def sweep(self, extra_cuts: Iterable[float] = ()) -> list[Segment]:
        """Elementary segments, each with the category of the highest layer covering it (last painted wins)."""
        pts = {self.lo, self.hi}
        for s, e, *_ in self._iv:
            pts.add(s)
            pts.add(e)
        cuts = {c for c in extra_cuts if self.lo < c < self.hi}  # segments never merge across these
        pts.update(cuts)
        points = sorted(pts)
        ivs = sorted(self._iv)
        heap: list[tuple[int, int, float, str]] = []
        out: list[Segment] = []
        j = 0
        for a, b in zip(points, points[1:]):
            while j < len(ivs) and ivs[j][0] <= a:
                s, e, layer, seq, cat = ivs[j]
                heapq.heappush(heap, (-layer, -seq, e, cat))
                j += 1
            while heap and heap[0][2] <= a:
                heapq.heappop(heap)
            # a popped-late interval below the top may already be over; the top never is
            cat = heap[0][3] if heap else Badput.OTHER.value
            if out and out[-1].category == cat and out[-1].end == a and a not in cuts:
                out[-1] = Segment(out[-1].start, b, cat)
            else:
                out.append(Segment(a, b, cat))
        return out


def apply_clock_offsets(events: Iterable[Event]) -> list[Event]:
    """The events with each node's recorded ``clock_offset`` applied (see the module docstring)."""
    evs = list(events)
    offsets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ev in evs:
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
    if not offsets:
        return evs
    for lst in offsets.values():
        lst.sort()
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


def _paint_around(painter: _Painter, a: float, b: float, amount: float, layer: int, category: str,
                  holes: Sequence[tuple[float, float]], hole_ends: Sequence[float]) -> None:
    """Paint ``amount`` seconds of ``[a, b]`` from its start, skipping the ``holes`` (save stalls, painted
    above), so that the step's productive, stalled and excess parts add up to the step."""
    t = a
    i = bisect.bisect_right(hole_ends, a)
    while amount > 0 and t < b:
        if i < len(holes) and holes[i][0] <= t:
            t = max(t, holes[i][1])
            i += 1
            continue
        end = min(b, holes[i][0] if i < len(holes) else b, t + amount)
        if end <= t:  # an amount below the clock's resolution at t
            return
        painter.paint(t, end, layer, category)
        amount -= end - t
        t = end


@dataclass
class _StepInfo:
    net: float  # seconds, the save stalls inside it taken out
    overlapped: bool  # background checkpoint work ran during it


def _ended(evs: list[Event]) -> bool:
    """A launch has ended when every node that announced RUN_START has written RUN_END (a node that left
    early, e.g. scaled down, does not end the job)."""
    started = {e.node for e in evs if e.kind is EventKind.RUN_START}
    ended = {e.node for e in evs if e.kind is EventKind.RUN_END}
    # a lost node (SIGKILLed, cut off) never writes RUN_END: its loss ends it, unless it was heard from again
    last = {e.node: e.kind for e in evs}
    lost = {n for n, k in last.items() if k is EventKind.AGENT_LOST}
    return bool(ended) and started <= ended | lost


def _sessions(evs: list[Event]) -> list[list[Event]]:
    """Split at a RUN_START after the previous launch ended: a separate launch into the same run directory."""
    out: list[list[Event]] = [[]]
    started: set[str] = set()
    ended: set[str] = set()
    for ev in evs:
        if ev.kind is EventKind.RUN_START and ended and started <= ended and out[-1]:
            out.append([])
            started, ended = set(), set()
        out[-1].append(ev)
        if ev.kind is EventKind.RUN_START:
            started.add(ev.node)
        elif ev.kind is EventKind.RUN_END:
            ended.add(ev.node)
    return out


def _attempts(session: int, evs: list[Event]) -> list[_Attempt]:
    starts: dict[int, _Attempt] = {}
    for ev in evs:
        if ev.kind is EventKind.ATTEMPT_START:
            k = ev.attempt if ev.attempt is not None else _int_or_none(ev.details.get("attempt", len(starts)))
            if k is None:
                k = len(starts)
            a = starts.get(k)
            if a is None:
                starts[k] = a = _Attempt(session, k, ev.wall)
            a.start = min(a.start, ev.wall)
            ws = ev.details.get("world_size")
            if isinstance(ws, int):
                a.world_size = max(a.world_size or 0, ws)
    if not starts:
        # a ledger without agent events (e.g. a plain worker): attempts from the workers' attempt field
        for ev in evs:
            if ev.kind is EventKind.STEP:
                k = ev.attempt or 0
                a = starts.get(k)
                t0 = ev.wall - _num(ev.details, "seconds")
                if a is None:
                    starts[k] = a = _Attempt(session, k, t0)
                a.start = min(a.start, t0)
        if not starts:
            starts[0] = _Attempt(session, 0, evs[0].wall)
        first = min(starts.values(), key=lambda a: a.start)
        first.start = min(first.start, evs[0].wall)
        for a in starts.values():  # a step's start may predate the first record; the run starts there
            a.start = max(a.start, evs[0].wall)
    ordered = sorted(starts.values(), key=lambda a: a.start)
    by_num = {a.attempt: a for a in ordered}
    begins = [a.start for a in ordered]
    for ev in evs:
        owner = None
        if ev.kind is EventKind.STEP and ev.attempt is not None:
            owner = by_num.get(ev.attempt)
        if owner is None:
            # the latest attempt spawned at or before this event
            i = max(0, bisect.bisect_right(begins, ev.wall) - 1)
            owner = ordered[i]
        owner.events.append(ev)
        if ev.kind is EventKind.STEP:
            owner.steps.append(ev)
        elif ev.kind is EventKind.SCALE:
            # an attempt's size is fixed at spawn; SCALE only fills it in when ATTEMPT_START did not say
            target = by_num.get(ev.attempt) if ev.attempt is not None else None
            ws = ev.details.get("new_world_size")
            if isinstance(ws, int) and target is not None and target.world_size is None:
                target.world_size = ws
    return ordered


def compute_report(events: Iterable[Event], *, now: float | None = None,
                   in_progress_step_cap: bool = True) -> GoodputReport:
    """The goodput report of the events of one run directory (any order, any number of nodes).

    ``now`` (wall seconds) is the end of a run still in progress; default: the current time.
    """
    evs = sorted(apply_clock_offsets(events), key=lambda e: e.wall)
    if not evs:
        raise EmptyLedgerError("the ledger holds no events: is this the run directory, and has the run started?")
    sessions = _sessions(evs)
    last = sessions[-1]
    in_progress = not _ended(last)
    t0 = evs[0].wall
    t1 = evs[-1].wall
    if in_progress:
        t1 = max(t1, time.time() if now is None else now)
    painter = _Painter(t0, t1)

    # A step record is kept iff no later record goes back to its step number or before (a rollback).
    steps_all = [e for e in evs if e.kind is EventKind.STEP and "step" in e.details]
    redone: set[int] = set()
    low = math.inf
    for ev in reversed(steps_all):
        n = _num(ev.details, "step", math.inf)
        if n >= low:
            redone.add(id(ev))
        low = min(low, n)

    # when training was blocked by a save, and when checkpoint work ran behind it
    stalls = stall_spans(evs)
    stall_ends = [e for _, e in stalls]
    bg = background_spans(evs)
    bg_ends = [e for _, e in bg]
    all_atts = [_attempts(si, sev) for si, sev in enumerate(sessions)]
    info: dict[int, _StepInfo] = {}
    clean_of: dict[int, list[float]] = {}  # id(attempt) → its clean samples
    for atts in all_atts:
        for att in atts:
            att.steps.sort(key=lambda e: e.wall)
            for e in att.steps:
                d = _num(e.details, "seconds")
                # never below 0: the stall is measured on wall clock values where a float's resolution is ~0.2 µs
                info[id(e)] = _StepInfo(max(0.0, d - overlap_seconds(e.wall - d, e.wall, stalls, stall_ends)),
                                        overlap_seconds(e.wall - d, e.wall, bg, bg_ends) > 0)
            sample = att.steps[1:] if len(att.steps) > 1 else att.steps
            clean_of[id(att)] = [info[id(e)].net for e in sample if not info[id(e)].overlapped]
    run_clean = [x for xs in clean_of.values() for x in xs]

    attempt_reports: list[AttemptReport] = []
    disruptions = 0
    attempt_cuts: list[tuple[float, AttemptReport]] = []
    for si, sev in enumerate(sessions):
        s_start = sev[0].wall
        s_ended = _ended(sev)
        s_end = sev[-1].wall if s_ended else t1
        run_end = next((e for e in reversed(sev) if e.kind is EventKind.RUN_END), None)
        atts = all_atts[si]
        counted_fault = False
        for k, att in enumerate(atts):
            nxt = atts[k + 1] if k + 1 < len(atts) else None
            a_start = s_start if k == 0 else att.start
            bound = nxt.start if nxt else s_end
            steps = att.steps
            durs = [_num(e.details, "seconds") for e in steps]
            source: str | None = None
            if clean_of[id(att)]:
                clean, source = statistics.median(clean_of[id(att)]), "attempt"
            elif steps and run_clean:
                clean, source = statistics.median(run_clean), "run"
            elif steps:
                sample = steps[1:] if len(steps) > 1 else steps
                clean, source = statistics.median(info[id(e)].net for e in sample), "all_steps"
            else:
                clean = 0.0
            first_start = steps[0].wall - durs[0] if steps else None
            last_end = steps[-1].wall if steps else None
            rep = AttemptReport(session=si, attempt=att.attempt, start=a_start, end=bound,
                                world_size=att.world_size, steps=len(steps),
                                steps_redone=sum(1 for e in steps if id(e) in redone),
                                clean_step_seconds=clean if source else None, clean_step_source=source)
            if steps:
                rep.first_step = int(_num(steps[0].details, "step"))
                rep.last_step = int(_num(steps[-1].details, "step"))

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
            if steps:
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

            # layers 4, 5: steps, and their time beyond the clean step time
            straggler_from = min((e.wall for e in att.events if e.kind is EventKind.STRAGGLER), default=math.inf)
            for i, (ev, d) in enumerate(zip(steps, durs)):
                cat = Badput.WASTED_PROGRESS.value if id(ev) in redone else PRODUCTIVE
                painter.paint(ev.wall - d, ev.wall, _L_STEP, cat)
                si_ = info[id(ev)]
                excess = si_.net - clean
                if cat != PRODUCTIVE or excess <= 0:
                    continue
                if i == 0:
                    why = Badput.STARTUP
                elif si_.overlapped:
                    # before straggler: the rank doing the checkpoint work is the one the detector flags
                    why = Badput.CHECKPOINT_INTERFERENCE
                elif ev.wall >= straggler_from:
                    why = Badput.STRAGGLER_SLOWDOWN
                else:
                    why = Badput.STEP_SLOWDOWN
                _paint_around(painter, ev.wall - d, ev.wall, excess, _L_STEP_EXCESS, why.value, stalls, stall_ends)

        if s_ended and not counted_fault and run_end is not None:
            code = run_end.details.get("exit_code")
            if code not in (0, None):
                disruptions += 1

    # layers 6, 7: checkpoint restore and save stalls, whichever attempt they belong to
    for ev in evs:
        if ev.kind is EventKind.CKPT_RESTORE:
            painter.paint(ev.wall - _num(ev.details, "seconds"), ev.wall, _L_RESTORE,
                          Badput.CHECKPOINT_RESTORE.value)
        elif ev.kind is EventKind.CKPT_SAVE:
            painter.paint(ev.wall - _num(ev.details, "blocking_seconds"), ev.wall, _L_SAVE,
                          Badput.CHECKPOINT_SAVE_STALL.value)

    cut_points = [c for c, _ in attempt_cuts]
    segments = painter.sweep(cut_points)
    totals: dict[str, list[float]] = defaultdict(list)
    per_attempt: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    starts_sorted = sorted(range(len(attempt_cuts)), key=lambda i: attempt_cuts[i][0])
    cut_walls = [attempt_cuts[i][0] for i in starts_sorted]
    for seg in segments:
        totals[seg.category].append(seg.seconds)
        if cut_walls:
            i = max(0, bisect.bisect_right(cut_walls, seg.start) - 1)
            per_attempt[starts_sorted[i]][seg.category].append(seg.seconds)
    # time between sessions is cut at the next session's start; give it to the earlier session's last attempt
    for idx, (_, rep) in enumerate(attempt_cuts):
        cats = per_attempt.get(idx, {})
        rep.productive_seconds = math.fsum(cats.get(PRODUCTIVE, []))
        rep.badput_seconds = {c: math.fsum(cats.get(c, [])) for c in CATEGORIES}
    # each attempt's row runs to the next row's start (or the end)
    ordered = [attempt_cuts[i][1] for i in starts_sorted]
    for a, b in zip(ordered, ordered[1:]):
        a.end = b.start
    if ordered:
        ordered[-1].end = t1

    wall = t1 - t0
    productive = math.fsum(totals.get(PRODUCTIVE, []))
    badput = {c: math.fsum(totals.get(c, [])) for c in CATEGORIES}
    goodput = min(1.0, max(0.0, productive / wall)) if wall > 0 else 0.0
    # every node may report the same restart: count each (launch, new attempt) once
    restarts = len({(si, e.attempt, _int_or_none(e.details.get("attempt"))) for si, sev in enumerate(sessions) for e in sev
                    if e.kind is EventKind.RESTART})
    kept_steps = [e for e in steps_all if id(e) not in redone]
    return GoodputReport(
        goodput=goodput, wall_seconds=wall, productive_seconds=productive, badput_seconds=badput,
        disruptions=disruptions, attempts=ordered, start_wall=t0, end_wall=t1, in_progress=in_progress,
        restarts=restarts, sessions=len(sessions),
        last_step=int(_num(steps_all[-1].details, "step")) if steps_all else None,
        steps_recorded=len(steps_all), steps_redone=len(steps_all) - len(kept_steps), timeline=segments,
    )


def report_for_run(run_dir: str | os.PathLike[str], *, now: float | None = None) -> GoodputReport:
    """Read the run's ledger, every writer's file merged (a truncated last line and malformed lines are skipped,
    and counted in ``skipped_lines``), and compute its report."""
    try:
        read = read_ledger(run_dir)
    except FileNotFoundError:
        raise EmptyLedgerError(f"no ledger in {run_dir}: expected {os.path.join(run_dir, 'events.jsonl')} and its "
                               "writers' events.*.jsonl; pass the --run-dir the job was launched with") from None
    if not read.events and read.skipped:
        raise GoodputError(f"{read.path} is not a ledger: none of its {read.lines} line(s) is an event")
    rep = compute_report(read.events, now=now)
    rep.skipped_lines = read.skipped
    rep.ledger_incomplete = read.incomplete
    return rep


# ---------------------------------------------------------------------------------------------- checkpoints
@dataclass
class TierSaves:
    """What one tier got of a run's saves, from its CKPT_TIER_DONE records."""

    tier: str
    count: int
    newest: int | None


@dataclass
class CheckpointSummary:
    """Which steps were saved where, and which saves failed (``resilient goodput`` and the launcher's closing
    lines). A failed save is one that reached no tier: a CKPT_SAVE_FAILED record, or (ledgers written before that
    record existed) a saved step with a tier failure and no tier that completed it."""

    attempted: list[int] = field(default_factory=list)  # steps whose save began (CKPT_SAVE)
    tiers: dict[str, TierSaves] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)
    first_error: str | None = None  # of the first failed save: "tier: error"
    stopped: str | None = None  # the CKPT_STOP message, when failed saves stopped the job
    restore_missing: list[int] = field(default_factory=list)  # steps a restart found nowhere (CKPT_RESTORE_MISSING)
    state_undefined: str | None = None  # the first restore that found no usable step: what was missing, what would do
    rank0: bool = False  # the ledger holds rank 0's checkpoint records (another node's own ledger may not)

    def newest(self, tier: str | None = None) -> int | None:
        if tier is not None:
            t = self.tiers.get(tier)
            return t.newest if t is not None else None
        return max((t.newest for t in self.tiers.values() if t.newest is not None), default=None)

    def not_durable(self, persistent: str = "persistent") -> tuple[int, int | None] | None:
        """(newest saved step, newest step on ``persistent``) when the newest saved step is not there."""
        newest = self.newest()
        if not self.rank0 or newest is None:
            return None
        there = self.newest(persistent)
        return None if there is not None and there >= newest else (newest, there)

    def lines(self) -> list[str]:
        if not self.attempted and not self.tiers and not self.failed and not self.state_undefined:
            return []
        order = {"local": 0, "peer": 1, "persistent": 2}
        where = "; ".join(f"{t.tier} {t.count} step(s), newest {t.newest}"
                          for t in sorted(self.tiers.values(), key=lambda t: (order.get(t.tier, 9), t.tier)))
        out = [f"checkpoints: {len(self.attempted)} save(s); {where or 'no tier holds any step'}"]
        if self.failed:
            out.append(f"checkpoints: {len(self.failed)} failed save(s) (reached no tier): steps "
                       f"{_steps_text(self.failed)}; first error: {self.first_error or 'unknown'}")
        if self.restore_missing:
            out.append(f"checkpoints: a restart found no checkpoint although steps {_steps_text(self.restore_missing)} "
                       "were saved before; it started from step 0")
        if self.state_undefined:
            out.append(f"checkpoints: state undefined: {self.state_undefined}")
        return out

    def to_json(self) -> dict[str, object]:
        return {"attempted": len(self.attempted), "newest": self.newest(),
                "tiers": {t: {"count": v.count, "newest": v.newest} for t, v in self.tiers.items()},
                "failed": {"count": len(self.failed), "steps": list(self.failed), "first_error": self.first_error},
                "stopped": self.stopped, "restore_missing": list(self.restore_missing),
                "state_undefined": self.state_undefined}


def fleet_lines(events: Iterable[Event]) -> list[str]:
    """What happened to the fleet beside the attempts: spares lost, failures by class (``resilient goodput``)."""
    lost: list[str] = []
    classes: dict[str, int] = defaultdict(int)
    for ev in sorted(events, key=lambda e: e.wall):
        if ev.kind is EventKind.SPARE_LOST:
            lost.append(f"{ev.details.get('node') or ev.node} ({ev.details.get('cause') or 'unknown'})")
        elif ev.kind is EventKind.WORKER_EXIT and ev.details.get("failure_class"):
            classes[str(ev.details["failure_class"])] += 1
    out = []
    if classes:
        out.append("failures by class: " + ", ".join(f"{c} {n}" for c, n in sorted(classes.items())))
    if lost:
        out.append(f"spares lost: {len(lost)}: " + "; ".join(lost[:8]) + (" …" if len(lost) > 8 else ""))
    return out


def _steps_text(steps: Sequence[int], most: int = 12) -> str:
    s = list(steps)
    if len(s) <= most:
        return ", ".join(map(str, s))
    return f"{', '.join(map(str, s[:most // 2]))}, … ({len(s) - most} more), {', '.join(map(str, s[-(most // 2):]))}"


def _step_of(ev: Event) -> int | None:
    v = ev.details.get("step")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# the kinds checkpoint_summary reads: a caller that reads the ledger for it alone reads only these
CHECKPOINT_SUMMARY_KINDS = frozenset({EventKind.CKPT_SAVE, EventKind.CKPT_TIER_DONE, EventKind.CKPT_SAVE_FAILED,
                                      EventKind.CKPT_TIER_FAILED, EventKind.CKPT_STOP,
                                      EventKind.CKPT_RESTORE_MISSING})


def checkpoint_summary(events: Iterable[Event]) -> CheckpointSummary:
    """Which steps were saved where, and which saves failed, from a run's events (see CheckpointSummary)."""
    evs = sorted(events, key=lambda e: e.wall)
    out = CheckpointSummary()
    attempted: set[int] = set()
    done: dict[str, set[int]] = defaultdict(set)
    failed_explicit: dict[int, str] = {}
    tier_failed: dict[int, str] = {}
    missing: set[int] = set()
    for ev in evs:
        step = _step_of(ev)
        if ev.kind is EventKind.CKPT_TIER_FAILED and ev.details.get("state_undefined") is True:
            out.state_undefined = out.state_undefined or str(ev.details.get("error") or "no usable step on any tier")
        if ev.kind is EventKind.CKPT_SAVE and step is not None:
            attempted.add(step)
            out.rank0 = out.rank0 or ev.rank in (0, None)
        elif ev.kind is EventKind.CKPT_TIER_DONE and step is not None:
            done[str(ev.details.get("tier"))].add(step)
            out.rank0 = out.rank0 or ev.rank in (0, None)
        elif ev.kind is EventKind.CKPT_SAVE_FAILED and step is not None:
            failed_explicit.setdefault(step, f"{ev.details.get('tier') or 'every tier'}: {ev.details.get('error')}")
        elif ev.kind is EventKind.CKPT_TIER_FAILED and step is not None:
            tier_failed.setdefault(step, f"{ev.details.get('tier')}: {ev.details.get('error')}")
        elif ev.kind is EventKind.CKPT_STOP and out.stopped is None:
            out.stopped = str(ev.details.get("message") or "")
        elif ev.kind is EventKind.CKPT_RESTORE_MISSING:
            missing.update(s for s in ev.details.get("attempted_steps") or () if isinstance(s, int))
    reached = set().union(*done.values()) if done else set()
    # a step that reached a tier later (saved again after a restart) is not a lost save
    failed = {s: e for s, e in failed_explicit.items() if s not in reached}
    for s, e in tier_failed.items():
        if s in attempted and s not in reached and s not in failed:
            failed[s] = e
    out.attempted = sorted(attempted)
    out.tiers = {t: TierSaves(t, len(s), max(s)) for t, s in done.items()}
    out.failed = sorted(failed)
    out.first_error = failed[out.failed[0]] if out.failed else None
    out.restore_missing = sorted(missing)
    return out
