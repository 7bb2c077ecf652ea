"""Contract of the multi-tier checkpointer: configuration, on-disk layout records, tier protocol, errors.

A checkpoint of step ``s`` on a tier is a plain ``torch.distributed.checkpoint`` directory
``<tier root>/step_<s:08d>/`` holding DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files, one
``manifest-rank<r>.json`` per rank (size, crc32c and per-block xxh3 of that rank's files and of ``.metadata``) and a
``COMMITTED`` marker written last. A step without ``COMMITTED`` is invisible to restore and is removed
by retention. ``dcp.load`` reads any tier's copy without this package.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from resilient import env


STEP_PREFIX = "step_"
COMMIT_MARKER = "COMMITTED"
DCP_METADATA = ".metadata"
MANIFEST_FMT = "manifest-rank{rank}.json"
PEER_SUBDIR = "peer"  # <local>/peer/step_*/ holds the partner node's replicated files
PER_RANK_PREFIX = "__rank{rank}__"  # per-rank values are saved under "__rank<r>__.<fqn>"


class TierName(str, enum.Enum):
    LOCAL = "local"
    PEER = "peer"
    PERSISTENT = "persistent"


DEFAULT_UPLOAD_GRACE_S = 60.0
# consecutive saves that reached no tier before the job stops (resilient-run --ckpt-max-failed-saves)
DEFAULT_MAX_FAILED_SAVES = 3
# nice value of the checkpointer's background threads (CheckpointConfig.background_nice). Off: in
# bench/interference.py a niced writer finished later whenever the cores were busy, and the next save() waits for
# the previous write (one set of staging buffers), so training blocked longer; its work is mostly Python under the
# GIL, which no priority shares out
DEFAULT_BACKGROUND_NICE: int | str = 0
# RUN_DIR/ckpt-stop/attempt<A>.rank<R>: this rank stopped training because its saves kept failing (JSON: steps,
# tier, error, message); the launcher reads it to exit with its own code instead of "succeeded"
CKPT_STOP_MARK_DIR = "ckpt-stop"

# restore prefers the earlier tier: cheaper to read
TIER_ORDER = (TierName.LOCAL, TierName.PEER, TierName.PERSISTENT)


class CheckpointError(RuntimeError):
    """Base class of the checkpointer's errors."""


class CheckpointConfigError(CheckpointError, ValueError):
    """A configuration value is invalid; the message names the field and what to do."""


class CheckpointSavesFailedError(CheckpointError):
    """``max_failed_saves`` consecutive saves reached no tier: training stops rather than go on without
    checkpoints. Raised by ``save()`` on every rank at the same step when no launcher runs the job (under
    ``resilient-run`` the ranks leave their loop instead and the launcher exits with its own code)."""

    def __init__(self, message: str, steps: list[int], tier: str | None, error: str | None):
        super().__init__(message)
        self.steps, self.tier, self.error = list(steps), tier, error


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the state (another model, wrong shapes); names the keys."""

    def __init__(self, step: int, missing: list[str], unexpected: list[str],
                 shape_mismatch: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        self.step, self.missing, self.unexpected, self.shape_mismatch = step, missing, unexpected, shape_mismatch
        parts = []
        if missing:
            parts.append(f"keys in the state but not in the checkpoint: {_short(missing)}")
        if shape_mismatch:
            shapes = ", ".join(f"{k}: checkpoint {list(c)} vs state {list(s)}"
                               for k, (c, s) in list(shape_mismatch.items())[:10])
            parts.append(f"shape mismatch: {shapes}")
        if unexpected:
            parts.append(f"keys in the checkpoint but not in the state: {_short(unexpected)}")
        super().__init__(f"checkpoint step {step} does not match the state ({'; '.join(parts)}); "
                         "is it from another model or configuration? Point the manager at the right "
                         "directory or start from an empty one.")


class CheckpointReshardError(CheckpointError):
    """The checkpoint was saved by another number of ranks and part of the state cannot be resharded to
    this one (per-rank objects of ranks that are gone or new, per-rank tensors whose size follows the world
    size). Raised on every rank during planning, before any byte is read into the state; names the keys."""

    def __init__(self, step: int, saved_world_size: int, world_size: int, problems: dict[str, str]):
        self.step, self.saved_world_size, self.world_size = step, saved_world_size, world_size
        self.problems = dict(problems)  # state key -> why it cannot be resharded
        why = "; ".join(f"{k}: {v}" for k, v in list(sorted(self.problems.items()))[:10])
        more = f" and {len(self.problems) - 10} more" if len(self.problems) > 10 else ""
        super().__init__(
            f"checkpoint step {step} was saved by {saved_world_size} ranks and cannot be restored onto "
            f"{world_size}: {why}{more}; nothing was loaded. Restart with {saved_world_size} ranks, or make "
            "this state the same on every rank (e.g. a global data position, as resilient.data.ResumableSampler "
            "keeps) so that it can be resharded, or leave it out of the state passed to restore()")


class CorruptFileError(CheckpointError):
    """A file's size or checksum (crc32c, or xxh3 per block) differs from its manifest entry."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code or reach outside its step directory when loaded; it is refused."""

    def __init__(self, path: str, forbidden: str | None, why: str):
        self.path, self.forbidden, self.why = path, forbidden, why
        what = f"it references the forbidden global {forbidden} ({why})" if forbidden else why
        super().__init__(f"{path}: unsafe, refused to load: {what}; the file was tampered with or is not a "
                         "checkpoint of this package")


class NoRestorableStepError(CheckpointError):
    """Committed steps exist but none could be assembled from verified files on any tier. ``details``: the steps
    tried, the tiers, and for each step what was missing (``why``: step → missing, ranks, files, tiers)."""

    def __init__(self, message: str = "", details: dict | None = None):
        super().__init__(message)
        self.details = dict(details or {})


class StateUndefinedError(NoRestorableStepError):
    """Bytes of a checkpoint already landed in the state (``restore()`` owns the target tensors until it
    returns) and some block has no good copy on any tier: the state is undefined."""


def _short(keys: list[str], n: int = 10) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32c: int
    # crc32c of each ``block_size`` bytes (the last block may be shorter): restore verifies and fetches
    # again per block; absent in manifests written before blocks existed (then the file is one block)
    block_size: int = 0
    blocks: tuple[int, ...] = ()
    # (item offset, data offset, bytes) of each plain tensor in the file: restore reads tensor bytes from any
    # tier straight into the state without parsing the file first
    items: tuple[tuple[int, int, int], ...] = ()
    # xxh3-64 of each verification block (of the whole file when there are no blocks): what restore and
    # verify check when present, being several times faster than crc32c (which stays for other readers).
    # Absent in manifests written before it existed (then crc32c is checked). Not part of equality: it
    # is derived from the same bytes as the crc32c fields.
    xxh3: tuple[int, ...] = field(default=(), compare=False)

    @property
    def digest(self) -> str:
        """The checksum restore verifies this file by."""
        return "xxh3" if self.xxh3 else "crc32c"

    def bounds(self) -> list[tuple[int, int]]:
        """(start, end) of each verification block (one block, the whole file, without blocks)."""
        if self.block_size and self.blocks:
            bs = self.block_size
            return [(i * bs, min(self.size, (i + 1) * bs)) for i in range(len(self.blocks))]
        return [(0, self.size)]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"size": self.size, "crc32c": self.crc32c}
        if self.block_size and self.blocks:
            d["block_size"], d["blocks"] = self.block_size, list(self.blocks)
        if self.items:
            d["items"] = [list(i) for i in self.items]
        if self.xxh3:
            d["xxh3"] = list(self.xxh3)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "FileEntry":
        bs, blocks = int(d.get("block_size", 0) or 0), tuple(int(c) for c in d.get("blocks", ()))
        if bs <= 0 or not blocks or len(blocks) != -(-int(d["size"]) // bs):
            bs, blocks = 0, ()  # inconsistent blocks: verify the whole file instead
        items = tuple((int(a), int(b), int(c)) for a, b, c in d.get("items", ()))
        if any(b < a or c < 0 or b + c > int(d["size"]) for a, b, c in items):
            items = ()  # inconsistent: parse the file instead
        xxh3 = tuple(int(x) for x in d.get("xxh3", ()))
        if len(xxh3) != (len(blocks) if blocks else 1):
            xxh3 = ()  # not one per block (or blocks dropped above): verify by crc32c instead
        return cls(size=int(d["size"]), crc32c=int(d["crc32c"]), block_size=bs, blocks=blocks, items=items,
                   xxh3=xxh3)


@dataclass(frozen=True)
class Manifest:
    """``manifest-rank<r>.json``: the files rank ``rank`` wrote for ``step``, plus ``.metadata``."""

    step: int
    rank: int
    world_size: int
    files: dict[str, FileEntry]  # this rank's .distcp files
    metadata: FileEntry  # DCP's .metadata (identical on every rank)
    per_rank_keys: tuple[str, ...] = ()  # fqns saved per rank under "__rank<r>__.<fqn>"
    wall: float = 0.0
    index: RankIndex | None = None  # this rank's own entries of .metadata (None: restores parse the whole file)

    def all_files(self) -> dict[str, FileEntry]:
        return {**self.files, DCP_METADATA: self.metadata}

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "world_size": self.world_size,
                "files": {k: v.to_json() for k, v in self.files.items()},
                "metadata": self.metadata.to_json(), "per_rank_keys": list(self.per_rank_keys),
                "wall": self.wall, **({"index": self.index.to_json()} if self.index is not None else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Manifest":
        return cls(step=int(d["step"]), rank=int(d["rank"]), world_size=int(d["world_size"]),
                   files={k: FileEntry.from_json(v) for k, v in d["files"].items()},
                   metadata=FileEntry.from_json(d["metadata"]),
                   per_rank_keys=tuple(d.get("per_rank_keys", ())), wall=float(d.get("wall", 0.0)),
                   index=RankIndex.from_json(d["index"]) if d.get("index") is not None else None)


@dataclass(frozen=True)
class RankIndex:
    """A rank's own entries of DCP's ``.metadata`` (``format/rank_index.py``): what a restart of the same layout
    reads instead of the whole file."""

    of: int  # crc32c of the .metadata it was taken from: a manifest rewritten for another encoding drops it
    crc: int  # zlib.crc32 of the pickled bytes
    data: str  # the pickled Metadata, base64

    def to_json(self) -> dict[str, Any]:
        return {"of": self.of, "crc": self.crc, "data": self.data}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RankIndex":
        return cls(of=int(d["of"]), crc=int(d["crc"]), data=str(d["data"]))


@dataclass(frozen=True)
class StepInfo:
    """What one tier holds of one step (``resilient ckpt ls``)."""

    step: int
    committed: bool
    ranks: tuple[int, ...]  # ranks whose manifests are present
    world_size: int | None
    bytes: int


@dataclass(frozen=True)
class RestoreResult:
    """What :meth:`CheckpointManager.restore` did on this rank."""

    step: int | None  # restored step, None when nothing was restorable
    tier: str | None  # slowest tier that served one of this rank's files
    seconds: float
    bytes: int
    sources: dict[str, str] = field(default_factory=dict)  # file name -> tier that served it
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (scan, verify, fetch, load)


@runtime_checkable
class Tier(Protocol):
    """A place holding step directories. Every implementation passes ``tests/checkpoint/test_tiers.py``.

    Methods that touch remote storage may raise ``OSError``; callers retry (see ``tiers.retry``).
    """

    name: str

    def url(self, step: int | None = None) -> str: ...
    def steps(self) -> dict[int, bool]: ...  # step -> committed
    def list_files(self, step: int) -> dict[str, int]: ...  # name -> size
    def put_file(self, step: int, name: str, local_path: str) -> None: ...
    def get_file(self, step: int, name: str, local_path: str) -> None: ...
    def write_bytes(self, step: int, name: str, data: bytes) -> None: ...
    def read_bytes(self, step: int, name: str) -> bytes: ...
    def delete_file(self, step: int, name: str) -> None: ...
    def delete_step(self, step: int) -> None: ...


@dataclass
class CheckpointConfig:
    """Validated configuration of :class:`~resilient.checkpoint.manager.CheckpointManager`.

    ``local`` may contain ``{node}`` / ``{rank}`` / ``{local_rank}``, expanded per process, which lets one
    machine stand in for several nodes (each "node" with its own local directory).
    """

    local: str | None = None
    persistent: str | None = None
    interval: int | str = 10  # steps between saves, or "auto"
    persistent_every: int | str = 5  # every N-th local save is uploaded; "auto" follows the tuner
    peer: bool = True
    overlap: bool = False  # stage behind the next forward/backward instead of inside save()
    keep_local: int = 2
    keep_peer: int = 2
    keep_persistent: int = 3
    upload_retries: int = 6
    upload_backoff_s: float = 0.5
    upload_backoff_max_s: float = 8.0
    collective_timeout_s: float = 600.0
    storage_options: dict[str, Any] = field(default_factory=dict)
    persistent_timeout_s: float = 30.0  # bound on one persistent-tier call (plus time for its bytes)
    restore_probe_s: float = 5.0  # at restore, a persistent store silent this long is skipped
    upload_grace_s: float | None = None  # at exit, pending uploads get this long; None: 60
    # consecutive saves that reach no tier before save() stops the job; 0: train on without checkpoints
    max_failed_saves: int | str = DEFAULT_MAX_FAILED_SAVES
    # scheduling priority of the background threads (save worker, uploader and the threads they start: local
    # writes, peer sends, digests, compression, upload parts), so they yield the CPU to training: a nice value
    # 1-19 (Linux applies it per thread), "idle" (SCHED_IDLE: only CPU time nothing else wants), or 0 to leave
    # them at the process's own priority. The training thread and gloo's threads are never changed.
    background_nice: int | str = DEFAULT_BACKGROUND_NICE
    # send the persistent tier's bytes from a process of its own (resilient.checkpoint.upload.process), so that an
    # upload's Python (and a compressed upload's codec) does not hold the training process's interpreter lock (a GPU
    # job's training thread needs it for every kernel launch). Off: the upload thread sends them itself. "auto" (the
    # default): on where the node has cores to spare, at least 2 cores a local rank (upload.process.CORES_PER_RANK;
    # measured: on 2 cores for 2 ranks the process competes with training for a core, and cost the headline 2 points
    # beside a CPU burner). A tier another process cannot reach (memory://, options that cannot be pickled) is sent
    # from the thread either way. True/False, "on"/"off" and "auto" are accepted
    upload_process: bool | str = "auto"
    # snapshots of the state in node memory (resilient.checkpoint.snapshot): "auto" takes one after every step whose
    # cost (the copy plus its digest) stays within snapshot_budget of the step time; N every N steps; 0 or "off"
    # none. They need a directory in memory that outlives the workers: snapshot_dir, which resilient-run gives each
    # node under /dev/shm (RESILIENT_CKPT_SNAPSHOT_DIR); without one they are off
    snapshot: int | str = "auto"
    snapshot_dir: str | None = None
    snapshot_budget: float = 0.01

    def __post_init__(self) -> None:
        if not self.local and not self.persistent:
            raise CheckpointConfigError(
                "CheckpointManager needs at least one tier: pass local='/path' (fast node-local disk) "
                f"and/or persistent='gs://bucket/run' (or set {env.CKPT_LOCAL} / {env.CKPT_PERSISTENT})")
        if isinstance(self.interval, str):
            s = self.interval.strip().lower()
            if s == "auto":
                self.interval = "auto"
            elif s.isdigit():
                self.interval = int(s)
            else:
                raise CheckpointConfigError(f"interval={self.interval!r}: give a number of steps (>= 1) or 'auto'")
        if isinstance(self.interval, bool) or (isinstance(self.interval, int) and self.interval < 1):
            raise CheckpointConfigError(f"interval={self.interval!r}: must be >= 1 step, or 'auto'")
        if isinstance(self.persistent_every, str):
            s = self.persistent_every.strip().lower()
            if s == "auto":
                self.persistent_every = "auto"
            elif s.isdigit():
                self.persistent_every = int(s)
            else:
                raise CheckpointConfigError(
                    f"persistent_every={self.persistent_every!r}: give a number of local saves (>= 1) or 'auto'")
        if isinstance(self.persistent_every, int) and self.persistent_every < 1:
            raise CheckpointConfigError(f"persistent_every={self.persistent_every}: must be >= 1 "
                                        "(1 uploads every save)")
        raw_max = self.max_failed_saves
        if isinstance(raw_max, str) and raw_max.strip().isdigit():
            self.max_failed_saves = int(raw_max.strip())
        if isinstance(self.max_failed_saves, bool) or not isinstance(self.max_failed_saves, int) \
                or self.max_failed_saves < 0:
            raise CheckpointConfigError(
                f"max_failed_saves={raw_max!r}: give a whole number of consecutive failed saves >= 0 after which "
                "the job stops (0 trains on without checkpoints; resilient-run --ckpt-max-failed-saves N)")
        raw_nice = self.background_nice
        if isinstance(raw_nice, str):
            t = raw_nice.strip().lower()
            self.background_nice = "idle" if t == "idle" else int(t) if t.lstrip("-").isdigit() else raw_nice
        if not (self.background_nice == "idle" or (isinstance(self.background_nice, int)
                                                   and not isinstance(self.background_nice, bool)
                                                   and 0 <= self.background_nice <= 19)):
            raise CheckpointConfigError(
                f"background_nice={raw_nice!r}: give a nice value from 0 (the process's own priority) to 19 "
                "(lowest) for the checkpoint's background threads, or 'idle' (SCHED_IDLE)")
        if isinstance(self.upload_process, str):
            t = self.upload_process.strip().lower()
            if t not in ("auto", "on", "off", "1", "0", "true", "false"):
                raise CheckpointConfigError(
                    f"upload_process={self.upload_process!r}: give auto (a process of their own where the node has "
                    "cores to spare), on (always) or off (from the training process's upload thread) "
                    "(resilient-run --ckpt-upload-process auto|on|off)")
            self.upload_process = "auto" if t == "auto" else t in ("on", "1", "true")
        if not isinstance(self.upload_process, bool) and self.upload_process != "auto":
            raise CheckpointConfigError(
                f"upload_process={self.upload_process!r}: give True, False or 'auto' (or 'on'/'off')")
        raw_snap = self.snapshot
        if isinstance(raw_snap, str):
            t = raw_snap.strip().lower()
            self.snapshot = "auto" if t == "auto" else 0 if t in ("off", "0") else int(t) if t.isdigit() else raw_snap
        if not (self.snapshot == "auto" or (isinstance(self.snapshot, int) and not isinstance(self.snapshot, bool)
                                            and self.snapshot >= 0)):
            raise CheckpointConfigError(
                f"snapshot={raw_snap!r}: give 'auto' (a snapshot in node memory whenever its cost allows), a number "
                "of steps between snapshots, or 'off' (resilient-run --ckpt-snapshot auto|N|off)")
        if isinstance(self.snapshot_budget, bool) or not isinstance(self.snapshot_budget, (int, float)) \
                or not 0 < self.snapshot_budget <= 1:
            raise CheckpointConfigError(f"snapshot_budget={self.snapshot_budget!r}: the share of step time a snapshot "
                                        "may cost, a number in (0, 1] (0.01: one percent)")
        if self.snapshot_dir is not None:
            self.snapshot_dir = os.fspath(self.snapshot_dir)
        for name in ("keep_local", "keep_peer", "keep_persistent"):
            if int(getattr(self, name)) < 1:
                raise CheckpointConfigError(f"{name}={getattr(self, name)}: must keep at least 1 step")
        if self.upload_retries < 0 or self.upload_backoff_s < 0 or not math.isfinite(self.upload_backoff_max_s):
            raise CheckpointConfigError("upload_retries and upload_backoff_s must be >= 0")
        if self.upload_grace_s is None:
            self.upload_grace_s = DEFAULT_UPLOAD_GRACE_S
        for name in ("persistent_timeout_s", "restore_probe_s", "upload_grace_s", "collective_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (v == 0 and name != "upload_grace_s"):
                raise CheckpointConfigError(f"{name}={v!r}: must be a finite number of seconds "
                                            f"({'>= 0' if name == 'upload_grace_s' else '> 0'})")
        if self.local is not None:
            self.local = os.fspath(self.local)
            if os.path.exists(self.local) and not os.path.isdir(self.local):
                raise CheckpointConfigError(f"local={self.local!r} is a file, not a directory: point the local "
                                            "tier at a directory (it is created if missing)")
