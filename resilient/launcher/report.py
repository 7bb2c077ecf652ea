"""What the agent tells people and the ledger about a restart and at the end of its run: why workers restart,
the supervisor's action in one line, the checkpoints' closing lines (and the exit rules that depend on them,
:func:`~resilient.launcher.exit.checkpoint_exit`), a ledger that lost events, and the metrics endpoint."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from resilient.events import EventKind, Ledger
from resilient.events.follow import LedgerTail, ledger_incomplete, read_events
from resilient.goodput.checkpoints import (CHECKPOINT_SUMMARY_KINDS, CheckpointSummary, CheckpointTally,
                                           checkpoint_summary)
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


class CheckpointFollower:
    """The run's checkpoint records followed while it trains, so that the closing lines at exit read only what was
    written since the last look. Read at exit, a week's ledger (a million step lines, 166 MB) cost 0.7 s between the
    last checkpoint and the launcher's end; followed every ``interval`` seconds on a thread of its own, the same
    bytes are read once, as they come, and the exit reads the last few seconds' lines.

    Made before the agent writes its RUN_START: what the files hold then is passed over unread (an earlier launch's
    records, which the closing lines leave out), and this node's RUN_START, when it is read, starts the tally again
    (the closing lines are of this launch, from this node's RUN_START on, as :func:`close_checkpoints` reads them
    without a follower). Step lines are passed over undecoded."""

    def __init__(self, run_dir: Path, node: str, *, interval: float = 5.0, rescan: float = 30.0,
                 from_start: bool = False):
        if not 0 < interval <= 3600:
            raise ValueError(f"CheckpointFollower interval must be between 0 and 3600 seconds, got {interval!r}")
        self.node = node
        self.interval = interval
        self._kinds = frozenset({EventKind.RUN_START, *CHECKPOINT_SUMMARY_KINDS})
        self._tally = CheckpointTally()
        self._since = float("-inf")  # wall of this node's newest RUN_START seen: older records are not this launch's
        self._tail = LedgerTail(run_dir, rescan=rescan)
        if not from_start:
            self._tail.skip_to_end()
        self._lock = threading.Lock()  # one look at a time: the thread's, or the exit's last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # why a look failed: the exit then reads the run itself
        self.added = 0  # records of this launch added, over every look

    def start(self) -> "CheckpointFollower":
        self._thread = threading.Thread(target=self._run, name="resilient-ckpt-follow", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._tail.spacing(self.interval)):  # see STAT_SECONDS
            self.poll()

    def poll(self) -> int:
        """One look at the files; how many records it added. Never raises: a look that fails marks the follower
        failed (the exit then reads the whole run, as it does without one)."""
        with self._lock:
            if self.failed is not None:
                return 0
            try:
                evs = self._tail.read_new(None, kinds=self._kinds)
            except Exception as e:  # noqa: BLE001 - the closing lines are a report: training goes on
                self.failed = f"{type(e).__name__}: {e}"
                logger.debug("following the checkpoint records failed: %s", e)
                return 0
            n = 0
            for ev in evs:  # one look's events come merged on wall
                if ev.kind is EventKind.RUN_START:
                    if ev.node == self.node and ev.wall >= self._since:
                        self._since, self._tally = ev.wall, CheckpointTally()
                    continue
                if ev.wall >= self._since:
                    self._tally.add(ev)
                    n += 1
            self.added += n
            return n

    def finish(self, timeout: float = 5.0) -> CheckpointSummary | None:
        """Stop following, take the last look and return the summary; None when a look failed or the thread's look did
        not end within ``timeout`` (a stalled volume): the caller then reads the run itself."""
        self._stop.set()
        if not self._lock.acquire(timeout=timeout):
            logger.debug("the checkpoint follower's look did not end within %.0fs", timeout)
            return None
        self._lock.release()
        self.poll()
        with self._lock:
            return None if self.failed is not None else self._tally.summary()

    def close(self) -> None:
        self._stop.set()


def follow_checkpoints(run_dir: Path, node: str) -> CheckpointFollower | None:
    """A :class:`CheckpointFollower` of ``run_dir`` for ``node`` (not started), or None when the run directory
    cannot be followed (the exit then reads the run itself)."""
    try:
        return CheckpointFollower(run_dir, node)
    except Exception as e:  # noqa: BLE001 - a report: the run goes on without it
        logger.debug("not following the checkpoint records: %s", e)
        return None


def close_checkpoints(end: Ending, ledger: Ledger, run_dir: Path, node: str, persistent: str | None,
                      ckpt_stop_mark: Callable[[], str | None],
                      follower: CheckpointFollower | None = None) -> Ending:
    """The run's closing lines on its checkpoints (which steps went where, which saves failed), and the ending
    the exit rules that depend on them give (``ckpt_stop_mark``: the workers' mark of saves that kept failing).
    With ``follower`` (made before this node's RUN_START), only what it has not read yet is read."""
    try:
        summary = follower.finish() if follower is not None else None
        if summary is not None:
            logger.debug("checkpoint summary from the run followed as it grew (%d record(s))", follower.added)
        else:
            # the STEP lines, most of a long run's ledger, are passed over undecoded
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
    lost = ledger_incomplete(run_dir)
    if lost is not None:
        print(f"resilient-run: {lost} ({ledger_path}); `resilient goodput` reports the run as "
              "incomplete", file=sys.stderr)
