"""Per-step cost of ``resilient.steps()`` against a plain ``range`` loop, and of a timed collective.

The agent side is real: a child process runs the node monitor and drains the socket as the agent does.
Cases (each the best of several repetitions, µs per step; the overhead is the difference to ``range``):

* ``range``: the baseline loop.
* ``steps, no agent``: not under resilient-run (no socket in the environment): must equal ``range``.
* ``steps, rank 1``: one non-blocking packet per step to the monitor.
* ``steps, rank 0``: the same plus one STEP event per step appended to the run's ledger.
* ``all_reduce``: one call of a 1-element gloo ``all_reduce`` (world size 1) outside and inside
  ``steps()``, where it is wrapped to measure the time spent waiting.

Each ``next()`` is timed alone while the loop body spins (100 µs by default: a 10 kHz training loop,
faster than any real one), so the agent drains packets at a realistic rate.

    python bench/step_overhead.py [--steps 20000] [--reps 3] [--body-us 100]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def agent(socket_path: str, run_dir: str, ready, stop) -> None:
    from resilient.events.ledger import Ledger
    from resilient.signals.api import MonitorConfig
    from resilient.signals.monitor import create_node_monitor

    led = Ledger(run_dir, node="bench")
    mon = create_node_monitor(MonitorConfig(socket_path=socket_path, heartbeat_timeout=60.0), led, 0)
    mon.attempt_started(0, {0: 0, 1: 1}, {})
    ready.set()
    while not stop.is_set():
        r, _, _ = select.select([mon.fileno()], [], [], 0.05)
        if r:
            mon.on_readable(time.monotonic())
        mon.tick(time.monotonic())
    mon.close()
    led.close()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def per_step(make_iter, n: int, reps: int, body: float) -> dict[str, float]:
    """Time each ``next()`` of the iterator alone while the loop body spins ``body`` seconds, so the agent
    drains packets at a realistic rate; µs per step (mean and median), best repetition by mean."""
    perf = time.perf_counter
    best: dict[str, float] | None = None
    for _ in range(reps):
        it = iter(make_iter(n))
        ts = []
        for _i in range(n):
            t0 = perf()
            next(it)
            ts.append(perf() - t0)
            if body:
                spin(body)
        for _rest in it:  # let steps() finish its bookkeeping outside the timing
            pass
        ts.sort()
        r = {"mean": sum(ts) / n * 1e6, "p50": ts[n // 2] * 1e6, "p99": ts[int(n * 0.99)] * 1e6}
        if best is None or r["mean"] < best["mean"]:
            best = r
    assert best is not None
    return best


def per_call(fn, n: int, reps: int) -> dict[str, float]:
    perf = time.perf_counter
    best: dict[str, float] | None = None
    for _ in range(reps):
        ts = []
        for _i in range(n):
            t0 = perf()
            fn()
            ts.append(perf() - t0)
        ts.sort()
        r = {"mean": sum(ts) / n * 1e6, "p50": ts[n // 2] * 1e6, "p99": ts[int(n * 0.99)] * 1e6}
        if best is None or r["mean"] < best["mean"]:
            best = r
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--body-us", type=float, default=100.0, help="spin time of the loop body (µs)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_overhead.json"))
    args = ap.parse_args(argv)

    from resilient.worker import steps as client

    n, reps, body = args.steps, args.reps, args.body_us * 1e-6
    res: dict[str, dict[str, float]] = {}
    res["range"] = per_step(lambda k: range(k), n, reps, body)
    os.environ.pop("RESILIENT_AGENT_SOCKET", None)
    res["steps, no agent"] = per_step(lambda k: client.steps(0, k), n, reps, body)

    run_dir = tempfile.mkdtemp(prefix="resilient-bench-")
    sock = f"@resilient-bench-{uuid.uuid4().hex}"
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=agent, args=(sock, run_dir, ready, stop), daemon=True)
    proc.start()
    dropped: dict[str, int] = {}
    try:
        if not ready.wait(60):
            raise SystemExit("the monitor process did not start within 60 s")
        os.environ.update({"RESILIENT_AGENT_SOCKET": sock, "RESILIENT_RUN_DIR": run_dir, "WORLD_SIZE": "2",
                           "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"})
        for rank in (1, 0):
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
            client._client_obj = None
            name = f"steps, rank {rank}" + (" (+ledger)" if rank == 0 else "")
            res[name] = per_step(lambda k: client.steps(0, k), n, reps, body)
            c = client._client()
            assert c is not None
            dropped[name] = c.dropped
            if c.ledger is not None:
                c.ledger.close()

        import torch
        import torch.distributed as dist

        os.environ.update({"RANK": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
        dist.init_process_group("gloo", rank=0, world_size=1)
        t = torch.zeros(1)
        m = max(2000, n // 4)
        res["all_reduce, plain"] = per_call(lambda: dist.all_reduce(t), m, reps)
        client._client_obj = None
        gen = client.steps(0, None)
        next(gen)  # inside steps(): all_reduce is wrapped to time its waits
        assert getattr(dist.all_reduce, "__resilient_timed__", False)
        res["all_reduce, timed wrapper"] = per_call(lambda: dist.all_reduce(t), m, reps)
        gen.close()
        dist.destroy_process_group()
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    def table(rows, base):
        for name in rows:
            v = res[name]
            print(f"{name:<30}{v['mean']:>9.3f}{v['p50']:>9.3f}{v['p99']:>9.3f}{v['mean'] - res[base]['mean']:>13.3f}")

    print(f"per step ({n} steps, body {args.body_us:.0f} µs, best of {reps}); µs")
    print(f"{'case':<30}{'mean':>9}{'p50':>9}{'p99':>9}{'overhead':>13}")
    table(["range", "steps, no agent", "steps, rank 1", "steps, rank 0 (+ledger)"], "range")
    print(f"per collective call ({m} calls); µs")
    table(["all_reduce, plain", "all_reduce, timed wrapper"], "all_reduce, plain")
    print("dropped packets: " + ", ".join(f"{k}: {v} of {n * reps}" for k, v in dropped.items()))
    summary = {
        "steps": n, "reps": reps, "body_us": args.body_us, "us": res, "dropped_packets": dropped,
        "overhead_us_mean": {
            "no_agent": res["steps, no agent"]["mean"] - res["range"]["mean"],
            "rank1": res["steps, rank 1"]["mean"] - res["range"]["mean"],
            "rank0_with_ledger": res["steps, rank 0 (+ledger)"]["mean"] - res["range"]["mean"],
            "all_reduce_wrapper": res["all_reduce, timed wrapper"]["mean"] - res["all_reduce, plain"]["mean"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
