"""Append-only JSON-lines ledger, safe for many writers on one node.

Each event is one ``os.write`` on an ``O_APPEND`` descriptor, so lines from the agent and its workers
never interleave on a local filesystem, and a crash can at worst leave the final line truncated —
which :func:`resilient.events.follow.read_events` skips.

**A ledger that lost events says so.** A write the filesystem refuses or cuts short (a full run directory, a
quota) never stops training, but it is not silent either: the writer says it once on stderr, in one line,
and leaves a marker beside the ledger, ``events.jsonl.incomplete``: one JSON line per writer that lost
events (when its first loss happened, which event, the error). Creating an empty file needs no data block,
so the marker exists even on a full filesystem where its line does not fit. Readers
(:func:`resilient.events.follow.ledger_incomplete`, ``resilient goodput``, the launcher's final lines) report the ledger as
incomplete whenever the marker exists: its last events may be missing, so a run that looks "in progress"
may have ended.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from resilient import env as renv
from resilient.events.api import Event, EventKind
# read_events is re-exported: the reading side lives in follow.py, but callers find it beside the writer
from resilient.events.follow import incomplete_path, ledger_path, read_events  # noqa: F401

logger = logging.getLogger(__name__)


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

