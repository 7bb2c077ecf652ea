"""Straggler scores from per-step own-work times (wall time minus time blocked in collectives).

Scores follow nvidia-resiliency-ext's ``straggler.reporting``: a score is reference time ÷ current time,
so 1.0 is "as fast as the reference" and 0.5 "twice as slow".

* ``peers``: the rank's median over the last ``window`` steps against the fastest median of its
  data-parallel peers on this node. Peers do the same work: with replicas of ``ranks_per_replica`` ranks
  (``--nodes-per-replica`` × workers per node) they are the ranks at the same position in every replica
  (``r % ranks_per_replica``), so a tensor- or pipeline-parallel rank is never compared with a rank holding
  another shard; without replicas every rank is a replica and all are peers. A rank with no peer on the node
  (with replicas of whole nodes: every rank) has no peers score (1.0); comparing nodes is the supervisor's.
* ``history``: the same median against the best median this rank has shown so far.

A rank is flagged only after ``confirm`` consecutive evaluations (one per step all ranks have reported)
below the threshold *and* slower by more than ``min_gap`` seconds, so scheduler noise on a busy machine
does not make a straggler; it is flagged again only after it has recovered.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StragglerConfig:
    threshold: float = 0.75
    history_threshold: float = 0.5
    window: int = 12
    confirm: int = 4
    min_gap: float = 0.005
    warmup: int = 1  # samples per rank and attempt ignored (first step: lazy init, connection set-up)

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1 or not 0 < self.history_threshold <= 1:
            raise ValueError(f"straggler thresholds are scores in (0, 1], got {self.threshold}, {self.history_threshold}")
        if self.window < 3 or self.confirm < 1 or self.warmup < 0 or self.min_gap < 0:
            raise ValueError("straggler window must be >= 3, confirm >= 1, warmup >= 0, min_gap >= 0; got "
                             f"{self.window}, {self.confirm}, {self.warmup}, {self.min_gap}")


@dataclass(frozen=True)
class StragglerFinding:
    rank: int
    reference: str  # "peers" or "history"
    score: float
    threshold: float
    median_seconds: float
    reference_seconds: float
    peers_score: float
    history_score: float
    step: int


@dataclass
class _RankSeries:
    samples: deque[float]
    seen: int = 0  # samples received this attempt, warm-up included
    last_step: int = -1
    best: float | None = None  # best (lowest) median ever: survives attempts
    below: dict[str, int] = field(default_factory=lambda: {"peers": 0, "history": 0})
    flagged: dict[str, bool] = field(default_factory=lambda: {"peers": False, "history": False})


class StragglerScorer:
    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._ranks: dict[int, _RankSeries] = {}
        self._members: set[int] = set()
        self._ranks_per_replica: int | None = None
        self._evaluated = 0  # the number of complete rounds evaluated this attempt

    def reset(self, ranks: set[int], ranks_per_replica: int | None = None) -> None:
        """A new attempt with these global ranks; keeps each rank's best median (its own history).

        ``ranks_per_replica`` (None: every rank a replica) decides which ranks are data-parallel peers."""
        if ranks_per_replica is not None and ranks_per_replica < 1:
            raise ValueError(f"ranks_per_replica must be >= 1, got {ranks_per_replica}")
        self._members = set(ranks)
        self._ranks_per_replica = ranks_per_replica
        for r in ranks:
            old = self._ranks.get(r)
            self._ranks[r] = _RankSeries(samples=deque(maxlen=self.config.window),
                                         best=old.best if old else None)
        self._evaluated = 0

    def add(self, rank: int, step: int, compute_seconds: float) -> list[StragglerFinding]:
        rs = self._ranks.get(rank)
        if rs is None or rank not in self._members or compute_seconds != compute_seconds:  # NaN
            return []
        rs.seen += 1
        rs.last_step = step
        if rs.seen <= self.config.warmup:
            return []
        rs.samples.append(compute_seconds)
        rounds = min(self._ranks[r].seen for r in self._members) - self.config.warmup
        if rounds <= self._evaluated or any(len(self._ranks[r].samples) < self.config.window for r in self._members):
            return []
        self._evaluated = rounds
        return self._evaluate()

    def medians(self) -> dict[int, float]:
        """rank → median own-work seconds over its current window (ranks with a full window)."""
        return {r: statistics.median(self._ranks[r].samples) for r in self._members
                if len(self._ranks[r].samples) >= self.config.window}

    def scores(self) -> dict[int, tuple[float, float]]:
        """rank → (peers score, history score) over the current windows (ranks with a full window)."""
        meds = self.medians()
        fastest = self._fastest_peers(meds)
        out = {}
        for r, m in meds.items():
            best = self._ranks[r].best
            out[r] = (_ratio(fastest[r], m), _ratio(best if best is not None else m, m))
        return out

    def peer_key(self, rank: int) -> int:
        """Ranks with the same key are data-parallel peers (the same position in every replica)."""
        return 0 if self._ranks_per_replica is None else rank % self._ranks_per_replica

    def _fastest_peers(self, meds: dict[int, float]) -> dict[int, float]:
        """rank → the fastest median among its peers in ``meds`` (itself included)."""
        best: dict[int, float] = {}
        for r, m in meds.items():
            k = self.peer_key(r)
            best[k] = min(best.get(k, m), m)
        return {r: best[self.peer_key(r)] for r in meds}

    def _evaluate(self) -> list[StragglerFinding]:
        cfg = self.config
        meds = {r: statistics.median(self._ranks[r].samples) for r in self._members}
        fastest_of = self._fastest_peers(meds)
        findings = []
        for r, m in meds.items():
            rs = self._ranks[r]
            fastest = fastest_of[r]
            best = m if rs.best is None else min(rs.best, m)
            peers, hist = _ratio(fastest, m), _ratio(best, m)
            for ref, score, thr, base in (("peers", peers, cfg.threshold, fastest),
                                          ("history", hist, cfg.history_threshold, best)):
                slow = score < thr and m - base > cfg.min_gap
                if slow:
                    rs.below[ref] += 1
                    if rs.below[ref] >= cfg.confirm and not rs.flagged[ref]:
                        rs.flagged[ref] = True
                        findings.append(StragglerFinding(
                            rank=r, reference=ref, score=score, threshold=thr, median_seconds=m,
                            reference_seconds=base, peers_score=peers, history_score=hist, step=rs.last_step))
                else:
                    rs.below[ref] = 0
                    # hysteresis: only a clear recovery re-arms the flag
                    if score >= min(1.0, thr + 0.1):
                        rs.flagged[ref] = False
            # the history reference only learns from windows that are not themselves flagged as slow
            if not rs.flagged["peers"]:
                rs.best = best
        return findings


def _ratio(ref: float, cur: float) -> float:
    if cur <= 0:
        return 1.0
    return min(1.0, ref / cur) if ref > 0 else 0.0
