"""World-size record: how ``on_scale`` callbacks learn that the world changed between attempts.

Local rank 0 of every node writes ``RUN_DIR/world.json`` (world size, data-parallel size, attempt) once the
first step of an attempt has completed; by then every rank of that attempt has passed the start of
``steps()`` (a synchronous step includes a collective), where each rank reads the record and, when its own
world differs, calls the registered callbacks before the first step. Writing only after a completed step is
what keeps a slow-starting rank from reading its own attempt's record; writing on every node is what gives
each node's run directory (shared or not) the record.

The launcher needs nothing else for nodes that trained before. A node that did not (a hot spare joining
the job) has no record: the supervisor/agent calls :func:`record_world` with the *previous* world on that
node's run directory before spawning its workers, so its ranks call the callbacks like everyone else.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

WORLD_RECORD = "world.json"


@dataclass(frozen=True)
class WorldRecord:
    world_size: int
    dp_size: int
    attempt: int | None = None
    wall: float = 0.0


def read_world(run_dir: str | os.PathLike[str]) -> WorldRecord | None:
    path = Path(run_dir) / WORLD_RECORD
    try:
        d = json.loads(path.read_text())
        return WorldRecord(world_size=int(d["world_size"]), dp_size=int(d["dp_size"]),
                           attempt=d.get("attempt"), wall=float(d.get("wall", 0.0)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("unreadable %s (%s); world-size changes will not be reported this attempt", path, e)
        return None


def record_world(run_dir: str | os.PathLike[str], world_size: int, dp_size: int | None = None,
                 attempt: int | None = None) -> None:
    """Atomically (tmp + rename) record the world the job is training with."""
    if world_size < 1 or (dp_size is not None and dp_size < 1):
        raise ValueError(f"world_size and dp_size must be >= 1, got {world_size} and {dp_size}")
    rec = WorldRecord(world_size=world_size, dp_size=world_size if dp_size is None else dp_size,
                      attempt=attempt, wall=time.time())
    path = Path(run_dir) / WORLD_RECORD
    # unique per writer: nodes sharing one run directory may write at the same moment
    tmp = path.with_name(f".{WORLD_RECORD}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(asdict(rec)))
    os.replace(tmp, path)
