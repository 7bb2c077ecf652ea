"""What rank 0's interval tuner has learnt from the run's ledger, kept beside it so that a restart reads only what
was written since.

A restarted rank 0 with ``--ckpt-interval auto`` learns the run's step times, saves, uploads and restarts from the
ledger before its first step, and the whole job waits for it: 1.7 s at a million steps when it reads every line. The
tuner follows the ledger while the run trains anyway (to learn each save's interference); after a look, at most
every ``IntervalTuner.cache_every_s``, the manager's save thread has it write down what it has taken from it
(``IntervalTuner.write_cache``) — the sums (:class:`LedgerSums`), the newest events it keeps, and where it stands in
each writer's file — as ``RUN_DIR/interval_tuner.json``. A restart that finds
the file, and finds every file it names unchanged up to its mark (same inode, at least as long, the same bytes before
the mark), reads on from the marks; anything else (no file, another version, a torn or altered file, a ledger file
replaced, truncated or gone) is reported and the ledger is read from its start, as without the file. One writer:
rank 0's tuner (the only one that follows the ledger), through a temporary file and a rename.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.events.follow import StepTally, event_from_json, is_ledger_name

logger = logging.getLogger(__name__)

CACHE_NAME = "interval_tuner.json"
VERSION = 1
_CHECK_BYTES = 64  # the bytes before each mark kept in the cache: a file rewritten in place does not match them
_STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that was killed while writing


@dataclass
class LedgerSums:
    """What the tuner takes from a ledger's lines, in the order read: the newest step times, their total with the
    saves' blocking times (the run's uptime), the newest save blocking and upload times, and the restarts (each
    counted once, however many nodes record it)."""

    steps: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    uptime: float = 0.0
    saves: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    uploads: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    restarts: set[tuple[Any, Any]] = field(default_factory=set)
    # attempts whose restore came from node memory (the snapshot tier), or from a disk step newer than every rank's
    # snapshot by less than a snapshot interval: their restarts did not need a disk tier
    snapshot_attempts: set[Any] = field(default_factory=set)

    @classmethod
    def sized(cls, window: int, recent: int) -> "LedgerSums":
        return cls(deque(maxlen=window), 0.0, deque(maxlen=recent), deque(maxlen=recent), set())

    def restarted_into(self) -> list[Any]:
        """The attempt each restart started (the agent's restart event carries it as its own attempt; a
        ``details.attempt`` names it where a writer gives one)."""
        return [new if new is not None else own for own, new in self.restarts]

    def absorb(self, events: Iterable[Event]) -> None:
        """The observations of events read from the ledger (the tuner's own ``observe_*`` rules: a value that is
        not a finite duration ≥ 0 is left out)."""
        for ev in events:
            d = ev.details
            try:
                if ev.kind is EventKind.STEP:
                    self._step(float(d.get("seconds", 0.0)))
                elif ev.kind is EventKind.CKPT_SAVE:
                    v = float(d.get("blocking_seconds", 0.0))
                    if v >= 0 and math.isfinite(v):
                        self.saves.append(v)
                        self.uptime += v
                elif ev.kind is EventKind.CKPT_TIER_DONE and str(d.get("tier")) == "persistent":
                    v = float(d.get("seconds", 0.0))
                    if v >= 0 and math.isfinite(v):
                        self.uploads.append(v)
                elif ev.kind is EventKind.RESTART:
                    self.restarts.add((ev.attempt, d.get("attempt")))
                elif (ev.kind is EventKind.CKPT_RESTORE and ev.attempt is not None
                      and (d.get("tier") == "snapshot" or d.get("covered_by_snapshot") is True)):
                    self.snapshot_attempts.add(ev.attempt)
            except (TypeError, ValueError):
                continue

    def add_tally(self, tally: StepTally) -> None:
        """Step lines summed without an event each (a restart's read of the older lines)."""
        self.steps.extend(tally.recent)
        self.uptime += tally.seconds

    def _step(self, v: float) -> None:
        if v >= 0 and math.isfinite(v):
            self.steps.append(v)
            self.uptime += v

    def copy(self) -> "LedgerSums":
        return LedgerSums(deque(self.steps, self.steps.maxlen), self.uptime, deque(self.saves, self.saves.maxlen),
                          deque(self.uploads, self.uploads.maxlen), set(self.restarts), set(self.snapshot_attempts))

    def to_json(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "uptime": self.uptime, "saves": list(self.saves),
                "uploads": list(self.uploads), "restarts": [list(r) for r in self.restarts],
                "snapshot_attempts": list(self.snapshot_attempts)}

    @classmethod
    def from_json(cls, d: Any, window: int, recent: int) -> "LedgerSums":
        """The sums a cache holds; ValueError naming the field that is not what the writer writes."""
        if not isinstance(d, dict):
            raise ValueError("sums: not an object")
        out = cls.sized(window, recent)
        for name, into in (("steps", out.steps), ("saves", out.saves), ("uploads", out.uploads)):
            v = d.get(name)
            if not isinstance(v, list) or not all(_duration(x) for x in v):
                raise ValueError(f"sums.{name}: not a list of durations")
            into.extend(float(x) for x in v)
        up = d.get("uptime")
        if not _duration(up):
            raise ValueError("sums.uptime: not a duration")
        out.uptime = float(up)
        rs = d.get("restarts")
        if not isinstance(rs, list) or not all(isinstance(r, list) and len(r) == 2 for r in rs):
            raise ValueError("sums.restarts: not a list of pairs")
        try:
            out.restarts = {(a, b) for a, b in rs}
        except TypeError:  # an unhashable member: nothing the writer writes
            raise ValueError("sums.restarts: a member that is not a number or text") from None
        # absent in a cache written before it was kept: those restarts count as needing the disk tiers (the
        # shorter, safe interval) until the run's ledger says otherwise
        snaps = d.get("snapshot_attempts", [])
        if not isinstance(snaps, list) or not all(isinstance(a, (int, str)) and not isinstance(a, bool)
                                                  for a in snaps):
            raise ValueError("sums.snapshot_attempts: not a list of attempts")
        out.snapshot_attempts = set(snaps)
        return out


def _duration(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)


@dataclass
class TunerCache:
    """Where the tuner stood in each ledger file (``marks``: name → (inode, offset at the end of a whole line)), the
    sums of everything before, and the newest events it kept (what it learns interference from)."""

    marks: dict[str, tuple[int, int]]
    sums: LedgerSums
    events: list[Event]


def cache_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CACHE_NAME


def write_cache(run_dir: str | os.PathLike[str], cache: TunerCache) -> bool:
    """Write ``cache`` beside the ledger (a temporary file, then a rename: a reader sees the old file or the new,
    never a torn one). False when it could not be written (the next restart then reads more of the ledger)."""
    d = Path(run_dir)
    files: dict[str, list[Any]] = {}
    for name, (ino, offset) in cache.marks.items():
        try:
            files[name] = [ino, offset, _tail_bytes(d / name, offset).hex()]
        except (OSError, ValueError) as e:
            logger.debug("no tuner cache: %s: %s", name, e)
            return False
    body = json.dumps({"version": VERSION, "files": files, "sums": cache.sums.to_json(),
                       "events": [_event_json(ev) for ev in cache.events]}, separators=(",", ":"), default=str).encode()
    tmp = d / f".{CACHE_NAME}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            # a first line with the body's checksum: a flipped byte in a number would still be JSON
            f.write(b"%08x\n" % zlib.crc32(body) + body)
        os.replace(tmp, d / CACHE_NAME)
    except OSError as e:
        logger.debug("could not write the interval tuner's cache in %s: %s", d, e)
        try:
            tmp.unlink()
        except OSError:
            pass
        return False
    return True


def _event_json(ev: Event) -> dict[str, Any]:
    """``Event.to_json`` without its deep copy (``dataclasses.asdict``): a cache of 4,096 events took 0.1 s with it,
    on the save thread of rank 0."""
    return {"kind": ev.kind.value, "node": ev.node, "rank": ev.rank, "attempt": ev.attempt, "details": ev.details,
            "wall": ev.wall, "mono": ev.mono, "schema": ev.schema}


def read_cache(run_dir: str | os.PathLike[str], window: int, recent: int) -> TunerCache | None:
    """The cache beside the run's ledger if every ledger file it names is as it was up to its mark; None otherwise
    (why is logged: the caller then reads the whole ledger)."""
    d = Path(run_dir)
    _remove_stale(d)
    p = d / CACHE_NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.info("the interval tuner's cache %s cannot be read (%s); reading the whole ledger", p, e)
        return None
    try:
        return _parse(d, raw, window, recent)
    except ValueError as e:
        logger.info("the interval tuner's cache %s is not used (%s); reading the whole ledger", p, e)
        return None


def _parse(d: Path, raw: bytes, window: int, recent: int) -> TunerCache:
    head, _, rest = raw.partition(b"\n")
    if head != b"%08x" % zlib.crc32(rest):
        raise ValueError("its checksum does not match its contents (torn or altered)")
    try:
        body = json.loads(rest)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(body, dict) or body.get("version") != VERSION:
        raise ValueError(f"not version {VERSION} of the cache")
    files = body.get("files")
    if not isinstance(files, dict):
        raise ValueError("files: not an object")
    marks: dict[str, tuple[int, int]] = {}
    for name, v in files.items():
        if not is_ledger_name(name):
            raise ValueError(f"{name!r} is not a ledger file's name")
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in v[:2]) and isinstance(v[2], str)):
            raise ValueError(f"files.{name}: not [inode, offset, hex]")
        ino, offset, check = v
        try:
            st = os.stat(d / name)
            if st.st_ino != ino:
                raise ValueError(f"{name} was replaced since")
            if st.st_size < offset:
                raise ValueError(f"{name} is shorter than when the cache was written")
            if _tail_bytes(d / name, offset).hex() != check:
                raise ValueError(f"{name} holds other bytes than when the cache was written")
        except FileNotFoundError:
            raise ValueError(f"{name} is gone") from None
        except OSError as e:
            raise ValueError(f"{name}: {e}") from None
        marks[name] = (ino, offset)
    sums = LedgerSums.from_json(body.get("sums"), window, recent)
    evs = body.get("events")
    if not isinstance(evs, list):
        raise ValueError("events: not a list")
    events = [event_from_json(e) for e in evs]
    if any(e is None for e in events):
        raise ValueError("events: one is not an event")
    return TunerCache(marks, sums, events)  # type: ignore[arg-type]


def _tail_bytes(path: Path, offset: int) -> bytes:
    """The bytes of ``path`` just before ``offset`` (at most _CHECK_BYTES)."""
    n = min(_CHECK_BYTES, offset)
    if n <= 0:
        return b""
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.pread(fd, n, offset - n)
    finally:
        os.close(fd)
    if len(got) != n:
        raise ValueError(f"{path.name} is shorter than its mark")
    return got


def _remove_stale(d: Path) -> None:
    """Temporary files of writers killed while writing (a rank 0 is SIGKILLed with its job's other workers)."""
    now = time.time()
    try:
        names = [n for n in os.listdir(d) if n.startswith(f".{CACHE_NAME}.") and n.endswith(".tmp")]
    except OSError:
        return
    for n in names:
        try:
            if now - os.stat(d / n).st_mtime > _STALE_TMP_S:
                os.unlink(d / n)
        except OSError:
            pass
