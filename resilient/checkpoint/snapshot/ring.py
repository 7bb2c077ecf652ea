"""One rank's snapshots in node memory: two slots, each the state's tensor bytes in a file of the node's snapshot
directory (``/dev/shm``, mapped into the process) plus its objects, and a commit record written last.

Writing (:meth:`SnapshotRing.take`, on the training thread, from ``CheckpointManager.save``) copies the state's
tensors into the older slot's mapping after unlinking that slot's commit record; a thread of its own then digests
the slot (xxh3) and writes the record (a rename). A worker killed at any instant leaves the other slot committed.
Nothing here is collective, and no step waits for a disk.

Restoring (``Restorer``) gathers every rank's committed ``(step, epoch)`` pairs and takes the newest step that every
rank holds under one epoch, when it is at least as new as the newest step complete on a disk tier. The epoch is
agreed at every restore and written into each later snapshot, so snapshots of two lineages (before and after a
restore from an older step) never mix. Each rank then checks its slot against its state (keys, shapes, dtypes,
DTensor placements, world size) and its digest before any byte lands; only when every rank can, every rank loads.

The cadence follows the cost: with ``every="auto"`` a snapshot is taken every k steps, k the smallest that keeps its
measured cost (the copy, plus the digest's CPU) within ``budget`` of the measured step time on the slowest rank. The
ranks agree on k (the manager's save worker gathers the proposals) first a few steps into an attempt, then at each
disk save, effective from a step none should have reached (the cadence in force until then), since a snapshot is only
of use when every rank has one of the same step. Each snapshot records
the cadence it was taken under, and a restore carries it over (``resume``: the slowest rank's, from the first step after the restored one), so a worker
killed before its attempt's first disk save still left snapshots to restore from. Only a job's first attempt, with no
snapshot anywhere, takes two snapshots at its first two steps to measure the cost before the ranks agree. A state of
a few MiB is snapshotted every step.
"""

from __future__ import annotations

import io
import json
import logging
import math
import mmap
import os
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from resilient.checkpoint.format.safe import safe_torch_load
from resilient.checkpoint.format.state import (dtensor_type, flatten, is_stateful, local_tensor, param_like,
                                               plain_state, set_path)

logger = logging.getLogger(__name__)

SLOTS = 2
VERSION = 1
_COMMIT_WAIT_S = 5.0  # an earlier snapshot's digest still running after this long: skip a snapshot rather than wait
_MAX_EVERY = 100_000


@dataclass(frozen=True)
class Leaf:
    """One leaf of a snapshot's layout: where its bytes are, and what it must match to be restored."""

    fqn: str
    path: tuple[Any, ...]
    kind: str  # "t": a plain tensor, "d": a DTensor's local shard, "o": an object (pickled with the others)
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0
    dmeta: str = ""  # a DTensor's placements, mesh shape, coordinate and global shape

    def to_json(self) -> list[Any]:
        return [self.fqn, list(self.path), self.kind, self.dtype, list(self.shape), self.offset, self.nbytes,
                self.dmeta]

    @classmethod
    def from_json(cls, v: list[Any]) -> "Leaf":
        fqn, path, kind, dtype, shape, off, n, dmeta = v
        return cls(str(fqn), tuple(path), str(kind), str(dtype), tuple(int(x) for x in shape), int(off), int(n),
                   str(dmeta))


def _dmeta(v: Any) -> str:
    mesh = v.device_mesh
    return json.dumps([str(v.placements), list(mesh.mesh.shape), mesh.get_coordinate(), list(v.shape)])


def _plain_tensor(v: Any, dt: Any) -> str | None:
    """"t" or "d" for a tensor whose bytes a snapshot copies, None for anything else (pickled as an object)."""
    if not isinstance(v, torch.Tensor):
        return None
    if dt is not None and isinstance(v, dt):
        return "d"
    if type(v) is torch.Tensor or type(v) is torch.nn.Parameter:
        return "t"
    return None


def _json_path(path: tuple[Any, ...]) -> bool:
    return all(type(p) in (str, int) for p in path)


class _Slot:
    """A slot's files: ``rank<r>-slot<k>.bin`` (tensor bytes, mapped), ``.obj`` (objects), ``.json`` (commit)."""

    def __init__(self, directory: Path, rank: int, k: int):
        stem = directory / f"rank{rank}-slot{k}"
        self.bin, self.obj, self.record = (Path(f"{stem}.bin"), Path(f"{stem}.obj"), Path(f"{stem}.json"))
        self.map: mmap.mmap | None = None
        self.base: torch.Tensor | None = None
        self.size = 0
        self.dsts: list[torch.Tensor] = []  # one view of the mapping per tensor leaf, in the layout's order
        self.layout_key: Any = None
        self.layout_json = "[]"
        self.layout_hash = ""
        self.done = threading.Event()  # no digest of this slot is running
        self.done.set()

    def mapping(self, size: int) -> torch.Tensor | None:
        """The slot's bytes, ``size`` of them, reserved in memory now: ``posix_fallocate`` fails with ENOSPC on a full
        ``/dev/shm`` here instead of a SIGBUS at the first write into a page the file system could not give."""
        if self.base is not None and self.size == size:
            return self.base
        self.dsts, self.base, self.map = [], None, None  # the old mapping goes with its last view
        try:
            self.bin.unlink()
        except FileNotFoundError:
            pass
        self.size = size
        if size == 0:
            return None
        fd = os.open(self.bin, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        return self.base

    def invalidate(self) -> None:
        for p in (self.record,):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


@dataclass
class Offer:
    """What a rank holds: its committed snapshots as (step, epoch), and the auto cadence its newest one was taken
    under (None: not recorded, or not auto)."""

    held: list[tuple[int, str]]
    every: int | None = None


class SnapshotRing:
    """One rank's two snapshot slots in ``directory`` (see the module's docstring)."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int, every: int | str = "auto",
                 budget: float = 0.01, on_failure: Any = None, on_skipped: Any = None):
        self.dir = Path(directory)
        self.rank, self.world_size = rank, world_size
        self.every, self.budget = every, budget
        self.epoch = f"unset-{os.getpid()}-{time.time_ns()}"  # until a restore agrees on one: matches nothing
        self._slots = [_Slot(self.dir, rank, k) for k in range(SLOTS)]
        self._next_slot = self._newer_free()
        self._on_failure = on_failure  # called once with the reason when the tier turns itself off
        self._on_skipped = on_skipped  # called with (step, reason) for each snapshot skipped (the tier stays on)
        self.off: str | None = None  # why snapshots stopped, once they did
        # auto: every (first step, steps between snapshots) agreed, oldest first; the training thread reads it whole
        # (one tuple, replaced by the save worker), so a new cadence takes over at its first step and the one before
        # it goes on until then
        self._schedule: tuple[tuple[int, int], ...] = ()
        self._last_call: float | None = None
        self._step_s: float | None = None  # EMA of the time between save() calls: the step
        self._cost_s: float | None = None  # EMA of a snapshot's cost: copy on this thread + digest on the other
        self._digest_s = 0.0
        self._setup_s = 0.0  # of the snapshot being taken: time spent mapping a slot (left out of its cost)
        self._lock = threading.Lock()
        self._jobs: list[tuple[_Slot, dict[str, Any], bytes, str]] = []
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._commit_loop, name="resilient-ckpt-snapshot", daemon=True)
        self._thread.start()
        self.taken = 0  # snapshots handed to the commit thread (tests read it)
        self.last_step: int | None = None

    # ------------------------------------------------------------------ writing
    def _newer_free(self) -> int:
        """Start writing over the older committed slot, so that the newest one from before survives longest."""
        steps = []
        for k, s in enumerate(self._slots):
            head = _read_head(s.record)
            steps.append(-1 if head is None else int(head.get("step", -1)))
        return 0 if steps[0] <= steps[1] else 1

    @property
    def auto(self) -> bool:
        return self.every == "auto"

    def observe_call(self) -> None:
        """Once per ``save()`` call: the step time the auto cadence measures against."""
        now = time.perf_counter()
        if self._last_call is not None:
            dt = now - self._last_call
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self._last_call = now

    def due(self, step: int) -> bool:
        if self.off is not None:
            return False
        if isinstance(self.every, int):
            return self.every > 0 and (step + 1) % self.every == 0
        seg = self._segment_at(step)
        if seg is None:
            return not self._schedule and self.taken < 2  # two snapshots at the start measure the cost; then agree
        start, k = seg
        return k > 0 and (step - start) % k == 0

    def _segment_at(self, step: int) -> tuple[int, int] | None:
        """The agreed (first step, cadence) in force at ``step``, None before the first one starts."""
        for seg in reversed(self._schedule):
            if seg[0] <= step:
                return seg
        return None

    def proposal(self) -> int | None:
        """This rank's cadence for the agreement (``agree``): steps between snapshots by its measured cost, 0 when the
        tier is off here, None before anything was measured."""
        if self.off is not None:
            return 0
        return self.cadence

    @property
    def agreed(self) -> tuple[int, int] | None:
        """The newest agreed (steps between snapshots, first step), None before any."""
        return (self._schedule[-1][1], self._schedule[-1][0]) if self._schedule else None

    def agree(self, k: int, start: int) -> bool:
        """The cadence every rank agreed on (the slowest rank's), from step ``start`` on, which no rank has passed:
        snapshots are only of use when every rank takes them at the same steps. A cadence within a quarter of the
        one in force keeps it (and its schedule): every change starts the schedule again ``start`` steps ahead, so a
        cost that wavers between 6 and 7 steps must not move it at each save. Returns whether it changed; every rank
        decides the same from the same proposals. The cadence in force goes on until ``start``: changing it must not
        leave the steps in between without snapshots."""
        k = int(k)
        if self._schedule:
            old = self._schedule[-1][1]
            if k == old or (k > 0 and old > 0 and abs(k - old) <= 0.25 * old):
                return False
        kept = tuple(x for x in self._schedule if x[0] < start)[-2:]  # the training thread is past none of start
        self._schedule = (*kept, (int(start), k))
        return True

    def resume(self, offers: "list[Offer | None]", start: int) -> int | None:
        """At a restore, every rank with the same ``offers`` (the gather's): carry the cadence the snapshots were taken
        under over to this attempt from step ``start`` (the first it trains), the slowest rank's, so that snapshots
        resume at once rather than after the attempt's first disk save agrees one anew. A rank without a recorded
        cadence (a replacement node's fresh directory) takes the others'; when no rank recorded one, nothing changes.
        Returns the cadence now agreed, or None."""
        if not self.auto or self.off is not None or any(o is None for o in offers):
            return None
        ks = [o.every for o in offers if o is not None and o.every is not None]
        if not ks:
            return None
        k = max(int(x) for x in ks)
        self._schedule = ((int(start), k),)
        return k

    def take(self, step: int, state: Mapping[str, Any]) -> bool:
        """Copy ``state`` (after step ``step``) into the older slot; its commit follows on the ring's thread."""
        slot = self._slots[self._next_slot]
        # every slot's digest done, not only this one's: this slot's commit record goes now, so the other slot must
        # be committed already, or a kill in between leaves the rank no snapshot at all (under load the newer slot's
        # digest, queued behind this one's, can still be running here; a restart then fell back to a disk tier)
        deadline = time.monotonic() + _COMMIT_WAIT_S
        for s in self._slots:
            if not s.done.wait(max(0.0, deadline - time.monotonic())):
                why = (f"snapshot of step {step} skipped: the digest of an earlier snapshot is still running after "
                       f"{_COMMIT_WAIT_S:g} s (the host is overloaded, or its memory directory stalls)")
                logger.warning("rank %d: %s", self.rank, why)
                if self._on_skipped is not None:
                    try:
                        self._on_skipped(step, why)
                    except Exception as e:  # noqa: BLE001 - a report must not stop training
                        logger.debug("snapshot skip report failed: %s", e)
                return False
        # the cost starts here: a wait above is the digest of the snapshot before, which the cost counts already (and
        # the first two snapshots, a step apart, would count the first one's twice)
        t0 = time.perf_counter()
        try:
            objects, layout_json, key = self._copy(slot, state)
        except OSError as e:
            self._turn_off(f"cannot write the snapshot of step {step} into {self.dir}: {e}; the snapshot tier is off "
                           "for this process (restarts restore from the disk tiers)")
            return False
        except _Unsupported as e:
            self._turn_off(f"state not snapshotted: {e}")
            return False
        slot.done.clear()
        head = {"v": VERSION, "step": step, "epoch": self.epoch, "rank": self.rank, "world_size": self.world_size,
                "tensor_bytes": slot.size, "object_bytes": len(objects), "layout": key, "wall": time.time(),
                "every": ((self._segment_at(step) or (0, 0))[1] or None) if self.auto else (int(self.every) or None)}
        with self._cv:
            self._jobs.append((slot, head, objects, layout_json))
            self._cv.notify()
        self._next_slot = (self._next_slot + 1) % SLOTS
        self.taken += 1
        self.last_step = step
        copy_s = time.perf_counter() - t0 - self._setup_s
        self._setup_s = 0.0
        self._learn(step, copy_s)
        return True

    def _copy(self, slot: _Slot, state: Mapping[str, Any]) -> tuple[bytes, str, str]:
        dt = dtensor_type()
        flat = flatten(plain_state(state))
        # one pass that only tells tensors from objects: the layout itself is rebuilt only when this key changes
        # (per-leaf Python was most of a snapshot's cost: 4-5 ms a step for the GPT recipe's 129 tensors)
        key: list[Any] = []
        srcs: list[torch.Tensor] = []
        objects: dict[str, Any] = {}
        for fqn, (path, v) in flat.items():
            kind = _plain_tensor(v, dt)
            if kind is None:
                objects[fqn] = v
                key.append(fqn)
            elif kind == "t":
                srcs.append(v)
                key.append((fqn, v.dtype, v.shape))
            else:
                local = local_tensor(v)
                srcs.append(local)
                key.append((fqn, local.dtype, local.shape, v.placements, id(v.device_mesh)))
        slot.invalidate()
        if slot.layout_key != key:
            t0 = time.perf_counter()
            self._layout(slot, flat, dt)
            slot.layout_key = key
            # a slot's first snapshot maps and reserves its memory: not what the next ones cost (the cadence the
            # ranks agree on comes from the first snapshot alone)
            self._setup_s += time.perf_counter() - t0
        with torch.no_grad():
            pairs = [(d, s) for d, s in zip(slot.dsts, srcs) if d.numel()]
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [s.detach() for _, s in pairs])
        buf = io.BytesIO()
        if objects:
            torch.save(objects, buf)
        return buf.getvalue(), slot.layout_json, slot.layout_hash

    @staticmethod
    def _layout(slot: _Slot, flat: dict[str, tuple[tuple[Any, ...], Any]], dt: Any) -> None:
        """The slot's layout and mapping for a state whose leaves changed (the first snapshot, or another model)."""
        layout: list[Leaf] = []
        off = 0
        for fqn, (path, v) in flat.items():
            if not _json_path(path):
                raise _Unsupported(f"the key path {path!r} of {fqn!r} is not made of strings and integers")
            kind = _plain_tensor(v, dt)
            if kind is None:
                layout.append(Leaf(fqn, path, "o"))
                continue
            local = local_tensor(v)
            n = local.numel() * local.element_size()
            layout.append(Leaf(fqn, path, kind, str(local.dtype).removeprefix("torch."), tuple(local.shape), off, n,
                               _dmeta(v) if kind == "d" else ""))
            off += -(-n // 64) * 64
        base = slot.mapping(off)
        slot.dsts = []
        for leaf in layout:
            if leaf.kind == "o":
                continue
            dtype = getattr(torch, leaf.dtype)
            slot.dsts.append(base[leaf.offset:leaf.offset + leaf.nbytes].view(dtype).view(leaf.shape)
                             if base is not None and leaf.nbytes else torch.empty(leaf.shape, dtype=dtype))
        slot.layout_json = json.dumps([x.to_json() for x in layout])
        slot.layout_hash = xxhash.xxh3_64_hexdigest(slot.layout_json.encode())

    def _learn(self, step: int, copy_s: float) -> None:
        cost = copy_s + self._digest_s
        # the first snapshot of a process pays first calls (torch.save's, the copy kernels') several times over what
        # the next ones cost (8.6 against about 2 ms for the GPT recipe): the second one replaces its figure
        self._cost_s = cost if self._cost_s is None or self.taken <= 2 else 0.7 * self._cost_s + 0.3 * cost

    @property
    def cadence(self) -> int | None:
        """Steps between snapshots now (what ``every="auto"`` chose), None before it knows."""
        if isinstance(self.every, int):
            return self.every
        if self._cost_s is None or not self._step_s:
            return None
        if self._cost_s <= 0:
            return 1
        return max(1, min(_MAX_EVERY, math.ceil(self._cost_s / (self.budget * self._step_s))))

    def _commit_loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                slot, head, objects, layout_json = self._jobs.pop(0)
            # CPU time, not wall: a thread that waits for a core beside busy training costs training nothing, and
            # its wall time beside two CPU burners read as 30 ms, a cadence of 58 steps where 8 was due
            t0 = time.thread_time()
            try:
                h = xxhash.xxh3_64()
                if slot.map is not None:
                    h.update(memoryview(slot.map)[:slot.size])
                h.update(objects)
                head["xxh3"] = h.intdigest()
                _write_file(slot.obj, objects)
                tmp = slot.record.with_suffix(".tmp")
                _write_file(tmp, (json.dumps(head) + "\n" + layout_json).encode())
                os.replace(tmp, slot.record)
            except OSError as e:
                self._turn_off(f"cannot commit the snapshot of step {head['step']} in {self.dir}: {e}; the snapshot "
                               "tier is off for this process")
            finally:
                self._digest_s = time.thread_time() - t0
                slot.done.set()

    def _turn_off(self, why: str) -> None:
        if self.off is not None:
            return
        self.off = why
        # a snapshot left behind could be taken for the newest state later: nothing of this rank's is offered
        for s in self._slots:
            s.invalidate()
        logger.warning("rank %d: %s", self.rank, why)
        if self._on_failure is not None:
            try:
                self._on_failure(why)
            except Exception as e:  # noqa: BLE001 - a report must not stop training
                logger.debug("snapshot failure report failed: %s", e)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken is committed (tests, and ``close``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self._slots:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not s.done.wait(left):
                return False
        return True

    def close(self) -> None:
        self.flush(_COMMIT_WAIT_S)
        with self._cv:
            self._closed = True
            self._cv.notify()

    # ------------------------------------------------------------------ restoring
    def offer(self) -> Offer:
        """This rank's committed snapshots of this world size."""
        held = []
        newest: tuple[int, int | None] | None = None
        if self.off is None:
            for s in self._slots:
                head = _read_head(s.record)
                if head and head.get("v") == VERSION and head.get("rank") == self.rank \
                        and head.get("world_size") == self.world_size:
                    step = int(head["step"])
                    held.append((step, str(head["epoch"])))
                    every = head.get("every")
                    if newest is None or step > newest[0]:
                        newest = (step, int(every) if isinstance(every, int) and every > 0 else None)
        return Offer(held, newest[1] if newest is not None else None)

    def prepare(self, step: int, epoch: str, state: Mapping[str, Any]) -> "_Load | str":
        """Check this rank's snapshot of ``step`` against ``state`` and its digest; the load to apply, or why not."""
        slot = next((s for s in self._slots
                     if ((h := _read_head(s.record) or {}).get("step"), h.get("epoch")) == (step, epoch)), None)
        if slot is None:
            return f"no committed snapshot of step {step} (lineage {epoch[:8]})"
        try:
            raw = slot.record.read_bytes()
            head_line, _, layout_text = raw.partition(b"\n")
            head = json.loads(head_line)
            if (head.get("step"), head.get("epoch")) != (step, epoch):  # rewritten since it was offered
                return f"the snapshot of step {step} was replaced"
            layout = [Leaf.from_json(v) for v in json.loads(layout_text)]
            data = _map_private(slot.bin, int(head["tensor_bytes"]))
            objects = slot.obj.read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"snapshot of step {step} unreadable: {e}"
        if len(objects) != int(head["object_bytes"]):
            return f"snapshot of step {step}: objects file has {len(objects)} bytes, record says {head['object_bytes']}"
        h = xxhash.xxh3_64()
        if data is not None:
            h.update(memoryview(data))
        h.update(objects)
        if h.intdigest() != head.get("xxh3"):
            return f"snapshot of step {step}: digest mismatch (a corrupt slot)"
        try:
            objs = safe_torch_load(io.BytesIO(objects), str(slot.obj)) if objects else {}
        except Exception as e:  # noqa: BLE001 - refused or corrupt objects: the disk tiers decide instead
            return f"snapshot of step {step}: objects refused ({e})"
        plan = _plan_load(layout, state, dtensor_type())
        if isinstance(plan, str):
            return f"snapshot of step {step} does not fit the state: {plan}"
        return _Load(step, layout, data, objs, plan)


class _Unsupported(Exception):
    pass


@dataclass
class _Load:
    step: int
    layout: list[Leaf]
    data: Any  # a private mapping of the slot's tensor bytes (None without tensors)
    objects: dict[str, Any]
    plan: tuple[dict[str, tuple[tuple[Any, ...], Any]], dict[str, Any], dict[str, torch.Tensor]]  # see _plan_load

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.layout)

    def apply(self, state: Mapping[str, Any]) -> None:
        """Land the snapshot in ``state``: tensors in place, objects and new entries set, Stateful objects loaded."""
        leaves, plain, like = self.plan
        with warnings.catch_warnings():  # a read-only mapping: its tensors are only read from, never written
            warnings.filterwarnings("ignore", message=".*not writable.*")
            base = torch.frombuffer(self.data, dtype=torch.uint8) if self.data is not None else None
        dt = dtensor_type()
        with torch.no_grad():
            for leaf in self.layout:
                if leaf.kind == "o":
                    (set_path if leaf.fqn in leaves else _set_new)(plain, leaf.path, self.objects[leaf.fqn])
                    continue
                dtype = getattr(torch, leaf.dtype)
                src = (base[leaf.offset:leaf.offset + leaf.nbytes].view(dtype).view(leaf.shape) if leaf.nbytes
                       else torch.empty(leaf.shape, dtype=dtype))
                target = leaves.get(leaf.fqn)
                if target is not None:
                    local_tensor(target[1]).copy_(src)
                elif leaf.fqn in like:  # a fresh optimizer's moment: made like its parameter
                    p = like[leaf.fqn]
                    if dt is not None and isinstance(p, dt):
                        local = local_tensor(p)
                        buf = torch.empty(leaf.shape, dtype=dtype, device=local.device)
                        buf.copy_(src)
                        _set_new(plain, leaf.path, dt.from_local(buf, p.device_mesh, p.placements, run_check=False,
                                                                 shape=p.shape, stride=p.stride()))
                    else:
                        _set_new(plain, leaf.path, src.to(p.device, copy=True))
                else:  # under an empty dict of the state (a fresh optimizer's): made here
                    _set_new(plain, leaf.path, src.clone())
        for k, v in state.items():
            if is_stateful(v):
                v.load_state_dict(plain[k])
            elif isinstance(state, dict) and plain[k] is not v:
                state[k] = plain[k]


def _plan_load(layout: list[Leaf], state: Mapping[str, Any], dt: Any) -> "tuple[dict, dict, dict] | str":
    """The target leaves, plain state and the parameters new leaves are made like (a fresh optimizer's moments)
    for a load of ``layout``, or why the snapshot does not fit ``state``."""
    plain = plain_state(state)
    target = flatten(plain)
    saved = {x.fqn: x for x in layout}
    params = param_like(state)  # a fresh optimizer's moments are made like these (DTensor, device)
    like: dict[str, torch.Tensor] = {}
    empty = {fqn for fqn, (_, v) in target.items() if isinstance(v, Mapping) and not v}
    for fqn, (_, v) in target.items():
        leaf = saved.get(fqn)
        if leaf is None:
            if fqn in empty and any(k.startswith(fqn + ".") for k in saved):
                continue
            return f"{fqn!r} is in the state but not in the snapshot"
        kind = _plain_tensor(v, dt)
        if leaf.kind == "o":
            if kind is not None:
                return f"{fqn!r} is a tensor in the state but an object in the snapshot"
            continue
        if kind != leaf.kind:
            return f"{fqn!r}: the snapshot holds a {'DTensor' if leaf.kind == 'd' else 'tensor'}, the state not"
        local = local_tensor(v)
        if str(local.dtype).removeprefix("torch.") != leaf.dtype or tuple(local.shape) != leaf.shape:
            return (f"{fqn!r}: snapshot {leaf.dtype}{list(leaf.shape)} against state "
                    f"{str(local.dtype).removeprefix('torch.')}{list(local.shape)}")
        if kind == "d" and _dmeta(v) != leaf.dmeta:
            return f"{fqn!r}: another DTensor layout (placements or mesh)"
    for leaf in layout:
        if leaf.fqn in target:
            continue
        under = next((".".join(str(p) for p in leaf.path[:i]) for i in range(len(leaf.path) - 1, 0, -1)
                      if ".".join(str(p) for p in leaf.path[:i]) in empty), None)
        if under is None:
            return f"{leaf.fqn!r} is in the snapshot but not in the state"
        p = params.get(leaf.fqn.rpartition(".")[0])
        if leaf.kind == "d":
            if p is None or not isinstance(p, dt):
                return f"{leaf.fqn!r}: a DTensor missing from the state, and no DTensor parameter to place it like"
            if _dmeta(p) != leaf.dmeta or tuple(local_tensor(p).shape) != leaf.shape:
                return f"{leaf.fqn!r}: placed otherwise than its parameter in the state"
            like[leaf.fqn] = p
        elif p is not None and leaf.shape == tuple(p.shape):
            like[leaf.fqn] = p  # a GPU parameter's moment: made on its device
    return target, plain, like


def _set_new(root: Any, path: tuple[Any, ...], value: Any) -> None:
    cur = root
    for p in path[:-1]:
        nxt = cur.get(p) if isinstance(cur, dict) else None
        if nxt is None:
            nxt = cur[p] = {}
        cur = nxt
    cur[path[-1]] = value


def _read_head(record: Path) -> dict[str, Any] | None:
    try:
        with open(record, "rb") as f:
            line = f.readline(1 << 16)
        head = json.loads(line)
        return head if isinstance(head, dict) else None
    except (OSError, ValueError):
        return None


def _map_private(path: Path, size: int) -> Any:
    """The slot's bytes mapped copy-on-write (tensors made from it are writable; nothing is written back)."""
    if size == 0:
        return None
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < size:
            raise ValueError(f"{path} holds {os.fstat(f.fileno()).st_size} bytes, the record says {size}")
        # read-only and shared, populated at once: a writable private mapping populated is a copy of every page
        # (1.46 s for 512 MB, against 0.10 s for the local tier's read), and pages faulted singly cost more than one call
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
