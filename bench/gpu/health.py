"""GPU health on the device: the agent's own health checks (``HostChecks`` on a ``HealthThread``) against the real
NVML, never nvidia-smi.

    python3 bench/gpu/health.py --out DIR [--dry-run] [--interval 5] [--rounds 20]

Reports: the time from starting the checks to their first complete round (NVML loaded, every GPU read) against
the check interval (the goal: healthy within one interval), each check's value per GPU (temperature, volatile
uncorrectable ECC errors, clock-event reasons, remapped rows, recovery action, whether Xid events could be
registered, what NVML does not support), the cost of one round (median and max of ``--rounds``) beside one bare
``nvmlDeviceGetTemperature`` call (the cheapest NVML query: what a round costs at least), and whether
``nvidia-smi`` ran (a recording ``nvidia-smi`` first on ``PATH`` would notice). Writes ``DIR/health.json`` and
prints a table. About 5 s on an H100.

``--dry-run``: the same code against the stand-in NVML of the tests (one healthy GPU); figures not meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
FAKE_NVML = ROOT / "tests" / "signals" / "fake_nvml"
FAKE_STATE = {"init": "ok", "devices": [{"uuid": "GPU-00000000-dry-run", "temperature": 41, "ecc": 0,
                                         "remapped": [0, 0, 0, 0], "clocks": 0x1, "recovery_action": 0,
                                         "xids": []}]}


def _guard_nvidia_smi(tmp: Path) -> Path:
    """A recording ``nvidia-smi`` first on PATH: if anything in this process runs it, the marker appears."""
    bindir, marker = tmp / "bin", tmp / "nvidia-smi-ran"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 1\n")
    exe.chmod(0o755)
    os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    return marker


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--interval", type=float, default=5.0, help="health check interval (seconds; the agent's default)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds timed for the cost of one")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.dry_run:
        sys.path.insert(0, str(FAKE_NVML))
        import pynvml  # the stand-in

        pynvml.STATE = FAKE_STATE

    from resilient.signals.gpu import GpuHealthConfig
    from resilient.signals.health import HealthConfig, HealthThread, HostChecks

    tmp = Path(tempfile.mkdtemp(prefix="health-bench-"))
    marker = _guard_nvidia_smi(tmp)
    cfg = HealthConfig(interval=args.interval, memory_threshold=100.0,
                       gpu=GpuHealthConfig(visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")))
    events: list = []

    def make_event(kind, **d):
        events.append((kind.value, d))
        return (kind.value, d)

    # 1. the agent's way: a health thread; its first round starts at once
    t0 = time.monotonic()
    checks = HostChecks(cfg, make_event)
    thread = HealthThread(checks, args.interval, wake=lambda: None)
    first_round_s = None
    deadline = t0 + args.interval + 3 * cfg.gpu.call_timeout
    while time.monotonic() < deadline:
        if checks.gpu.rounds >= 1 or checks.gpu.state == "absent":
            first_round_s = time.monotonic() - t0
            break
        threading.Event().wait(0.002)
    readings = list(checks.gpu.last)
    gpus = [(g.index, g.uuid, g.events is not None, sorted(c.value for c in g.unsupported)) for g in checks.gpu.gpus]
    state = checks.gpu.state
    thread.close(timeout=cfg.gpu.call_timeout)

    # 2. the cost of one round (the same class, driven directly), beside one bare NVML query
    rounds_ms: list[float] = []
    bare_ms: list[float] = []
    if state == "ready":
        direct = HostChecks(cfg, make_event)
        direct.run()  # loads NVML
        for _ in range(args.rounds):
            t = time.perf_counter()
            direct.run()
            rounds_ms.append((time.perf_counter() - t) * 1e3)
        nv, g0 = direct.gpu.nvml, direct.gpu.gpus[0] if direct.gpu.gpus else None
        if g0 is not None:
            for _ in range(args.rounds):
                t = time.perf_counter()
                nv.nvmlDeviceGetTemperature(g0.handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
                bare_ms.append((time.perf_counter() - t) * 1e3)
        direct.close()

    def per_gpu(check: str) -> list:
        return [r.value for r in readings if r.check.value == check and r.index is not None]

    unhealthy = [{"index": r.index, "check": r.check.value, "value": r.value} for r in readings if r.bad]
    smi_ran = marker.exists()
    healthy_in_time = (state == "ready" and first_round_s is not None and first_round_s <= args.interval
                       and not unhealthy and bool(gpus))
    doc = {
        "dry_run": bool(args.dry_run),
        "meaningful": not args.dry_run,
        "nvml": "stand-in" if args.dry_run else "real",
        "nvml_state": state,
        "gpus": len(gpus),
        "gpu_uuids": [u for _, u, _, _ in gpus],
        "interval_s": args.interval,
        "first_round_s": None if first_round_s is None else round(first_round_s, 4),
        "goal_first_round_s": args.interval,
        "healthy_within_interval": healthy_in_time,
        "temperature_c": per_gpu("temperature"),
        "temperature_threshold_c": cfg.gpu.temperature_threshold,
        "ecc_uncorrected_volatile": per_gpu("ecc_uncorrected"),
        "clock_event_reasons": per_gpu("throttle"),
        "remapped_rows": per_gpu("remapped_rows"),
        "recovery_action": per_gpu("recovery_action"),
        "xid_registered": [x for _, _, x, _ in gpus],
        "unsupported_checks": [u for _, _, _, u in gpus],
        "unhealthy": unhealthy,
        "events": events,
        "round_ms_median": round(statistics.median(rounds_ms), 3) if rounds_ms else None,
        "round_ms_max": round(max(rounds_ms), 3) if rounds_ms else None,
        "baseline_bare_query_ms_median": round(statistics.median(bare_ms), 4) if bare_ms else None,
        "rounds_timed": len(rounds_ms),
        "nvidia_smi_invoked": smi_ran,
        "goal": "healthy (every check read, none unhealthy) within one check interval; nvidia-smi never run",
    }
    doc["met"] = bool(healthy_in_time and not smi_ran)
    (out / "health.json").write_text(json.dumps(doc, indent=1, default=str))

    rows = [("NVML", doc["nvml"] + ("" if state == "ready" else f" ({state})")), ("GPUs watched", len(gpus)),
            ("first complete round (s)", f"{doc['first_round_s']} (goal <= {args.interval})"),
            ("temperature (C)", doc["temperature_c"]), ("ECC uncorrected (volatile)", doc["ecc_uncorrected_volatile"]),
            ("clock-event reasons", doc["clock_event_reasons"]), ("remapped rows", doc["remapped_rows"]),
            ("recovery action", doc["recovery_action"]), ("Xid events registered", doc["xid_registered"]),
            ("not supported", doc["unsupported_checks"]), ("unhealthy", unhealthy or "none"),
            ("round (ms, median / max)", f"{doc['round_ms_median']} / {doc['round_ms_max']}"),
            ("bare NVML query (ms, median)", doc["baseline_bare_query_ms_median"]),
            ("nvidia-smi invoked", smi_ran), ("met", doc["met"])]
    title = "GPU health" + (" (dry run: stand-in NVML, figures not meaningful)" if args.dry_run else "")
    print(title)
    for k, v in rows:
        print(f"  {k:<30} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
