"""A minimal stand-in for the node agent: spawns real worker processes and drives a real NodeMonitor.

It does what the agent contract says the agent does — ``attempt_started`` after spawning, select on
``fileno()``, ``on_readable``/``tick`` at ``next_deadline`` — and writes every event to the run's ledger.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger
from resilient.signals.api import MonitorConfig
from resilient.signals.monitor import create_node_monitor
from tests._helpers.gcs import free_port

WORKER = str(Path(__file__).with_name("worker.py"))
REPO = str(Path(__file__).resolve().parents[2])


class Agent:
    def __init__(self, run_dir: Path, **config: object) -> None:
        self.run_dir = run_dir
        self.ledger = Ledger(run_dir, node="node0")
        self.config = MonitorConfig(socket_path=f"@resilient-test-{uuid.uuid4().hex}", **config)  # type: ignore[arg-type]
        self.monitor = create_node_monitor(self.config, self.ledger, 0)
        self.procs: list[subprocess.Popen] = []
        self.events: list[Event] = []
        self.attempt = -1

    def spawn(self, nproc: int, env: dict[str, str] | None = None, script: str = WORKER,
              ranks_per_replica: int | None = None) -> list[subprocess.Popen]:
        self.attempt += 1
        port = free_port()
        self.procs = []
        for r in range(nproc):
            e = dict(os.environ)
            e.update({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
                      "RESILIENT_AGENT_SOCKET": self.config.socket_path, "RESILIENT_RUN_DIR": str(self.run_dir),
                      "RESILIENT_NODE": "node0", "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
            e.update(env or {})
            self.procs.append(subprocess.Popen([sys.executable, script], env=e))
        self.monitor.attempt_started(self.attempt, {r: r for r in range(nproc)}, {r: p.pid for r, p in enumerate(self.procs)},
                                     ranks_per_replica)
        return self.procs

    def _round(self, end: float) -> list[Event]:
        """One pass of the agent loop: wait for the socket or the next deadline (at most until ``end``)."""
        now = time.monotonic()
        dl = self.monitor.next_deadline()
        wait = max(0.0, min(0.1, end - now, max(0.0, dl - now) if dl is not None else 0.1))
        r, _, _ = select.select([self.monitor.fileno()], [], [], wait)
        evs = self.monitor.on_readable(time.monotonic()) if r else []
        evs += self.monitor.tick(time.monotonic())
        for ev in evs:
            self.ledger.write(ev)
        self.events += evs
        return evs

    def pump(self, until, timeout: float) -> list[Event]:
        """Run the agent loop until ``until(events)`` is true; events of this pump are returned.

        The socket is read before the condition is first checked, so a condition that holds at once still
        sees what was already queued. To let time pass, use :meth:`pump_for`.
        """
        new: list[Event] = []
        end = time.monotonic() + timeout
        while True:
            new += self._round(end)
            if until(new):
                return new
            if time.monotonic() > end:
                raise TimeoutError(f"condition not met in {timeout} s; events: {[(e.kind.value, e.rank, e.details) for e in new]}")

    def pump_for(self, seconds: float) -> list[Event]:
        """Run the agent loop for ``seconds`` (reading, ticking, writing the ledger); events of it are returned."""
        new: list[Event] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            new += self._round(end)
        return new

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.monitor.attempt_stopped()

    def close(self) -> None:
        self.stop()
        self.monitor.close()  # idempotent: a test may have closed it already
        self.ledger.close()


def kinds(events: list[Event], kind: EventKind) -> list[Event]:
    return [e for e in events if e.kind == kind]
