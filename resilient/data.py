"""``ResumableSampler``: a drop-in for ``DistributedSampler`` whose position is checkpoint state.

The epoch's permutation is global and fixed by ``seed + epoch``; the ranks walk it in lockstep (rank ``r``
of ``W`` takes positions ``consumed + r``, ``consumed + r + W``, ...). Its state is the number of samples
of the epoch that the whole job has consumed, the same on every rank. So after any change of world size —
scale down, scale up, a hot swap — the job continues with exactly the samples not yet consumed: none
skipped, none repeated.

``ElasticBatch``: the same global batch at every data-parallel size. A global step takes the next
``global_batch`` positions of the epoch's order, whatever the size; the size only decides how they are split
into micro-steps (gradient accumulation) and ranks. With :meth:`ResumableSampler.next_global_batch` the
position is the sampler's state, so a run that changes size any number of times mid-epoch sees every sample
exactly once, in the uninterrupted run's order, and (with the loss scaled as :class:`ElasticBatch` says) the
uninterrupted run's gradients.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from resilient import env


@dataclass(frozen=True)
class MicroBatch:
    """One rank's share of one micro-step of a global step.

    ``positions``: positions into the epoch's order; ``indices``: the samples at them (the data set's indices;
    equal to ``positions`` without a sampler). ``loss_scale``: multiply the SUM of this micro-batch's per-sample
    losses by it before ``backward()`` (see :class:`ElasticBatch`). An empty micro-batch (``empty``) still runs
    its step with a zero loss (e.g. ``model(x[:0]).sum() * 0``) so the rank joins the gradient collective."""

    micro_step: int
    positions: range
    indices: tuple[int, ...]
    loss_scale: float

    @property
    def empty(self) -> bool:
        return len(self.positions) == 0

    def __len__(self) -> int:
        return len(self.positions)


class ElasticBatch:
    """The gradient-accumulation steps and each rank's samples that keep ``global_batch`` samples per step at
    any data-parallel size ``d``, each rank taking at most ``micro_batch`` samples per micro-step.

    Layout of one global step of ``S`` samples (``S = global_batch``, less only at an epoch's short tail), at
    positions ``start .. start+S-1`` of the epoch's order:

    * ``accum_steps(d) = ceil(S / (micro_batch * d))`` micro-steps; micro-step ``m`` takes the chunk of
      positions ``[start + m*micro_batch*d, start + min((m+1)*micro_batch*d, S))``;
    * a chunk of ``c`` positions is split into ``d`` consecutive runs, rank ``r`` taking the ``r``-th; their
      lengths are ``c // d`` plus one for the first ``c % d`` ranks, so ranks differ by at most one sample.
      Every chunk but the last is full (``micro_batch`` each); the last may leave a rank with no sample: it
      gets an empty :class:`MicroBatch` and must still run the micro-step (DDP/FSDP's collective needs it).

    The gradient equals the uninterrupted run's, whose step loss is the MEAN of the ``S`` per-sample losses,
    when each rank multiplies each micro-batch's SUM of per-sample losses by ``loss_scale(d) = d / S`` and
    the data-parallel wrapper averages gradients over the ``d`` ranks (DDP, FSDP2's default): the average of
    ``d`` ranks' sums times ``d / S`` is the sum over the step's samples divided by ``S``. Only the summation
    order changes with ``d`` (exact in real numbers, within rounding in floating point).

    ``even=True`` refuses sizes whose micro-steps are not all full (``global_batch`` not a multiple of
    ``micro_batch * d``), for steps that need one shape. ``max_accum_steps`` bounds the accumulation
    steps a size may need. Sizes outside the bounds raise ValueError naming the numbers (:meth:`check`)."""

    def __init__(self, global_batch: int, micro_batch: int, *, even: bool = False,
                 max_accum_steps: int = 4096) -> None:
        for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch),
                        ("max_accum_steps", max_accum_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ElasticBatch: {name} must be a whole number >= 1, got {v!r}")
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.even, self.max_accum_steps = even, max_accum_steps

    def __repr__(self) -> str:
        return (f"ElasticBatch(global_batch={self.global_batch}, micro_batch={self.micro_batch}, even={self.even}, "
                f"max_accum_steps={self.max_accum_steps})")

    def check(self, dp_size: int) -> None:
        """Raise ValueError (one line, naming the numbers) when the global batch cannot be made at ``dp_size``."""
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"ElasticBatch: the data-parallel size must be a whole number >= 1, got {dp_size!r}")
        g, mb = self.global_batch, self.micro_batch
        if dp_size > g:
            raise ValueError(f"ElasticBatch: data-parallel size {dp_size} exceeds the global batch {g}: "
                             f"{dp_size - g} replica(s) would never get a sample; use a global batch >= {dp_size}")
        if self.even and g % (mb * dp_size):
            raise ValueError(f"ElasticBatch: global batch {g} is not a multiple of micro_batch {mb} x data-parallel "
                             f"size {dp_size} = {mb * dp_size} (even=True); choose a global batch every size divides")
        accum = -(-g // (mb * dp_size))
        if accum > self.max_accum_steps:
            raise ValueError(f"ElasticBatch: global batch {g} at data-parallel size {dp_size} with micro_batch {mb} "
                             f"needs {accum} accumulation steps, over max_accum_steps={self.max_accum_steps}")

    def accum_steps(self, dp_size: int, samples: int | None = None) -> int:
        """Micro-steps of a global step of ``samples`` (default ``global_batch``) at ``dp_size``."""
        self.check(dp_size)
        s = self._samples(samples)
        return -(-s // (self.micro_batch * dp_size))

    def loss_scale(self, dp_size: int, samples: int | None = None) -> float:
        """The factor for each micro-batch's SUM of per-sample losses: ``dp_size / samples``."""
        self.check(dp_size)
        return dp_size / self._samples(samples)

    def micro_batches(self, dp_size: int, dp_rank: int, start: int = 0, samples: int | None = None,
                      order: list[int] | None = None) -> list[MicroBatch]:
        """Rank ``dp_rank``'s micro-batches of the global step at epoch positions ``start ..
        start+samples-1`` (``samples`` default ``global_batch``); ``order``: the epoch's order (the sampler's
        permutation) giving the indices, else the positions are the indices."""
        self.check(dp_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not (0 <= dp_rank < dp_size):
            raise ValueError(f"ElasticBatch: dp_rank {dp_rank!r} is not in [0, {dp_size})")
        s = self._samples(samples)
        chunk = self.micro_batch * dp_size
        scale = dp_size / s
        out = []
        for m in range(-(-s // chunk)):
            lo = start + m * chunk
            c = min(chunk, s - m * chunk)
            q, extra = divmod(c, dp_size)
            first = lo + dp_rank * q + min(dp_rank, extra)
            pos = range(first, first + q + (1 if dp_rank < extra else 0))
            idx = tuple(order[p] for p in pos) if order is not None else tuple(pos)
            out.append(MicroBatch(micro_step=m, positions=pos, indices=idx, loss_scale=scale))
        return out

    def _samples(self, samples: int | None) -> int:
        if samples is None:
            return self.global_batch
        if not (1 <= samples <= self.global_batch):
            raise ValueError(f"ElasticBatch: a step of {samples} samples is outside [1, {self.global_batch}]")
        return samples


class ResumableSampler(torch.utils.data.Sampler[int]):
    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        """``dataset``: a sized data set or its length. ``num_replicas``/``rank`` default to the data-parallel
        size and rank under ``resilient-run`` (:func:`resilient.topology`: the world size and rank unless
        ``--nodes-per-replica``), else to the process group's (or ``WORLD_SIZE``/``RANK``), as
        ``DistributedSampler``'s do."""
        n = dataset if isinstance(dataset, int) else len(dataset)
        if n < 0:
            raise ValueError(f"ResumableSampler: the data set length must be >= 0, got {n}")
        if (num_replicas is None or rank is None) and os.environ.get(env.DP_SIZE):
            # under resilient-run the replicas, not the ranks, split the data: the ranks of one replica
            # (tensor/pipeline parallel) take the same samples
            from resilient.topology import topology

            t = topology()
            num_replicas = t.dp_size if num_replicas is None else num_replicas
            rank = t.dp_rank if rank is None else rank
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
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation) for next_global_batch

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

    def next_global_batch(self, batch: ElasticBatch, dp_size: int | None = None,
                          dp_rank: int | None = None) -> list[MicroBatch]:
        """This rank's micro-batches of the next global step (see :class:`ElasticBatch`), and the position moved
        past the whole step (every rank calls it once per step, so the state stays the same on every rank).
        ``dp_size``/``dp_rank`` default to :func:`resilient.topology`'s. An empty list: the epoch is over
        (with ``drop_last``, also when fewer than ``global_batch`` samples are left); call :meth:`set_epoch`.
        The last step of an epoch whose length ``global_batch`` does not divide has the samples left."""
        if dp_size is None or dp_rank is None:
            from resilient.topology import topology

            t = topology()
            dp_size = t.dp_size if dp_size is None else dp_size
            dp_rank = t.dp_rank if dp_rank is None else dp_rank
        pos = self._position()
        left = self.n - pos
        if left <= 0 or (self.drop_last and left < batch.global_batch):
            return []
        take = min(batch.global_batch, left)
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.permutation())  # one permutation per epoch, not one per step
        out = batch.micro_batches(dp_size, dp_rank, start=pos, samples=take, order=self._order[1])
        self.consumed, self._taken = pos + take, 0
        return out

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
