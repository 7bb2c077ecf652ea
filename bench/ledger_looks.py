"""What following a quiet run costs when its directory holds thousands of writers' files.

Two followers look at the whole run again and again while it trains: rank 0's interval tuner (``--ckpt-interval
auto``, after saves) and each agent's follower of the checkpoint records (for its closing lines). The supervisor
was a third (for checkpoint boundaries, at every pass of its loop): it now reads no ledger, each agent forwards its
own node's boundaries from its own host's files (``resilient/launcher/forward.py``), so it is not measured here;
``bench/results/ledger_looks.json`` of the round before has its rows. A look at a run where nothing was written costs a ``stat`` per
writer's file (and a directory listing). On a shared volume, with every node's workers writing to the same run
directory (1,000 nodes x 8 workers), that is thousands of round trips to the file server per look.

For each number of files, this script makes a run directory of that many writers' files (a few lines each), times
a quiet look (``LedgerTail.read_new`` with nothing new: stats, and a listing when the directory changed), and
gives each follower's looks per second before and after spacing the looks by the number of files
(``STAT_SECONDS`` a file): the stats per second it makes and the share of a core it spends. The look is measured
here, on a local disk, where a stat costs a microsecond; on a network volume each stat is a round trip (0.1-1 ms),
so the stats per second are the figure to read.

    python bench/ledger_looks.py [--files 8,1000,8000] [--reps 5] [--out bench/results/ledger_looks.json]
    python bench/ledger_looks.py --quick     # 8 and 1,000 files, 2 repetitions
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from resilient.events.api import Event, EventKind  # noqa: E402
from resilient.events.follow import STAT_SECONDS, LedgerTail  # noqa: E402

# each follower's look period before spacing (seconds: the tuner's follow_every_s, the checkpoint follower's
# interval; defaults in checkpoint/save/interval.py, launcher/report.py), and whether it already spaced its looks and
# kept its listing before (the checkpoint follower did)
FOLLOWERS = {"interval tuner": (1.0, False), "checkpoint follower": (5.0, True)}


def make_run(root: Path, files: int, lines: int = 4) -> Path:
    run = root / f"run-{files}"
    run.mkdir(parents=True)
    for i in range(files):
        with open(run / f"events.n{i // 8}-r{i % 8}.jsonl", "w") as f:
            for s in range(lines):
                f.write(json.dumps(Event(EventKind.STEP, node=f"n{i // 8}", rank=i % 8, details={"step": s, "seconds": 0.1},
                              wall=1.7e9 + s, mono=float(s)).to_json(), separators=(",", ":")) + "\n")
    return run


def quiet_look(run: Path, reps: int, rescan: float | None) -> dict[str, float]:
    """Seconds (and CPU seconds) of one look at ``run`` with nothing new, after a first look read it all."""
    tail = LedgerTail(run, rescan=rescan)
    tail.read_new()
    walls, cpus = [], []
    for _ in range(max(reps, 1) * 5):
        t0, c0 = time.perf_counter(), time.process_time()
        got = tail.read_new()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if got:
            raise SystemExit(f"a quiet look at {run} read {len(got)} events: the run is not quiet")
    return {"seconds": statistics.median(walls), "cpu_seconds": statistics.median(cpus), "files": tail.files}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="8,1000,8000", help="comma-separated numbers of writers' files")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="8 and 1,000 files, 2 repetitions")
    ap.add_argument("--out", default=str(HERE / "results" / "ledger_looks.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.files, a.reps = "8,1000", 2
    try:
        counts = [int(x) for x in a.files.split(",") if x]
    except ValueError:
        ap.error(f"--files takes comma-separated whole numbers, got {a.files!r}")
    if not counts or min(counts) < 1 or a.reps < 1:
        ap.error("--files needs numbers >= 1 and --reps >= 1")
    rows = []
    root = Path(tempfile.mkdtemp(prefix="ledger-looks-"))
    try:
        for n in counts:
            run = make_run(root, n)
            # before: the tuner's tail listed the directory at every look (no rescan)
            before, after = quiet_look(run, a.reps, None), quiet_look(run, a.reps, 30.0)
            for who, (period, spaced_before) in FOLLOWERS.items():
                new_period = max(period, n * STAT_SECONDS)
                old_period = new_period if spaced_before else period
                b = after if spaced_before else before
                rows.append({"files": n, "follower": who, "look_s": after["seconds"],
                             "look_cpu_s": after["cpu_seconds"], "look_before_s": b["seconds"],
                             "period_before_s": old_period, "period_s": new_period,
                             "stats_per_s_before": n / old_period, "stats_per_s": n / new_period,
                             "core_share_before": b["cpu_seconds"] / old_period,
                             "core_share": after["cpu_seconds"] / new_period})
            shutil.rmtree(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'files':>6} {'follower':<20} {'quiet look':>14} {'looks every':>16} {'stats/s':>18} {'core share':>18}")
    for r in rows:
        print(f"{r['files']:>6} {r['follower']:<20} {r['look_before_s'] * 1e3:>6.2f}→{r['look_s'] * 1e3:.2f} ms "
              f"{r['period_before_s']:>6.2f}→{r['period_s']:<6.2f} s {r['stats_per_s_before']:>8.0f}→{r['stats_per_s']:<8.0f} "
              f"{r['core_share_before'] * 100:>7.2f}→{r['core_share'] * 100:.2f} %")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"mode": "quick" if a.quick else "full", "reps": a.reps,
                                       "stat_seconds": STAT_SECONDS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
