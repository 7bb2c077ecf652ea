"""PyTorch Lightning: checkpoints through ``resilient.CheckpointManager``, steps through ``resilient.steps``.

    from resilient.integrations.lightning import ResilientCheckpoint, ResilientCheckpointIO

    trainer = L.Trainer(strategy="ddp", enable_checkpointing=False,
                        plugins=[ResilientCheckpointIO()], callbacks=[ResilientCheckpoint(sampler=sampler)])
    trainer.fit(model)          # resumes by itself from the newest complete step on our tiers

* :class:`ResilientCheckpointIO` stores Lightning's whole checkpoint dict (weights, optimizer and scheduler
  states, loop progress, callback states) in our tiers: async, on the manager's own gloo groups (DCP's
  ``async_save`` on the default group hangs inside a Lightning callback), and reads it back from the fastest
  tier holding a verified copy. ``path`` arguments are ignored: the tiers come from ``resilient-run``'s
  ``--ckpt-*`` flags (or the manager you pass).
* :class:`ResilientCheckpoint` drives it: every rank saves at ``on_train_batch_end`` when the interval says
  so (Lightning's own ``ModelCheckpoint`` saves on rank 0 only, and a collective save cannot), restores at
  ``on_fit_start`` (after the optimizers exist, before Lightning restores loops and optimizers), runs the
  training steps inside ``resilient.steps`` (heartbeats, hang and straggler detection, goodput), calls an
  ``on_scale`` function, and keeps per-rank RNG states and the data position of a
  :class:`resilient.data.ResumableSampler` exact across restarts.
* :class:`ResilientPreemption`: on a preemption notice (SIGTERM forwarded by ``resilient-run`` or Slurm,
  or a ``RUN_DIR/preempt`` file) every rank agrees on one step over a gloo group (so it works on any
  device, unlike CUDA-only preemption callbacks), saves it and stops the trainer cleanly.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone pytorch_lightning distribution
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError("resilient.integrations.lightning needs PyTorch Lightning: "
                          "pip install 'resilient[lightning]'") from e

from resilient.integrations import _state

logger = logging.getLogger(__name__)

LIGHTNING_KEY = "lightning"
RNG_KEY = "rng"
DATA_KEY = "data"


class ResilientCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose storage is ``CheckpointManager``'s tiers.

    ``save_checkpoint`` and ``load_checkpoint`` are collective when a process group exists: every rank
    calls them (``ResilientCheckpoint`` does). ``manager_options`` go to ``CheckpointManager.from_env``.
    """

    def __init__(self, manager: Any = None, **manager_options: Any) -> None:
        self._manager = manager
        self._options = manager_options
        self.extra: dict[str, Any] = {}  # more Stateful objects saved and restored with every checkpoint
        self.restored_rng: dict[str, Any] | None = None
        self.last_step: int | None = None  # the last step this IO saved

    @property
    def manager(self) -> Any:
        """Created on first use: it needs the process group Lightning sets up inside ``fit``."""
        if self._manager is None:
            self._manager = _state.manager_from(None, self._options)
        return self._manager

    def state(self, checkpoint: Mapping[str, Any] | None) -> dict[str, Any]:
        st: dict[str, Any] = {LIGHTNING_KEY: _state.pack(checkpoint) if checkpoint is not None
                              else _state.empty_packed(), RNG_KEY: _state.rng_state()}
        st.update(self.extra)
        return st

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any = None, storage_options: Any = None) -> None:
        """Save now (asynchronously: returns once the state is copied to host memory).

        A step already saved at its step boundary is not saved again: Lightning's state after ``fit`` stopped
        early (a preemption, ``should_stop``) counts the epoch as completed and would resume at the next
        epoch; the boundary's copy resumes exactly."""
        step = int(checkpoint.get("global_step", 0)) - 1
        if step == self.last_step:
            logger.info("step %d is already on the tiers (saved at its step boundary); not saving it again", step)
            return
        self.save_step(step, lambda: checkpoint, force=True)

    def save_step(self, step: int, dump: Callable[[], Mapping[str, Any]], force: bool = False) -> bool:
        """Save step ``step`` if the interval says so (or ``force``); ``dump`` builds the checkpoint dict
        only when a save is due."""
        lazy = _state.LazyState(dump, "ResilientCheckpointIO.load_checkpoint")
        saved = bool(self.manager.save(step, {**self.state(None), LIGHTNING_KEY: lazy}, force=force))
        if saved:
            self.last_step = step
        return saved

    def load_checkpoint(self, path: Any = None, map_location: Any = None, weights_only: Any = None,
                        set_rng: bool = True) -> dict[str, Any]:
        """The newest complete checkpoint, or ``{}`` when the tiers hold none. The RNG states saved with it
        are set now, or kept in ``restored_rng`` (``set_rng=False``) for the caller to set when the run
        reaches the point where they were saved."""
        st = self.state(None)
        start = self.manager.restore(st)
        if start == 0:
            return {}
        self.restored_rng = st[RNG_KEY]
        if set_rng:
            _state.set_rng_state(st[RNG_KEY])
        ckpt = _state.unpack(st[LIGHTNING_KEY])
        if map_location is not None:
            ckpt = _map(ckpt, map_location)
        return ckpt

    def remove_checkpoint(self, path: Any) -> None:
        """Retention belongs to the manager (``keep_local``/``keep_persistent``): nothing to remove here."""

    def teardown(self) -> None:
        if self._manager is not None:
            self._manager.wait(timeout=self._manager.config.collective_timeout_s)


def _map(tree: Any, loc: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(loc) if isinstance(loc, (str, torch.device)) else tree
    if isinstance(tree, dict):
        return {k: _map(v, loc) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, loc) for v in tree]
    return tree


class _Position:
    """A ResumableSampler's position as training sees it. The sampler itself runs ahead: Lightning's data
    fetcher prefetches a batch, so its own count includes one not trained on yet."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.batches = 0  # batches trained since the sampler's current iteration began
        self.batch_size = 1
        self.base: tuple[int, int] | None = None  # (epoch, consumed) when the iteration began

    def state_dict(self) -> dict[str, int]:
        s = self.sampler
        epoch, start = self.base if self.base is not None else (s.epoch, s.consumed)
        consumed = min(s.n, start + self.batches * self.batch_size * s.num_replicas)
        return {"epoch": epoch, "consumed": consumed, "seed": s.seed, "n": s.n}

    def load_state_dict(self, sd: Mapping[str, int]) -> None:
        self.sampler.load_state_dict(dict(sd))
        self.base, self.batches = None, 0


def _epoch_length_sampler(sampler: Any) -> Any:
    """Lightning counts an epoch's batches once, from ``len(dataloader)``, and expects a resumed loader to
    yield only the rest while ``len`` stays the whole epoch (as stateful loaders do). ``ResumableSampler``'s
    ``len`` is what is left, for plain loops; give this instance the whole epoch's length instead."""
    from resilient.data import ResumableSampler

    if not isinstance(sampler, ResumableSampler):
        raise TypeError(f"ResilientCheckpoint(sampler=...) takes a resilient.data.ResumableSampler, "
                        f"got {type(sampler).__name__}")
    if not isinstance(sampler, _EpochLengthSampler):
        sampler.__class__ = _EpochLengthSampler
    return sampler


def _epoch_len(s: Any) -> int:
    if s.drop_last:
        return s.n // s.num_replicas
    return max(0, -(-(s.n - s.rank) // s.num_replicas))


class ResilientCheckpoint(Callback):
    """Save every rank through :class:`ResilientCheckpointIO`, restore at start, drive ``resilient.steps``.

    ``sampler``: a :class:`resilient.data.ResumableSampler` used by the train dataloader (create the Trainer
    with ``use_distributed_sampler=False``); its position is saved exactly. ``on_scale``: called with a
    ``resilient.ScaleEvent`` when the world size changed since the last attempt. ``state``: more Stateful
    objects to save and restore with each checkpoint. Without a ``ResilientCheckpointIO`` among the
    Trainer's plugins one is made from the launcher's flags (or ``manager``).
    """

    def __init__(self, sampler: Any = None, on_scale: Callable[[Any], Any] | None = None,
                 state: Mapping[str, Any] | None = None, manager: Any = None, **manager_options: Any) -> None:
        self.sampler = sampler
        self._pos = _Position(_epoch_length_sampler(sampler)) if sampler is not None else None
        self._on_scale = on_scale
        self._extra = dict(state or {})
        self._manager, self._options = manager, manager_options
        self.io: ResilientCheckpointIO | None = None
        self.restored_step: int | None = None
        self._steps: Iterator[int] | None = None
        self._validation: Any = None  # the open "eval" section of a validation loop inside training
        self._start = 0

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if not isinstance(io, ResilientCheckpointIO):
            io = ResilientCheckpointIO(self._manager, **self._options)
        self.io = io
        io.extra.update(self._extra)
        if self._pos is not None:
            io.extra[DATA_KEY] = self._pos
        _ = io.manager  # collective: every rank builds its groups here, at the same point
        strategy = trainer.strategy
        if getattr(strategy, "checkpoint_io", None) is io and trainer.world_size > 1:
            # Lightning's strategies write on global rank 0 only; a save through our tiers is collective, so
            # trainer.save_checkpoint() (which every rank calls) must reach the IO on every rank
            def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
                io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

            strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        if self._on_scale is not None:
            import resilient

            resilient.on_scale(self._on_scale)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self.io is not None
        ckpt = self.io.load_checkpoint(set_rng=False)  # set at on_train_start: see there
        if not ckpt:
            logger.info("no checkpoint on the tiers: starting from scratch")
            return
        self.restored_step = int(ckpt.get("global_step", 0))
        # hand it to Lightning's own restore: the model and callbacks now, then (right after this hook)
        # loops, optimizers and schedulers, exactly as for fit(ckpt_path=...)
        conn = trainer._checkpoint_connector
        conn._loaded_checkpoint = ckpt
        conn.restore_model()
        conn.restore_datamodule()
        conn.restore_callbacks()
        logger.info("restored Lightning state at global step %d from the %s tier", self.restored_step,
                    getattr(self.io.manager.last_restore, "tier", "?"))

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        import resilient

        _quiet_sigterm()
        self._start = trainer.global_step
        if self.restored_step is not None and self.io is not None and self.io.restored_rng is not None:
            # the RNG states as they were after the saved step: set only now, since creating the epoch's data
            # iterator (after on_fit_start) draws from the global generator, which the uninterrupted run did
            # at the start of the epoch, not here
            _state.set_rng_state(self.io.restored_rng)
            self.io.restored_rng = None
            if _resumed_after_last_batch(trainer):
                _start_next_epoch(trainer)
        self._steps = iter(resilient.steps(self._start))

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._pos is not None:
            self._pos.batches, self._pos.base = 0, None

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._pos is not None and self._pos.base is None:
            s = self._pos.sampler
            self._pos.base = (s.epoch, s.consumed)  # the sampler's iteration has begun by now
            dl = trainer.train_dataloader
            self._pos.batch_size = int(getattr(dl, "batch_size", None) or 1)
        if self._steps is not None:
            try:
                next(self._steps)
            except StopIteration:  # a preemption's agreed last step is behind us: stop like max_steps
                trainer.should_stop = True

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._pos is not None:
            self._pos.batches += 1
        step = trainer.global_step - 1  # the optimizer step just completed (0-based)
        if step < self._start or self.io is None:
            return  # gradient accumulation: no optimizer step finished in this batch
        conn = trainer._checkpoint_connector
        self.io.save_step(step, lambda: conn.dump_checkpoint(weights_only=False))
        from resilient.worker.preemption import preempt_save_due

        if self._steps is not None and preempt_save_due(step):
            # the last step every rank agreed on after a preemption notice: it was just saved (the manager
            # forces it); stop here, and let steps() record the clean stop so the launcher exits "preempted"
            trainer.should_stop = True
            for _ in self._steps:
                pass

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # a validation loop inside training is a section (its own learned hang timeout): it would otherwise look like
        # a hung step; the sanity check before training runs under the start-up timeout anyway
        if self._steps is not None and self._validation is None:
            import contextlib

            import resilient

            self._validation = contextlib.ExitStack()
            self._validation.enter_context(resilient.section("eval"))

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._validation is not None:
            validation, self._validation = self._validation, None
            validation.close()

    @property
    def drives_steps(self) -> bool:
        return self._steps is not None

    def _finish(self) -> None:
        self.on_validation_end(None, None)  # type: ignore[arg-type]  # an exception inside validation
        if self._steps is not None:
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()
            self._steps = None

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._finish()
        if self.io is not None:
            self.io.teardown()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._finish()


def _resumed_after_last_batch(trainer: "pl.Trainer") -> bool:
    """True when Lightning resumed from a checkpoint saved at ``on_train_batch_end`` of an epoch's last batch
    (the same test its ``FitLoop.reset`` uses to count that epoch as finished)."""
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    try:
        return bool(loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
                    and epoch_loop.batch_progress.is_last_batch)
    except AttributeError:  # another Lightning version: its loops decide alone
        logger.warning("cannot tell whether Lightning resumed at an epoch's end; a resume there may not be exact")
        return False


def _start_next_epoch(trainer: "pl.Trainer") -> None:
    """Do what an uninterrupted run does at the start of the epoch after the restored step, and Lightning skips
    when it resumes after an epoch's last batch (it treats the next epoch as one restarted mid-way): set the
    sampler's epoch, count the epoch as ready and started, run the ``on_train_epoch_start`` hooks, and create
    the epoch's data iterator. Creating it draws a seed from the global RNG; Lightning made the iterator it
    would use before the restored RNG state was set, so the first step of the epoch ran with a different
    RNG state (dropout) than the uninterrupted run, and the weights differed from then on. Called right after
    the RNG is restored, which is where the uninterrupted run was at that point."""
    try:
        from lightning.fabric.utilities.data import _set_sampler_epoch
        from lightning.pytorch.trainer import call
    except ImportError:  # the standalone pytorch_lightning distribution
        from lightning_fabric.utilities.data import _set_sampler_epoch  # type: ignore[no-redef]
        from pytorch_lightning.trainer import call  # type: ignore[no-redef]

    loop = trainer.fit_loop
    progress = loop.epoch_progress
    combined = loop._combined_loader
    if combined is not None:
        for dl in combined.flattened:
            _set_sampler_epoch(dl, progress.current.processed)
    progress.increment_ready()
    call._call_callback_hooks(trainer, "on_train_epoch_start")
    call._call_lightning_module_hook(trainer, "on_train_epoch_start")
    progress.increment_started()
    if loop._data_fetcher is not None:
        iter(loop._data_fetcher)
    logger.info("resumed after the last batch of epoch %d: epoch %d starts as in an uninterrupted run",
                progress.current.processed - 1, progress.current.processed)


def _quiet_sigterm() -> None:
    """Replace Lightning's SIGTERM handler while training runs (it broadcasts on the default group from inside
    the handler, which can cross a collective in flight) with ``resilient``'s: it only records the notice;
    the ranks agree on a step at the next step boundary. Lightning restores its own handlers at teardown."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    from resilient.worker.preemption import on_sigterm as _on_sigterm

    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError) as e:
        logger.warning("cannot take over SIGTERM (%s); Lightning's own handler stays", e)


class ResilientPreemption(Callback):
    """Stop at a step every rank agrees on when preempted, after saving it through ``ckpt``.

    Noticed from ``resilient``'s own notice (SIGTERM forwarded by ``resilient-run``, a ``RUN_DIR/preempt``
    file) or Lightning's SIGTERM flag. Lightning's SIGTERM handler (a broadcast on the default group from
    inside the handler) is replaced by one that only records the notice. With a ``ResilientCheckpoint`` that
    drives ``resilient.steps`` (``ckpt``), that machinery agrees on the step, saves it and makes
    ``resilient-run`` exit 75; without one, the ranks agree over a gloo group of this callback's own (CPU
    tensors: any device, any default backend) and the trainer stops.
    """

    def __init__(self, ckpt: ResilientCheckpoint | None = None, timeout_s: float = 120.0) -> None:
        self.ckpt = ckpt
        self.timeout_s = timeout_s
        self._group: Any = None
        self.stopped_at: int | None = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        _quiet_sigterm()

    @staticmethod
    def _noticed(trainer: "pl.Trainer") -> bool:
        from resilient.worker.preemption import preempted

        return bool(preempted() or getattr(trainer, "received_sigterm", False))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.ckpt is not None and self.ckpt.drives_steps:
            return  # ResilientCheckpoint's steps() agrees on the step, the manager saves it, the launcher exits 75
        flag = torch.tensor([1 if self._noticed(trainer) else 0], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if not int(flag.item()) or self.stopped_at is not None:
            return
        step = trainer.global_step - 1
        self.stopped_at = step
        if self.ckpt is not None and self.ckpt.io is not None:
            conn = trainer._checkpoint_connector
            self.ckpt.io.save_step(step, lambda: conn.dump_checkpoint(weights_only=False), force=True)
            self.ckpt.io.teardown()
        logger.warning("preempted: stopped after step %d%s", step, " (saved)" if self.ckpt is not None else "")
        if hasattr(trainer, "_signal_connector"):
            # the step is saved: Lightning's own SIGTERM path would now end the run with an error
            trainer._signal_connector.received_sigterm = False
        trainer.should_stop = True


__all__ = ["ResilientCheckpointIO", "ResilientCheckpoint", "ResilientPreemption"]


def _make_epoch_length_sampler() -> type:
    from resilient.data import ResumableSampler

    class _EpochLengthSampler(ResumableSampler):
        def __len__(self) -> int:
            return _epoch_len(self)

    return _EpochLengthSampler


_EpochLengthSampler = _make_epoch_length_sampler()
