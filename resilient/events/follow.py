"""The one reader and tailer of a run's ledger: every ``events*.jsonl`` file of a run directory, merged.

**One file per writer.** Every process that records events (each node's agent, with the supervisor it may host;
each worker; a standalone supervisor) appends to a file of its own under the run directory, so no two processes
ever append to one file: ``O_APPEND`` is atomic on a local filesystem but not across the clients of a shared
volume (NFS, a Kubernetes ``ReadWriteMany`` claim), where two nodes appending to one file can overwrite each
other's lines. The names (see :mod:`resilient.events.ledger`, the writer):

* ``RUN_DIR/events.jsonl`` — the file of the run's first writer (on a single node: the agent, which also
  holds the supervisor's decisions; with a standalone supervisor started first: that supervisor). It keeps
  the name users and older tools know, and an old run directory, where every writer shared it, is just a run
  with one file.
* ``RUN_DIR/events.<writer>.jsonl`` — every other writer, ``<writer>`` being the host name and process id
  (``[A-Za-z0-9_-]``; a name already taken gets a ``-<n>`` suffix, the file being created exclusively).
* ``<ledger file>.incomplete`` — beside a writer's file: that writer lost events (see :func:`ledger_incomplete`).

A run is read as one time line: each file in its own order, the files merged on ``wall`` (a file's own order is
kept even where its clock stepped back). ``events.jsonl`` alone is therefore not the run: read a run through
:func:`read_events` (``resilient goodput``, ``resilient plan``, ``/metrics`` and the supervisor all do); a path
to ``events.jsonl`` given to it means the whole run in that directory, a path to any other file that file alone.

Every line is checked for shape before it becomes an :class:`Event`: a line that is not JSON, not an object, of an
unknown kind, or whose fields have the wrong type (``"wall": "x"``, ``"details": null``, ``"attempt": [1]``) is
skipped and counted, never passed on, so one bad line cannot take down ``resilient goodput``, the metrics
endpoint, the supervisor or the interval tuner. An unfinished last line (a writer at work, or one killed
mid-line) is not malformed: a whole read stops before it (in that file only: the other writers' files are read
whole), a tail waits for its newline.

* :func:`read_events`: every well-formed event, as an iterator (also importable as
  ``resilient.events.read_events`` and ``resilient.events.ledger.read_events``).
* :func:`read_ledger`: the same as a :class:`LedgerRead`, with the count of malformed lines and whether a
  writer lost events (the markers beside the ledger files, see :func:`ledger_incomplete`).
* :func:`ledger_files`: the ledger files of a run directory.
* :class:`LedgerTail`: follows a growing run (new writers' files included); each call returns only what was
  appended since the last.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol

from resilient.events.api import Event, EventKind

logger = logging.getLogger(__name__)

LEDGER_NAME = "events.jsonl"
INCOMPLETE_SUFFIX = ".incomplete"
INCOMPLETE_NAME = LEDGER_NAME + INCOMPLETE_SUFFIX  # beside the ledger: some writer lost events
# events.jsonl, or events.<writer>.jsonl: the files of one run's writers
_LEDGER_RE = re.compile(r"^events(?:\.[A-Za-z0-9_-]+)?\.jsonl$")
_WRITER_RE = re.compile(r"^[A-Za-z0-9_-]+$")

_KINDS = {k.value: k for k in EventKind}
# Unix seconds: 0 to year ~5000; a wall outside would stretch the run's time line to nonsense
_WALL_MAX = 1e11
# a quiet look at a run costs a ``stat`` per writer's file; followers that look again and again space their looks by
# this much per file, so that one follower makes at most ~500 stats a second on a shared volume with thousands of
# writers' files (1,000 nodes x 8 workers), where a stat is a round trip to the file server
STAT_SECONDS = 0.002


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/events.jsonl``: the run's first writer's file, and the name that stands for the whole run."""
    return Path(run_dir) / LEDGER_NAME


def writer_path(run_dir: str | os.PathLike[str], writer: str) -> Path:
    """``RUN_DIR/events.<writer>.jsonl``: the ledger file of one writer."""
    if not _WRITER_RE.match(writer):
        raise ValueError(f"a ledger writer's name is letters, digits, '_' and '-': {writer!r}")
    return Path(run_dir) / f"events.{writer}.jsonl"


def is_ledger_name(name: str) -> bool:
    return _LEDGER_RE.match(name) is not None


def ledger_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The ledger files of a run directory: ``events.jsonl`` first, then the other writers' by name. Empty when
    there are none; ``OSError`` (such as ``FileNotFoundError``) when the directory cannot be listed."""
    d = Path(run_dir)
    names = sorted(n for n in os.listdir(d) if is_ledger_name(n))
    if LEDGER_NAME in names:
        names.remove(LEDGER_NAME)
        names.insert(0, LEDGER_NAME)
    return [d / n for n in names]


def _run_of(path_or_dir: str | os.PathLike[str]) -> tuple[Path, list[Path]]:
    """What a path names: (the path readers report, the files to read). A directory, or a path to its
    ``events.jsonl``, is the whole run; any other file is itself. ``FileNotFoundError`` when nothing is there."""
    p = Path(path_or_dir)
    if p.is_dir() and p.name != LEDGER_NAME:
        files = ledger_files(p)
        if not files:
            raise FileNotFoundError(2, "no ledger in the run directory", str(ledger_path(p)))
        return ledger_path(p), files
    if p.name == LEDGER_NAME and p.parent.is_dir():
        files = ledger_files(p.parent)
        if p.is_dir() and p not in files:
            files.insert(0, p)  # not a file: opening it says so, as it always did
        if not files:
            raise FileNotFoundError(2, "no ledger", str(p))
        return p, files
    return p, [p]


def incomplete_path(path_or_dir: str | os.PathLike[str]) -> Path:
    """The marker of lost events beside a ledger file (``<file>.incomplete``), or for a run directory
    ``events.jsonl.incomplete`` (the marker of a run whose writers shared one file)."""
    p = Path(path_or_dir)
    return p.with_name(p.name + INCOMPLETE_SUFFIX) if is_ledger_name(p.name) else p / INCOMPLETE_NAME


def _markers(path_or_dir: str | os.PathLike[str]) -> list[Path]:
    p = Path(path_or_dir)
    if is_ledger_name(p.name) and p.name != LEDGER_NAME:
        return [incomplete_path(p)]
    d = p.parent if p.name == LEDGER_NAME else p
    try:
        names = os.listdir(d)
    except OSError:
        return [d / INCOMPLETE_NAME]
    return [d / n for n in sorted(names)
            if n.endswith(INCOMPLETE_SUFFIX) and is_ledger_name(n[:-len(INCOMPLETE_SUFFIX)])]


def ledger_incomplete(path_or_dir: str | os.PathLike[str]) -> str | None:
    """One line saying that (and from when, and why) the run's ledger lost events; None when it lost none.

    Every writer's marker counts (a run directory, or a path to its ``events.jsonl``, means all of them). A
    marker may be empty (the disk had no room even for its line): it still means events were lost."""
    notes: list[dict[str, Any]] = []
    found = False
    for marker in _markers(path_or_dir):
        try:
            raw = marker.read_bytes()[:1 << 16]
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"the ledger may be incomplete ({marker} exists but cannot be read: {e.strerror or e})"
        found = True
        for line in raw.splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict):
                notes.append(d)
    if not found:
        return None
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


# A ledger is mostly rank 0's STEP lines (one per step: 200,000 of them in a 33 MB ledger), and restarts, exits
# and reports read it whole. Two byte-level shortcuts keep that from scaling with json.loads: the line format
# of worker/steps.py's STEP formatter decoded by one match, and the leading "kind" our writers put first
# (Event.to_json's field order) read to pass over lines of kinds a reader did not ask for, undecoded.
# The formatter's numbers, bounded so that each converts without a check: ints of at most 18 digits; seconds
# non-negative and finite, with a fraction or an exponent (json.loads makes floats of them, as the formatter's %r
# of a float always is); a wall of 0 to 1e10 (to the year 2286, inside _WALL_MAX); a finite mono. A line outside
# these bounds is decoded by json.loads, as any other line.
_INT = rb"-?(?:0|[1-9][0-9]{0,17})"
_INT_OR_NULL = rb"(" + _INT + rb"|null)"
_EXP = rb"[eE][-+]?[0-9]{1,2}"
_SECONDS = rb"(?:0|[1-9][0-9]{0,15})(?:\.[0-9]+(?:" + _EXP + rb")?|" + _EXP + rb")"
_WALL = rb"(?:0|[1-9][0-9]{0,9})(?:\.[0-9]+)?"
_MONO = rb"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]+)?(?:" + _EXP + rb")?"
_STEP_LINE = re.compile(
    rb'\{"kind":"step","node":(?:"([^"\\\x00-\x1f\x7f-\xff]*)"|null),"rank":' + _INT_OR_NULL
    + rb',"attempt":' + _INT_OR_NULL + rb',"details":\{"step":(' + _INT + rb'),"seconds":(' + _SECONDS
    + rb'),"compute_seconds":(' + _SECONDS + rb')\},"wall":(' + _WALL + rb'),"mono":(' + _MONO
    + rb'),"schema":([0-9]{1,18})\}[ \t\r\n]*')
_LEADING_KIND = re.compile(rb'\s*\{\s*"kind"\s*:\s*"([a-z_]{1,64})"')


def _step_line(m: re.Match[bytes]) -> Event:
    node, rank, attempt, step, seconds, compute, wall, mono, schema = m.groups()
    # every field is bounded by the match, as Event's own __init__ would not check: set them as one dict (a
    # frozen dataclass's __init__ sets each through object.__setattr__, the larger part of the cost per line)
    ev = object.__new__(Event)
    ev.__dict__.update(kind=EventKind.STEP, node=None if node is None else node.decode("ascii"),
                       rank=None if rank == b"null" else int(rank),
                       attempt=None if attempt == b"null" else int(attempt),
                       details={"step": int(step), "seconds": float(seconds), "compute_seconds": float(compute)},
                       wall=float(wall), mono=float(mono), schema=int(schema))  # event_from_json floats both too
    return ev


def parse_line(raw: bytes | str) -> Event | None:
    """The event one ledger line holds, or None when it is not a well-formed event."""
    if isinstance(raw, bytes) and (m := _STEP_LINE.fullmatch(raw)) is not None:
        return _step_line(m)
    return _json_event(raw)


def _json_event(raw: bytes | str) -> Event | None:
    try:
        return event_from_json(json.loads(raw))
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError); absurdly nested
        return None


class StepSink(Protocol):
    """Takes a run's events as they are read, in each file's line order: the STEP lines of the formatter's own
    format as their numbers (no event is built for them: a long run's ledger is nearly all of them), every other
    well-formed line as an event (a STEP line in another spelling too)."""

    def add(self, ev: Event) -> None: ...

    def add_step(self, node: str | None, attempt: int | None, step: int, seconds: float, wall: float) -> None: ...


def _feed(f: BinaryIO, out: LedgerRead, sink: StepSink) -> None:
    """:func:`_scan` into a sink."""
    lines = []
    for raw in f:
        if not raw.endswith(b"\n"):
            out.cut_last_line = True
            break
        lines.append(raw)
        if len(lines) == 4096:
            out.lines, out.skipped = _feed_lines(lines, sink, out.lines, out.skipped)
            lines = []
    out.lines, out.skipped = _feed_lines(lines, sink, out.lines, out.skipped)


def _feed_lines(lines: Iterable[bytes], sink: StepSink, counted: int, skipped: int) -> tuple[int, int]:
    """Whole lines into a sink, in order; returns the lines and malformed lines counted, these added."""
    match = _STEP_LINE.fullmatch
    add, add_step = sink.add, sink.add_step
    for raw in lines:
        if not raw.strip():
            continue
        counted += 1
        m = match(raw)
        if m is not None:
            node, _, attempt, step, seconds, _, wall, _, _ = m.groups()
            add_step(None if node is None else node.decode("ascii"), None if attempt == b"null" else int(attempt),
                     int(step), float(seconds), float(wall))
            continue
        ev = _json_event(raw)
        if ev is None:
            skipped += 1
        else:
            add(ev)
    return counted, skipped


def _decode(raw: bytes, wanted: frozenset[str] | None) -> Event | Literal[False] | None:
    """parse_line, or False for a line that names a known kind first and not one of ``wanted`` (None: every
    kind is wanted); a line that does not start with its kind is decoded, so nothing asked for is lost."""
    if wanted is None or "step" in wanted:
        return parse_line(raw)
    if raw.startswith(b'{"kind":"step",'):
        return False  # the formatter's STEP lines, nearly every line of a long run: one comparison each
    m = _LEADING_KIND.match(raw)
    if m is not None:
        kind = m.group(1).decode()
        if kind in _KINDS and kind not in wanted:
            return False
    return parse_line(raw)


@dataclass
class LedgerRead:
    path: Path
    events: list[Event] = field(default_factory=list)
    skipped: int = 0  # malformed lines, not counting an unfinished last line
    lines: int = 0
    # why the ledger lost events (a writer could not write: full disk, quota), None when it lost none
    incomplete: str | None = None
    cut_last_line: bool = False  # a file ends inside a line (a writer at work, or one cut short)
    files: list[Path] = field(default_factory=list)  # the ledger files read (one per writer)


def _wanted(kinds: Collection[EventKind] | None) -> frozenset[str] | None:
    return None if kinds is None else frozenset(EventKind(k).value for k in kinds)


def _scan(f: BinaryIO, out: LedgerRead, wanted: frozenset[str] | None = None) -> Iterator[Event]:
    """The well-formed events of an open ledger (of the ``wanted`` kinds' names; None: all), counting lines
    and malformed ones into ``out``."""
    for raw in f:
        if not raw.endswith(b"\n"):
            out.cut_last_line = True
            return
        if not raw.strip():
            continue
        out.lines += 1
        ev = _decode(raw, wanted)
        if ev is None:
            out.skipped += 1
        elif ev is not False and (wanted is None or ev.kind.value in wanted):
            yield ev


def _wall(ev: Event) -> float:
    return ev.wall


def _read_files(files: list[Path], out: LedgerRead, wanted: frozenset[str] | None = None) -> list[Event]:
    """Every file whole (one open at a time: a run may have thousands), merged on wall time."""
    per_file: list[list[Event]] = []
    for p in files:
        one = LedgerRead(p)
        with open(p, "rb") as f:
            per_file.append(list(_scan(f, one, wanted)))
        out.lines += one.lines
        out.skipped += one.skipped
        out.cut_last_line = out.cut_last_line or one.cut_last_line
    if len(per_file) == 1:
        return per_file[0]
    return list(heapq.merge(*per_file, key=_wall))


def read_events(path_or_dir: str | os.PathLike[str], *,
                kinds: Collection[EventKind] | None = None) -> Iterator[Event]:
    """Yield every well-formed event of a run (its directory, or its ``events.jsonl``), every writer's file
    merged on wall time; or of one other ledger file given directly. With ``kinds``, only events of those
    kinds, the other lines passed over mostly undecoded (a reader that wants no STEP lines reads a long
    run's ledger in a fraction of the time)."""
    p, files = _run_of(path_or_dir)
    out = LedgerRead(p, files=files)
    yield from _read_files(files, out, _wanted(kinds))
    if out.skipped:
        logger.debug("%s: %d malformed line(s) skipped", p, out.skipped)


def read_ledger(path_or_dir: str | os.PathLike[str]) -> LedgerRead:
    """Every well-formed event of a run (or of one ledger file given directly), every writer's file merged on
    wall time, with the number of malformed lines skipped and ``incomplete`` set when a writer lost events.
    Raises ``OSError`` (such as ``FileNotFoundError``) when there is no ledger or a file cannot be read."""
    return read_ledgers([path_or_dir])


def read_ledgers(paths: Sequence[str | os.PathLike[str]], *, into: StepSink | None = None) -> LedgerRead:
    """Several run directories' ledgers read as one run: the nodes of one job that each kept a run directory of their
    own (a ``--run-dir`` per node, the supervisor's too), every writer's file of every directory merged on wall time,
    as one shared directory's are. A file named twice (a directory given twice) is read once; ``incomplete`` joins
    each directory's reason. Raises ``OSError`` (``FileNotFoundError`` with the first path that has no ledger as its
    ``filename``) as :func:`read_ledger` does. With ``into``, every event goes to that sink instead of ``events``
    (which stays empty), file by file in line order, STEP lines as numbers: a report's reader holds no event per
    step."""
    if not paths:
        raise ValueError("read_ledgers needs at least one run directory")
    runs = [_run_of(x) for x in paths]
    files: list[Path] = []
    seen: set[str] = set()
    for _, fs in runs:
        for f in fs:
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                files.append(f)
    out = LedgerRead(runs[0][0], files=files)
    if into is None:
        out.events.extend(_read_files(files, out))
    else:
        for p in files:  # one open at a time, as _read_files
            with open(p, "rb") as f:
                _feed(f, out, into)
    if out.skipped:
        logger.debug("%s: %d malformed line(s) skipped", out.path, out.skipped)  # callers report the count
    reasons = [r for p, _ in runs if (r := ledger_incomplete(p)) is not None]
    out.incomplete = "; ".join(dict.fromkeys(reasons)) or None
    return out


@dataclass
class StepTally:
    """The STEP lines of a ledger counted rather than returned as events (see ``LedgerTail.read_new``): a reader that
    needs only their seconds (the interval tuner at a restart) pays no event per step."""
    recent_max: int = 256
    count: int = 0
    seconds: float = 0.0  # their sum, in the order read
    recent: deque[float] = field(default_factory=deque)  # the last ``recent_max`` of them, oldest first

    def add(self, seconds: float) -> None:
        self.extend((seconds,))

    def extend(self, seconds: Iterable[float]) -> None:
        # not a duration (negative, not finite): left out, as IntervalTuner.observe_step leaves it out
        got = [s for s in seconds if s >= 0 and math.isfinite(s)]
        self.count += len(got)
        self.seconds += sum(got)
        self.recent.extend(got[-self.recent_max:])
        while len(self.recent) > self.recent_max:
            self.recent.popleft()


@dataclass
class _Followed:
    """One writer's file as a tail has read it so far."""
    offset: int = 0
    partial: bytes = b""
    ino: int | None = None
    # followed from its end while a line was being written: the rest of that line is not an event of its own
    drop_to_newline: bool = False


class LedgerTail:
    """Follows a run: every writer's file under ``run_dir``, those created later included; a line still being
    written stays buffered until its newline. Each call's events are merged on wall time; an event written
    late by a slow writer comes in a later call, so a follower must not take one call's order as final."""

    # a directory changed less than this before it was listed may change again within the same tick of the coarse
    # clock file times come from, leaving its time as it was: it is listed again at the next call
    _MTIME_SLACK_NS = 100_000_000

    def __init__(self, run_dir: str | os.PathLike[str], *, chunk: int = 1 << 20,
                 names: Callable[[str], bool] | None = None, rescan: float | None = None):
        """``names``: which of the run's ledger files to follow, by file name (None: all): a follower that wants
        some writers only (one node's, on a shared volume with thousands of files) opens no other file.
        ``rescan``: list the directory only when its modification time changed, and at least every ``rescan``
        seconds (None: at every call): a frequent follower of a directory of thousands of files then costs one
        stat of the directory per call, not a listing."""
        self.run_dir = Path(run_dir)
        self.path: Path = ledger_path(run_dir)
        self._files: dict[str, _Followed] = {}
        self._names = names
        self._rescan = rescan
        self._listing: tuple[int, float, list[str]] | None = None  # (directory's mtime, monotonic time, names)
        self._chunk = chunk
        self.skipped = 0  # malformed lines seen (each once)
        self.last_read = 0  # bytes the last read_new read: 0 when it found nothing new (caught up)

    def incomplete(self) -> str | None:
        """Why the run being followed lost events, or None (see :func:`ledger_incomplete`)."""
        return ledger_incomplete(self.run_dir)

    def _listed(self) -> list[str]:
        """The followed files' names, ``events.jsonl`` first; empty when the directory cannot be listed."""
        mtime: int | None = None
        if self._rescan is not None:
            try:
                mtime = os.stat(self.run_dir).st_mtime_ns
            except OSError:
                mtime = None
            last, now = self._listing, time.monotonic()
            if mtime is not None and last is not None and last[0] == mtime and now - last[1] < self._rescan:
                return last[2]
        try:
            names = [n for n in os.listdir(self.run_dir)
                     if is_ledger_name(n) and (self._names is None or self._names(n))]
        except FileNotFoundError:
            return []
        except OSError as e:
            logger.debug("cannot list %s: %s", self.run_dir, e)
            return []
        names.sort(key=lambda n: (n != LEDGER_NAME, n))
        if mtime is not None and time.time_ns() - mtime > self._MTIME_SLACK_NS:
            self._listing = (mtime, time.monotonic(), names)
        else:
            self._listing = None
        return names

    @property
    def files(self) -> int:
        """How many files this tail has looked at (each costs a ``stat`` per look while it is quiet)."""
        return len(self._files)

    def spacing(self, base: float) -> float:
        """Seconds to leave between two looks of a follower that would look every ``base`` seconds: at least
        :data:`STAT_SECONDS` per file followed."""
        return max(base, len(self._files) * STAT_SECONDS)

    def marks(self) -> dict[str, tuple[int, int]]:
        """Where this tail stands in each file it has read, at the end of the last whole line: ``{name: (inode,
        offset)}``. A tail made later and given them (:meth:`resume`) reads on from there, as this one would."""
        return {name: (st.ino, st.offset - len(st.partial)) for name, st in self._files.items()
                if st.ino is not None and not st.drop_to_newline}

    def resume(self, marks: dict[str, tuple[int, int]]) -> None:
        """Read on from ``marks`` (of :meth:`marks`); a file whose inode is not the one marked, or that is shorter
        than its mark, is read again from its start (the caller checks that what it holds came from these bytes)."""
        for name, (ino, offset) in marks.items():
            self._files[name] = _Followed(offset=int(offset), ino=int(ino))

    def skip_to_end(self) -> None:
        """Follow from now on: what the files hold now is passed over unread (without reading it: one stat per
        file, and one byte where a line may still be being written, whose rest is passed over too). Files that
        appear later are read from their start."""
        for name in self._listed():
            path = self.run_dir / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                logger.debug("cannot open %s: %s", path, e)
                continue
            try:
                st = os.fstat(fd)
                last = os.pread(fd, 1, st.st_size - 1) if st.st_size else b"\n"
            except OSError as e:
                logger.debug("cannot read %s: %s", path, e)
                continue
            finally:
                os.close(fd)
            self._files[name] = _Followed(offset=st.st_size, ino=st.st_ino, drop_to_newline=last != b"\n")

    def read_new(self, max_bytes: int | None = 64 << 20, *, contains: bytes | None = None,
                 kinds: Collection[EventKind] | None = None, steps: StepTally | None = None,
                 leave: int = 0, into: StepSink | None = None) -> list[Event]:
        """The events appended since the last call (at most about ``max_bytes`` of them; None: all). With
        ``contains``, only lines holding those bytes are decoded (a follower that wants one kind skips the cost
        of decoding every other line); with ``kinds``, only events of those kinds are returned. With ``steps``,
        the STEP lines in their writer's format (rank 0's, nearly every line of a long run) are added to it
        instead of being returned, and each file is read only to ``leave`` bytes before its end, so that a
        call without ``steps`` reads the newest lines as events. With ``into``, every line goes to that sink instead
        (file by file in line order, the STEP lines of their writer's format as numbers) and nothing is returned:
        a follower that keeps a report's columns builds no event a step."""
        names = self._listed()
        batches: list[list[Event]] = []
        budget = max_bytes
        self.last_read = 0
        # paths as strings: a quiet look is a stat per file, and building a Path per file cost as much as the stat
        root = os.fspath(self.run_dir) + os.sep
        for name in names:
            if budget is not None and budget <= 0:
                break
            st = self._files.setdefault(name, _Followed())
            got, used = self._read_file(root + name, st, budget, contains, kinds, steps, leave, into)
            self.last_read += used
            if budget is not None:
                budget -= used
            if got:
                batches.append(got)
        if len(batches) == 1:
            return batches[0]
        return list(heapq.merge(*batches, key=_wall))

    def _read_file(self, path: str, st: _Followed, budget: int | None, contains: bytes | None,
                   kinds: Collection[EventKind] | None, steps: StepTally | None = None,
                   leave: int = 0, into: StepSink | None = None) -> tuple[list[Event], int]:
        try:
            if st.ino is not None:
                now = os.stat(path)
                if now.st_ino == st.ino and now.st_size == st.offset:
                    return [], 0  # nothing new: one stat, not an open, per quiet writer
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return [], 0
        except OSError as e:
            logger.debug("cannot open %s: %s", path, e)
            return [], 0
        out: list[Event] = []
        read = 0
        try:
            fst = os.fstat(fd)
            if st.ino is not None and (fst.st_ino != st.ino or fst.st_size < st.offset):
                logger.warning("%s was replaced or truncated; reading it again from the start", path)
                st.offset, st.partial, st.drop_to_newline = 0, b"", False
            st.ino = fst.st_ino
            end = fst.st_size - leave if steps is not None else None
            while budget is None or read < budget:
                n = self._chunk if end is None else min(self._chunk, end - st.offset)
                if n <= 0:
                    break
                buf = os.pread(fd, n, st.offset)
                if not buf:
                    break
                st.offset += len(buf)
                read += len(buf)
                lines = (st.partial + buf).split(b"\n")
                st.partial = lines.pop()  # b"" after a complete line, else the unfinished one
                if st.drop_to_newline:
                    if not lines:
                        st.partial = b""  # still inside the line that was being written when the tail began
                        continue
                    lines.pop(0)
                    st.drop_to_newline = False
                if into is not None:
                    _, self.skipped = _feed_lines(lines, into, 0, self.skipped)
                    continue
                if steps is not None and (kinds is None or EventKind.STEP in kinds):
                    lines = self._tally(lines, steps)
                out.extend(self._parse(lines, contains, kinds))
        finally:
            os.close(fd)
        return out, read

    @staticmethod
    def _tally(lines: list[bytes], steps: StepTally) -> list[bytes]:
        """Add the STEP lines in their writer's format to ``steps``; the other lines, to be parsed."""
        rest: list[bytes] = []
        seconds: list[bytes] = []
        match = _STEP_LINE.fullmatch
        for raw in lines:
            m = match(raw)
            if m is None:
                rest.append(raw)
            else:
                seconds.append(m.group(5))
        steps.extend(map(float, seconds))
        return rest

    def _parse(self, lines: Iterable[bytes], contains: bytes | None,
               kinds: Collection[EventKind] | None) -> Iterator[Event]:
        wanted = _wanted(kinds)
        for raw in lines:
            if not raw.strip() or (contains is not None and contains not in raw):
                continue
            ev = _decode(raw, wanted)
            if ev is False:
                continue
            if ev is None:
                self.skipped += 1
                logger.debug("malformed ledger line skipped")
            elif kinds is None or ev.kind in kinds:
                yield ev
