"""Measured figures from a run directory's ledger, for ``resilient plan RUN_DIR``.

Everything is read through the goodput calculator's own report (``compute_report``), so that a figure means
in the plan what it meant in the run's ``resilient goodput`` table: the productive seconds of a kept step,
the start-up badput of a launch and of a restarted attempt, the detection and recovery badput of each
disruption (by the kind of fault, and by the action the supervisor took), the blocking time of a save, the
restore time by tier. A figure the run never showed (no hang, no hot swap) keeps its default, and the result
says which figures came from where.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.goodput.api import GoodputError, GoodputReport
from resilient.goodput.calculator import compute_report
from resilient.events.follow import read_ledger
from resilient.plan.api import (
    FAULT_KINDS, RECOVERY_ACTIONS, STEP_EXTRA_CATEGORIES, TIERS, Figures, PlanInputError, PlannedFault,
)

logger = logging.getLogger(__name__)


@dataclass
class Measured:
    """What a run's ledger says: the figures (as keyword arguments of :class:`Figures`), where each came from,
    and what the run looked like (its size, interval, policy and the faults it met)."""

    figures: dict[str, Any] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    nodes: int | None = None
    gpus_per_node: int | None = None
    spares: int | None = None
    ckpt_interval: int | None = None
    policy: str | None = None
    max_restarts: int | None = None
    nodes_per_replica: int | None = None  # the run's --nodes-per-replica (its assignments say)
    faults: dict[str, int] = field(default_factory=dict)  # fault kind → disruptions
    schedule: list[PlannedFault] = field(default_factory=list)  # the run's own faults, to replay
    tiers: tuple[str, ...] | None = None  # checkpoint tiers the run saved to or restored from (None: unknown)
    running_seconds: float = 0.0  # time the job ran steps (the time failures could happen in)
    goodput: float | None = None
    report: GoodputReport | None = None

    @property
    def failures_per_node_day(self) -> float | None:
        n = sum(self.faults.values())
        if not self.nodes or self.running_seconds <= 0:
            return None
        return n / (self.nodes * self.running_seconds / 86400.0)

    @property
    def node_loss_share(self) -> float | None:
        n = sum(self.faults.values())
        return self.faults.get(EventKind.AGENT_LOST.value, 0) / n if n else None

    @property
    def hang_share(self) -> float | None:
        rest = sum(v for k, v in self.faults.items() if k != EventKind.AGENT_LOST.value)
        return self.faults.get(EventKind.HANG.value, 0) / rest if rest else None


def _argv_value(argv: Any, flag: str) -> str | None:
    if not isinstance(argv, list):
        return None
    for i, a in enumerate(argv):
        if not isinstance(a, str):
            continue
        if a == flag and i + 1 < len(argv) and isinstance(argv[i + 1], str):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _num(d: dict, key: str) -> float | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _mean(xs: list[float]) -> float | None:
    # the plan adds one figure per event, so the figure that gives back a run's total is the mean (a median
    # of a few skewed samples, e.g. one slow start-up among quick ones, under-counts the total)
    return statistics.fmean(xs) if xs else None


def measure_events(events: list[Event]) -> Measured:
    """The figures of the run these events describe (one run directory's ledger)."""
    try:
        rep = compute_report(events, timeline=False)  # the figures; the plan draws no time line of its own
    except GoodputError as e:
        raise PlanInputError(str(e)) from None
    evs = sorted(events, key=lambda e: e.wall)
    m = Measured(report=rep, goodput=rep.goodput)
    fig: dict[str, Any] = {}

    # size, spares, policy, budget: the first assignment and the launch's command line
    start = next((e for e in evs if e.kind is EventKind.ACTION and isinstance(e.details.get("assignment"), dict)), None)
    if start is not None:
        a = start.details["assignment"]
        members, nproc = a.get("members"), a.get("nproc")
        if isinstance(members, list) and members:
            m.nodes = len(members)
            m.spares = len(a.get("spares") or [])
            k = a.get("nodes_per_replica")
            m.nodes_per_replica = k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else None
            if isinstance(nproc, dict) and nproc:
                vals = [v for v in nproc.values() if isinstance(v, int) and v > 0]
                m.gpus_per_node = max(vals) if vals else None
    run_start = next((e for e in evs if e.kind is EventKind.RUN_START), None)
    if run_start is not None:
        argv = run_start.details.get("argv")
        m.policy = _argv_value(argv, "--policy")
        mr = _argv_value(argv, "--max-restarts")
        if mr is not None and mr.isdigit():
            m.max_restarts = int(mr)

    # steps: productive seconds per kept step, the gaps between steps, the tail after the last one
    steps = [e for e in evs if e.kind is EventKind.STEP and _num(e.details, "seconds") is not None]
    kept = rep.steps_recorded - rep.steps_redone
    if kept > 0 and rep.productive_seconds > 0:
        fig["step_s"] = rep.productive_seconds / kept
        for c in STEP_EXTRA_CATEGORIES:
            if rep.badput_seconds.get(c, 0.0) > 0:
                fig.setdefault("step_extra_s", {})[c] = rep.badput_seconds[c] / kept
    gaps: list[float] = []
    by_attempt: dict[Any, list[Event]] = defaultdict(list)
    for e in steps:
        by_attempt[e.attempt].append(e)
    for group in by_attempt.values():
        for s1, s2 in zip(group, group[1:]):
            gaps.append(max(0.0, (s2.wall - float(s2.details["seconds"])) - s1.wall))
    if gaps:
        fig["step_gap_s"] = statistics.fmean(gaps)
    run_end = next((e for e in reversed(evs) if e.kind is EventKind.RUN_END), None)
    if run_end is not None and steps and run_end.wall >= steps[-1].wall:
        fig["teardown_s"] = run_end.wall - steps[-1].wall

    # saves: blocking time (one per step, whichever ranks reported it) and the interval
    stalls: dict[int, float] = {}
    for e in evs:
        if e.kind is EventKind.CKPT_SAVE and isinstance(e.details.get("step"), int):
            b = _num(e.details, "blocking_seconds")
            if b is not None:
                stalls[e.details["step"]] = max(stalls.get(e.details["step"], 0.0), b)
    if stalls:
        fig["save_stall_s"] = statistics.fmean(stalls.values())
        ss = sorted(stalls)
        diffs = [b - a for a, b in zip(ss, ss[1:]) if b > a]
        if diffs:
            m.ckpt_interval = int(statistics.median(diffs))

    # restore by tier (the slowest rank of an attempt is what the job waits for)
    restores: dict[str, dict[Any, float]] = defaultdict(dict)
    for e in evs:
        if e.kind is EventKind.CKPT_RESTORE and e.details.get("tier") in TIERS:
            s = _num(e.details, "seconds")
            if s is not None:
                d = restores[e.details["tier"]]
                d[e.attempt] = max(d.get(e.attempt, 0.0), s)
    if restores:
        fig["restore_s"] = {t: _mean(list(v.values())) for t, v in restores.items()}
    # the tiers the run had: those it finished a save on or read a restore from
    seen = {e.details.get("tier") for e in evs if e.kind is EventKind.CKPT_TIER_DONE}
    for e in evs:
        if e.kind is EventKind.CKPT_RESTORE:
            src = e.details.get("sources")
            seen.update(src if isinstance(src, list) else [e.details.get("tier")])
    m.tiers = tuple(t for t in TIERS if t in seen) or None

    # start-up, detection and recovery, per attempt
    actions: dict[int, str] = {}  # new round → action that made it
    for e in evs:
        if e.kind is EventKind.ACTION and isinstance(e.details.get("round"), int):
            k = str(e.details.get("action"))
            if k in RECOVERY_ACTIONS:
                actions[e.details["round"]] = k
    launch, startup = [], []
    detect: dict[str, list[float]] = defaultdict(list)
    recovery: dict[str, list[float]] = defaultdict(list)
    first_of_session: set[int] = set()
    for a in rep.attempts:
        if a.session not in first_of_session:
            first_of_session.add(a.session)
            if a.steps:
                launch.append(a.badput_seconds.get("startup", 0.0))
        elif a.steps:
            startup.append(a.badput_seconds.get("startup", 0.0))
        if a.fault_wall is not None and a.detect_wall is not None and a.end_reason.startswith("fault:"):
            kind = a.end_reason.split(":", 1)[1]
            if kind in FAULT_KINDS:
                m.faults[kind] = m.faults.get(kind, 0) + 1
                detect[kind].append(a.badput_seconds.get("detection", 0.0))
        act = actions.get(a.attempt + 1)
        if a.detect_wall is not None and act is not None:
            recovery[act].append(a.badput_seconds.get("recovery", 0.0))
    if launch:
        fig["launch_s"] = _mean(launch)
    if startup:
        fig["startup_s"] = _mean(startup)
    if detect:
        fig["detect_s"] = {k: _mean(v) for k, v in detect.items()}
    if recovery:
        fig["recovery_s"] = {k: _mean(v) for k, v in recovery.items()}
    # the time failures could happen in: steps run and saves (the planner draws failures only while running)
    b = rep.badput_seconds
    m.running_seconds = rep.productive_seconds + b.get("wasted_progress", 0.0) + b.get("checkpoint_save_stall", 0.0) \
        + sum(b.get(c, 0.0) for c in STEP_EXTRA_CATEGORIES) + fig.get("step_gap_s", 0.0) * max(0, len(steps) - 1)
    m.schedule = _schedule(evs, rep)
    # spares: those in the first assignment and those that joined as spares before the first fault (a spare
    # agent often registers a moment after the job formed, so the first assignment alone says none)
    first_fault = m.schedule[0].at + rep.start_wall if m.schedule else math.inf
    if start is not None and m.nodes:
        a = start.details["assignment"]
        members = set(a.get("members") or [])
        spares = {n for n in (a.get("spares") or []) if isinstance(n, str)}
        spares |= {e.node for e in evs if e.kind is EventKind.NODE_JOINED and e.details.get("spare") is True
                   and e.wall < first_fault and e.node not in members}
        m.spares = len(spares)
    m.figures = fig
    m.source = {k: "ledger" for k in fig}
    return m


def _schedule(evs: list[Event], rep: GoodputReport) -> list[PlannedFault]:
    """The run's faults as the planner replays them: seconds from the launch, the kind the calculator gave, and
    the failing node's index among the members of the attempt it hit (the policy counts failures per node, so a
    replay that moved every fault to one node, or spread them, would decide differently)."""
    acts: dict[int, Event] = {}  # round → the supervisor's decision that started it
    members: dict[int, list[str]] = {}  # round → its members in group-rank order
    for e in evs:
        if e.kind is EventKind.ACTION and isinstance(e.details.get("round"), int) \
                and not isinstance(e.details.get("round"), bool):
            acts.setdefault(e.details["round"], e)
            a = e.details.get("assignment")
            if isinstance(a, dict) and isinstance(a.get("members"), list):
                members.setdefault(e.details["round"], [str(x) for x in a["members"]])
    out = []
    for a in rep.attempts:
        if a.fault_wall is None or not a.end_reason.startswith("fault:"):
            continue
        kind = a.end_reason.split(":", 1)[1]
        if kind not in FAULT_KINDS:
            continue
        act = acts.get(a.attempt + 1)
        cause = act.details.get("cause_node") if act is not None else None
        before = members.get(a.attempt, [])
        node = before.index(cause) if cause in before else 0
        out.append(PlannedFault(at=max(0.0, a.fault_wall - rep.start_wall), kind=kind, node=node))
    return out


def measure_run(run_dir: str | os.PathLike[str]) -> Measured:
    """Read the run's ledger (every writer's file, merged) and measure it; :class:`PlanInputError` with one line
    when it cannot."""
    if not os.path.isdir(run_dir):
        raise PlanInputError(f"run directory {run_dir} does not exist; pass the --run-dir the job was launched "
                             "with, or plan from flags alone")
    try:
        read = read_ledger(run_dir)
    except FileNotFoundError:
        raise PlanInputError(f"no ledger in {run_dir} (expected events.jsonl and its writers' events.*.jsonl "
                             "there); pass the run directory the job was launched with") from None
    except OSError as e:
        raise PlanInputError(f"cannot read the ledger in {run_dir}: {e.strerror or e}") from None
    if not read.events:
        what = f"none of its {read.lines} line(s) is an event" if read.skipped else "it holds no events"
        raise PlanInputError(f"{read.path} is not a usable ledger: {what}; pass the run directory the job was "
                             "launched with")
    if not any(e.kind is EventKind.STEP for e in read.events):
        raise PlanInputError(f"{read.path} records no training step: there is nothing to measure a step time from "
                             "(give --step-s, or a run that trained)")
    return measure_events(read.events)


def figures_from(measured: Measured | None, overrides: dict[str, Any]) -> Figures:
    """Defaults, then the run's measurements, then the flags; each figure's source is kept."""
    base = Figures()
    kw: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name in ("step_s", "step_gap_s", "save_stall_s", "startup_s", "launch_s", "teardown_s"):
        kw[name] = getattr(base, name)
        source[name] = "default"
    for name in ("restore_s", "detect_s", "recovery_s", "step_extra_s"):
        kw[name] = dict(getattr(base, name))
        for k in kw[name]:
            source[f"{name}[{k}]"] = "default"
    for layer, tag in ((measured.figures if measured else {}, "ledger"), (overrides, "flag")):
        for name, v in layer.items():
            if v is None:
                continue
            if isinstance(v, dict):
                for k, x in v.items():
                    if x is not None:
                        kw.setdefault(name, {})[k] = x
                        source[f"{name}[{k}]"] = tag
            else:
                kw[name] = v
                source[name] = tag
    _bound_restore(kw["restore_s"], source)
    kw["policy"] = measured.policy if measured else None
    return Figures(**kw, source=source)


def _bound_restore(restore: dict[str, float], source: dict[str, str]) -> None:
    """Keep the tiers in their order (local ≤ peer ≤ persistent) around the restore times that were measured
    or given: a default must not contradict them.

    Why: a restore is labelled with the slowest tier it read from, and in a job of several nodes a restart in
    place reads its partner's replica (the peer tier, kept on its own disk) besides its local copy, so such a
    run measures only ``peer``. The plan restarts in place from ``local``, which then kept its 10 s default:
    a run that restored in 0.4 s was planned at 10 s per restart (ten times the measured restore badput)."""
    known = {t: restore[t] for t in TIERS if source.get(f"restore_s[{t}]", "default") != "default"}
    for i, t in enumerate(TIERS):
        if t in known:
            continue
        slower = [(known[x], x) for x in TIERS[i + 1:] if x in known]
        faster = [(known[x], x) for x in TIERS[:i] if x in known]
        if slower and restore[t] > min(slower)[0]:
            restore[t], by = min(slower)
        elif faster and restore[t] < max(faster)[0]:
            restore[t], by = max(faster)
        else:
            continue
        source[f"restore_s[{t}]"] = f"{source[f'restore_s[{by}]']}:{by}"
