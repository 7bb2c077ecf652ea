"""``ResumableSampler``: a drop-in for ``DistributedSampler`` whose position is checkpoint state.

The epoch's permutation is global and fixed by ``seed + epoch``; the ranks walk it in lockstep (rank ``r``
of ``W`` takes positions ``consumed + r``, ``consumed + r + W``, ...). Its state is the number of samples
of the epoch that the whole job has consumed, the same on every rank. So after any change of world size —
scale down, scale up, a hot swap — the job continues with exactly the samples not yet consumed: none
skipped, none repeated.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch


class ResumableSampler(torch.utils.data.Sampler[int]):
    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        """``dataset``: a sized data set or its length. ``num_replicas``/``rank`` default to the process
        group's (or ``WORLD_SIZE``/``RANK``), as ``DistributedSampler``'s do."""
        n = dataset if isinstance(dataset, int) else len(dataset)
        if n < 0:
            raise ValueError(f"ResumableSampler: the data set length must be >= 0, got {n}")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
                rank = dist.get_rank() if rank is None else rank
            else:
                num_replicas = int(os.environ.get("WORLD_SIZE", "1")) if num_replicas is None else num_replicas
                rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if num_replicas < 1 or not (0 <= rank < num_replicas):
            raise ValueError(f"ResumableSampler: rank {rank} is not in [0, {num_replicas})")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.consumed = 0  # samples of this epoch consumed by the whole job when the current iteration began
        self._taken = 0  # samples this rank has taken from the current iterator

    def permutation(self, epoch: int | None = None) -> list[int]:
        e = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + e)
        return torch.randperm(self.n, generator=g).tolist()

    def _position(self) -> int:
        return min(self.n, self.consumed + self._taken * self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        self.consumed, self._taken = self._position(), 0
        perm = self.permutation()
        left = self.n - self.consumed
        rounds = left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)
        for k in range(rounds):
            i = self.consumed + k * self.num_replicas + self.rank
            if i >= self.n:
                return  # the epoch's tail is shorter than the world: this rank has no sample left
            self._taken = k + 1
            yield perm[i]

    def __len__(self) -> int:
        left = self.n - self._position()
        if self.drop_last:
            return left // self.num_replicas
        return max(0, -(-(left - self.rank) // self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed, self._taken = epoch, 0, 0

    # the same on every rank, so DCP may keep one copy of it
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self._position(), "seed": self.seed, "n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if int(sd.get("n", self.n)) != self.n or int(sd.get("seed", self.seed)) != self.seed:
            raise ValueError(f"ResumableSampler: the checkpoint's sampler is for {sd.get('n')} samples with seed "
                             f"{sd.get('seed')}, this one for {self.n} with seed {self.seed}")
        self.epoch, self.consumed, self._taken = int(sd["epoch"]), int(sd["consumed"]), 0
