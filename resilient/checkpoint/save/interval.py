"""``--ckpt-interval auto``: the checkpoint interval from the Young/Daly optimum, re-evaluated as the run goes.

With δ the blocking cost of one save and M the mean time between interruptions, the expected loss
per unit of time with saves every T seconds of training is about δ/T (stalls) + T/(2M) (work redone
after an interruption), minimal at T ≈ √(2·δ·M); Daly's refinement subtracts δ. We use
T = √(2·δ·M) − δ, and T = M once δ ≥ M/2 (where the formula stops making sense).

* δ is the cost of one save: the median of its recent measured blocking times plus the median of its
  *interference*, the time its background work (local write, replication, upload) added to the steps it
  overlapped, beyond the clean step time (steps with no checkpoint work in flight). A background write
  competes with training for CPU and memory bandwidth; counting only the blocking part would make saves
  look nearly free and the interval too short. Interference is learnt from the run's ledger (the steps'
  records and the checkpointer's events, see :func:`save_costs`) when the tuner follows one
  (:meth:`IntervalTuner.from_run_dir`); without a ledger, δ is the blocking time alone. Before the first
  save, one step time stands in for δ (the first save then measures it); with a ledger, one step time stands in
  for the interference until a save's is measured (the blocking part alone made the first intervals 6-9 steps
  where 22-38 followed). An attempt's first save is cold and left out of the interference (3-6 times what the
  next cost: it made the next interval 37-44 steps where 24-34 followed).
* M is the posterior mean of a gamma prior on the interruption rate: ``prior_weight`` pseudo-
  interruptions over ``prior_weight × prior_mtbf_s`` seconds, updated with the observed uptime and
  interruptions — the configured prior rules until the run has seen enough to overrule it. Only the
  interruptions that needed a disk tier count: a restart that resumed from the snapshot tier (node memory,
  newer than any save) lost no work back to the last save, so it says nothing about how often saves are
  needed (the multi-level view: each tier's interval follows the failures only that tier covers). A run
  without snapshots counts every restart.
* The interval in steps is T ÷ median step time, bounded by ``[min_steps, max_steps]``, and only moves
  when the optimum moved by more than ``hysteresis`` (goodput is flat near the optimum, so flapping
  would buy nothing and cost reproducibility).
* Persistent uploads run in the background and block nothing, so the persistent tier is uploaded as
  often as uploads keep up with: every ⌈headroom × upload time ÷ local interval time⌉-th local save
  (``persistent_prior`` until an upload has been measured).

Every rank must save on the same steps: evaluate the tuner on one rank and broadcast its answer, or
feed every rank the same observations (for example the maximum over ranks).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from resilient import env
from resilient.events.api import Event, EventKind
from resilient.events.follow import LedgerTail, StepTally
from resilient.events.spans import CKPT_KINDS, finite, merge_spans, overlap_seconds, save_spans, stall_spans
from resilient.checkpoint.save.tuner_cache import LedgerSums, TunerCache, read_cache, write_cache

logger = logging.getLogger(__name__)

# seconds; the tuner's prior MTBF when a run gives none in code (``resilient-run`` has no flag for it)
PRIOR_MTBF_ENV = env.CKPT_PRIOR_MTBF

_READ_KINDS = frozenset({*CKPT_KINDS, EventKind.STEP, EventKind.RESTART, EventKind.CKPT_RESTORE})
_START_SLICE_BYTES = 8 << 20
_RECENT_BYTES = 2 << 20  # the newest lines read as events at a restart: more than the 4096 the follower keeps
_UNMEASURED_STEPS = 10  # the interval while no step time is known yet
# seconds between two looks at the ledger while no save's interference is measured yet (then follow_every_s): a
# save's effect on the steps shows only once its background work ended, and the first decisions wait for it
_UNMEASURED_FOLLOW_S = 0.1
_COUNTED_ONLY = frozenset({EventKind.RESTART, EventKind.CKPT_RESTORE})  # summed (LedgerSums), not kept as events


@dataclass(frozen=True)
class SaveCosts:
    """What background checkpoint work cost the steps, from a ledger (see :func:`save_costs`)."""

    clean_step_seconds: float | None  # median step with no save in flight (None: no such step)
    interference: list[float] = field(default_factory=list)  # per finished save, in save order
    clean_steps: int = 0
    overlapped_steps: int = 0
    # per finished save, beside interference: is it the first of its attempt among the events read (a process's first
    # save is cold: its staging buffers, files and copy kernels are new, 3-6 times what the next ones cost)
    firsts: list[bool] = field(default_factory=list)


def save_costs(events: Iterable[Event]) -> SaveCosts:
    """The clean step time and each finished save's interference: the sum, over the steps its background
    work overlapped, of their time beyond the clean step time (the save's own blocking time taken out of the
    step that contains it). Each step is charged to one save at most; an attempt's first step (warm-up) is
    neither clean nor charged."""
    evs = list(events)
    stalls = stall_spans(evs)
    stall_ends = [e for _, e in stalls]
    per_save = save_spans(evs)
    bg = merge_spans(sp for spans, _ in per_save.values() for sp in spans)
    bg_ends = [e for _, e in bg]
    seen_attempts: set[Any] = set()
    steps: list[tuple[float, float, float]] = []  # (start, end, seconds net of stalls)
    for ev in sorted((e for e in evs if e.kind is EventKind.STEP), key=lambda e: e.wall):
        d = finite(ev.details.get("seconds"))
        if d is None or d <= 0:
            continue
        if ev.attempt not in seen_attempts:  # warm-up: compilation, first touches
            seen_attempts.add(ev.attempt)
            continue
        a = ev.wall - d
        steps.append((a, ev.wall, max(0.0, d - overlap_seconds(a, ev.wall, stalls, stall_ends))))
    clean = [net for a, b, net in steps if overlap_seconds(a, b, bg, bg_ends) <= 0]
    if not clean:
        return SaveCosts(None, [], 0, len(steps))
    c = statistics.median(clean)
    ends = [b for _, b, _ in steps]
    taken: set[int] = set()
    out: list[float] = []
    finished = sorted(((min(s for s, _ in spans), key[0], spans) for key, (spans, done) in per_save.items()
                       if done and spans), key=lambda x: x[0])
    firsts: list[bool] = []
    saw: set[Any] = set()
    for _, attempt, spans in finished:
        firsts.append(attempt not in saw)
        saw.add(attempt)
        excess = 0.0
        for s0, s1 in spans:
            i = bisect.bisect_right(ends, s0)
            while i < len(steps) and steps[i][0] < s1:
                if i not in taken:
                    taken.add(i)
                    excess += max(0.0, steps[i][2] - c)
                i += 1
        out.append(excess)
    return SaveCosts(c, out, len(clean), len(steps) - len(clean), firsts)


class _LedgerFollower:
    """The step and checkpoint events of a growing ledger, read incrementally, the newest ``keep`` kept, and the
    sums of everything read (``sums``: what a restarted tuner takes from the ledger, see :mod:`.tuner_cache`)."""

    def __init__(self, run_dir: str | os.PathLike[str], keep: int = 4096, sums: LedgerSums | None = None):
        self.run_dir = run_dir
        # rescan: a directory of thousands of writers' files is listed again only when its time changed
        self._tail = LedgerTail(run_dir, rescan=30.0)
        self.events: deque[Event] = deque(maxlen=keep)
        self.sums = sums if sums is not None else LedgerSums()
        self.bytes_read = 0  # over every read_new

    def resume(self, cache: TunerCache) -> None:
        """Go on from where a tuner that wrote ``cache`` stood (its sums, its newest events, its marks)."""
        self._tail.resume(cache.marks)
        self.sums = cache.sums
        self.events.extend(cache.events)

    def cache(self) -> TunerCache:
        """Where the follower stands now: a copy, which later reads leave as it is."""
        return TunerCache(self._tail.marks(), self.sums.copy(), list(self.events))

    def read_new(self, max_bytes: int | None = 16 << 20, *, steps: StepTally | None = None,
                 leave: int = 0) -> list[Event]:
        """Keep what was written since the last call; returns the new step, checkpoint and restart events
        (with ``steps``: STEP lines tallied there instead, to ``leave`` bytes before each file's end)."""
        new = self._tail.read_new(max_bytes, kinds=_READ_KINDS, steps=steps, leave=leave)
        self.bytes_read += self._tail.last_read
        self.events.extend(ev for ev in new if ev.kind not in _COUNTED_ONLY)
        self.sums.absorb(new)
        return new

    def spacing(self, base: float) -> float:
        """Seconds between two looks of a follower that would look every ``base`` (see ``LedgerTail.spacing``)."""
        return self._tail.spacing(base)

    def caught_up(self) -> bool:
        """Whether the last read_new found nothing new to read."""
        return self._tail.last_read == 0


class IntervalTuner:
    def __init__(self, prior_mtbf_s: float = 3600 * 6, min_steps: int = 1, max_steps: int = 10000, *,
                 prior_weight: float = 0.5, window: int = 256, hysteresis: float = 0.1,
                 persistent_prior: int = 10, upload_headroom: float = 1.5, max_persistent_every: int = 1000):
        if not (prior_mtbf_s > 0 and math.isfinite(prior_mtbf_s)):
            raise ValueError(f"prior_mtbf_s must be a positive number of seconds, got {prior_mtbf_s!r}")
        if not (1 <= int(min_steps) <= int(max_steps)):
            raise ValueError(f"need 1 <= min_steps <= max_steps, got min_steps={min_steps}, max_steps={max_steps}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0 (pseudo-interruptions of the prior), got {prior_weight}")
        if not (0 <= hysteresis < 1):
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}")
        if persistent_prior < 1 or max_persistent_every < 1 or upload_headroom <= 0:
            raise ValueError("persistent_prior and max_persistent_every must be >= 1 and upload_headroom > 0")
        self.prior_mtbf_s = float(prior_mtbf_s)
        self.min_steps, self.max_steps = int(min_steps), int(max_steps)
        self.prior_weight = float(prior_weight)
        self.hysteresis = hysteresis
        self.persistent_prior = int(persistent_prior)
        self.upload_headroom = upload_headroom
        self.max_persistent_every = int(max_persistent_every)
        self._steps: deque[float] = deque(maxlen=window)
        self._saves: deque[float] = deque(maxlen=max(8, window // 8))
        self._uploads: deque[float] = deque(maxlen=max(8, window // 8))
        self._interference: deque[float] = deque(maxlen=max(8, window // 8))
        self._clean_step: float | None = None
        self._follower: _LedgerFollower | None = None
        self._followed_at = -math.inf
        self.follow_every_s = 1.0  # re-read the ledger at most this often (it is read in the save thread)
        # what the tuner took from the ledger, written beside it at most this often (see tuner_cache); the first
        # time at the first look after the start
        self.cache_every_s = 60.0
        self._cached_at = -math.inf
        # (bytes of the ledger read before the first step, whether on from a cache): from_run_dir's, for the ledger
        self._start_read: tuple[int, bool] | None = None
        self._pending_cache: TunerCache | None = None
        self._uptime = 0.0
        self._interruptions = 0
        self._from_snapshots = 0  # of those, restarts that resumed from the snapshot tier
        self._restore_seen = False  # this attempt's restore was observed (at most one counts)
        self._current: int | None = None
        self._last_logged: tuple[int, int] | None = None

    # observations -------------------------------------------------------------------------------
    def observe_step(self, seconds: float) -> None:
        """Wall time of one training step (without the save's blocking time, if you can separate it)."""
        if seconds >= 0 and math.isfinite(seconds):
            self._steps.append(float(seconds))
            self._uptime += seconds

    def observe_save(self, blocking_seconds: float) -> None:
        """Time training was blocked by one save (staging), not the background write."""
        if blocking_seconds >= 0 and math.isfinite(blocking_seconds):
            self._saves.append(float(blocking_seconds))
            self._uptime += blocking_seconds

    def observe_interruption(self, from_snapshot: bool = False) -> None:
        """One disruption of the job (a restart of the workers, for whatever reason); ``from_snapshot``: the
        restart resumed from the snapshot tier, so no work was lost back to the last save."""
        self._interruptions += 1
        if from_snapshot:
            self._from_snapshots += 1

    def observe_restore(self, tier: str | None, covered: bool = False) -> None:
        """Where this attempt's restore came from, once it is known: a restore from the snapshot tier, or from a disk
        tier whose step was newer than every rank's snapshot by less than a snapshot interval (``covered``), means the
        interruption before it (already observed) did not need a disk tier."""
        if self._restore_seen:
            return
        self._restore_seen = True
        if (tier == "snapshot" or covered) and self._from_snapshots < self._interruptions:
            self._from_snapshots += 1

    def observe_upload(self, seconds: float) -> None:
        """Duration of one background upload to the persistent tier."""
        if seconds >= 0 and math.isfinite(seconds):
            self._uploads.append(float(seconds))

    def observe_interference(self, seconds: float) -> None:
        """Time one save's background work added to the steps it overlapped (beyond the clean step time)."""
        if seconds >= 0 and math.isfinite(seconds):
            self._interference.append(float(seconds))

    def observe_uptime(self, seconds: float) -> None:
        """Running time observed outside steps and saves (e.g. earlier attempts read from the ledger)."""
        if seconds > 0 and math.isfinite(seconds):
            self._uptime += seconds

    # estimates ----------------------------------------------------------------------------------
    def step_seconds(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    def blocking_seconds(self) -> float | None:
        return statistics.median(self._saves) if self._saves else None

    def interference_seconds(self) -> float | None:
        self._follow()
        return statistics.median(self._interference) if self._interference else None

    def save_seconds(self) -> float | None:
        """Cost of one save: blocking time plus interference. Until a save's interference is measured, one step time
        stands in for it when the tuner follows a ledger (a background write of the state competes with about a
        step's compute on a busy host; the blocking part alone is a tenth of the cost, measured), and nothing
        without one (nothing will measure it)."""
        block = self.blocking_seconds()
        if block is None:
            return None
        interference = self.interference_seconds()
        if interference is None and self._follower is not None:
            interference = self.step_seconds()
        return block + (interference or 0.0)

    def mtbf_seconds(self) -> float:
        """Mean time between the interruptions that fall back to a disk tier (see the module's docstring)."""
        needed_disk = self._interruptions - self._from_snapshots
        return (self.prior_weight * self.prior_mtbf_s + self._uptime) / (self.prior_weight + needed_disk)

    def optimal_seconds(self) -> float | None:
        """Young/Daly optimum of the training time between two saves, or None before any step is seen."""
        step = self.step_seconds()
        if step is None:
            return None
        delta = self.save_seconds()
        if delta is None:
            delta = step  # a guess until the first save is measured
        m = self.mtbf_seconds()
        if delta >= m / 2:
            return m
        return math.sqrt(2 * delta * m) - delta

    def interval_steps(self) -> int:
        """Local checkpoint interval in steps, bounded; ``_UNMEASURED_STEPS`` before any step is measured. Not a save
        at once: the interval in force at a save sets the next one, so the save after it would come one step later
        and wait for its write (a process's first save is its slowest: 0.2-0.3 s of stall in a 10-s run)."""
        opt = self.optimal_seconds()
        step = self.step_seconds()
        if opt is None or step is None:
            return max(self.min_steps, min(self.max_steps, _UNMEASURED_STEPS))
        raw = opt / step if step > 0 else math.inf
        target = int(round(min(float(self.max_steps), max(float(self.min_steps), raw))))
        cur = self._current
        if cur is None or abs(target - cur) > self.hysteresis * cur or target in (self.min_steps, self.max_steps):
            self._current = target
        self._maybe_log()
        return self._current  # type: ignore[return-value]

    def persistent_every(self) -> int:
        """Upload every N-th local save to the persistent tier."""
        if not self._uploads:
            return self.persistent_prior
        step = self.step_seconds() or 0.0
        local_s = max(1e-9, (self._current or self.interval_steps()) * step)
        n = math.ceil(self.upload_headroom * statistics.median(self._uploads) / local_s)
        return int(min(self.max_persistent_every, max(1, n)))

    def inputs(self) -> dict[str, Any]:
        """Everything the decision is made of (for the CKPT_INTERVAL event and the logs)."""
        return {
            "step_seconds": self.step_seconds(),
            "save_blocking_seconds": self.blocking_seconds(),
            "save_interference_seconds": self.interference_seconds(),
            "save_cost_seconds": self.save_seconds(),
            "clean_step_seconds": self._clean_step,
            "upload_seconds": statistics.median(self._uploads) if self._uploads else None,
            "mtbf_seconds": self.mtbf_seconds(),
            "prior_mtbf_seconds": self.prior_mtbf_s,
            "uptime_seconds": self._uptime,
            "interruptions": self._interruptions,
            "interruptions_from_snapshots": self._from_snapshots,
            "optimal_seconds": self.optimal_seconds(),
            "interval_steps": self._current,
            "min_steps": self.min_steps,
            "max_steps": self.max_steps,
            # what the start cost: a restart that reads on from the cache reads what was written since it
            "ledger_bytes_read_at_start": self._start_read[0] if self._start_read else None,
            "ledger_cache_used": self._start_read[1] if self._start_read else None,
        }

    def _maybe_log(self) -> None:
        key = (self._current or 0, self.persistent_every() if self._uploads else self.persistent_prior)
        if key != self._last_logged:
            self._last_logged = key
            i = self.inputs()
            logger.info("checkpoint interval %d steps (optimum %.1f s: save %.3f s blocking + %.3f s interference, "
                        "MTBF %.0f s from %d interruption(s), %d of them resumed from snapshots, in %.0f s + prior "
                        "%.0f s), persistent every %d",
                        key[0], i["optimal_seconds"] or 0.0, i["save_blocking_seconds"] or 0.0,
                        i["save_interference_seconds"] or 0.0, i["mtbf_seconds"],
                        i["interruptions"], i["interruptions_from_snapshots"], i["uptime_seconds"], self.prior_mtbf_s,
                        key[1])

    def _follow(self, force: bool = False) -> None:
        """Learn the interference of recent saves from the ledger being followed (rate-limited)."""
        f = self._follower
        if f is None:
            return
        now = time.monotonic()
        base = self.follow_every_s if self._interference else min(self.follow_every_s, _UNMEASURED_FOLLOW_S)
        if not force and now - self._followed_at < f.spacing(base):
            return
        self._followed_at = now
        try:
            f.read_new()
            costs = save_costs(f.events)
            if not force and now - self._cached_at >= self.cache_every_s:
                self._cached_at = now
                self._pending_cache = f.cache()  # written by write_cache(), outside the caller's lock
        except Exception as e:  # noqa: BLE001 - a tuner must never stop a save; it keeps what it knew
            logger.debug("reading the ledger for save interference failed: %s", e)
            return
        if costs.clean_step_seconds is not None:
            self._clean_step = costs.clean_step_seconds
            self._interference.clear()
            # what the next saves will cost: an attempt's first (cold) save left out, the stand-in until a second
            self._interference.extend(x for x, first in zip(costs.interference, costs.firsts) if not first)

    def write_cache(self) -> bool:
        """Write what the tuner took from the ledger beside it, when a look since the last write made it due (at
        most every ``cache_every_s``; see :mod:`.tuner_cache`): a restarted rank 0 then reads on from there. Call it
        outside any lock the training thread takes: it serializes a few thousand events (~20 ms)."""
        pending, self._pending_cache = self._pending_cache, None
        if pending is None or self._follower is None:
            return False
        return write_cache(self._follower.run_dir, pending)

    # restarts ------------------------------------------------------------------------------------
    @classmethod
    def from_run_dir(cls, run_dir: str | os.PathLike[str], **kwargs: Any) -> "IntervalTuner":
        """A tuner that remembers earlier attempts: a restarted worker would otherwise forget every
        interruption it was restarted for. Reads the run's ledger (steps, saves, uploads, restarts)."""
        if "prior_mtbf_s" not in kwargs and os.environ.get(PRIOR_MTBF_ENV):
            raw = os.environ[PRIOR_MTBF_ENV]
            v = finite(raw)
            if v is None or v <= 0:
                raise ValueError(f"{PRIOR_MTBF_ENV}={raw!r} is not a positive number of seconds; "
                                 "unset it or give e.g. 21600 (6 h)")
            kwargs["prior_mtbf_s"] = v
        tuner = cls(**kwargs)
        window, recent = tuner._steps.maxlen or 256, tuner._saves.maxlen or 32
        tuner._follower = follower = _LedgerFollower(run_dir, sums=LedgerSums.sized(window, recent))
        cache = read_cache(run_dir, window, recent)
        if cache is not None:  # what an earlier rank 0 took from the ledger: read on from where it stood
            follower.resume(cache)
        # A week's ledger holds millions of STEP lines, and the whole job waits for rank 0 here. All but the
        # newest _RECENT_BYTES of each file: STEP lines only summed (no event each); then the newest as events,
        # which the follower keeps to learn the recent saves' interference. Read in slices, so that memory is
        # bounded by a slice's events, not the run's (read_new stops after about max_bytes; caught up: 0 read).
        tally = StepTally(recent_max=window)
        for steps in (tally, None):
            while True:
                follower.read_new(max_bytes=_START_SLICE_BYTES, steps=steps,
                                  leave=_RECENT_BYTES if steps is not None else 0)
                if follower.caught_up():
                    break
            if steps is not None:
                follower.sums.add_tally(tally)
        sums = follower.sums
        tuner._steps.extend(sums.steps)
        tuner._uptime += sums.uptime
        tuner._saves.extend(sums.saves)
        tuner._uploads.extend(sums.uploads)
        tuner._follow(force=True)
        for new in sums.restarted_into():
            tuner.observe_interruption(from_snapshot=new in sums.snapshot_attempts)
        # a restore of this attempt already in the ledger (an earlier manager of the same process): counted above
        tuner._restore_seen = _this_attempt() in sums.snapshot_attempts
        tuner._start_read = (follower.bytes_read, cache is not None)
        return tuner


def _this_attempt() -> int | None:
    # the attempt this process's ledger events carry (the Ledger's own rule)
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
