"""Live Prometheus metrics of a run, computed from its ledger at scrape time.

The node agent on node 0 runs one :class:`MetricsServer` when ``--metrics-port`` is given. It has its own
registry (never the process-global one, so it adds nothing to a user's own exporter) and reads the ledger
incrementally: each scrape parses only the lines appended since the previous one, and keeps what it read as the
calculator's columns (:class:`~resilient.goodput.columns.ReportInputs`: ~45 bytes a step), not as events, so a
weeks-long run's agent holds tens of megabytes for it, not gigabytes.

For TensorBoard, ``resilient goodput RUN_DIR --tensorboard DIR`` writes the same figures as scalars
(:mod:`resilient.goodput.tensorboard`, optional extra ``[tensorboard]``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from resilient.events.api import Event, EventKind
from resilient.goodput.api import CATEGORIES, GoodputError
from resilient.goodput.calculator import compute_report
from resilient.goodput.columns import ReportInputs
from resilient.events.follow import LedgerTail
from resilient.logs import RateLimitedLog

logger = logging.getLogger(__name__)

PREFIX = "resilient"

# The report's counters and gauges that change only at these (a few an attempt): a scrape after one always
# recomputes, so a restart or the run's end never hides behind a reused report
_STATE_KINDS = frozenset({EventKind.RUN_START, EventKind.RUN_END, EventKind.ATTEMPT_START, EventKind.ATTEMPT_END,
                          EventKind.RESTART, EventKind.SCALE, EventKind.WORKERS_READY})


class LedgerCollector(Collector):
    """Turns the ledger into metric families; every scrape reads what was appended since the last."""

    def __init__(self, run_dir: str | os.PathLike[str], *, max_cpu_share: float = 0.05,
                 free_report_seconds: float = 0.05):
        if not 0 < max_cpu_share <= 1:
            raise ValueError(f"LedgerCollector max_cpu_share is the share of one core the report may take, in (0, 1]; "
                             f"got {max_cpu_share!r}")
        if not 0 <= free_report_seconds < float("inf"):
            raise ValueError(f"LedgerCollector free_report_seconds must be a finite number of seconds >= 0 (0: every "
                             f"report is rationed); got {free_report_seconds!r}")
        self.run_dir = str(run_dir)
        # the report is recomputed from all events; on a long run that costs ~0.15 s per 100k steps, and node 0's
        # agent shares the CPU with training: reuse the last report while recomputing would exceed this share,
        # unless it cost under free_report_seconds (a short run's: every scrape is fresh)
        self.max_cpu_share = max_cpu_share
        self.free_report_seconds = free_report_seconds
        self._report: Any = None
        self._report_at = 0.0
        self._report_cost = 0.0  # CPU seconds of this thread: wall time would grow with the load it is meant to spare
        self._state_changed = False
        self._tail = LedgerTail(run_dir)
        self._inputs = ReportInputs()
        self._lock = threading.Lock()
        self._kinds: Counter[str] = Counter()
        self._last: dict[EventKind, Event] = {}
        self._last_step: tuple[float, Any, Any] | None = None  # (wall, step, seconds) of the newest STEP record
        self._tier_done: dict[str, Event] = {}
        self._tier_failed: Counter[str] = Counter()  # CKPT_TIER_FAILED by tier, a skipped snapshot not counted
        self._errors = RateLimitedLog(logger, 60.0)

    def _update(self) -> None:
        self._tail.read_new(into=self)  # rank 0's step lines come as numbers (add_step): no event a step

    def add(self, ev: Event) -> None:
        """An event the tail read (the tail's sink)."""
        self._inputs.add(ev)
        self._kinds[ev.kind.value] += 1
        if ev.kind is EventKind.STEP:
            self._newest_step(ev.wall, ev.details.get("step"), ev.details.get("seconds"))
            return
        if ev.kind in _STATE_KINDS:
            self._state_changed = True
        prev = self._last.get(ev.kind)
        if prev is None or ev.wall >= prev.wall:
            self._last[ev.kind] = ev
        if ev.kind is EventKind.CKPT_TIER_FAILED and ev.details.get("skipped") is not True:
            self._tier_failed[str(ev.details.get("tier") or "unknown")] += 1
        if ev.kind is EventKind.CKPT_TIER_DONE:
            tier = str(ev.details.get("tier"))
            p = self._tier_done.get(tier)
            if p is None or ev.wall >= p.wall:
                self._tier_done[tier] = ev

    def add_step(self, node: str | None, attempt: int | None, step: int, seconds: float, wall: float) -> None:
        """A STEP line the tail read in its writer's format (the tail's sink)."""
        self._inputs.add_step(node, attempt, step, seconds, wall)
        self._kinds[EventKind.STEP.value] += 1
        self._newest_step(wall, step, seconds)

    def _newest_step(self, wall: float, step: Any, seconds: Any) -> None:
        if self._last_step is None or wall >= self._last_step[0]:
            self._last_step = (wall, step, seconds)

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # scrapes may overlap; the tail and the event list are not thread-safe
            try:
                self._update()
            except OSError as e:
                self._errors.warning("cannot read the ledger in %s: %s", self.run_dir, e, key="read")
            now = time.time()
            yield from self._families(now)

    def _families(self, now: float) -> Iterator[Metric]:
        p = PREFIX
        ev_total = CounterMetricFamily(f"{p}_ledger_events", "Events in the run's ledger, by kind", labels=["kind"])
        for kind, n in sorted(self._kinds.items()):
            ev_total.add_metric([kind], n)
        yield ev_total
        yield _counter(f"{p}_ledger_skipped_lines", "Malformed ledger lines left out of the accounting",
                       self._tail.skipped)
        if not len(self._inputs):
            return
        rep = self._report
        cheap = self._report_cost < self.free_report_seconds
        due = now - self._report_at >= self._report_cost / self.max_cpu_share
        if rep is None or cheap or self._state_changed or due:
            t = time.thread_time()
            try:
                rep = compute_report(self._inputs, now=now, timeline=False)
            except GoodputError as e:
                logger.debug("no goodput yet: %s", e)
                return
            except Exception as e:  # noqa: BLE001 - a scrape must never fail for good: serve the last report
                self._errors.log(logging.ERROR, "goodput report failed (%r); serving the last one", e, key="report")
                if rep is None:
                    return
            else:
                self._report, self._report_at, self._report_cost = rep, now, time.thread_time() - t
                self._state_changed = False
        yield _gauge(f"{p}_goodput_ratio", "Productive time / wall time of the run so far (0..1)", rep.goodput)
        yield _gauge(f"{p}_wall_seconds", "Wall time of the run so far", rep.wall_seconds)
        yield _gauge(f"{p}_productive_seconds", "Productive training time so far", rep.productive_seconds)
        bad = GaugeMetricFamily(f"{p}_badput_seconds", "Non-productive time by category", labels=["category"])
        for c in CATEGORIES:
            bad.add_metric([c], rep.badput_seconds[c])
        yield bad
        yield _counter(f"{p}_restarts", "Worker restarts", rep.restarts)
        yield _counter(f"{p}_disruptions", "Disruptions (faults that ended an attempt)", rep.disruptions)
        yield _gauge(f"{p}_in_progress", "1 while the run has not ended", float(rep.in_progress))
        if rep.attempts:
            cur = rep.attempts[-1]
            yield _gauge(f"{p}_attempt", "Current attempt number (restart count)", cur.attempt)
            if cur.world_size is not None:
                yield _gauge(f"{p}_world_size", "World size of the current attempt", cur.world_size)
            if cur.clean_step_seconds is not None:
                yield _gauge(f"{p}_clean_step_seconds", "Clean step time of the current attempt (no checkpoint "
                             "work in flight): each step counts as productive for at most this long",
                             cur.clean_step_seconds)
        if self._last_step is not None:
            wall, step, seconds = self._last_step
            yield _gauge(f"{p}_last_step", "Last step recorded", _f(step))
            yield _gauge(f"{p}_step_seconds", "Wall time of the last recorded step", _f(seconds))
            yield _gauge(f"{p}_last_step_age_seconds", "Seconds since the last step was recorded", now - wall)
        save = self._last.get(EventKind.CKPT_SAVE)
        if save is not None:
            yield _gauge(f"{p}_checkpoint_save_blocking_seconds", "Blocking time of the last save",
                         _f(save.details.get("blocking_seconds")))
        if self._tier_done:
            age = GaugeMetricFamily(f"{p}_checkpoint_age_seconds", "Seconds since the newest complete checkpoint "
                                    "on each tier", labels=["tier"])
            cstep = GaugeMetricFamily(f"{p}_checkpoint_step", "Step of the newest complete checkpoint on each tier",
                                      labels=["tier"])
            for tier, ev in sorted(self._tier_done.items()):
                age.add_metric([tier], now - ev.wall)
                cstep.add_metric([tier], _f(ev.details.get("step")))
            yield age
            yield cstep
        if self._tier_failed:
            # an alert's input: an upload refused while the local tier has the step is no failed save, and the
            # checkpoint's age on that tier grows only as fast as the interval
            failed = CounterMetricFamily(f"{p}_checkpoint_tier_failures", "Checkpoint saves or restores a tier did "
                                         "not do (the step may be on another tier)", labels=["tier"])
            for tier, n in sorted(self._tier_failed.items()):
                failed.add_metric([tier], n)
            yield failed
        interval = self._last.get(EventKind.CKPT_INTERVAL)
        if interval is not None:
            yield _gauge(f"{p}_checkpoint_interval_steps", "Current checkpoint interval (steps)",
                         _f(interval.details.get("interval")))
            yield _gauge(f"{p}_checkpoint_persistent_every", "Every N-th local save is uploaded",
                         _f(interval.details.get("persistent_every")))


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


class MetricsServer:
    """``MetricsServer(port, run_dir).start()`` serves ``/metrics``; ``close()`` stops it. Port 0 picks a free
    port (see :attr:`port`)."""

    def __init__(self, port: int, run_dir: str, *, addr: str = "127.0.0.1"):
        if not (0 <= int(port) <= 65535):
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.requested_port = int(port)
        self.addr = addr
        self.run_dir = run_dir
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = LedgerCollector(run_dir)
        self.registry.register(self.collector)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> "MetricsServer":
        if self._server is not None:
            return self
        self._server, self._thread = start_http_server(self.requested_port, addr=self.addr, registry=self.registry)
        self.port = int(self._server.server_address[1])
        logger.info("Prometheus metrics of %s on http://%s:%d/metrics", self.run_dir, self.addr, self.port)
        return self

    def close(self, timeout: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "MetricsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
