"""Append-only JSON-lines ledger, safe for many writers on one node.

Each event is one ``os.write`` on an ``O_APPEND`` descriptor, so lines from the agent and its workers
never interleave on a local filesystem, and a crash can at worst leave the final line truncated —
which :func:`read_events` skips.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from resilient import env as renv
from resilient.events.api import Event, EventKind

logger = logging.getLogger(__name__)

LEDGER_NAME = "events.jsonl"


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LEDGER_NAME


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
        try:
            with self._lock:
                os.write(self._fd, line)
        except OSError as e:
            if not self._warned:
                logger.warning("ledger write failed (%s); further failures are silent", e)
                self._warned = True

    def write_line(self, line: bytes) -> bool:
        """Append one pre-formatted event line (``Event.to_json`` as JSON, ending in a newline) with one
        ``os.write``: the hot path of per-step records. False when the write failed (the caller stops)."""
        try:
            os.write(self._fd, line)
            return True
        except OSError as e:
            if not self._warned:
                logger.warning("ledger write failed (%s); further failures are silent", e)
                self._warned = True
            return False

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
