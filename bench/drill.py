"""Seeded random fault drill across the supervisor's faults: N runs × M faults, each run checked bit-exact.

The drill is the one ``tests/cluster/test_drill.py`` runs in the suite (2 runs × 3 faults), here at any
size. Each run is a real job on this machine: a standalone ``resilient supervisor``, two node agents of one
worker each (``--nnodes 1:2``, each agent in its own session with its own local tier), sometimes a warm
spare; a deterministic data-parallel script that checkpoints every step and pauses at gate steps. For run
``i`` a generator seeded with ``--seed + i`` draws M faults among kill-worker (SIGKILL one worker),
kill-node (SIGKILL a whole node, its local tier deleted: hot swap to a spare, or scale down), spare-join
(scale up when below MAX) and kill-supervisor (SIGKILL, then started again at once or after training went
on alone to the next gate), each landing at a gate or while the job runs (a seeded number of steps past the
gate, at a seeded instant within the step).

A run counts as bit-exact when every surviving agent and the last supervisor exit 0, the supervisor's
actions are the predicted ones, the sampler consumed exactly the global permutation in order, the final
model and optimizer equal, bit for bit, a single-process replay of the world-size schedule the job ran
(itself checked equal to the uninterrupted 2-rank reference), and equal the reference itself when the world
never changed; and no process of the job is left.

    python bench/drill.py [--runs 6] [--faults 3] [--seed 0] [--out bench/results/drill.json] [--keep]

Recovery is timed from the fault to every rank of the new round at the next gate, so it includes the steps
run up to that gate; a supervisor restarted "after the next gate" adds the time training ran alone. A spare
that joined a second before it is needed is still cold (its fork server importing torch): the hot swap or
scale-up then includes that warm-up, as it would in production.

Prints a table and writes the JSON (per run: plan, where each fault landed, its recovery time, actions,
world sizes, steps redone, the checks; summary: the count and recovery times per fault kind).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.test_drill import Drill, DrillFault, make_plan, make_reference, schedule  # noqa: E402


def positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=positive, default=6)
    ap.add_argument("--faults", type=positive, default=3, help="faults per run")
    ap.add_argument("--seed", type=int, default=0, help="run i uses seed SEED + i")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "drill.json"))
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories (logs, ledgers)")
    a = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that the running drill kills its processes on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    base = Path(tempfile.mkdtemp(prefix="resilient-drill-"))
    t0 = time.monotonic()
    results = []
    try:
        print(f"reference: 2 ranks, {schedule(a.faults)[1]} steps, never interrupted", flush=True)
        reference = make_reference(base / "reference", schedule(a.faults)[1])
        for i in range(a.runs):
            plan = make_plan(a.seed + i, a.faults)
            print("\n".join(plan.describe()), flush=True)
            r = Drill(base / f"run{i}", plan, reference).run()
            results.append(r)
            verdict = "bit-exact" if r.ok else "FAILED: " + r.error.strip().splitlines()[0][:200]
            print(f"  -> {verdict} in {r.seconds:.1f}s; actions {r.actions}; worlds {r.worlds}; "
                  f"recovery {[f['recovery_s'] for f in r.faults]} s; {r.steps_redone} step(s) redone", flush=True)
    finally:
        if a.keep:
            print(f"runs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)

    ok = [r for r in results if r.ok]
    by_kind: dict[str, list[float]] = defaultdict(list)
    landed: dict[str, int] = defaultdict(int)
    for r in ok:
        for f in r.faults:
            by_kind[f["fault"].split()[0]].append(f["recovery_s"])
            landed[f["landed"]] += 1
    summary = {
        "runs": len(results), "faults_per_run": a.faults, "seed": a.seed, "bit_exact": len(ok),
        "failed_seeds": [r.seed for r in results if not r.ok],
        "faults_total": sum(len(r.faults) for r in ok),
        "world_changed_runs": sum(1 for r in ok if any(w != 2 for w in r.worlds)),
        "landed": dict(landed),
        "recovery_s": {k: {"n": len(v), "median": round(statistics.median(v), 3), "max": round(max(v), 3)}
                       for k, v in sorted(by_kind.items())},
        "actions": {k: sum(r.actions.count(k) for r in ok) for k in ("restart", "hot_swap", "scale_down", "scale_up")},
        "steps_redone_total": sum(r.steps_redone for r in ok),
        "wall_s": round(time.monotonic() - t0, 1),
        "line": f"{len(results)} runs × {a.faults} faults, "
                + ("all bit-exact" if len(ok) == len(results) else f"{len(ok)} bit-exact, "
                   f"{len(results) - len(ok)} failed (seeds {[r.seed for r in results if not r.ok]})"),
    }
    kinds = {k.value for k in DrillFault}
    print()
    print(f"{'fault':<16} {'n':>3} {'median s':>9} {'max s':>7}   (recovery: from the fault to every rank of the "
          "new round at the next gate)")
    for k in sorted(kinds):
        s = summary["recovery_s"].get(k)
        if s:
            print(f"{k:<16} {s['n']:>3} {s['median']:>9.3f} {s['max']:>7.3f}")
    print(f"supervisor actions: {summary['actions']}")
    print(f"landed: {dict(landed)}; runs whose world changed: {summary['world_changed_runs']}; "
          f"steps redone: {summary['steps_redone_total']}")
    print(summary["line"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"summary": summary, "runs": [asdict(r) for r in results]}, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
