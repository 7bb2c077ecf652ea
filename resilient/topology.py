"""``resilient.topology()``: where this rank sits in the job's data-parallel layout, and its ``DeviceMesh``.

Under ``resilient-run --nodes-per-replica K`` a data-parallel replica is K consecutive nodes, so with
``nproc`` workers per node it holds ``K x nproc`` consecutive global ranks: the data-parallel dimension is
outermost, as ``init_device_mesh(device, (dp, ...), mesh_dim_names=("dp", ...))`` lays ranks out. The
number of replicas (``dp_size``) is what grows and shrinks when the job scales; the inner dimensions (the
user's tensor, pipeline or FSDP sharding inside a replica) keep their size.

Without the flag (or outside ``resilient-run``, from ``RANK``/``WORLD_SIZE``) every rank is a replica.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resilient import env

__all__ = ["Topology", "topology"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job: ``rank`` of ``world_size``, in replica ``dp_rank`` of ``dp_size``; each
    replica holds ``ranks_per_replica`` consecutive ranks (``nodes_per_replica`` nodes, None when every rank is
    a replica)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    nodes_per_replica: int | None
    ranks_per_replica: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not (0 <= self.rank < self.world_size):
            raise ValueError(f"Topology: rank {self.rank} is not in [0, {self.world_size})")
        if self.ranks_per_replica < 1 or self.dp_size < 1:
            raise ValueError(f"Topology: ranks_per_replica ({self.ranks_per_replica}) and dp_size ({self.dp_size}) "
                             "must be >= 1")
        if self.nodes_per_replica is not None and self.nodes_per_replica < 1:
            raise ValueError(f"Topology: nodes_per_replica must be >= 1, got {self.nodes_per_replica}")
        if self.dp_size * self.ranks_per_replica != self.world_size:
            raise ValueError(f"Topology: a world of {self.world_size} ranks is not {self.dp_size} replicas of "
                             f"{self.ranks_per_replica} ranks; start the job with a node count that is a multiple "
                             "of --nodes-per-replica")
        if self.dp_rank != self.rank // self.ranks_per_replica:
            raise ValueError(f"Topology: rank {self.rank} is in replica {self.rank // self.ranks_per_replica} "
                             f"(replicas of {self.ranks_per_replica} ranks), not {self.dp_rank}")

    @property
    def replica_rank(self) -> int:
        """This rank's position inside its replica (0 .. ranks_per_replica - 1)."""
        return self.rank % self.ranks_per_replica

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's replica, in order."""
        first = self.dp_rank * self.ranks_per_replica
        return tuple(range(first, first + self.ranks_per_replica))

    @property
    def dp_group_ranks(self) -> tuple[int, ...]:
        """This rank's data-parallel peers (itself included): the rank at the same position in every replica.
        They do the same work on other data, so they are the ranks to compare (stragglers) or average over."""
        return tuple(range(self.replica_rank, self.world_size, self.ranks_per_replica))

    def mesh(self, device_type: str, **inner: int) -> Any:
        """The ``DeviceMesh`` of the current size: ``dp`` outermost, then ``inner``'s dimensions in the order
        given, e.g. ``topology().mesh("cuda", tp=8)`` for replicas of one 8-GPU node with tensor parallelism
        inside. The product of ``inner`` must be ``ranks_per_replica``; with no inner dimension every rank must
        be a replica (a 1-D ``("dp",)`` mesh). Needs the default process group (``init_process_group``)."""
        shape = self.mesh_shape(**inner)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, shape, mesh_dim_names=("dp", *inner))

    def mesh_shape(self, **inner: int) -> tuple[int, ...]:
        """The shape :meth:`mesh` builds, checked: ``(dp_size, *inner.values())``."""
        for name, size in inner.items():
            if name == "dp":
                raise ValueError("Topology.mesh: 'dp' is the outer dimension resilient sizes; name the inner "
                                 "dimensions otherwise (tp, pp, fsdp, ...)")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Topology.mesh: dimension {name}={size!r} must be a whole number >= 1")
        prod = math.prod(inner.values())
        if not inner and self.ranks_per_replica > 1:
            raise ValueError(f"Topology.mesh: a replica has {self.ranks_per_replica} ranks "
                             f"({self.nodes_per_replica or 1} node(s) x "
                             f"{self.ranks_per_replica // (self.nodes_per_replica or 1)} workers): name its inner "
                             f"dimensions, e.g. mesh(device_type, tp={self.ranks_per_replica})")
        if prod != self.ranks_per_replica:
            dims = " x ".join(f"{k}={v}" for k, v in inner.items())
            raise ValueError(f"Topology.mesh: inner dimensions {dims} make {prod} ranks but a replica has "
                             f"{self.ranks_per_replica} ({self.nodes_per_replica or 1} node(s) x "
                             f"{self.ranks_per_replica // (self.nodes_per_replica or 1)} workers); give inner "
                             f"dimensions whose product is {self.ranks_per_replica}")
        return (self.dp_size, *inner.values())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Topology:
        """Read from a worker's environment: ``RESILIENT_DP_SIZE``/``RESILIENT_DP_RANK``/
        ``RESILIENT_NODES_PER_REPLICA`` as ``resilient-run`` sets them, else ``RANK``/``WORLD_SIZE`` (or the
        initialised default process group) with every rank a replica."""
        rank, world = _rank_world(environ)
        k = _int(environ, env.NODES_PER_REPLICA)
        dp_size = _int(environ, env.DP_SIZE)
        if dp_size is None:
            dp_size = world
        if world % dp_size:
            raise ValueError(f"Topology: {env.DP_SIZE}={dp_size} does not divide WORLD_SIZE={world}")
        rpr = world // dp_size
        dp_rank = _int(environ, env.DP_RANK)
        return cls(rank=rank, world_size=world, dp_rank=rank // rpr if dp_rank is None else dp_rank,
                   dp_size=dp_size, nodes_per_replica=k, ranks_per_replica=rpr)


def topology(environ: Mapping[str, str] = os.environ) -> Topology:
    """This rank's :class:`Topology`, read from the environment ``resilient-run`` gives its workers."""
    return Topology.from_env(environ)


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number") from None


def _rank_world(environ: Mapping[str, str]) -> tuple[int, int]:
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    if rank is None or world is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return rank or 0, world or 1
