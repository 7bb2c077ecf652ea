"""Restore at another data-parallel size: the byte ranges of saved chunks that a new local shard needs.

A ``DTensor`` saved at one layout (FSDP2 ``Shard(0)`` over 2 ranks, TP ``Shard(1)`` inside a replica, both)
is read back at another by intersecting the new local shard's box with each saved chunk's box. A saved
chunk is one row-major ``torch.save`` record whose data offset the manifest gives (``FileEntry.items``), so
the intersection is a list of runs contiguous in the file *and* in the new local tensor: each becomes a
:class:`Span` into a flat view of the local tensor, and the file is read only in the manifest blocks those
runs touch (each block still verified whole: the digest is per block), from whichever copy holds it.

DCP's own planner, which this replaces for such tensors, loads every overlapping saved chunk whole with
``torch.load`` and narrows it, over files fetched whole: a rank that needs half of another rank's shard
received and held the whole file. Pure functions; no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from resilient.checkpoint.api import FileEntry
from resilient.checkpoint.format.spans import Span


def box_runs(chunk_off: Sequence[int], chunk_size: Sequence[int], local_off: Sequence[int],
             local_size: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(element offset in the chunk, element offset in the local shard, elements) of each run of the
    intersection of a saved chunk's box and the local shard's box, both row-major, in chunk order.

    Trailing dimensions the intersection spans whole in both boxes are merged into one run."""
    nd = len(chunk_size)
    lo = [max(a, b) for a, b in zip(chunk_off, local_off)]
    hi = [min(a + s, b + n) for a, s, b, n in zip(chunk_off, chunk_size, local_off, local_size)]
    if any(h <= l for l, h in zip(lo, hi)) or nd == 0:
        if nd == 0:
            yield 0, 0, 1
        return
    cs = [1] * nd  # row-major strides, in elements
    ls = [1] * nd
    for d in range(nd - 2, -1, -1):
        cs[d] = cs[d + 1] * chunk_size[d + 1]
        ls[d] = ls[d + 1] * local_size[d + 1]
    # the run covers dims [k, nd): dim k partly, every later dim whole in the chunk and the shard
    k = nd - 1
    while k > 0 and all(lo[j] == chunk_off[j] == local_off[j] and hi[j] - lo[j] == chunk_size[j] == local_size[j]
                        for j in range(k, nd)):
        k -= 1
    n = (hi[k] - lo[k]) * math.prod(hi[j] - lo[j] for j in range(k + 1, nd))
    outer = [range(lo[d], hi[d]) for d in range(k)]

    def walk(d: int, c: int, l: int) -> Iterator[tuple[int, int, int]]:
        if d == k:
            yield (c + (lo[k] - chunk_off[k]) * cs[k], l + (lo[k] - local_off[k]) * ls[k], n)
            return
        for i in outer[d]:
            yield from walk(d + 1, c + (i - chunk_off[d]) * cs[d], l + (i - local_off[d]) * ls[d])

    yield from walk(0, 0, 0)


def run_spans(data_off: int, itemsize: int, runs: Sequence[tuple[int, int, int]], flat: torch.Tensor) -> list[Span]:
    """Spans of a file (the chunk's data at ``data_off``) landing in ``flat`` (a 1-D view of the local shard)."""
    return [Span(data_off + c * itemsize, n * itemsize, target=flat[l:l + n]) for c, l, n in runs if n]


def cover(size: int, taking: Sequence[Span]) -> list[Span] | None:
    """The file cut into spans in file order: ``taking`` (spans into targets) and the checked-only bytes
    between them; None when two of them overlap (not a file DCP wrote: the caller takes DCP's path)."""
    out: list[Span] = []
    pos = 0
    for s in sorted(taking, key=lambda s: s.off):
        if s.off < pos or s.off + s.n > size:
            return None
        if s.off > pos:
            out.append(Span(pos, s.off - pos))
        out.append(s)
        pos = s.off + s.n
    if pos < size:
        out.append(Span(pos, size - pos))
    return out


def blocks_touched(bounds: Sequence[tuple[int, int]], taking: Sequence[Span]) -> frozenset[int]:
    """Indices of the verification blocks (``bounds``: (start, end) each) that some span of ``taking`` overlaps."""
    starts = [a for a, _ in bounds]
    out: set[int] = set()
    for s in taking:
        if not s.n:
            continue
        i = bisect.bisect_right(starts, s.off) - 1
        while i < len(bounds) and bounds[i][0] < s.off + s.n:
            if bounds[i][1] > s.off:
                out.add(i)
            i += 1
    return frozenset(out)


def chunk_spans(key: str, m: Any, local: torch.Tensor, offsets: tuple[int, ...], chunk_at: Mapping[Any, Any],
                files: Mapping[str, FileEntry]) -> dict[str, list[Span]] | None:
    """File -> spans of the saved chunks of ``key`` that land in ``local`` (a DTensor's local shard at global
    ``offsets``), or None when some overlapping chunk is not a plain record the manifest locates (DCP's path)."""
    if not isinstance(m, TensorStorageMetadata) or m.properties.dtype != local.dtype or not local.is_contiguous() \
            or local.device.type not in ("cpu", "cuda"):
        return None
    flat = local.detach().view(-1)
    itemsize = local.element_size()
    out: dict[str, list[Span]] = {}
    covered = 0
    for c in m.chunks:
        runs = list(box_runs(tuple(c.offsets), tuple(c.sizes), offsets, tuple(local.shape)))
        if not runs:
            continue
        info = chunk_at.get((key, tuple(int(o) for o in c.offsets)))
        entry = files.get(info.relative_path) if info is not None else None
        if info is None or entry is None or info.transform_descriptors:
            return None
        at = next(((start, n) for off, start, n in entry.items if off == info.offset), None)
        if at is None or at[1] != math.prod(c.sizes) * itemsize:
            return None
        out.setdefault(info.relative_path, []).extend(run_spans(at[0], itemsize, runs, flat))
        covered += sum(n for _, _, n in runs)
    if covered != local.numel():
        return None
    return out
