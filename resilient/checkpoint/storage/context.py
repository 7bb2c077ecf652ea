"""What the checkpointer's components share: the tiers, this rank's place in the job, its groups, the ledger.

``CheckpointManager`` is a façade over components (saving, the peer ring in ``replicate/peer.py``, uploads
in ``upload/uploader.py``, restore in ``restore/restore.py``) that each hold the one :class:`Context` built at
construction. :meth:`Context.commit` is the one writer of a step's commit marker.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from resilient.checkpoint.api import COMMIT_MARKER, PER_RANK_PREFIX, CheckpointConfig
from resilient.checkpoint.storage.collective import Ranks
from resilient.checkpoint.storage.retention import retain
from resilient.events.api import EventKind

logger = logging.getLogger(__name__)

# DCP raises CheckpointException, a BaseException: `except Exception` alone lets a failed write (a full
# disk) kill the thread that runs it
FAILURES: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def quiet(fn: Any, *args: Any, **kw: Any) -> Any:
    """DCP warns on every single-process call that it "assumes" single-process intent; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kw)


def one_line(e: BaseException) -> str:
    """An error for the ledger and a warning: DCP's CheckpointException carries whole tracebacks; keep the
    underlying error of the first failed rank."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = next(iter(e.failures.items()))
        return f"{type(inner).__name__}: {inner} (rank {rank})"
    return f"{type(e).__name__}: {e}"


def per_rank_key(rank: int, fqn: str) -> str:
    return f"{PER_RANK_PREFIX.format(rank=rank)}.{fqn}"


def rmdir_quiet(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass  # not empty (another rank of this node still uses it) or gone


@dataclass
class Context:
    """One rank's checkpointing context (built once by the manager; components only read it)."""

    config: CheckpointConfig
    rank: int
    world_size: int
    local_world_size: int
    distributed: bool
    pg: Any  # the manager's own gloo group (saves, replication, restore)
    pg_up: Any  # the uploader's group
    local: Any  # DirTier | None
    peer: Any  # DirTier | None
    persistent: Any  # BoundedTier | None
    scratch: Path
    ledger: Any  # Ledger | None
    snapshot: Any = None  # SnapshotRing | None: this rank's snapshots in node memory

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    def emit(self, kind: EventKind, **details: Any) -> None:
        if self.ledger is not None:
            self.ledger.emit(kind, rank=self.rank, **details)

    def ranks(self, group: Any) -> Ranks:
        return Ranks(group, self.rank, self.world_size, self.distributed)

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def commit(self, tier: Any, step: int, ranks: list[int]) -> None:
        body = {"step": step, "world_size": self.world_size, "ranks": ranks, "wall": time.time()}
        tier.write_bytes(step, COMMIT_MARKER, json.dumps(body).encode())


class Component:
    """A part of the manager: reads the shared :class:`Context` (``self.ctx``), never copies it."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    # helpers
    def _emit(self, kind: EventKind, **details: Any) -> None:
        self.ctx.emit(kind, **details)

    def _ranks(self, group: Any) -> Ranks:
        return self.ctx.ranks(group)

    def _gather(self, obj: Any, group: Any) -> list[Any]:
        return self.ctx.ranks(group).gather(obj)

    def _bcast(self, obj: Any, group: Any) -> Any:
        return self.ctx.ranks(group).broadcast(obj)

    def _all(self, ok: bool) -> bool:
        return all(self._gather(bool(ok), self.ctx.pg))

    def _node_ranks(self, node: int) -> list[int]:
        return self.ctx.node_ranks(node)

    def _commit(self, tier: Any, step: int, ranks: list[int]) -> None:
        self.ctx.commit(tier, step, ranks)

    def _retain(self, tier: Any, keep: int, pinned_from: int | None, drop_newer_partial: bool = False) -> None:
        retain(tier, keep, pinned_from, drop_newer_partial)
