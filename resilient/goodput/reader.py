"""Reading a ledger for accounting: every line is checked for shape before it becomes an :class:`Event`.

The ledger is append-only JSON lines written by several processes, and anyone who can write the run
directory can append to it. A line that is not JSON, not an object, of an unknown kind, or whose fields have
the wrong type (``"wall": "x"``, ``"details": null``, ``"attempt": [1]``) is skipped and counted, never
passed on: one bad line must not take down ``resilient goodput`` or the metrics endpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.events.ledger import ledger_incomplete, ledger_path

logger = logging.getLogger(__name__)

_KINDS = {k.value: k for k in EventKind}
# Unix seconds: 0 to year ~5000; a wall outside would stretch the run's time line to nonsense
_WALL_MAX = 1e11


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
    # why the ledger lost events (a writer could not write: full disk, quota), None when it lost none; its
    # marker is written beside the ledger by the writer that failed (see resilient.events.ledger)
    incomplete: str | None = None
    cut_last_line: bool = False  # the file ends inside a line (a writer at work, or one cut short)


def read_ledger(path_or_dir: str | os.PathLike[str]) -> LedgerRead:
    """Every well-formed event of ``RUN_DIR/events.jsonl`` (or of that file given directly), with the number of
    malformed lines skipped. An unfinished last line (a writer still at work, or killed mid-line) is not
    counted as malformed. ``incomplete`` says when a writer lost events (the marker beside the ledger). Raises ``FileNotFoundError``/``OSError`` when the file cannot be read."""
    p = Path(path_or_dir)
    if p.is_dir():
        p = ledger_path(p)
    out = LedgerRead(p)
    with open(p, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                out.cut_last_line = True
                break
            if not raw.strip():
                continue
            out.lines += 1
            ev = parse_line(raw)
            if ev is None:
                out.skipped += 1
            else:
                out.events.append(ev)
    if out.skipped:
        logger.debug("%s: %d malformed line(s) skipped", p, out.skipped)  # callers report the count
    out.incomplete = ledger_incomplete(p)
    return out
