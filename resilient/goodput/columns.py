"""A run's events as the goodput calculator keeps them: STEP records in columns, everything else as events.

A ledger is mostly rank 0's STEP records, one a step: a million of them for twelve days of one-second steps. As
:class:`~resilient.events.api.Event` objects with their details they take about a kilobyte each, and a report
that walks them one by one takes seconds. Here each STEP record is five numbers in typed arrays (about 40 bytes)
that the calculator reads as NumPy arrays; the other kinds (a few per attempt, save and restore) stay events.
Something that keeps a run's events for long (the Prometheus collector) keeps a :class:`ReportInputs` and adds
what it reads as it reads it.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from resilient.events.api import Event, EventKind

NO_ATTEMPT = -(2**63)  # an attempt column's None


def detail_number(d: dict, key: str, default: float = 0.0) -> float:
    """``d[key]`` as a finite float, else ``default`` (a detail may hold anything JSON does: 10**400 too)."""
    v = d.get(key, default)
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return default
    return f if math.isfinite(f) else default


@dataclass(frozen=True)
class StepColumns:
    """Every STEP record, in arrival order: one row a record."""

    wall: np.ndarray  # float64
    seconds: np.ndarray  # float64: the record's ``seconds`` (0 where absent or not a finite number)
    step: np.ndarray  # float64: the record's ``step``; inf where it is not a finite number; NaN where absent
    attempt: np.ndarray  # int64: the record's attempt; NO_ATTEMPT for None
    node: np.ndarray  # int32: an index into ``nodes``
    seq: np.ndarray  # int64: the record's place in the order events were added (shared with the other events)
    nodes: tuple[str | None, ...]

    def __len__(self) -> int:
        return len(self.wall)

    def take(self, idx: np.ndarray) -> "StepColumns":
        return StepColumns(self.wall[idx], self.seconds[idx], self.step[idx], self.attempt[idx], self.node[idx],
                           self.seq[idx], self.nodes)


class ReportInputs:
    """Events added one by one or in bulk (``add``/``extend``); ``others`` and ``others_seq`` hold the events
    that are not STEP records, ``steps()`` the STEP records as columns."""

    def __init__(self, events: Iterable[Event] = ()):
        self.others: list[Event] = []
        self.others_seq: list[int] = []
        self._wall = array("d")
        self._seconds = array("d")
        self._step = array("d")
        self._attempt = array("q")
        self._node = array("i")
        self._seq = array("q")
        self._nodes: dict[str | None, int] = {}
        self._n = 0
        self.extend(events)

    def __len__(self) -> int:
        return self._n

    @property
    def step_count(self) -> int:
        return len(self._wall)

    def add(self, ev: Event) -> None:
        if ev.kind is EventKind.STEP:
            d = ev.details
            a = ev.attempt
            self._row(ev.node, a if isinstance(a, int) and not isinstance(a, bool) and -(2**63) < a < 2**63
                      else NO_ATTEMPT, detail_number(d, "step", math.inf) if "step" in d else math.nan,
                      detail_number(d, "seconds"), ev.wall)
        else:
            self.others.append(ev)
            self.others_seq.append(self._n)
            self._n += 1

    def add_step(self, node: str | None, attempt: int | None, step: int, seconds: float, wall: float) -> None:
        """A STEP record given as its numbers (a ledger reader's fast path: ``read_ledgers(..., into=self)``):
        what ``add`` of that record as an event keeps."""
        # the reader's match bounds both numbers (an int of at most 18 digits, finite seconds): no check per line
        self._row(node, NO_ATTEMPT if attempt is None else attempt, float(step), seconds, wall)

    def _row(self, node: str | None, attempt: int, step: float, seconds: float, wall: float) -> None:
        self._wall.append(wall)
        self._seconds.append(seconds)
        self._step.append(step)
        self._attempt.append(attempt)
        code = self._nodes.get(node)
        if code is None:
            code = self._nodes[node] = len(self._nodes)
        self._node.append(code)
        self._seq.append(self._n)
        self._n += 1

    def extend(self, events: Iterable[Event]) -> "ReportInputs":
        for ev in events:
            self.add(ev)
        return self

    def steps(self) -> StepColumns:
        """The STEP records as arrays (copies: adding more later does not change them)."""
        return StepColumns(np.array(self._wall, dtype=np.float64), np.array(self._seconds, dtype=np.float64),
                           np.array(self._step, dtype=np.float64), np.array(self._attempt, dtype=np.int64),
                           np.array(self._node, dtype=np.int32), np.array(self._seq, dtype=np.int64),
                           tuple(self._nodes))

    def nbytes(self) -> int:
        """Bytes the STEP columns take (the other events not counted)."""
        return sum(a.itemsize * len(a) for a in (self._wall, self._seconds, self._step, self._attempt, self._node,
                                                  self._seq))


@dataclass(frozen=True)
class StepPoints:
    """The STEP records as a figure draws them: in wall-time order (ties in the order added), the step number 0
    where a record has none (``step`` is NaN only where it was not a finite number: such a record is not placed on
    the step axis), and which records were redone later (a later record of the same or an earlier step)."""

    wall: np.ndarray
    seconds: np.ndarray
    step: np.ndarray
    redone: np.ndarray  # bool

    @classmethod
    def of(cls, source: "Iterable[Event] | ReportInputs") -> "StepPoints":
        inputs = source if isinstance(source, ReportInputs) else ReportInputs(source)
        cols = inputs.steps()
        order = np.argsort(cols.wall, kind="stable")
        step = cols.step[order]
        step = np.where(np.isnan(step), 0.0, step)  # no step number: drawn at 0, as a record of step 0
        step = np.where(np.isfinite(step), step, np.nan)  # not a number: on no step axis
        # redone: some later record has a step number at or below this one's
        later = np.where(np.isnan(step), np.inf, step)[::-1]
        low = np.minimum.accumulate(np.concatenate(([np.inf], later[:-1])))[::-1] if len(step) else later
        return cls(cols.wall[order], cols.seconds[order], step, ~np.isnan(step) & (step >= low))
