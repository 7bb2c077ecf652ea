"""How a node agent ends: its exit code and the reason it records, as pure functions of what happened.

torchrun's codes where torchrun has one (0 succeeded, 1 failed or stopped by a signal); the preemption and
checkpoint codes of :mod:`resilient.launcher.api` where schedulers must tell a requeue from a failure. Also why a
worker failed (:func:`failure_cause`): its error file and the cgroup's OOM kill count, the only reads here.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from resilient.launcher.api import (
    CKPT_FAILED_EXIT_CODE, NOT_DURABLE_EXIT_CODE, PREEMPTED_EXIT_CODE, Outcome, WorkerExit,
)


# Exit code of an agent that needed a decision (its workers failed or hung, it waits as a spare, its workers
# finished and it waits for the job's end) while no supervisor could be reached for --supervisor-timeout seconds,
# the supervisor dead or hung: sysexits' EX_PROTOCOL, "the remote side did not answer as the protocol wants".
# Distinct from 69 (the store stayed away for the whole --rendezvous-timeout) and 75 (preempted after a save), so
# that an operator tells them apart; requeued like both: nothing is wrong with the training, and the rerun
# resumes from the newest complete checkpoint. Neither Slurm nor Kubernetes gives 76 a meaning of its own.
SUPERVISOR_UNREACHABLE_EXIT_CODE = 76


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


def supervisor_unreachable(need: str, waited: float, bound: float, endpoint: str) -> Ending:
    """The ending of an agent that needed a decision (``need``: why) and heard from no supervisor for ``waited``
    seconds, past the ``bound`` (--supervisor-timeout); its reason is the one line the agent prints."""
    return Ending(SUPERVISOR_UNREACHABLE_EXIT_CODE,
                  f"no supervisor reachable at {endpoint} for {waited:.0f} s (--supervisor-timeout {bound:g}) while "
                  f"{need}; exit {SUPERVISOR_UNREACHABLE_EXIT_CODE}: requeue the job, it resumes from its newest "
                  f"checkpoint")


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


def read_error_file(path: str | None, limit: int = 1 << 20) -> dict[str, Any]:
    """What a worker's error file (torch elastic's ``@record`` format, which the fork server writes too) says:
    ``exc_type``, ``message`` (the first line of the exception's text), ``frame`` (``file:line in function``,
    where it was raised) and, when the worker put them there, ``restore`` (a failed restore's details). Empty
    when there is no readable file (a script without ``@record`` run directly, a signal)."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            raw = f.read(limit)
        data = json.loads(raw)
    except (OSError, ValueError):
        return {}
    msg = data.get("message") if isinstance(data, dict) else None
    extra: dict[str, Any] = {}
    if isinstance(msg, dict):
        text = msg.get("message")
        extra = msg.get("extraInfo") if isinstance(msg.get("extraInfo"), dict) else {}
    else:
        text = msg
    text = str(text or "")
    stack = str(extra.get("py_callstack") or "")
    out: dict[str, Any] = {}
    first = text.strip().splitlines()[0] if text.strip() else ""
    # "Type: message" is how torch's @record and the fork server spell it; the traceback's last line says the same
    head, sep, rest = first.partition(": ")
    if sep and head and " " not in head:
        out["exc_type"], out["message"] = head, rest[:500]
    elif first:
        out["message"] = first[:500]
    frames = _FRAME.findall(stack)
    if frames:
        file, line, func = frames[-1]
        out["frame"] = f"{file}:{line} in {func}"
    if "exc_type" not in out and stack.strip():
        last = stack.strip().splitlines()[-1]
        head, sep, rest = last.partition(": ")
        if head and " " not in head:
            out["exc_type"] = head
            out.setdefault("message", rest[:500])
    restore = extra.get("restore")
    if isinstance(restore, dict):
        out["restore"] = restore
    return out


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.MULTILINE)


def oom_kills() -> int | None:
    """The kernel's OOM kill count of this process's cgroup (cgroup v2 ``memory.events``, else v1's
    ``memory.oom_control``), None where neither is readable. Workers live in the agent's cgroup, so a count that
    grew across a worker's SIGKILL says the kernel killed it for memory."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = []
    for ln in lines:
        parts = ln.split(":", 2)
        if len(parts) == 3 and parts[0] == "0":
            paths.append(("/sys/fs/cgroup" + parts[2].rstrip("/"), "memory.events", "oom_kill"))
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            paths.append(("/sys/fs/cgroup/memory" + parts[2].rstrip("/"), "memory.oom_control", "oom_kill"))
    for base, name, key in paths:
        try:
            with open(f"{base}/{name}") as f:
                for ln in f:
                    k, _, v = ln.partition(" ")
                    if k == key:
                        return int(v)
        except (OSError, ValueError):
            continue
    return None


def failure_cause(ex: WorkerExit, oom_before: int | None, oom_now: int | None) -> dict[str, Any]:
    """The cause a worker_exit event carries: the error file's facts, the OOM kill, and the ``failure_class``
    (:func:`resilient.supervisor.classify.classify`) of the whole."""
    from resilient.events.api import EventKind
    from resilient.supervisor.classify import classify, peer_consequence

    d: dict[str, Any] = read_error_file(ex.error_file) if ex.exit_code > 0 else {}
    if ex.signal_name == "SIGKILL" and oom_before is not None and oom_now is not None:
        d["oom_kill"] = oom_now > oom_before
    if d.get("exc_type") and peer_consequence(d.get("exc_type"), d.get("message")):
        d["consequence"] = True  # a collective with a dead peer: the first failure is elsewhere
    d["failure_class"] = classify(EventKind.WORKER_EXIT, {**d, "signal": ex.signal_name}).value
    return d


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
