"""Incremental reading of a growing ledger: each call returns only the events appended since the last."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from resilient.events.api import Event
from resilient.events.ledger import ledger_incomplete, ledger_path
from resilient.goodput.reader import parse_line

logger = logging.getLogger(__name__)


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
        """Why the ledger being followed lost events, or None (see :func:`resilient.events.ledger.ledger_incomplete`)."""
        return ledger_incomplete(self.path)

    def read_new(self, max_bytes: int = 64 << 20, *, contains: bytes | None = None) -> list[Event]:
        """The events appended since the last call; with ``contains``, only lines holding those bytes are
        parsed (a follower that wants one kind skips the cost of decoding every other line)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        out: list[Event] = []
        try:
            st = os.fstat(fd)
            if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
                logger.warning("%s was replaced or truncated; reading it again from the start", self.path)
                self._offset, self._partial, self.skipped = 0, b"", 0
            self._ino = st.st_ino
            read = 0
            while read < max_bytes:
                buf = os.pread(fd, self._chunk, self._offset)
                if not buf:
                    break
                self._offset += len(buf)
                read += len(buf)
                data = self._partial + buf
                lines = data.split(b"\n")
                self._partial = lines.pop()  # b"" after a complete line, else the unfinished one
                for raw in lines:
                    if not raw.strip() or (contains is not None and contains not in raw):
                        continue
                    ev = parse_line(raw)
                    if ev is None:
                        self.skipped += 1
                        logger.debug("malformed ledger line skipped")
                    else:
                        out.append(ev)
        finally:
            os.close(fd)
        return out
