"""What the agent tells people and the ledger about a restart and at the end of its run: why workers restart,
the supervisor's action in one line, the checkpoints' closing lines (and the exit rules that depend on them,
:func:`~resilient.launcher.exit.checkpoint_exit`), a ledger that lost events, and the metrics endpoint."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from resilient.events import EventKind, Ledger
from resilient.launcher.api import PREEMPTED_EXIT_CODE, AgentConfig, Outcome, WorkerExit
from resilient.launcher.exit import Ending, checkpoint_exit, read_error_file

logger = logging.getLogger(__name__)


def describe(action: dict) -> str:
    """The supervisor's action as people read it: "hot_swap node=a spare=s: reason", never a Python dict repr."""
    kind = action.get("action", "?")
    rest = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in action.items()
                    if k not in ("action", "reason") and v not in (None, "", []))
    reason = action.get("reason")
    return f"{kind}{' ' + rest if rest else ''}{': ' + reason if reason else ''}"


def why(cause: str, failures: Sequence[WorkerExit], hang_note: str) -> str:
    """What the terminal says a restart is for: the failed ranks with pid and exit code or signal, as
    torchrun does, the hung rank, or (for another node's failure) the supervisor's reason."""
    if cause == Outcome.FAILED.value and failures:
        last = failures[-1].attempt
        return "; ".join(f.describe() + _raised(f) for f in failures if f.attempt == last)
    if cause == Outcome.HUNG.value and hang_note:
        return hang_note
    return {Outcome.PEER_FAILED.value: "the job restarts (another node's workers failed or it was lost)"}.get(
        cause, cause)


def _raised(f: WorkerExit) -> str:
    """": Type: message at file:line in function" from a failed worker's error file, or nothing."""
    d = read_error_file(f.error_file) if f.exit_code > 0 else {}
    if not d.get("exc_type"):
        return ""
    at = f" at {d['frame']}" if d.get("frame") else ""
    return f": {d['exc_type']}: {d.get('message') or ''}{at}"


def close_checkpoints(end: Ending, ledger: Ledger, run_dir: Path, node: str, persistent: str | None,
                      ckpt_stop_mark: Callable[[], str | None]) -> Ending:
    """The run's closing lines on its checkpoints (which steps went where, which saves failed), and the ending
    the exit rules that depend on them give (``ckpt_stop_mark``: the workers' mark of saves that kept failing)."""
    try:
        from resilient.events.follow import read_events
        from resilient.goodput.checkpoints import CHECKPOINT_SUMMARY_KINDS, checkpoint_summary

        # at every exit: the STEP lines, most of a long run's ledger, are passed over undecoded
        events = list(read_events(run_dir, kinds={EventKind.RUN_START, *CHECKPOINT_SUMMARY_KINDS}))
        mine = [i for i, e in enumerate(events) if e.kind is EventKind.RUN_START and e.node == node]
        summary = checkpoint_summary(events[mine[-1]:] if mine else events)
    except Exception as e:  # noqa: BLE001 - a report: the exit goes on without it
        logger.debug("no checkpoint summary: %s", e)
        return end
    for line in summary.lines():
        print(f"resilient-run: {line}", file=sys.stderr)
    stop = ckpt_stop_mark() if end.code == 0 else None
    gap = summary.not_durable() if stop is None and persistent and end.code in (0, PREEMPTED_EXIT_CODE) else None
    new, line = checkpoint_exit(end, ckpt_stop=stop, not_durable=gap, persistent=persistent)
    if gap is not None:
        ledger.emit(EventKind.CKPT_NOT_DURABLE, step=gap[0], persistent_step=gap[1], exit_code=new.code)
    if line is not None:
        print(f"resilient-run: {line}", file=sys.stderr)
    return new


def start_metrics(cfg: AgentConfig, run_dir: Path, *, hosts_supervisor: bool) -> object | None:
    """The Prometheus endpoint (``--metrics-port``), served by the node that hosts the supervisor (or the only
    node); None when it is not asked for, not this node's, or unavailable (training goes on without it)."""
    if cfg.metrics_port is None or (not hosts_supervisor and not cfg.single_node):
        return None
    try:
        from resilient.goodput.metrics import MetricsServer

        metrics = MetricsServer(cfg.metrics_port, str(run_dir), addr=cfg.metrics_addr)
        metrics.start()
    except Exception as e:  # noqa: BLE001 - fail static
        logger.warning("metrics endpoint on port %s unavailable: %s", cfg.metrics_port, e)
        return None
    return metrics


def say_ledger_lost(run_dir: Path, ledger_path: object) -> None:
    """The final word on a ledger that lost events (any writer of this run dir: the agent, a worker)."""
    from resilient.events.follow import ledger_incomplete

    lost = ledger_incomplete(run_dir)
    if lost is not None:
        print(f"resilient-run: {lost} ({ledger_path}); `resilient goodput` reports the run as "
              "incomplete", file=sys.stderr)
