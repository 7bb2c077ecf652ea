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


@dataclass(frozen=True)
class MonitorConfig:
    socket_path: str  # where the worker client connects (RESILIENT_AGENT_SOCKET)
    heartbeat_timeout: float | None = None  # None: learned from observed step times
    initial_timeout: float = 600.0  # start-up: spawn → first heartbeat
    ckpt_local: str | None = None  # local tier directory, for the free-space check

    def __post_init__(self) -> None:
        if self.heartbeat_timeout is not None and self.heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat timeout must be > 0 seconds, got {self.heartbeat_timeout}")
        if self.initial_timeout <= 0:
            raise ValueError(f"initial timeout must be > 0 seconds, got {self.initial_timeout}")


class NodeMonitor(Protocol):
    def fileno(self) -> int: ...

    def on_readable(self, now: float) -> list[Event]: ...

    def attempt_started(self, attempt: int, ranks: dict[int, int], pids: dict[int, int]) -> None:
        """``ranks``: local rank → global rank; ``pids``: local rank → worker pid."""

    def attempt_stopped(self) -> None: ...

    def tick(self, now: float) -> list[Event]:
        """Time-driven checks (hang, straggler, health); ``now`` is ``time.monotonic()``."""

    def next_deadline(self) -> float | None:
        """Monotonic time at which ``tick`` must next run, or None; lets the agent sleep exactly."""

    def close(self) -> None: ...
