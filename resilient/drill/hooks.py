"""Checkpoint faults of a drill (:data:`resilient.drill.spec.CHECKPOINT_HOWS`): a kill in the middle of a
local write, in the middle of an upload, after a complete save, or a lost local disk.

They need the script's ``CheckpointManager``: :func:`arm_checkpoint_faults` once after it is made,
:func:`after_save` after each save. The mid-write and mid-upload kills are installed by wrapping DCP's
filesystem ``_write_item`` and the tiers' upload methods, matched by step (the background writer may run
while training is already steps ahead).
"""

from __future__ import annotations

import logging
import shutil
import time

from resilient.drill.spec import CHECKPOINT_HOWS, FaultHow, WorkerFault
from resilient.drill.worker import _die, _mine

logger = logging.getLogger(__name__)

__all__ = ["arm_checkpoint_faults", "after_save"]


def arm_checkpoint_faults(manager: object) -> None:
    """Call once after making the script's ``CheckpointManager``: installs this rank's planned mid-write and
    mid-upload kills for this attempt (hooks on the writer and on the tiers' upload, matched by step: the
    background writer may run while training is already steps ahead)."""
    for f in _mine({FaultHow.KILL_MID_WRITE, FaultHow.KILL_MID_UPLOAD}):
        if f.how == FaultHow.KILL_MID_WRITE:
            _arm_mid_write(f)
        else:
            _arm_mid_upload(f, getattr(getattr(manager, "_up", None), "sender", None))


def _arm_mid_write(f: WorkerFault) -> None:
    import torch
    import torch.distributed.checkpoint.filesystem as fs

    orig = fs._write_item
    marker = f"step_{f.step:08d}"

    def write_half(transforms, stream, data, write_item, storage_key, fmt):  # type: ignore[no-untyped-def]
        if marker in str(getattr(stream, "name", "")) and isinstance(data, torch.Tensor) and data.numel() > 64:
            raw = data.detach().contiguous().view(torch.uint8).numpy().tobytes()
            stream.write(raw[: len(raw) // 2])
            stream.flush()
            _die(f.how, f.rank, f.step)
        return orig(transforms, stream, data, write_item, storage_key, fmt)

    fs._write_item = write_half


def _arm_mid_upload(f: WorkerFault, sender: object | None) -> None:
    """The kill once a first file (or part) of the step reached the store: told by the upload process
    (``sender.on_landed``) where the manager has one, and on the tiers' own upload methods where this process sends."""
    from resilient.checkpoint.storage import tiers

    if sender is not None:
        def landed(s: int, name: str) -> None:
            if s == f.step:
                _die(f.how, f.rank, f.step)

        sender.on_landed = landed  # type: ignore[attr-defined]

    for cls in (tiers.FsspecTier, tiers.DirTier):
        orig_put = cls.put_file

        def put(self, s, name, local_path, _orig=orig_put):  # type: ignore[no-untyped-def]
            _orig(self, s, name, local_path)
            if s == f.step and self.name == "persistent":
                _die(f.how, f.rank, f.step)

        cls.put_file = put  # type: ignore[method-assign]
        orig_write = cls.write_bytes

        def write(self, s, name, data, _orig=orig_write):  # type: ignore[no-untyped-def]
            _orig(self, s, name, data)  # plain files of one part go up in one request each
            if s == f.step and self.name == "persistent":
                _die(f.how, f.rank, f.step)

        cls.write_bytes = write  # type: ignore[method-assign]


_COMMIT_WAIT_S = 60.0


def _wait_committed(manager: object, step: int) -> None:
    """Until ``step`` is complete on every tier that holds any of it. ``wait()`` returns once this rank's part
    is done; the commit marker is written after that by another rank (local rank 0 on its node, rank 0 on
    the persistent tier), and killing this rank first may kill that one before it writes. Bounded: a failed
    upload never commits; the fault then still happens, and what a test sees is the real outcome."""
    tiers = [getattr(manager, "local", None), getattr(manager, "persistent", None)]
    for tier in [t for t in tiers if t is not None]:
        deadline = time.monotonic() + _COMMIT_WAIT_S
        while tier.steps().get(step) is False:  # nothing signals a commit by another rank: polled
            if time.monotonic() >= deadline:
                logger.warning("fault at step %d: timed out after %ss waiting for step %d committed on the %s tier",
                               step, _COMMIT_WAIT_S, step, tier.name)
                break
            time.sleep(0.01)


def settle(manager: object, timeout_s: float = _COMMIT_WAIT_S) -> None:
    """Until no save this rank took part in is still in flight: its own part written (``wait()``) and every
    step begun on a disk tier committed by the rank that commits it. A test calls it before a planned fault
    meant to come *between* saves: on a loaded machine a background save can outlast several short steps, and
    a rank killed while a peer is still in that save's collectives fails the save for real (a correct, recorded
    ``ckpt_tier_failed``, but not the fault the test meant). Bounded like the commit wait of a fault."""
    manager.wait(timeout=timeout_s, upload_timeout=timeout_s)  # type: ignore[attr-defined]
    tiers = [getattr(manager, "local", None), getattr(manager, "persistent", None)]
    for tier in [t for t in tiers if t is not None]:
        for step in [s for s, done in tier.steps().items() if not done]:
            _wait_committed(manager, step)


def after_save(step: int, manager: object) -> None:
    """Call after each ``manager.save(step, ...)``: carries out this rank's kill-after-save and lose-disk
    faults of ``step`` (once the save is complete), and holds training at a planned mid-upload step until
    the upload (and so the kill) has happened."""
    for f in _mine(CHECKPOINT_HOWS - {FaultHow.KILL_MID_WRITE}):
        if f.step != step:
            continue
        manager.wait()  # type: ignore[attr-defined]
        _wait_committed(manager, step)
        if f.how == FaultHow.LOSE_DISK:
            local = getattr(manager, "local", None)
            if local is not None:
                shutil.rmtree(local.root, ignore_errors=True)
        if f.how in (FaultHow.KILL_AFTER_SAVE, FaultHow.LOSE_DISK):
            _die(f.how, f.rank, f.step)


