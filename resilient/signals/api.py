"""Contract between the node agent and the signal detectors.

The agent owns the worker processes and an event loop; a :class:`NodeMonitor` owns everything the
workers report over the agent socket (heartbeats, step times, sections) plus the host/GPU/notice
detectors. The agent drives it: ``attempt_started`` when workers are spawned, ``fileno``/``on_readable``
when the socket has data, ``tick`` at least every ``monitor_interval``; events returned by ``tick`` are
written to the ledger by the agent and acted on (HANG → restart, like a worker exit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from resilient.events.api import Event

# The section a checkpoint restore is reported as (``resilient.section(RESTORE_SECTION)`` marks a restore of one's
# own the same way). It is held to the start-up bound, not a learned one (a restore from another tier can take ten
# times the last), and its time is left out of the start-up a later attempt's bound is learned from.
RESTORE_SECTION = "restore"


@dataclass(frozen=True)
class MonitorConfig:
    socket_path: str  # where the worker client connects (RESILIENT_AGENT_SOCKET)
    heartbeat_timeout: float | None = None  # None: learned from observed step times
    initial_timeout: float = 600.0  # start-up: spawn → first heartbeat
    ckpt_local: str | None = None  # local tier directory, for the free-space check
    # Everything below has a default, so ``MonitorConfig(socket_path=...)`` stays valid.
    # Learned timeouts (heartbeat_timeout None, or sections without their own): safety factor × the
    # longest step observed so far, never below ``min_learned_timeout``; ``initial_timeout`` until
    # ``learn_after`` steps (or sections of that name) have been seen. nvidia-resiliency-ext uses 5×; 3× with
    # a 1 s floor acts on a hang within a few steps, and stays safe because what is long by nature is never
    # learned from nor held to it: each rank's first ``warmup_steps`` steps of every attempt (compile, lazy
    # communicator set-up, peers still restoring) run under the initial timeout, a step that holds a section
    # (a checkpoint's blocking part, a marked evaluation) is not a step sample, and the step after a section
    # gets that section's timeout on top (peers may still be inside it). A rare long unmarked step can still
    # exceed it: each hang declared on a learned timeout doubles the learned timeouts, so a false alarm
    # cannot repeat forever; not one where a rank's process was stopped (no long step looks like that).
    learn_factor: float = 3.0
    min_learned_timeout: float = 1.0
    # A later attempt's start-up (spawn → ``steps()``, a marked restore left out) is held to ``learn_factor`` × the
    # longest an earlier attempt's took, never below this floor (nor above the start-up bound's reach: it replaces
    # ``initial_timeout`` there), once an earlier attempt restored through the checkpointer, whose restore is
    # marked (:data:`RESTORE_SECTION`). The floor covers what a start-up waits for beyond its own work: other
    # nodes' workers joining the process group a few seconds later, a loaded machine.
    min_learned_startup: float = 30.0
    learn_after: int = 3
    warmup_steps: int = 3
    # Straggler scores (1.0 = as fast as the reference): "peers" compares a rank's median own-work
    # time with the fastest local rank's, "history" with the rank's own best median.
    straggler_threshold: float = 0.75
    straggler_history_threshold: float = 0.5
    straggler_window: int = 12  # steps per median
    straggler_confirm: int = 4  # consecutive evaluations below threshold before flagging
    straggler_min_gap: float = 0.005  # seconds: slower by less than this is noise, never a straggler
    # Host / GPU health, checked in a background thread so a stuck filesystem cannot stall the agent.
    health_interval: float = 5.0
    memory_threshold: float = 95.0  # percent of RAM in use
    disk_min_free_bytes: int = 1 << 30
    disk_min_free_fraction: float = 0.02  # unhealthy below min(bytes, fraction × size)
    gpu_temperature_threshold: float = 90.0
    # External notice: a file whose appearance means "preempted/maintenance soon". None: RUN_DIR/preempt.
    preempt_file: str | None = None
    preempt_grace: float = 30.0  # deadline when the notice names none: its time + this
    preempt_poll: float = 0.25
    # HTTP notice endpoint (e.g. GCE metadata ".../instance/preempted"); None: $RESILIENT_PREEMPT_URL if set
    preempt_url: str | None = None
    preempt_url_poll: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.socket_path, str) or not self.socket_path or self.socket_path == "@":
            raise ValueError(f"socket_path must be a filesystem path or '@name' (abstract), got {self.socket_path!r}")
        if self.heartbeat_timeout is not None and self.heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat timeout must be > 0 seconds, got {self.heartbeat_timeout}")
        if self.initial_timeout <= 0:
            raise ValueError(f"initial timeout must be > 0 seconds, got {self.initial_timeout}")
        for name in ("learn_factor", "min_learned_timeout", "min_learned_startup", "health_interval", "preempt_poll", "preempt_url_poll",
                     "straggler_min_gap", "gpu_temperature_threshold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MonitorConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.learn_after < 1:
            raise ValueError(f"MonitorConfig.learn_after must be >= 1 observed gap, got {self.learn_after}")
        if self.warmup_steps < 0:
            raise ValueError(f"MonitorConfig.warmup_steps must be >= 0 steps, got {self.warmup_steps}")
        for name in ("straggler_threshold", "straggler_history_threshold"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"MonitorConfig.{name} is a score in (0, 1], got {getattr(self, name)}")
        if self.straggler_window < 3:
            raise ValueError(f"MonitorConfig.straggler_window must be >= 3 steps for a median, got {self.straggler_window}")
        if self.straggler_confirm < 1:
            raise ValueError(f"MonitorConfig.straggler_confirm must be >= 1, got {self.straggler_confirm}")
        if not 0 < self.memory_threshold <= 100:
            raise ValueError(f"MonitorConfig.memory_threshold is a percentage in (0, 100], got {self.memory_threshold}")
        if self.disk_min_free_bytes < 0 or not 0 <= self.disk_min_free_fraction < 1:
            raise ValueError("MonitorConfig.disk_min_free_bytes must be >= 0 and disk_min_free_fraction in [0, 1), "
                             f"got {self.disk_min_free_bytes} and {self.disk_min_free_fraction}")
        if self.preempt_url is not None and not self.preempt_url.startswith(("http://", "https://")):
            raise ValueError(f"MonitorConfig.preempt_url must be an http(s) URL, got {self.preempt_url!r}")
        if self.preempt_grace < 0:
            raise ValueError(f"MonitorConfig.preempt_grace must be >= 0 seconds, got {self.preempt_grace}")


class NodeMonitor(Protocol):
    def fileno(self) -> int: ...

    def on_readable(self, now: float) -> list[Event]: ...

    def attempt_started(self, attempt: int, ranks: dict[int, int], pids: dict[int, int],
                        ranks_per_replica: int | None = None) -> None:
        """``ranks``: local rank → global rank; ``pids``: local rank → worker pid; ``ranks_per_replica``
        (``--nodes-per-replica`` × workers per node; None: every rank a replica) decides which ranks are
        data-parallel peers for straggler scores."""

    def attempt_stopped(self) -> None: ...

    def tick(self, now: float) -> list[Event]:
        """Time-driven checks (hang, straggler, health); ``now`` is ``time.monotonic()``."""

    def next_deadline(self) -> float | None:
        """Monotonic time at which ``tick`` must next run, or None; lets the agent sleep exactly."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class ScaleEvent:
    """Passed to ``resilient.on_scale`` callbacks when an attempt starts with another world size than the
    last attempt that trained (see :mod:`resilient.worker.scale`). ``reason``: why the supervisor changed the
    size (its action's reason), None when it gave none."""

    old_world_size: int
    new_world_size: int
    old_dp_size: int
    new_dp_size: int
    reason: str | None = None
