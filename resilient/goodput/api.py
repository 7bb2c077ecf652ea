"""Contract of goodput accounting: the report, its badput categories and errors.

A :class:`GoodputReport` splits a run's wall-clock time into productive time and the badput
categories of :class:`Badput`; productive time plus every category equals the wall time.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any


class Badput(str, enum.Enum):
    """Where non-productive wall time went. The values are the JSON keys of ``badput_seconds``."""

    STARTUP = "startup"  # launch (or re-launch) to the first step of an attempt, incl. first-step warm-up
    CHECKPOINT_SAVE_STALL = "checkpoint_save_stall"  # training blocked by a save
    CHECKPOINT_RESTORE = "checkpoint_restore"  # loading a checkpoint
    WASTED_PROGRESS = "wasted_progress"  # steps computed, then lost to a disruption and redone
    DETECTION = "detection"  # fault happened, not yet noticed
    RECOVERY = "recovery"  # fault noticed, the next attempt not yet launched
    STRAGGLER_SLOWDOWN = "straggler_slowdown"  # step time above the attempt's norm while a straggler was flagged
    # step time above the clean step time while background checkpoint work (write, replication, upload) ran
    CHECKPOINT_INTERFERENCE = "checkpoint_interference"
    STEP_SLOWDOWN = "step_slowdown"  # any other step time above the clean step time (noise, contention)
    WAITING_FOR_SPARES = "waiting_for_spares"  # the job idles until enough nodes are back
    OTHER = "other"  # everything else: gaps between steps, teardown, time between separate launches


CATEGORIES: tuple[str, ...] = tuple(b.value for b in Badput)
PRODUCTIVE = "productive"


class GoodputError(Exception):
    """The ledger cannot give a report; the message says why and what to check."""


class EmptyLedgerError(GoodputError):
    """The ledger holds no events (yet)."""


@dataclass(frozen=True)
class Segment:
    """A stretch of wall time given to one category (``productive`` or a :class:`Badput` value)."""

    start: float
    end: float
    category: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TimelineArrays:
    """The time line as arrays, a segment an entry, in time order: ``start`` and ``end`` (wall seconds, float64)
    and ``code``, an index into ``(PRODUCTIVE, *CATEGORIES)``. What :attr:`GoodputReport.timeline` holds as one
    object a segment (two a step: 2 million objects at a million steps), for readers of a long run. Typed ``Any``:
    numpy arrays, and this contract file stays free of numpy."""

    start: Any
    end: Any
    code: Any

    def __len__(self) -> int:
        return len(self.start)


@dataclass
class AttemptReport:
    """One attempt (one set of worker processes) of one launch ("session") of the run.

    An attempt's time runs from its launch to the next attempt's launch, so the detection and
    recovery after its fault are charged to it.
    """

    session: int
    attempt: int
    start: float
    end: float
    world_size: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0  # step records in this attempt
    steps_redone: int = 0  # of which were lost and recomputed later
    productive_seconds: float = 0.0
    badput_seconds: dict[str, float] = field(default_factory=dict)
    end_reason: str = "running"  # "completed", "fault:<kind>", "restart", "stopped", "running"
    fault_wall: float | None = None
    detect_wall: float | None = None
    restart_cause: str | None = None
    # the attempt's clean step time (median of steps with no checkpoint work in flight): each step is
    # productive for at most this long; clean_step_source says where it came from ("attempt", "run": the
    # other attempts' clean steps, "all_steps": no clean step anywhere, the median of every step)
    clean_step_seconds: float | None = None
    clean_step_source: str | None = None

    @property
    def wall_seconds(self) -> float:
        return self.end - self.start


@dataclass
class GoodputReport:
    goodput: float  # productive_seconds / wall_seconds, in [0, 1]
    wall_seconds: float
    productive_seconds: float
    badput_seconds: dict[str, float]  # every Badput value → seconds; sums with productive to wall
    disruptions: int
    attempts: list[AttemptReport]
    start_wall: float
    end_wall: float
    in_progress: bool
    restarts: int = 0
    sessions: int = 1
    last_step: int | None = None
    steps_recorded: int = 0
    steps_redone: int = 0
    timeline: list[Segment] = field(default_factory=list, repr=False)
    # the same time line as arrays (the figure draws from them), filled when a time line was asked for: with
    # ``timeline="arrays"`` (see compute_report) only these, without ``timeline``'s object a segment
    timeline_arrays: TimelineArrays | None = field(default=None, repr=False, compare=False)
    skipped_lines: int = 0  # malformed ledger lines left out of the accounting
    # why the ledger lost events (a writer could not write it: full disk, quota), None when it lost none: its
    # last events may be missing, so "in progress" may be a run that ended
    ledger_incomplete: str | None = None

    def __post_init__(self) -> None:
        missing = set(CATEGORIES) - set(self.badput_seconds)
        if missing:
            raise ValueError(f"badput_seconds lacks categories {sorted(missing)}; give every Badput value")
        if not (0.0 <= self.goodput <= 1.0) or math.isnan(self.goodput):
            raise ValueError(f"goodput must be in [0, 1], got {self.goodput}")

    @property
    def badput_total_seconds(self) -> float:
        return math.fsum(self.badput_seconds.values())

    def to_json(self, *, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "goodput": self.goodput,
            "wall_seconds": self.wall_seconds,
            "productive_seconds": self.productive_seconds,
            "badput_seconds": dict(self.badput_seconds),
            "disruptions": self.disruptions,
            "restarts": self.restarts,
            "sessions": self.sessions,
            "in_progress": self.in_progress,
            "start_wall": self.start_wall,
            "end_wall": self.end_wall,
            "last_step": self.last_step,
            "steps_recorded": self.steps_recorded,
            "steps_redone": self.steps_redone,
            "skipped_lines": self.skipped_lines,
            "ledger_incomplete": self.ledger_incomplete is not None,
            "ledger_incomplete_reason": self.ledger_incomplete,
            "attempts": [dict(asdict(a), wall_seconds=a.wall_seconds) for a in self.attempts],
        }
        if timeline:
            d["timeline"] = [asdict(s) for s in self.timeline]
        return d
