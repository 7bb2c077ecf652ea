"""Host, GPU and external-notice detectors of the node monitor.

Host and GPU checks run in a background thread (a statvfs on a stuck filesystem or an NVML call on a
failing GPU can block; the agent's loop must not). Each check reports a transition: an event when it
turns unhealthy, nothing while it stays so, re-armed once it is healthy again. The GPU checks are
:mod:`resilient.signals.gpu`'s; an Xid that is not unhealthy becomes a ``log`` event in the node's ledger.

A preemption notice comes from a file (default ``RUN_DIR/preempt``) whose appearance means "this node goes
away soon", or from an HTTP endpoint polled on a thread (:class:`NoticeURL`, e.g. the GCE metadata server). Its content may name the deadline: empty (mtime + grace), a number (epoch seconds, or seconds from
the file's mtime when below 10^9), an ISO-8601 time, or JSON ``{"deadline": ..., "reason": ...}``. Write it
atomically (tmp + rename); a rewrite with another content is a new notice.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.signals.gpu import GpuCheck, GpuHealth, GpuHealthConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthConfig:
    """``gpu``: the NVML checks' settings; None builds them from ``gpu_temperature_threshold`` and this process's
    ``CUDA_VISIBLE_DEVICES`` (the agent's, which its workers' GPUs are picked from)."""

    interval: float = 5.0
    memory_threshold: float = 95.0
    ckpt_local: str | None = None
    disk_min_free_bytes: int = 1 << 30
    disk_min_free_fraction: float = 0.02
    gpu_temperature_threshold: float = 90.0
    gpu: GpuHealthConfig | None = None

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError(f"health check interval must be > 0 seconds, got {self.interval}")
        if self.gpu is None:
            object.__setattr__(self, "gpu", GpuHealthConfig(temperature_threshold=self.gpu_temperature_threshold,
                                                            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")))
        elif self.gpu.temperature_threshold != self.gpu_temperature_threshold != 90.0:
            raise ValueError(f"two GPU temperature thresholds: gpu_temperature_threshold={self.gpu_temperature_threshold}"
                             f" and gpu.temperature_threshold={self.gpu.temperature_threshold}")


def _existing_dir(path: str) -> str | None:
    p = Path(path)
    for q in (p, *p.parents):
        if q.is_dir():
            return str(q)
    return None


class HostChecks:
    """One round of host checks → events for checks that just turned unhealthy."""

    def __init__(self, config: HealthConfig, make_event: Callable[..., Event], nvml: Any = None) -> None:
        """``nvml``: a ``pynvml`` module to use instead of importing it (a stand-in where no GPU exists)."""
        self.config = config
        self._event = make_event
        self._bad: set[str] = set()
        self._no_psutil = False
        assert config.gpu is not None  # filled in by HealthConfig
        self.gpu = GpuHealth(config.gpu, nvml=nvml)

    def _transition(self, key: str, bad: bool, kind: EventKind, **details: Any) -> list[Event]:
        """``key`` names the check's state (one per GPU and metric); ``details`` go into the event."""
        if bad and key not in self._bad:
            self._bad.add(key)
            logger.warning("%s: %s unhealthy: %s", kind.value, key, details)
            return [self._event(kind, **details)]
        if not bad and key in self._bad:
            self._bad.discard(key)
            logger.info("%s healthy again", key)
        return []

    def run(self) -> list[Event]:
        out: list[Event] = []
        try:
            import psutil
        except ImportError:  # a dependency, but a source tree run on a bare GPU machine may lack it
            if not self._no_psutil:
                logger.warning("psutil is not installed: the memory check is skipped")
            self._no_psutil = True
        else:
            mem = psutil.virtual_memory()
            out += self._transition("memory", mem.percent >= self.config.memory_threshold, EventKind.HOST_UNHEALTHY,
                                    check="memory", value=mem.percent, threshold=self.config.memory_threshold,
                                    available_bytes=mem.available)
        if self.config.ckpt_local:
            d = _existing_dir(self.config.ckpt_local)
            if d is not None:
                du = shutil.disk_usage(d)
                need = min(self.config.disk_min_free_bytes, int(self.config.disk_min_free_fraction * du.total))
                out += self._transition("disk_free", du.free < need, EventKind.HOST_UNHEALTHY,
                                        check="disk_free", value=du.free, threshold=need, path=self.config.ckpt_local,
                                        total_bytes=du.total)
        readings, xids = self.gpu.round()
        for r in readings:
            out += self._transition(r.key, r.bad, EventKind.GPU_UNHEALTHY,
                                    index=r.index, uuid=r.uuid, check=r.check.value, value=r.value, **r.extra)
        for x in xids:
            logger.warning("GPU %s: Xid %d (%s): reported, not unhealthy", x.index, x.xid, x.kind)
            out.append(self._event(EventKind.LOG, message=f"GPU {x.index}: Xid {x.xid} ({x.kind})", index=x.index,
                                   uuid=x.uuid, check=GpuCheck.XID.value, xid=x.xid, xid_kind=x.kind))
        return out

    def close(self) -> None:
        self.gpu.close()


class HealthThread:
    """Runs a detector's ``run()`` (:class:`HostChecks`, :class:`NoticeURL`) every interval on its own thread;
    hands events over through ``drain()`` and calls ``wake`` so the agent's loop picks them up at once."""

    def __init__(self, checks: Any, interval: float, wake: Callable[[], None], name: str = "health") -> None:
        self.checks = checks
        self.name = name
        self.interval = interval
        self._wake = wake
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"resilient-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                evs = self.checks.run()
                failing = False
            except Exception as e:  # noqa: BLE001 — fail static: a broken detector must not stop the agent
                if not failing:
                    logger.warning("%s check failed: %s", self.name, e, exc_info=True)
                failing = True
                evs = []
            if evs:
                with self._lock:
                    self._events.extend(evs)
                self._wake()
            self._stop.wait(self.interval)

    def drain(self) -> list[Event]:
        with self._lock:
            evs, self._events = self._events, []
        return evs

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.checks.close()


def parse_deadline(text: str, mtime: float, grace: float) -> tuple[float, str | None]:
    """Deadline (wall seconds) and reason from a notice file's content."""
    text = text.strip()
    reason = None
    value: Any = text
    if text.startswith("{"):
        try:
            d = json.loads(text)
            value, reason = d.get("deadline"), d.get("reason")
        except ValueError:
            value = None
    if value in (None, ""):
        return mtime + grace, reason
    try:
        x = float(value)
        return (x if x >= 1e9 else mtime + x), reason
    except (TypeError, ValueError):
        pass
    try:
        t = _dt.datetime.fromisoformat(str(value))
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp(), reason
    except ValueError:
        logger.warning("preemption notice: unreadable deadline %r; assuming %.0f s of grace", value, grace)
        return mtime + grace, reason


_MTIME_SLACK = 0.05  # seconds: more than one kernel tick at any HZ


class NoticeFile:
    """Polls a notice file; one PREEMPTION_NOTICE per distinct version of it."""

    def __init__(self, path: str, grace: float, make_event: Callable[..., Event],
                 not_before: float | None = None) -> None:
        self.path = path
        self.grace = grace
        self._event = make_event
        self._seen: tuple[int, int, int] | None = None
        # a file older than this (left by an earlier run in the same run directory) is stale: the workers ignore
        # it too, and taken for news it would make the supervisor end a rerun as preempted
        self.not_before = time.time() if not_before is None else not_before
        # a file's times come from the kernel's coarse clock, up to a tick behind time.time(): a notice written in
        # the same tick as this check began would otherwise look older than the agent
        self.not_before -= _MTIME_SLACK

    def poll(self) -> list[Event]:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._seen:
                return []
            with open(self.path, "rb") as f:
                text = f.read(4096).decode(errors="replace")
        except FileNotFoundError:
            self._seen = None
            return []
        except OSError as e:
            logger.debug("preemption notice %s unreadable: %s", self.path, e)
            return []
        self._seen = key
        if st.st_mtime < self.not_before:
            logger.info("preemption notice %s predates this agent: stale, ignored", self.path)
            return []
        deadline, reason = parse_deadline(text, st.st_mtime, self.grace)
        logger.warning("preemption notice from %s: deadline in %.1f s", self.path, deadline - time.time())
        details: dict[str, Any] = {"deadline": deadline, "source": f"file:{self.path}"}
        if reason:
            details["reason"] = reason
        return [self._event(EventKind.PREEMPTION_NOTICE, **details)]


GCE_MAINTENANCE_URL = "http://metadata.google.internal/computeMetadata/v1/instance/maintenance-event"
_QUIET = {"", "NONE", "FALSE", "0"}


class NoticeURL:
    """Polls an HTTP endpoint; any answer other than empty/NONE/FALSE is a notice (its text the reason).

    Made for cloud metadata servers: GCE's ``instance/maintenance-event`` answers ``NONE`` or
    ``TERMINATE_ON_HOST_MAINTENANCE``/``MIGRATE_ON_HOST_MAINTENANCE``; ``instance/preempted`` answers
    ``FALSE`` or ``TRUE`` (about 30 s before a spot VM goes). The deadline is the answer's time + grace.
    Unreachable endpoints are logged once and retried."""

    def __init__(self, url: str, grace: float, make_event: Callable[..., Event], timeout: float = 2.0) -> None:
        self.url = url
        self.grace = grace
        self.timeout = timeout
        self._event = make_event
        self._last = ""
        self._failing = False

    def run(self) -> list[Event]:
        import urllib.request

        req = urllib.request.Request(self.url, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read(4096).decode(errors="replace").strip()
            self._failing = False
        except OSError as e:
            if not self._failing:
                logger.info("preemption notice endpoint %s unreachable (%s); retrying quietly", self.url, e)
            self._failing = True
            return []
        quiet = text.upper() in _QUIET
        if quiet or text == self._last:
            self._last = "" if quiet else text
            return []
        self._last = text
        deadline = time.time() + self.grace
        logger.warning("preemption notice from %s: %s", self.url, text)
        return [self._event(EventKind.PREEMPTION_NOTICE, deadline=deadline, source=f"http:{self.url}", reason=text)]

    def close(self) -> None:
        pass
