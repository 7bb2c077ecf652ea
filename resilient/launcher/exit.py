"""How a node agent ends: its exit code and the reason it records, as pure functions of what happened.

torchrun's codes where torchrun has one (0 succeeded, 1 failed or stopped by a signal); the preemption and
checkpoint codes of :mod:`resilient.launcher.api` where schedulers must tell a requeue from a failure.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from resilient.launcher.api import (
    CKPT_FAILED_EXIT_CODE, NOT_DURABLE_EXIT_CODE, PREEMPTED_EXIT_CODE, Outcome, WorkerExit,
)


@dataclass(frozen=True)
class Ending:
    code: int
    reason: str


def preempted_cleanly(marked: Mapping[int, bool]) -> bool:
    """Every local worker ended its loop for the notice after a saved step (resilient.steps marks it) and exited
    0; a script that does not use resilient never marks, and exits as under torchrun. ``marked``: rank → both."""
    return bool(marked) and all(marked.values())


def exit_code(outcome: Outcome, plan: Mapping | None, *, signum: int | None = None,
              preempted: bool = False) -> Ending:
    """The agent's ending for the last thing that happened: ``outcome`` STOPPED (a signal, ``signum``) or the
    supervisor's final ``plan`` (any other outcome). ``preempted``: every local worker stopped cleanly for a
    preemption notice (:func:`preempted_cleanly`)."""
    if outcome == Outcome.STOPPED:
        name = signal.Signals(signum or signal.SIGTERM).name
        if signum == signal.SIGTERM and preempted:
            return Ending(PREEMPTED_EXIT_CODE, "preempted")
        # torchrun exits 1 when stopped by a signal; schedulers and wrappers rely on it
        return Ending(1, f"signal {name}")
    if plan is None:
        raise ValueError("an ending that is not a signal's needs the supervisor's final plan")
    stop = plan.get("stop")
    if stop is not None:
        return Ending(1, f"stopped by the supervisor: {stop}")
    if plan.get("preempted") or preempted:
        # a preemption (a notice file, or another node's that nothing could replace) ended the loop: exit as
        # preempted, so the scheduler requeues
        return Ending(PREEMPTED_EXIT_CODE, "preempted")
    return Ending(0, "succeeded")


def checkpoint_exit(ending: Ending, *, ckpt_stop: str | None, not_durable: tuple[int, int | None] | None,
                    persistent: str | None) -> tuple[Ending, str | None]:
    """The exit rules that depend on the run's checkpoints, and the line to print (None: nothing to say).

    A job its failed saves stopped (``ckpt_stop``: the workers' mark, read on a 0 exit only) exits
    CKPT_FAILED_EXIT_CODE; a finished run whose newest saved step is not on the persistent tier (``not_durable``:
    that step and the persistent tier's newest) exits NOT_DURABLE_EXIT_CODE; a preempted one keeps
    PREEMPTED_EXIT_CODE, so that it is still requeued, and says so."""
    if ending.code == 0 and ckpt_stop is not None:
        return (Ending(CKPT_FAILED_EXIT_CODE, f"checkpoint saves failed: {ckpt_stop}"),
                f"the job stopped (exit {CKPT_FAILED_EXIT_CODE}): {ckpt_stop}")
    if not_durable is None or not persistent or ending.code not in (0, PREEMPTED_EXIT_CODE):
        return ending, None
    step, there = not_durable
    what = (f"the newest saved step {step} is not on the persistent tier {persistent} (newest "
            f"there: {'none' if there is None else there}); only node-local tiers hold it")
    if ending.code == 0:
        return (Ending(NOT_DURABLE_EXIT_CODE, f"succeeded, but step {step} is not durable"),
                f"training finished, but {what} (exit {NOT_DURABLE_EXIT_CODE})")
    return (Ending(ending.code, f"{ending.reason}; step {step} is not durable"),
            f"preempted (exit {ending.code} kept, so that the job is requeued), but {what}")


def failure_summary(script_name: str, failures: Iterable[WorkerExit]) -> str:
    """torchrun's closing report: the failures of the last attempt, every failed rank (ChildFailedError makes
    the earliest the root cause); earlier attempts' failures were printed when they happened."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = list(failures)
    last = failures[-1].attempt if failures else None
    out = {}
    for f in [f for f in failures if f.attempt == last]:
        err = f.error_file if f.error_file and os.path.exists(f.error_file) else "<N/A>"
        out[f.rank] = ProcessFailure(local_rank=f.local_rank, pid=f.pid, exitcode=f.exit_code, error_file=err)
    if not out:
        return f"{script_name} FAILED (no worker failure recorded)"
    return ChildFailedError(name=script_name, failures=out).format_msg()
