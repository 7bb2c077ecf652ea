"""``--ckpt-interval auto``: the checkpoint interval from the Young/Daly optimum, re-evaluated as the run goes.

With δ the blocking cost of one save and M the mean time between interruptions, the expected loss
per unit of time with saves every T seconds of training is about δ/T (stalls) + T/(2M) (work redone
after an interruption), minimal at T ≈ √(2·δ·M); Daly's refinement subtracts δ. We use
T = √(2·δ·M) − δ, and T = M once δ ≥ M/2 (where the formula stops making sense).

* δ is the median of the recent measured blocking times of saves; before the first save, one step
  time stands in for it (the first save then measures it).
* M is the posterior mean of a gamma prior on the interruption rate: ``prior_weight`` pseudo-
  interruptions over ``prior_weight × prior_mtbf_s`` seconds, updated with the observed uptime and
  interruptions — the configured prior rules until the run has seen enough to overrule it.
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

import logging
import math
import os
import statistics
from collections import deque
from typing import Any

from resilient.events.api import EventKind
from resilient.events.ledger import read_events

logger = logging.getLogger(__name__)


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
        self._uptime = 0.0
        self._interruptions = 0
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

    def observe_interruption(self) -> None:
        """One disruption of the job (a restart of the workers, for whatever reason)."""
        self._interruptions += 1

    def observe_upload(self, seconds: float) -> None:
        """Duration of one background upload to the persistent tier."""
        if seconds >= 0 and math.isfinite(seconds):
            self._uploads.append(float(seconds))

    def observe_uptime(self, seconds: float) -> None:
        """Running time observed outside steps and saves (e.g. earlier attempts read from the ledger)."""
        if seconds > 0 and math.isfinite(seconds):
            self._uptime += seconds

    # estimates ----------------------------------------------------------------------------------
    def step_seconds(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    def save_seconds(self) -> float | None:
        return statistics.median(self._saves) if self._saves else None

    def mtbf_seconds(self) -> float:
        return (self.prior_weight * self.prior_mtbf_s + self._uptime) / (self.prior_weight + self._interruptions)

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
        """Local checkpoint interval in steps, bounded; before any step is measured: ``min_steps``."""
        opt = self.optimal_seconds()
        step = self.step_seconds()
        if opt is None or step is None:
            return self.min_steps
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
            "save_blocking_seconds": self.save_seconds(),
            "upload_seconds": statistics.median(self._uploads) if self._uploads else None,
            "mtbf_seconds": self.mtbf_seconds(),
            "prior_mtbf_seconds": self.prior_mtbf_s,
            "uptime_seconds": self._uptime,
            "interruptions": self._interruptions,
            "optimal_seconds": self.optimal_seconds(),
            "interval_steps": self._current,
            "min_steps": self.min_steps,
            "max_steps": self.max_steps,
        }

    def _maybe_log(self) -> None:
        key = (self._current or 0, self.persistent_every() if self._uploads else self.persistent_prior)
        if key != self._last_logged:
            self._last_logged = key
            i = self.inputs()
            logger.info("checkpoint interval %d steps (optimum %.1f s: save %.3f s, MTBF %.0f s from %d "
                        "interruption(s) in %.0f s + prior %.0f s), persistent every %d",
                        key[0], i["optimal_seconds"] or 0.0, i["save_blocking_seconds"] or 0.0, i["mtbf_seconds"],
                        i["interruptions"], i["uptime_seconds"], self.prior_mtbf_s, key[1])

    # restarts ------------------------------------------------------------------------------------
    @classmethod
    def from_run_dir(cls, run_dir: str | os.PathLike[str], **kwargs: Any) -> "IntervalTuner":
        """A tuner that remembers earlier attempts: a restarted worker would otherwise forget every
        interruption it was restarted for. Reads the run's ledger (steps, saves, uploads, restarts)."""
        tuner = cls(**kwargs)
        try:
            events = list(read_events(run_dir))
        except FileNotFoundError:
            return tuner
        restarts: set[tuple[object, object]] = set()
        for ev in events:
            d = ev.details
            try:
                if ev.kind is EventKind.STEP:
                    tuner.observe_step(float(d.get("seconds", 0.0)))
                elif ev.kind is EventKind.CKPT_SAVE:
                    tuner.observe_save(float(d.get("blocking_seconds", 0.0)))
                elif ev.kind is EventKind.CKPT_TIER_DONE and str(d.get("tier")) == "persistent":
                    tuner.observe_upload(float(d.get("seconds", 0.0)))
                elif ev.kind is EventKind.RESTART:
                    restarts.add((ev.attempt, d.get("attempt")))  # once per restart, however many nodes say so
            except (TypeError, ValueError):
                continue
        for _ in restarts:
            tuner.observe_interruption()
        return tuner
