"""Which steps a run saved where, which saves failed, and what happened to its fleet: read from its ledger for
``resilient goodput`` and for the launcher's closing lines (which import this without the calculator and NumPy:
an exit must be quick)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from resilient.events.api import Event, EventKind


@dataclass
class TierSaves:
    """What one tier got of a run's saves, from its CKPT_TIER_DONE records."""

    tier: str
    count: int
    newest: int | None


@dataclass
class TierFailures:
    """What went wrong on one tier, from its CKPT_TIER_FAILED records: a save or restore that tier did not do (the
    step may well be on another tier: a failed save is one that reached none)."""

    tier: str
    count: int  # records
    steps: list[int]  # the steps they name (a failure at a restore's probe names none)
    first_error: str


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
    snapshots_skipped: list[int] = field(default_factory=list)  # steps whose node-memory snapshot a rank skipped
    skip_reason: str | None = None  # the first skip's reason
    # ranks whose snapshot tier turned itself off (a full or missing memory directory, a state it cannot copy): their
    # restarts go to the disk tiers
    snapshots_off: list[int] = field(default_factory=list)
    off_reason: str | None = None  # the first rank's reason
    # every tier's failures, a failed save's included: an upload that failed while the local tier got the step is no
    # failed save, and would otherwise be seen by nobody
    tier_failures: dict[str, TierFailures] = field(default_factory=dict)
    tier_failure_first: str | None = None  # the earliest of them: "tier: error"
    # the upload processes' failures (CKPT_UPLOAD_PROCESS): no step is lost by them (the upload thread sends), but each
    # costs the training process the interpreter lock they were there to spare
    upload_process_failures: int = 0  # records: deaths, and processes turned off for the run
    upload_process_off: list[int] = field(default_factory=list)  # ranks whose uploads go from the thread for the run
    upload_process_first: str | None = None  # the earliest record's error

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
        if (not self.attempted and not self.tiers and not self.failed and not self.state_undefined
                and not self.snapshots_skipped and not self.snapshots_off and not self.tier_failures
                and not self.upload_process_failures):
            return []
        where = "; ".join(f"{t.tier} {t.count} step(s), newest {t.newest}"
                          for t in sorted(self.tiers.values(), key=lambda t: _tier_order(t.tier)))
        out = [f"checkpoints: {len(self.attempted)} save(s); {where or 'no tier holds any step'}"]
        if self.failed:
            out.append(f"checkpoints: {len(self.failed)} failed save(s) (reached no tier): steps "
                       f"{_steps_text(self.failed)}; first error: {self.first_error or 'unknown'}")
        if self.restore_missing:
            out.append(f"checkpoints: a restart found no checkpoint although steps {_steps_text(self.restore_missing)} "
                       "were saved before; it started from step 0")
        if self.state_undefined:
            out.append(f"checkpoints: state undefined: {self.state_undefined}")
        if self.snapshots_skipped:
            out.append(f"checkpoints: {len(self.snapshots_skipped)} snapshot(s) in node memory skipped: steps "
                       f"{_steps_text(self.snapshots_skipped)}; first: {self.skip_reason or 'unknown'}")
        if self.tier_failures:
            fs = sorted(self.tier_failures.values(), key=lambda f: _tier_order(f.tier))
            out.append("checkpoints: tier failures: " + ", ".join(
                f"{f.tier} {f.count}" + (f" (step{'s' if len(f.steps) > 1 else ''} {_steps_text(f.steps)})"
                                         if f.steps else "") for f in fs) + f"; first: {self.tier_failure_first}")
        if self.snapshots_off:
            out.append(f"checkpoints: snapshots in node memory off on {len(self.snapshots_off)} rank(s) ("
                       f"{_steps_text(self.snapshots_off)}), their restarts restore from disk; first: "
                       f"{self.off_reason or 'unknown'}")
        if self.upload_process_failures:
            off = (f"; off for the rest of the run on {len(self.upload_process_off)} rank(s) "
                   f"({_steps_text(self.upload_process_off)})" if self.upload_process_off else "")
            out.append(f"checkpoints: upload process failed {self.upload_process_failures} time(s), its uploads sent "
                       f"from the training process instead{off}; first: {self.upload_process_first or 'unknown'}")
        return out

    def to_json(self) -> dict[str, object]:
        return {"attempted": len(self.attempted), "newest": self.newest(),
                "tiers": {t: {"count": v.count, "newest": v.newest} for t, v in self.tiers.items()},
                "failed": {"count": len(self.failed), "steps": list(self.failed), "first_error": self.first_error},
                "stopped": self.stopped, "restore_missing": list(self.restore_missing),
                "state_undefined": self.state_undefined,
                "snapshots_skipped": {"count": len(self.snapshots_skipped), "steps": list(self.snapshots_skipped),
                                      "first_reason": self.skip_reason},
                "snapshots_off": {"ranks": list(self.snapshots_off), "first_reason": self.off_reason},
                "tier_failures": {t: {"count": f.count, "steps": list(f.steps), "first_error": f.first_error}
                                  for t, f in self.tier_failures.items()},
                "tier_failure_first": self.tier_failure_first,
                "upload_process": {"failures": self.upload_process_failures, "off_ranks": list(self.upload_process_off),
                                   "first_error": self.upload_process_first}}


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


def _tier_order(tier: str) -> tuple[int, str]:
    """The fastest tier first in a report's lines; others after, by name."""
    return {"local": 0, "peer": 1, "persistent": 2}.get(tier, 9), tier


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
                                      EventKind.CKPT_RESTORE_MISSING, EventKind.CKPT_UPLOAD_PROCESS})


def checkpoint_summary(events: Iterable[Event]) -> CheckpointSummary:
    """Which steps were saved where, and which saves failed, from a run's events (see CheckpointSummary)."""
    tally = CheckpointTally()
    for ev in events:
        tally.add(ev)
    return tally.summary()


@dataclass
class _Trouble:
    """One tier's CKPT_TIER_FAILED records as a tally adds them."""

    first: tuple[tuple[float, int], str]  # ((wall, seq), error) of the earliest
    records: int = 0
    steps: set[int] = field(default_factory=set)


class CheckpointTally:
    """:func:`checkpoint_summary` kept up to date one event at a time, in any order: a follower of a growing ledger
    (the launcher's, see :class:`resilient.launcher.report.CheckpointFollower`) adds what each look found, and at
    the end reads the summary without reading the run again. Saved steps are kept as sets (what the summary counts);
    where the summary names the first of something (the first failed save's error, the stop message), the earliest
    by wall wins, ties going to the one added first: the answer of sorting every event by wall first."""

    def __init__(self) -> None:
        self._seq = 0  # order of adding: the tie-break a stable sort on wall gives
        self._attempted: set[int] = set()
        self._done: dict[str, set[int]] = defaultdict(set)
        self._rank0 = False
        # step -> ((wall, seq), error), the earliest kept
        self._failed_explicit: dict[int, tuple[tuple[float, int], str]] = {}
        self._tier_failed: dict[int, tuple[tuple[float, int], str]] = {}
        self._stopped: tuple[tuple[float, int], str] | None = None
        self._undefined: tuple[tuple[float, int], str] | None = None
        self._missing: set[int] = set()
        self._skipped: set[int] = set()
        self._skip_reason: tuple[tuple[float, int], str] | None = None
        self._off: set[int] = set()
        self._trouble: dict[str, _Trouble] = {}
        self._off_reason: tuple[tuple[float, int], str] | None = None
        self._up_failures = 0
        self._up_off: set[int] = set()
        self._up_first: tuple[tuple[float, int], str] | None = None

    def add(self, ev: Event) -> None:
        self._seq += 1
        at = (ev.wall, self._seq)
        step = _step_of(ev)
        k = ev.kind
        if k is EventKind.CKPT_UPLOAD_PROCESS:
            self._up_failures += 1
            if ev.details.get("state") == "off" and ev.rank is not None:
                self._up_off.add(ev.rank)
            self._up_first = _earliest(self._up_first, at, str(ev.details.get("error") or "unknown"))
            return
        if k is EventKind.CKPT_TIER_FAILED and ev.details.get("skipped") is True:
            # a snapshot skipped, the tier still on: no save of that step failed (a disk save of the same step is
            # judged by its own records)
            if step is not None:
                self._skipped.add(step)
            self._skip_reason = _earliest(self._skip_reason, at, str(ev.details.get("error") or "skipped"))
            return
        if k is EventKind.CKPT_TIER_FAILED and step is None and ev.details.get("tier") == "snapshot":
            # the tier turned off on a rank (no step of its own): its saves go on on the disk tiers
            if ev.rank is not None:
                self._off.add(ev.rank)
            self._off_reason = _earliest(self._off_reason, at, str(ev.details.get("error") or "off"))
            return
        if k is EventKind.CKPT_TIER_FAILED:
            tier, err = str(ev.details.get("tier") or "unknown"), str(ev.details.get("error") or "unknown")
            t = self._trouble.get(tier)
            if t is None:
                t = self._trouble[tier] = _Trouble(first=(at, err))
            else:
                t.first = _earliest(t.first, at, err)
            t.records += 1
            if step is not None:
                t.steps.add(step)
        if k is EventKind.CKPT_TIER_FAILED and ev.details.get("state_undefined") is True:
            self._undefined = _earliest(self._undefined, at,
                                        str(ev.details.get("error") or "no usable step on any tier"))
        if k is EventKind.CKPT_SAVE and step is not None:
            self._attempted.add(step)
            self._rank0 = self._rank0 or ev.rank in (0, None)
        elif k is EventKind.CKPT_TIER_DONE and step is not None:
            self._done[str(ev.details.get("tier"))].add(step)
            self._rank0 = self._rank0 or ev.rank in (0, None)
        elif k is EventKind.CKPT_SAVE_FAILED and step is not None:
            self._failed_explicit[step] = _earliest(
                self._failed_explicit.get(step), at,
                f"{ev.details.get('tier') or 'every tier'}: {ev.details.get('error')}")
        elif k is EventKind.CKPT_TIER_FAILED and step is not None:
            self._tier_failed[step] = _earliest(self._tier_failed.get(step), at,
                                                f"{ev.details.get('tier')}: {ev.details.get('error')}")
        elif k is EventKind.CKPT_STOP:
            self._stopped = _earliest(self._stopped, at, str(ev.details.get("message") or ""))
        elif k is EventKind.CKPT_RESTORE_MISSING:
            self._missing.update(s for s in ev.details.get("attempted_steps") or () if isinstance(s, int))

    def summary(self) -> CheckpointSummary:
        out = CheckpointSummary()
        reached = set().union(*self._done.values()) if self._done else set()
        # a step that reached a tier later (saved again after a restart) is not a lost save
        failed = {s: e for s, (_, e) in self._failed_explicit.items() if s not in reached}
        for s, (_, e) in self._tier_failed.items():
            if s in self._attempted and s not in reached and s not in failed:
                failed[s] = e
        out.attempted = sorted(self._attempted)
        out.tiers = {t: TierSaves(t, len(s), max(s)) for t, s in self._done.items()}
        out.failed = sorted(failed)
        out.first_error = failed[out.failed[0]] if out.failed else None
        out.stopped = self._stopped[1] if self._stopped is not None else None
        out.state_undefined = self._undefined[1] if self._undefined is not None else None
        out.restore_missing = sorted(self._missing)
        out.rank0 = self._rank0
        out.snapshots_skipped = sorted(self._skipped)
        out.skip_reason = self._skip_reason[1] if self._skip_reason is not None else None
        out.snapshots_off = sorted(self._off)
        out.off_reason = self._off_reason[1] if self._off_reason is not None else None
        out.tier_failures = {tier: TierFailures(tier, t.records, sorted(t.steps), t.first[1])
                             for tier, t in self._trouble.items()}
        if self._trouble:
            tier, t = min(self._trouble.items(), key=lambda kv: kv[1].first[0])
            out.tier_failure_first = f"{tier}: {t.first[1]}"
        out.upload_process_failures = self._up_failures
        out.upload_process_off = sorted(self._up_off)
        out.upload_process_first = self._up_first[1] if self._up_first is not None else None
        return out


def _earliest(kept: tuple[tuple[float, int], str] | None, at: tuple[float, int],
              text: str) -> tuple[tuple[float, int], str]:
    return kept if kept is not None and kept[0] <= at else (at, text)
