"""World-size record: how ``on_scale`` callbacks learn that the world changed between attempts.

Local rank 0 of every node writes ``RUN_DIR/world.json`` (world size, data-parallel size, attempt) once the
first step of an attempt has completed; by then every rank of that attempt has passed the start of
``steps()`` (a synchronous step includes a collective), where each rank reads the record and, when its own
world differs, calls the registered callbacks before the first step. Writing only after a completed step is
what keeps a slow-starting rank from reading its own attempt's record; writing on every node is what gives
each node's run directory (shared or not) the record.

The launcher needs nothing else for nodes that trained in the round before. A node that did not has no record
(a hot spare joining the job), or, with a run directory of its own, a stale one (a node lost or benched and back:
its record is of the world it last trained in, while the others' is of the round they trained in since): the
agent records the *previous* round's world on that node's run directory before spawning its workers
(:func:`resilient.launcher.workers.record_previous_world`), so its ranks call the callbacks like everyone else.

The data-parallel size is ``RESILIENT_DP_SIZE`` as ``resilient-run`` sets it (the number of replicas with
``--nodes-per-replica``, else the world size); the reason is that of the supervisor's action that started
the round (``RESILIENT_ROUND_REASON``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from resilient import env
from resilient.signals.api import ScaleEvent

logger = logging.getLogger(__name__)

WORLD_RECORD = "world.json"


@dataclass(frozen=True)
class WorldRecord:
    world_size: int
    dp_size: int
    attempt: int | None = None
    wall: float = 0.0
    host: str | None = None  # the machine that wrote it (records written before it was kept have none)


def read_world(run_dir: str | os.PathLike[str]) -> WorldRecord | None:
    path = Path(run_dir) / WORLD_RECORD
    try:
        d = json.loads(path.read_text())
        host = d.get("host")
        return WorldRecord(world_size=int(d["world_size"]), dp_size=int(d["dp_size"]),
                           attempt=d.get("attempt"), wall=float(d.get("wall", 0.0)),
                           host=host if isinstance(host, str) else None)
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
                      attempt=attempt, wall=time.time(), host=socket.gethostname())
    path = Path(run_dir) / WORLD_RECORD
    # unique per writer: nodes sharing one run directory may write at the same moment
    tmp = path.with_name(f".{WORLD_RECORD}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(asdict(rec)))
    os.replace(tmp, path)


def current_dp_size(world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """This attempt's data-parallel size: ``RESILIENT_DP_SIZE``, else ``world_size`` (every rank a replica)."""
    raw = environ.get(env.DP_SIZE, "").strip()
    try:
        return int(raw) if raw else world_size
    except ValueError:
        raise ValueError(f"{env.DP_SIZE}={raw!r}: expected a whole number") from None


def scale_event(run_dir: str | os.PathLike[str], world_size: int, dp_size: int,
                environ: Mapping[str, str] = os.environ) -> ScaleEvent | None:
    """The change since the last attempt that trained, or None when there was none (or no record)."""
    prev = read_world(run_dir)
    if prev is None or (prev.world_size == world_size and prev.dp_size == dp_size):
        return None
    return ScaleEvent(old_world_size=prev.world_size, new_world_size=world_size, old_dp_size=prev.dp_size,
                      new_dp_size=dp_size, reason=environ.get(env.ROUND_REASON) or None)
