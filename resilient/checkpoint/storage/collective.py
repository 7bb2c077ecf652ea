"""Agreement across ranks, in one place: run a step on every rank, gather every rank's outcome, and raise
with every rank's failure (in the spirit of DCP's ``_DistWrapper.all_gather``), so that a rank never waits
in a collective another rank skipped and no rank's error is lost behind "see that rank's error"."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from resilient.checkpoint.api import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RankFailure:
    """A failure of one rank, as it travels to the others (exceptions need not be picklable)."""

    rank: int
    kind: str  # the exception's class name
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


class RanksFailedError(CheckpointError):
    """A collective step failed on some ranks; ``failures`` holds every failed rank's error."""

    def __init__(self, what: str, failures: list[RankFailure], local: BaseException | None = None):
        self.what, self.failures, self.local = what, failures, local
        shown = "; ".join(str(f) for f in failures[:8])
        more = f"; and {len(failures) - 8} more ranks" if len(failures) > 8 else ""
        super().__init__(f"{what} failed on {len(failures)} rank(s): {shown}{more}")


class Ranks:
    """The ranks of one of the checkpointer's own process groups (or a single process when ``group`` is None
    and no group exists).

    Never the job's default group: its backend may carry no host tensors (NCCL), and our background threads'
    collectives would interleave with the user's on it. In a distributed job the default group, or ``None``
    (which torch reads as the default group), is refused.
    """

    def __init__(self, group: Any, rank: int, world_size: int, distributed: bool):
        if distributed and (group is None or group is dist.GroupMember.WORLD):
            raise ValueError("the checkpointer's collectives run on its own gloo groups, never on the job's "
                             "default group: pass one")
        self.group, self.rank, self.world_size, self.distributed = group, rank, world_size, distributed

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        lst = [obj if self.rank == src else None]
        dist.broadcast_object_list(lst, src=src, group=self.group)
        return lst[0]

    def all_ok(self, ok: bool) -> bool:
        return all(self.gather(bool(ok)))

    def all_gather(self, what: str, fn: Callable[[], T],
                   catch: tuple[type[BaseException], ...] = (Exception,)) -> list[T]:
        """Run ``fn`` here, gather every rank's result; if any rank failed, raise on every rank: a rank that
        failed raises its own exception (its type kept for callers that catch it) with a note naming every
        rank's failure; the others raise :class:`RanksFailedError` naming every failure."""
        local: BaseException | None = None
        try:
            payload: Any = ("ok", fn())
        except catch as e:
            local = e
            payload = ("err", type(e).__name__, str(e))
        everyone = self.gather(payload)
        failures = [RankFailure(r, p[1], p[2]) for r, p in enumerate(everyone) if p[0] == "err"]
        if failures:
            err = RanksFailedError(what, failures, local)
            if local is not None:
                if len(failures) > 1:
                    local.add_note(str(err))
                raise local
            raise err
        return [p[1] for p in everyone]

    def run(self, what: str, fn: Callable[[], T], catch: tuple[type[BaseException], ...] = (Exception,)) -> T:
        """:meth:`all_gather` for a result that stays on this rank (only the outcome travels)."""
        box: list[T] = []

        def step() -> None:
            box.append(fn())

        self.all_gather(what, step, catch=catch)
        return box[0]
