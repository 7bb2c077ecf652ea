"""In-step faults, carried out for real in the worker: the plan in ``env.FAULTS`` (see
:mod:`resilient.drill.spec`), for this rank, step and attempt.

``resilient.steps()`` carries them out at each step (importing this module registers :func:`maybe_fail` as a
step hook of :mod:`resilient.worker.steps`); a script with a loop of its own calls :func:`maybe_fail` once per
step, or :func:`fail_at` directly. Every fault is written to the run's ledger as ``fault_injected`` before it
happens, so a goodput report and a test both see what was done.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time

from resilient import env as renv
from resilient.drill.spec import CHECKPOINT_HOWS, FaultHow, WorkerFault, read_plan
from resilient.worker import preemption, steps

logger = logging.getLogger(__name__)

__all__ = ["InjectedFault", "fail_at", "maybe_fail"]


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault: a failure of the training step itself."""


def _plan() -> list[WorkerFault]:
    return read_plan(os.environ)


def _attempt() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _record(fault: str, target: int, at: str, **details: object) -> None:
    """The ledger line comes first: a SIGKILL leaves no chance to write it afterwards."""
    try:
        from resilient.events.api import EventKind
        from resilient.events.ledger import Ledger

        led = Ledger.from_env()
        if led is None:
            return
        try:
            led.emit(EventKind.FAULT_INJECTED, rank=target, fault=fault, target=target, at=at, **details)
        finally:
            led.close()
    except Exception as e:  # noqa: BLE001 - a drill must still run when the ledger cannot be written
        logger.warning("fault %s not recorded in the ledger: %s", fault, e)


def fail_at(rank: int, step: int, how: FaultHow | str, *, current_rank: int | None = None,
            current_step: int | None = None, seconds: float = 0.05, tier_dir: str | None = None) -> None:
    """Carry out fault ``how`` if this process is ``rank`` at ``step`` (``slow``: at and after ``step``).

    ``current_rank`` defaults to ``$RANK``; ``current_step`` must be given by the caller's loop. ``wipe-tier``
    deletes ``tier_dir`` (default: this node's local tier, ``env.CKPT_LOCAL``)."""
    how = FaultHow(how)
    me = int(os.environ.get("RANK", "0")) if current_rank is None else current_rank
    if me != rank or current_step is None or how in CHECKPOINT_HOWS:
        return
    if how == FaultHow.SLOW:
        if current_step >= step:
            if current_step == step:
                _record(how.value, rank, f"step{step}", seconds=seconds)
            time.sleep(seconds)  # the fault itself is lost time
        return
    if current_step != step:
        return
    _record(how.value, rank, f"step{step}")
    sys.stdout.flush()
    sys.stderr.flush()
    if how == FaultHow.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == FaultHow.STOP:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == FaultHow.RAISE:
        raise InjectedFault(f"injected failure on rank {rank} at step {step}")
    elif how == FaultHow.HANG_COLLECTIVE:
        import torch
        import torch.distributed as dist

        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    elif how == FaultHow.PREEMPT:
        _preempt_notice(step)
    elif how == FaultHow.WIPE_TIER:
        d = tier_dir or os.environ.get(renv.CKPT_LOCAL)
        if d:
            shutil.rmtree(d, ignore_errors=True)


def _preempt_notice(step: int) -> None:
    """Agree on ``step`` as the preempted attempt's last step, then drop the notice file. Which step the ranks
    agree on for a real notice depends on where each rank is when it first looks (see
    :mod:`resilient.worker.preemption`); a drill picks it, so a test reproduces each case. Every rank that
    notices the file later reads this agreement from the store; none can be past ``step`` yet (this rank has
    not taken part in the step's collectives)."""
    preemption.agree_stop(_store_attempt(), step)
    run_dir = os.environ.get(renv.RUN_DIR)
    if run_dir:
        with open(os.path.join(run_dir, preemption.PREEMPT_NOTICE_FILE), "w"):
            pass


def _store_attempt() -> int:
    """The attempt ``steps()`` agrees under: torchrun's restart count under ``resilient-run``, else -1."""
    if not os.environ.get(renv.AGENT_SOCKET):
        return -1
    try:
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    except (KeyError, ValueError):
        return -1


def maybe_fail(step: int) -> None:
    """Call once per step in a script with its own loop: carries out the faults planned in ``env.FAULTS`` for
    this rank, step and attempt."""
    att = _attempt()
    for f in _plan():
        if f.attempt is None or f.attempt == att:
            fail_at(f.rank, f.step, f.how, current_step=step, seconds=f.seconds)


def _mine(hows: frozenset[FaultHow] | set[FaultHow]) -> list[WorkerFault]:
    me, att = int(os.environ.get("RANK", "0")), _attempt()
    return [f for f in _plan() if f.how in hows and f.rank == me and (f.attempt is None or f.attempt == att)]


def _die(how: FaultHow, rank: int, step: int) -> None:
    _record(how.value, rank, f"step{step}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


steps.add_step_hook(maybe_fail)
