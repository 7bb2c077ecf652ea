"""The supervisor's decision core at fleet scale: a fake fleet of N nodes × R ranks (default 512 × 8 =
4,096 ranks) feeding a real :class:`SupervisorCore` in real time.

Every node reports a summary once a second (``seen``), the core ticks ten times a second (node timeouts,
deferred scale-ups), and random faults arrive as a Poisson stream: worker exits, hangs, stragglers,
checkpoint completions, and now and then a node that goes silent (lost) and, later, joins back as a
spare. The policy is the shipped ``policies/default.py`` loaded like a user's ``--policy`` (so every
decision also pays for the policy thread and its timeout), or the built-in default with ``--builtin``.

Measured: the latency of every core call that produced a decision (p50, p99, max), the latency of every
``seen``/``tick`` (the steady-state cost), and the process CPU time over wall time (the whole process is
the core plus a loop that only generates calls). The transport is measured separately.

    python bench/supervisor_scale.py [--nodes 512] [--nproc 8] [--seconds 20] [--fault-rate 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from resilient.events.api import Event, EventKind  # noqa: E402
from resilient.supervisor.core import SupervisorConfig, SupervisorCore  # noqa: E402
from resilient.supervisor.policy import load_policy  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(nodes: int, nproc: int, spares: int, seconds: float, fault_rate: float, builtin: bool, seed: int) -> dict:
    rng = random.Random(seed)
    policy = None if builtin else load_policy(REPO / "policies" / "default.py")
    cfg = SupervisorConfig(min_nodes=nodes // 2, max_nodes=nodes, nproc_per_node=nproc, max_restarts=10**9,
                           node_timeout=5.0, scale_up_wait=3.0, failure_window=60.0)
    core = SupervisorCore(cfg, policy)
    names = [f"node{i:04d}" for i in range(nodes + spares)]
    t0 = time.monotonic()
    for n in names:
        core.join(n, nproc, 0.0)
    core.form(0.0)

    silent: dict[str, float] = {}  # node → when it comes back as a spare
    decision_lat: list[float] = []
    kinds: dict[str, int] = {}
    seen_lat: list[float] = []
    tick_lat: list[float] = []
    step = 0
    # every node reports once a second, spread evenly over the second
    period = 1.0 / len(names)
    next_report = 0.0
    next_tick = 0.0
    next_fault = rng.expovariate(fault_rate)
    ri = 0
    cpu0, wall0 = time.process_time(), time.monotonic()

    def timed(fn, *a) -> list:
        s = time.perf_counter()
        ds = fn(*a)
        dt = time.perf_counter() - s
        if ds:
            decision_lat.append(dt)
            for d in ds:
                kinds[d.action.kind] = kinds.get(d.action.kind, 0) + 1
        return ds

    while True:
        now = time.monotonic() - t0
        if now >= seconds:
            break
        due = min(next_report, next_tick, next_fault)
        if due > now:
            time.sleep(min(due - now, 0.05))  # the fleet's pacing, not a synchronisation
            continue
        if next_report <= now:
            n = names[ri % len(names)]
            ri += 1
            next_report += period
            if n in silent:
                if now >= silent[n]:
                    del silent[n]
                    timed(core.join, n, nproc, now)
                continue
            s = time.perf_counter()
            core.seen(n, now)
            seen_lat.append(time.perf_counter() - s)
        elif next_tick <= now:
            next_tick += 0.1
            s = time.perf_counter()
            ds = timed(core.tick, now)
            tick_lat.append(time.perf_counter() - s)
            if core.stopped:
                break
            del ds
        else:
            next_fault += rng.expovariate(fault_rate)
            a = core.assignment
            assert a is not None
            node = rng.choice(a.members)
            r = rng.random()
            base = a.base_rank(node)
            if r < 0.1:
                silent[node] = now + cfg.node_timeout + 5.0  # lost, then back as a spare
                continue
            if r < 0.4:
                ev = Event(EventKind.WORKER_EXIT, node=node, rank=base + rng.randrange(nproc), attempt=a.attempt,
                           details={"exit_code": 1, "signal": None})
            elif r < 0.5:
                ev = Event(EventKind.HANG, node=node, rank=base, attempt=a.attempt, details={"timeout": 30})
            elif r < 0.8:
                ev = Event(EventKind.STRAGGLER, node=node, rank=base, attempt=a.attempt, details={"score": 0.4})
            else:
                step += 10
                ev = Event(EventKind.CKPT_TIER_DONE, node=node, rank=base, attempt=a.attempt,
                           details={"step": step, "tier": "local"})
            timed(core.handle, ev, now)
            if core.stopped:
                break
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    a = core.assignment
    return {
        "nodes": nodes, "spares": spares, "nproc_per_node": nproc, "ranks": nodes * nproc, "seconds": round(wall, 2),
        "policy": "builtin default" if builtin else "policies/default.py (policy thread)",
        "fault_rate_per_s": fault_rate, "decisions": sum(kinds.values()), "decisions_by_kind": kinds,
        "decision_calls": len(decision_lat),
        "decision_ms": {"p50": pct(decision_lat, 0.5) * 1e3, "p99": pct(decision_lat, 0.99) * 1e3,
                        "max": max(decision_lat, default=float("nan")) * 1e3},
        "seen_us": {"p50": pct(seen_lat, 0.5) * 1e6, "p99": pct(seen_lat, 0.99) * 1e6, "calls": len(seen_lat)},
        "tick_ms": {"p50": pct(tick_lat, 0.5) * 1e3, "p99": pct(tick_lat, 0.99) * 1e3, "calls": len(tick_lat)},
        "cpu_share_of_one_core": cpu / wall, "final_round": a.round if a else None,
        "final_members": len(a.members) if a else None, "stopped": core.stopped,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--spares", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--fault-rate", type=float, default=2.0, help="faults per second across the fleet")
    ap.add_argument("--builtin", action="store_true", help="the built-in default policy (no policy thread)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "supervisor_scale.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    results = [run(args.nodes, args.nproc, args.spares, args.seconds, args.fault_rate, b, args.seed)
               for b in (False, True)]

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"supervisor core, {args.nodes} nodes × {args.nproc} ranks, {args.fault_rate:g} faults/s")
    for c in ("policy", "decisions", "decision p50", "decision p99", "decision max", "seen p50", "tick p99",
              "CPU (one core)"):
        t.add_column(c, justify="right" if c != "policy" else "left")
    for r in results:
        t.add_row(r["policy"], str(r["decisions"]), f"{r['decision_ms']['p50']:.2f} ms",
                  f"{r['decision_ms']['p99']:.2f} ms", f"{r['decision_ms']['max']:.2f} ms",
                  f"{r['seen_us']['p50']:.1f} µs", f"{r['tick_ms']['p99']:.2f} ms",
                  f"{r['cpu_share_of_one_core']:.1%}")
    Console(width=140).print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/supervisor_scale.py " + " ".join(sys.argv[1:]),
                               "python": sys.version.split()[0], "runs": results}, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
