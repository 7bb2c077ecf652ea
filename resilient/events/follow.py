"""The one reader and tailer of a run's ledger (``RUN_DIR/events.jsonl``).

The ledger is append-only JSON lines written by several processes, and anyone who can write the run
directory can append to it. Every line is checked for shape before it becomes an :class:`Event`: a line that
is not JSON, not an object, of an unknown kind, or whose fields have the wrong type (``"wall": "x"``,
``"details": null``, ``"attempt": [1]``) is skipped and counted, never passed on, so one bad line cannot take
down ``resilient goodput``, the metrics endpoint, the supervisor or the interval tuner. An unfinished last
line (a writer at work, or one killed mid-line) is not malformed: a whole read stops before it, a tail waits
for its newline.

* :func:`read_events`: every well-formed event, as an iterator (also importable as
  ``resilient.events.read_events`` and ``resilient.events.ledger.read_events``).
* :func:`read_ledger`: the same as a :class:`LedgerRead`, with the count of malformed lines and whether a
  writer lost events (the marker beside the ledger, see :func:`ledger_incomplete`).
* :class:`LedgerTail`: follows a growing ledger; each call returns only what was appended since the last.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from resilient.events.api import Event, EventKind

logger = logging.getLogger(__name__)

LEDGER_NAME = "events.jsonl"
INCOMPLETE_NAME = LEDGER_NAME + ".incomplete"  # beside the ledger: some writer lost events

_KINDS = {k.value: k for k in EventKind}
# Unix seconds: 0 to year ~5000; a wall outside would stretch the run's time line to nonsense
_WALL_MAX = 1e11


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LEDGER_NAME


def _resolve(path_or_dir: str | os.PathLike[str]) -> Path:
    p = Path(path_or_dir)
    return ledger_path(p) if p.is_dir() else p


def incomplete_path(path_or_dir: str | os.PathLike[str]) -> Path:
    """The marker of lost events for a run directory, or for the ledger file given directly."""
    p = Path(path_or_dir)
    return p.with_name(INCOMPLETE_NAME) if p.name == LEDGER_NAME else p / INCOMPLETE_NAME


def ledger_incomplete(path_or_dir: str | os.PathLike[str]) -> str | None:
    """One line saying that (and from when, and why) the run's ledger lost events; None when it lost none.

    The marker may be empty (the disk had no room even for its line): it still means events were lost."""
    marker = incomplete_path(path_or_dir)
    try:
        raw = marker.read_bytes()[:1 << 16]
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"the ledger may be incomplete ({marker} exists but cannot be read: {e.strerror or e})"
    notes = []
    for line in raw.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            notes.append(d)
    if not notes:
        return "the ledger is incomplete: some events could not be written (the disk had no room to say which)"
    first = min(notes, key=lambda d: d.get("wall") if isinstance(d.get("wall"), (int, float)) else float("inf"))
    when = first.get("wall")
    at = time.strftime("%H:%M:%S", time.gmtime(when)) + " UTC" if isinstance(when, (int, float)) else "an unknown time"
    who = f"{len(notes)} writer(s)" if len(notes) > 1 else f"a writer ({first.get('who', '?')})"
    return (f"the ledger is incomplete: {who} could not write events from {at} on ({first.get('error', '?')}, "
            f"first lost: {first.get('kind', '?')}); the run's last events may be missing")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def event_from_json(d: Any) -> Event | None:
    """The event a decoded ledger line describes, or None when the line is not a well-formed event."""
    if not isinstance(d, dict):
        return None
    kind = _KINDS.get(d.get("kind")) if isinstance(d.get("kind"), str) else None
    if kind is None:
        return None
    wall = d.get("wall")
    if not _is_finite(wall) or not 0 <= wall < _WALL_MAX:
        return None
    kw: dict[str, Any] = {"kind": kind, "wall": float(wall)}
    if "mono" in d:
        if not _is_finite(d["mono"]):
            return None
        kw["mono"] = float(d["mono"])
    if "node" in d:
        if d["node"] is not None and not isinstance(d["node"], str):
            return None
        kw["node"] = d["node"]
    for name in ("rank", "attempt"):
        if name in d:
            if d[name] is not None and not _is_int(d[name]):
                return None
            kw[name] = d[name]
    if "details" in d:
        if not isinstance(d["details"], dict):
            return None
        kw["details"] = d["details"]
    if "schema" in d:
        if not _is_int(d["schema"]):
            return None
        kw["schema"] = d["schema"]
    return Event(**kw)


def parse_line(raw: bytes | str) -> Event | None:
    try:
        return event_from_json(json.loads(raw))
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError); absurdly nested
        return None


@dataclass
class LedgerRead:
    path: Path
    events: list[Event] = field(default_factory=list)
    skipped: int = 0  # malformed lines, not counting an unfinished last line
    lines: int = 0
    # why the ledger lost events (a writer could not write: full disk, quota), None when it lost none
    incomplete: str | None = None
    cut_last_line: bool = False  # the file ends inside a line (a writer at work, or one cut short)


def _scan(f: BinaryIO, out: LedgerRead) -> Iterator[Event]:
    """The well-formed events of an open ledger, counting lines and malformed ones into ``out``."""
    for raw in f:
        if not raw.endswith(b"\n"):
            out.cut_last_line = True
            return
        if not raw.strip():
            continue
        out.lines += 1
        ev = parse_line(raw)
        if ev is None:
            out.skipped += 1
        else:
            yield ev


def read_events(path_or_dir: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield every well-formed event of ``RUN_DIR/events.jsonl`` (or of that file given directly)."""
    p = _resolve(path_or_dir)
    out = LedgerRead(p)
    with open(p, "rb") as f:
        yield from _scan(f, out)
    if out.skipped:
        logger.debug("%s: %d malformed line(s) skipped", p, out.skipped)


def read_ledger(path_or_dir: str | os.PathLike[str]) -> LedgerRead:
    """Every well-formed event of ``RUN_DIR/events.jsonl`` (or of that file given directly), with the number of
    malformed lines skipped and ``incomplete`` set when a writer lost events. Raises ``OSError`` (such as
    ``FileNotFoundError``) when the file cannot be read."""
    p = _resolve(path_or_dir)
    out = LedgerRead(p)
    with open(p, "rb") as f:
        out.events.extend(_scan(f, out))
    if out.skipped:
        logger.debug("%s: %d malformed line(s) skipped", p, out.skipped)  # callers report the count
    out.incomplete = ledger_incomplete(p)
    return out


class LedgerTail:
    """Follows ``RUN_DIR/events.jsonl``; a line still being written stays buffered until its newline."""

    def __init__(self, run_dir: str | os.PathLike[str], *, chunk: int = 1 << 20):
        self.path: Path = ledger_path(run_dir)
        self._offset = 0
        self._partial = b""
        self._chunk = chunk
        self._ino: int | None = None
        self.skipped = 0  # malformed lines seen (each once)

    def incomplete(self) -> str | None:
        """Why the ledger being followed lost events, or None (see :func:`ledger_incomplete`)."""
        return ledger_incomplete(self.path)

    def read_new(self, max_bytes: int | None = 64 << 20, *, contains: bytes | None = None,
                 kinds: Collection[EventKind] | None = None) -> list[Event]:
        """The events appended since the last call (at most about ``max_bytes`` of them; None: all). With
        ``contains``, only lines holding those bytes are decoded (a follower that wants one kind skips the cost
        of decoding every other line); with ``kinds``, only events of those kinds are returned."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        except OSError as e:
            logger.debug("cannot open %s: %s", self.path, e)
            return []
        out: list[Event] = []
        try:
            st = os.fstat(fd)
            if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
                logger.warning("%s was replaced or truncated; reading it again from the start", self.path)
                self._offset, self._partial, self.skipped = 0, b"", 0
            self._ino = st.st_ino
            read = 0
            while max_bytes is None or read < max_bytes:
                buf = os.pread(fd, self._chunk, self._offset)
                if not buf:
                    break
                self._offset += len(buf)
                read += len(buf)
                lines = (self._partial + buf).split(b"\n")
                self._partial = lines.pop()  # b"" after a complete line, else the unfinished one
                out.extend(self._parse(lines, contains, kinds))
        finally:
            os.close(fd)
        return out

    def _parse(self, lines: Iterable[bytes], contains: bytes | None,
               kinds: Collection[EventKind] | None) -> Iterator[Event]:
        for raw in lines:
            if not raw.strip() or (contains is not None and contains not in raw):
                continue
            ev = parse_line(raw)
            if ev is None:
                self.skipped += 1
                logger.debug("malformed ledger line skipped")
            elif kinds is None or ev.kind in kinds:
                yield ev
