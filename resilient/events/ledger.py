"""Append-only JSON-lines ledger, safe for many writers on one node.

Each event is one ``os.write`` on an ``O_APPEND`` descriptor, so lines from the agent and its workers
never interleave on a local filesystem, and a crash can at worst leave the final line truncated —
which :func:`read_events` skips.

**A ledger that lost events says so.** A write the filesystem refuses or cuts short (a full run directory, a
quota) never stops training, but it is not silent either: the writer says it once on stderr, in one line,
and leaves a marker beside the ledger, ``events.jsonl.incomplete``: one JSON line per writer that lost
events (when its first loss happened, which event, the error). Creating an empty file needs no data block,
so the marker exists even on a full filesystem where its line does not fit. Readers
(:func:`ledger_incomplete`, ``resilient goodput``, the launcher's final lines) report the ledger as
incomplete whenever the marker exists: its last events may be missing, so a run that looks "in progress"
may have ended.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from resilient import env as renv
from resilient.events.api import Event, EventKind

logger = logging.getLogger(__name__)

LEDGER_NAME = "events.jsonl"
INCOMPLETE_NAME = LEDGER_NAME + ".incomplete"  # beside the ledger: some writer lost events (see the docstring)


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LEDGER_NAME


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


class Ledger:
    """Writer for ``RUN_DIR/events.jsonl``. Never raises on write: a ledger problem must not stop training."""

    def __init__(self, run_dir: str | os.PathLike[str], *, node: str | None = None, attempt: int | None = None):
        self.path = ledger_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self.node = node
        self.attempt = attempt
        self._warned = False
        self.lost = 0  # events this writer could not write (whole or in part)

    @classmethod
    def from_env(cls) -> "Ledger | None":
        run_dir = os.environ.get(renv.RUN_DIR)
        if not run_dir:
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        try:
            return cls(run_dir, attempt=int(attempt) if attempt is not None else None)
        except OSError as e:
            logger.warning("cannot open the ledger in %s: %s; events will not be recorded", run_dir, e)
            return None

    def emit(self, kind: EventKind | Event, *, rank: int | None = None, attempt: int | None = None,
             **details: object) -> Event:
        if isinstance(kind, Event):
            ev = kind
        else:
            kw: dict[str, object] = {}
            if self.node is not None:
                kw["node"] = self.node
            ev = Event(kind=kind, rank=rank, attempt=self.attempt if attempt is None else attempt,
                       details=dict(details), **kw)  # type: ignore[arg-type]
        self.write(ev)
        return ev

    def write(self, ev: Event) -> None:
        line = (json.dumps(ev.to_json(), separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            self._append(line, ev.kind.value)

    def write_line(self, line: bytes) -> bool:
        """Append one pre-formatted event line (``Event.to_json`` as JSON, ending in a newline) with one
        ``os.write``: the hot path of per-step records. False when the write failed (the caller stops)."""
        return self._append(line, None)

    def _append(self, line: bytes, kind: str | None) -> bool:
        try:
            n = os.write(self._fd, line)
        except OSError as e:
            self._lost(e.strerror or str(e), kind, line)
            return False
        if n != len(line):
            # a full disk can take part of a line: the rest is lost, and the cut line is unreadable
            self._lost(f"only {n} of {len(line)} bytes written", kind, line)
            return False
        return True

    def _lost(self, error: str, kind: str | None, line: bytes) -> None:
        self.lost += 1
        if self._warned:
            return
        self._warned = True
        if kind is None:
            try:
                kind = str(json.loads(line).get("kind", "?"))
            except (ValueError, AttributeError):
                kind = "?"
        who = f"{self.node or os.environ.get(renv.NODE) or 'node'} pid {os.getpid()}"
        rank = os.environ.get("RANK")
        if rank is not None:
            who += f" rank {rank}"
        note = (json.dumps({"wall": time.time(), "who": who, "kind": kind, "error": error}) + "\n").encode()
        marker = incomplete_path(self.path)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, note)
            except OSError:
                pass  # no room for the line: the empty marker still says events were lost
            finally:
                os.close(fd)
        except OSError as e:
            logger.debug("cannot write %s: %s", marker, e)
        # once per process, one line: every lost event after this one would only repeat it
        logger.error("cannot write the ledger %s (%s; first lost: %s): the run's record is incomplete from "
                     "here on; training goes on; free space in the run directory", self.path, error, kind)

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path_or_dir: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield every well-formed event; a truncated or corrupt line (a crash mid-write) is skipped."""
    p = Path(path_or_dir)
    if p.is_dir():
        p = ledger_path(p)
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                logger.debug("%s:%d: incomplete last line skipped", p, lineno)
                break
            try:
                yield Event.from_json(json.loads(raw))
            except (ValueError, KeyError, TypeError) as e:
                logger.debug("%s:%d: unreadable line skipped (%s)", p, lineno, e)
