"""Hugging Face ``transformers.Trainer``: checkpoints through ``resilient.CheckpointManager``.

    from resilient.integrations.hf import ResilientTrainer

    args = TrainingArguments(output_dir="out", save_strategy="no", max_steps=10_000, ...)
    trainer = ResilientTrainer(model=model, args=args, train_dataset=ds)   # any Trainer argument
    trainer.train()             # resumes by itself from the newest complete step on our tiers

* :class:`ResilientCallback` saves model, optimizer, scheduler, per-rank RNG states and the Trainer's state
  (global step, epoch: the data position, as the Trainer counts it) at ``on_step_end`` when the interval
  says so: the training thread only copies the state to host memory, the rest is written in the background
  on the manager's own gloo groups. It stops the Trainer's own blocking ``save_steps`` saves
  (``replace_saves=True``) and runs the steps inside ``resilient.steps`` (heartbeats, hang and straggler
  detection, goodput, preemption: an agreed last step is saved and training stops).
* :class:`ResilientTrainer` is ``Trainer`` plus that callback plus the restore: ``train()`` without
  ``resume_from_checkpoint`` restores the newest complete step from the fastest tier holding a verified
  copy and resumes through the Trainer's own resume path (epochs and batches skipped exactly as when
  resuming from one of its checkpoint directories, RNG states set where it sets them), reading the state from
  memory instead of its files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState, TrainerState
except ImportError as e:
    raise ImportError("resilient.integrations.hf needs transformers: pip install 'resilient[hf]'") from e

from resilient.integrations import _state

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
HF_KEY = "hf"
RNG_KEY = "rng"
TRAINER_STATE_NAME = "trainer_state.json"  # the Trainer reads its state from this file when resuming
_RESUME_MARK = ".resilient-resume"  # a resume directory of ours holds this file and the state, nothing else


def _trainer_state_json(trainer: Any, state: Any) -> str:
    """The Trainer's state as its own checkpoints store it (stateful callbacks brought up to date first)."""
    if trainer is not None:
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


class ResilientCallback(TrainerCallback):
    """Save through ``CheckpointManager`` at every step's end (the interval decides), drive ``resilient.steps``.

    ``manager``: a ``CheckpointManager``, else one from ``resilient-run``'s ``--ckpt-*`` flags made on first
    use (``manager_options`` go to ``CheckpointManager.from_env``). ``replace_saves``: turn the Trainer's own
    checkpoint saves off (they block training while they serialise everything).
    """

    def __init__(self, manager: Any = None, replace_saves: bool = True, **manager_options: Any) -> None:
        self._manager, self._options = manager, manager_options
        self.replace_saves = replace_saves
        self.trainer: Any = None  # set by ResilientTrainer: the stateful callbacks' states are saved too
        self._steps: Iterator[int] | None = None
        self._start = 0
        self._saved: int | None = None  # the last step saved
        # the Trainer's evaluation and own saves run between a step's end and the next step's begin: that stretch
        # is a section (its own learned hang timeout), or a long evaluation would look like a hung step
        self._between: contextlib.ExitStack | None = None

    @property
    def manager(self) -> Any:
        if self._manager is None:
            self._manager = _state.manager_from(None, self._options)
        return self._manager

    def state(self, model: Any, dump: Callable[[], Mapping[str, Any]] | None) -> dict[str, Any]:
        lazy = _state.LazyState(dump, "ResilientTrainer") if dump is not None else _state.empty_packed()
        return {MODEL_KEY: model, HF_KEY: lazy,
                RNG_KEY: _state.rng_state()}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        import resilient

        _ = self.manager  # collective: every rank builds its groups at the same point
        self._start = state.global_step
        self._steps = iter(resilient.steps(self._start))

    def _close_between(self) -> None:
        if self._between is not None:
            between, self._between = self._between, None
            between.close()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._close_between()
        if self._steps is None:
            return
        try:
            next(self._steps)
        except StopIteration:  # preempted: the agreed last step is done and saved
            control.should_training_stop = True

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, _force: bool = False, **kw: Any) -> None:
        step = state.global_step - 1  # the optimizer step just completed (0-based)

        def dump() -> dict[str, Any]:
            out: dict[str, Any] = {"trainer_state": _trainer_state_json(self.trainer, state)}
            if optimizer is not None:
                out["optimizer"] = optimizer.state_dict()
            if lr_scheduler is not None:
                out["scheduler"] = lr_scheduler.state_dict()
            return out

        if self.manager.save(step, self.state(model, dump), force=_force):
            self._saved = step
        if self.replace_saves:
            control.should_save = False
        from resilient.worker.preemption import preempt_save_due

        if self._steps is not None and not _force and preempt_save_due(step):
            # the last step the ranks agreed on after a preemption notice, just saved: stop, and let steps()
            # record the clean stop so that resilient-run exits 75 (requeue and rerun the same command)
            control.should_training_stop = True
            for _ in self._steps:
                pass
        if self._steps is not None and (control.should_evaluate or control.should_save) and self._between is None:
            import resilient

            self._between = contextlib.ExitStack()
            self._between.enter_context(resilient.section("eval" if control.should_evaluate else "save"))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not control.should_save:
            self._close_between()

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._close_between()

    def _finish(self) -> None:
        self._close_between()
        if self._steps is not None:
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()
            self._steps = None

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                     lr_scheduler: Any = None, **kw: Any) -> None:
        self._finish()
        last = state.global_step - 1
        if self._manager is not None and last >= self._start and last != self._saved:
            # the end of training is saved whatever the interval: a rerun of a finished job has nothing to redo
            self.on_step_end(args, state, control, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                             _force=True)
        if self._manager is not None:
            self._manager.wait(timeout=self._manager.config.collective_timeout_s)


class ResilientTrainer(Trainer):
    """``transformers.Trainer`` that saves through our tiers and resumes from them by itself.

    Extra keyword arguments: ``resilient_manager`` (a ``CheckpointManager``; default: from the launcher's
    flags), ``resilient_options`` (for ``CheckpointManager.from_env``), ``replace_saves`` (default True).
    """

    def __init__(self, *args: Any, resilient_manager: Any = None, resilient_options: Mapping[str, Any] | None = None,
                 replace_saves: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resilient = ResilientCallback(resilient_manager, replace_saves=replace_saves, **dict(resilient_options or {}))
        self.resilient.trainer = self
        self.add_callback(self.resilient)
        self.restored_step: int | None = None
        self._resume: dict[str, Any] | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Without ``resume_from_checkpoint``: resume from the newest complete step on our tiers, if any."""
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        resume_dir = self._restore()
        done = self._already_done(resume_dir)
        if done is not None:
            shutil.rmtree(resume_dir, ignore_errors=True)  # type: ignore[arg-type]
            self._resume = None
            return done
        try:
            return super().train(resume_dir, *args, **kwargs)
        finally:
            if resume_dir is not None:
                shutil.rmtree(resume_dir, ignore_errors=True)
            self._resume = None

    def _restore(self) -> str | None:
        st = self.resilient.state(self.model, None)
        start = self.resilient.manager.restore(st)
        if start == 0:
            logger.info("no checkpoint on the tiers: starting from scratch")
            return None
        hf = _state.unpack(st[HF_KEY])
        self._resume = {"optimizer": hf.get("optimizer"), "scheduler": hf.get("scheduler"), "rng": st[RNG_KEY]}
        self.restored_step = start
        # the Trainer's resume path reads its state (global step, epoch) from a directory: give it one holding
        # only that small file; the model is already loaded and the rest is handed over from memory below
        d = tempfile.mkdtemp(prefix="resilient-hf-resume-")
        with open(os.path.join(d, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(hf["trainer_state"])
        open(os.path.join(d, _RESUME_MARK), "w").close()
        restored = TrainerState.load_from_json(os.path.join(d, TRAINER_STATE_NAME))
        logger.info("restored step %d (global step %d) from the %s tier", start - 1, restored.global_step,
                    getattr(self.resilient.manager.last_restore, "tier", "?"))
        return d

    def _already_done(self, resume_dir: str | None) -> Any:
        """A rerun of a finished job: the Trainer would run one more step past ``max_steps``; run none."""
        if resume_dir is None or self.args.max_steps <= 0:
            return None
        st = TrainerState.load_from_json(os.path.join(resume_dir, TRAINER_STATE_NAME))
        if st.global_step < self.args.max_steps:
            return None
        from transformers.trainer_utils import TrainOutput

        self.state = st
        logger.info("the checkpoint is at global step %d, max_steps is %d: nothing left to train",
                    st.global_step, self.args.max_steps)
        return TrainOutput(st.global_step, 0.0, {})

    def _ours(self, checkpoint: str | None) -> bool:
        return (self._resume is not None and checkpoint is not None
                and os.path.isfile(os.path.join(checkpoint, _RESUME_MARK)))

    # the Trainer's load hooks: ours serve the restored state from memory; any other directory goes the usual way
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._ours(resume_from_checkpoint):
            return  # restored in place before training started
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        assert self._resume is not None
        if self._resume["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(self._resume["optimizer"])
        if self._resume["scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(self._resume["scheduler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        assert self._resume is not None
        _state.set_rng_state(self._resume["rng"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            parent = getattr(super(), "_load_scaler", None)
            return parent(checkpoint) if parent is not None else None
        return None  # mixed-precision scaler state is not saved yet: it re-learns its scale in a few steps


__all__ = ["ResilientCallback", "ResilientTrainer"]
