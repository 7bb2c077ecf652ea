"""The goodput report and the Prometheus collector on a long run's ledger, against the code of an earlier commit.

Two readers compute a run's goodput report from its whole ledger: ``resilient goodput RUN_DIR --json``
(``report``: the command's own ``main``, reading, report and checkpoint lines; ``plot``: the same with ``--plot``,
which draws every step and the report's time line) and the agent that serves
``--metrics-port`` (``scrape``: a ``LedgerCollector`` started on the ledger scrapes until it has caught up, each
scrape reading at most 64 MiB and keeping what it read; its report of the whole ledger is timed; then the ledger
grows by 1,000 steps and the next scrape reads them and computes the report again). The collector lives as long
as the job, so what it keeps matters there: its process's resident memory once caught up (an upper bound: freed
memory the allocator keeps counts too). Each measurement runs in a fresh process, against the same code at
``--before`` (a git worktree of that commit), interleaved, on the same synthetic ledgers as ``bench/ledger_read.py`` (the writers' own formats).

    python bench/report_scale.py [--steps 20000,200000,1000000] [--reps 3] [--before REF] [--readers report,scrape,plot]
                                 [--quick]

Prints a table and writes bench/results/report_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from ledger_read import STEP_LINE, make_ledger, write_results  # noqa: E402  (one writer of the synthetic ledgers)

READERS = ("report", "scrape", "plot")

# {reader} {run_dir} -> one JSON line; the code measured is whatever `resilient` PYTHONPATH gives
CHILD = r'''
import gc, json, resource, sys, time
from pathlib import Path
reader, run_dir, step_line, steps = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

out = {}
if reader in ("report", "plot"):
    import contextlib, io
    from resilient.goodput.cli import main
    buf = io.StringIO()
    plot = ["--plot", str(run_dir / "timeline.png")] if reader == "plot" else []
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = main([str(run_dir), "--json", "--now", repr(1.7e9 + steps + 60.0), *plot])  # the same end for both
    out["seconds"] = time.perf_counter() - t0
    assert rc == 0, rc
    out["answer"] = json.loads(buf.getvalue())["goodput"]
else:
    from resilient.goodput.metrics import LedgerCollector
    c = LedgerCollector(run_dir)
    # an agent started on a long run's ledger: scrapes read at most 64 MiB each until they have caught up
    t0 = time.perf_counter()
    out["scrapes"] = 0
    while True:
        fams = {m.name: m for m in c.collect()}
        out["scrapes"] += 1
        if c._tail.last_read == 0:
            break
    out["seconds"] = time.perf_counter() - t0
    c._report = None  # the report of the whole ledger (catching up may have served one of a part)
    fams = {m.name: m for m in c.collect()}
    out["report_seconds"] = c._report_cost
    out["answer"] = fams["resilient_goodput_ratio"].samples[0].value
    gc.collect()
    out["held_rss_mib"] = rss_mib()  # what the agent keeps between scrapes (at most)
    # the job goes on: 1,000 more steps, then a scrape that must compute the report again
    with open(run_dir / "events.jsonl", "a") as f:
        for s in range(steps, steps + 1000):
            w = 1.7e9 + s * 1.0
            f.write(step_line % (0, s, 0.99, 0.98, w, w))
    c._report = None  # a fresh report, not the one the CPU budget would reuse
    t0 = time.perf_counter()
    list(c.collect())
    out["next_scrape_seconds"] = time.perf_counter() - t0
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
'''


def measure(code_root: Path, reader: str, run_dir: Path, steps: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    p = subprocess.run([sys.executable, "-c", CHILD, reader, str(run_dir), STEP_LINE, str(steps)], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=code_root)
    if p.returncode != 0:
        raise RuntimeError(f"{reader} at {code_root} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _median(got: list[dict], key: str) -> float | None:
    vals = [g[key] for g in got if g.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="20000,200000,1000000", help="comma-separated run lengths in steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--readers", default=",".join(READERS), help="comma-separated, of: " + ", ".join(READERS))
    ap.add_argument("--before", default="e80adbb", help="the commit to compare against (its code, same ledgers)")
    ap.add_argument("--quick", action="store_true", help="one small ledger, one repetition (a smoke run)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "report_scale.json"))
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still removes its worktree
    sizes = [20000] if a.quick else [int(x) for x in a.steps.split(",")]
    reps = 1 if a.quick else a.reps
    readers = [r for r in a.readers.split(",") if r]
    if not readers or set(readers) - set(READERS):
        ap.error(f"--readers takes some of {', '.join(READERS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), a.before], check=True,
                       capture_output=True, timeout=120)
        try:
            codes = {"new": ROOT, "before": before}
            for steps in sizes:
                master = Path(tmp) / f"run-{steps}"
                size = make_ledger(master, steps)
                for reader in readers:
                    got: dict[str, list[dict]] = {"new": [], "before": []}
                    for _ in range(reps):
                        for mode in ("new", "before"):  # interleaved: machine noise hits both alike
                            run_dir = Path(tmp) / "scratch"  # a scrape appends to its ledger: a fresh copy each
                            shutil.rmtree(run_dir, ignore_errors=True)
                            shutil.copytree(master, run_dir)
                            got[mode].append(measure(codes[mode], reader, run_dir, steps, a.timeout))
                    row: dict = {"steps": steps, "ledger_mib": round(size / 2**20, 1), "reader": reader, "reps": reps}
                    for mode in ("new", "before"):
                        for key in ("seconds", "report_seconds", "next_scrape_seconds", "held_rss_mib"):
                            row[f"{mode}_{key}"] = _median(got[mode], key)
                        secs = [g["seconds"] for g in got[mode]]
                        row[f"{mode}_seconds_min"], row[f"{mode}_seconds_max"] = min(secs), max(secs)
                        row[f"{mode}_peak_rss_mib"] = max(g["peak_rss_mib"] for g in got[mode])
                    row["speedup"] = row["before_seconds"] / row["new_seconds"]
                    new, old = got["new"][0]["answer"], got["before"][0]["answer"]
                    # the collector reports a run in progress up to its own now, which moves between two processes
                    # (~1e-7 of this ledger's wall a second); the command is given one --now
                    tol = 1e-5 if reader == "scrape" else 1e-9
                    row["same_answer"] = abs(new - old) <= tol * max(1e-3, abs(old))
                    if not row["same_answer"]:
                        raise SystemExit(f"{reader} at {steps} steps: new code answered {new!r}, before {old!r}")
                    rows.append(row)
                    print(f"{steps:>8d} steps {reader:7s} new {row['new_seconds']:7.2f} s  before "
                          f"{row['before_seconds']:7.2f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                           capture_output=True, timeout=120)
    print(f"\n{'steps':>8s} {'reader':7s} {'new s':>7s} {'before s':>8s} {'×':>5s} {'new peak':>9s} "
          f"{'before peak':>11s} {'new held':>9s} {'before held':>11s} {'next scrape new/before s':>25s}")
    for r in rows:
        held = (f"{r['new_held_rss_mib']:8.0f}M {r['before_held_rss_mib']:10.0f}M"
                if r["new_held_rss_mib"] is not None else f"{'':9s} {'':11s}")
        nxt = (f"{r['new_next_scrape_seconds']:.2f} / {r['before_next_scrape_seconds']:.2f}"
               if r["new_next_scrape_seconds"] is not None else "")
        print(f"{r['steps']:8d} {r['reader']:7s} {r['new_seconds']:7.2f} {r['before_seconds']:8.2f} "
              f"{r['speedup']:5.1f} {r['new_peak_rss_mib']:8.0f}M {r['before_peak_rss_mib']:10.0f}M {held} {nxt:>25s}")
    if not a.quick or a.out != ap.get_default("out"):
        write_results(a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
