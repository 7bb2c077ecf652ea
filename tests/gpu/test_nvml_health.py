"""The GPU health checks against the real NVML: a healthy GPU reports healthy within one check interval, through
the agent's own classes (``HostChecks`` on a ``HealthThread``), without nvidia-smi. The wiring (each check turning
unhealthy, re-armed, unsupported, unresponsive, Xids) is tested on CPU against a stand-in NVML in
``tests/signals/test_gpu_health.py``; only a real driver can show that the real answers read as healthy."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest

from resilient.events.api import EventKind
from resilient.signals.gpu import GpuCheck, GpuHealthConfig
from resilient.signals.health import HealthConfig, HealthThread, HostChecks


def _nvml_reason() -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pynvml
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 — any failure means: no NVML here
        return f"needs NVML and an NVIDIA GPU (nvidia-ml-py and a driver): {e!r}"
    return None if n else "NVML found no GPU"


WHY = _nvml_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.mark.timeout(60)
def test_a_healthy_gpu_reports_healthy_within_one_check_interval(tmp_path, monkeypatch):
    smi = tmp_path / "bin" / "nvidia-smi"  # a recording nvidia-smi first on PATH: the checks must never run it
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\ntouch {tmp_path / 'smi-ran'}\nexit 1\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    interval = HealthConfig().interval  # what resilient-run uses unless --health-interval says otherwise
    made: list = []
    cfg = HealthConfig(interval=interval, memory_threshold=100.0,
                       gpu=GpuHealthConfig(visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")))
    t0 = time.monotonic()
    checks = HostChecks(cfg, lambda kind, **d: made.append((kind, d)) or (kind, d))
    thread = HealthThread(checks, interval, wake=lambda: None)
    try:
        wait = threading.Event()
        while checks.gpu.rounds < 1 and time.monotonic() - t0 < 30:
            wait.wait(0.005)
        first = time.monotonic() - t0
        readings = list(checks.gpu.last)
    finally:
        thread.close(timeout=10)
    assert checks.gpu.rounds >= 1 and first <= interval, f"first complete round after {first:.3f} s"
    assert [d for k, d in made if k == EventKind.GPU_UNHEALTHY] == [], made
    assert not [r for r in readings if r.bad], readings
    read = {(r.index, r.check) for r in readings}
    for g in checks.gpu.gpus:  # what an H100 supports is read, not skipped
        for c in (GpuCheck.REACHABLE, GpuCheck.RESPONSIVE, GpuCheck.TEMPERATURE, GpuCheck.ECC_UNCORRECTED,
                  GpuCheck.THROTTLE, GpuCheck.XID):
            assert (g.index, c) in read, (g.index, c, sorted(read))
    assert not (tmp_path / "smi-ran").exists()


@pytest.mark.timeout(60)
def test_the_workers_gpu_is_picked_by_uuid():
    probe = HostChecks(HealthConfig(memory_threshold=100.0, gpu=GpuHealthConfig(visible_devices=None)),
                       lambda kind, **d: (kind, d))
    probe.run()
    try:
        last = probe.gpu.gpus[-1]
    finally:
        probe.close()
    checks = HostChecks(HealthConfig(memory_threshold=100.0, gpu=GpuHealthConfig(visible_devices=last.uuid)),
                        lambda kind, **d: (kind, d))
    try:
        assert checks.run() == []
        assert [(g.index, g.uuid) for g in checks.gpu.gpus] == [(last.index, last.uuid)]
    finally:
        checks.close()
