"""Reading a long run's ledger: what a restart and an exit pay for the run's length.

A run's ledger holds one ``step`` line per step (rank 0's), so a week of 1 s steps is ~600,000 lines and ~100 MB.
Three readers read it whole: a restarted rank 0 with ``--ckpt-interval auto`` (``IntervalTuner.from_run_dir``,
before its first step: the whole job waits for it), every launcher at its exit (``close_checkpoints``: which
steps went where) and ``resilient goodput`` (the report). The launcher now follows the run's checkpoint records as
they are written (``CheckpointFollower``), so its exit reads only what came since the follower's last look:
``exit-followed`` times that exit, with the newest 1,000 steps' lines left to read, against the exit that reads
the whole run (``exit``'s new reader). Likewise rank 0's tuner writes what it took from the ledger beside it while the
run trains (``interval_tuner.json``): ``restart-cached`` times a restart that reads on from a cache written 1,000
steps before the ledger's end, against a restart that reads the whole ledger (``restart``'s new reader). Each is timed in a fresh process (as a restarted
worker is), with its peak resident memory, against the same reader fed by the decoding the ledger had before
(``json.loads`` and the event check for every line, every event held in memory at once), in the same script on
the same files.

The ledgers are synthetic but in the writers' own formats: the STEP lines as ``resilient/worker/steps.py``
formats them (tests/goodput/test_ledger_read.py checks that a real run's lines take the same path), the
checkpoint lines (a save every 100 steps, its local tier done) and restarts (one every 50,000 steps) through
``Ledger.emit``.

    python bench/ledger_read.py [--steps 20000,200000,1000000] [--reps 3] [--readers restart-cached,exit-followed] [--quick]

Prints a table and writes bench/results/ledger_read.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READERS = ("restart", "restart-cached", "exit", "exit-followed", "report")
# the exit with the launcher's follower reads what the run wrote since the follower's last look (every 5 s): here the
# newest 1,000 steps' lines, as a run of 5 ms steps would leave
TAIL_STEPS = 1000

# one process per measurement: {reader} {mode} {run_dir} -> one JSON line (seconds, peak RSS)
CHILD = r'''
import json, resource, sys, time
from pathlib import Path
reader, mode, run_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
TAIL_BYTES = int(sys.argv[4])
from resilient.checkpoint.save.interval import IntervalTuner
from resilient.events.api import EventKind
from resilient.goodput.calculator import compute_report, report_for_run
from resilient.goodput.checkpoints import CHECKPOINT_SUMMARY_KINDS, checkpoint_summary

def old_events():
    """The decoding before: every line of every writer's file through json.loads and the event check."""
    from resilient.events.follow import _run_of, event_from_json
    out = []
    for p in _run_of(run_dir)[1]:
        with open(p, "rb") as f:
            for raw in f:
                try:
                    ev = event_from_json(json.loads(raw))
                except ValueError:
                    ev = None
                if ev is not None:
                    out.append(ev)
    out.sort(key=lambda e: e.wall)
    return out

def old_tuner():
    t = IntervalTuner()
    restarts = set()
    for ev in old_events():
        d = ev.details
        if ev.kind is EventKind.STEP:
            t.observe_step(float(d.get("seconds", 0.0)))
        elif ev.kind is EventKind.CKPT_SAVE:
            t.observe_save(float(d.get("blocking_seconds", 0.0)))
        elif ev.kind is EventKind.RESTART:
            restarts.add((ev.attempt, d.get("attempt")))
    for _ in restarts:
        t.observe_interruption()
    return t.inputs()["uptime_seconds"]

def closing(text):
    """The closing lines as one number (both readers must print the same)."""
    import zlib
    return zlib.crc32(text.encode())

def new_exit(follower=None, where=None):
    """close_checkpoints itself, as a launcher calls it at its exit (its lines to a buffer)."""
    from resilient.launcher.exit import Ending
    from resilient.launcher.report import close_checkpoints
    from resilient.events.ledger import Ledger
    import contextlib, io, tempfile
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as other, contextlib.redirect_stderr(out):
        close_checkpoints(Ending(0, "succeeded"), Ledger(other, node="bench"), where or run_dir, "bench", None,
                          lambda: None, follower)
    return closing(out.getvalue())

def old_exit():
    evs = old_events()
    mine = [i for i, e in enumerate(evs) if e.kind is EventKind.RUN_START and e.node == "bench"]
    return closing("".join(f"resilient-run: {ln}\n" for ln in checkpoint_summary(evs[mine[-1]:] if mine else evs).lines()))

def cut_copy():
    """A copy of the run as it stood TAIL_BYTES (the newest TAIL_STEPS steps' lines) before its end, and the rest
    of its bytes: what a reader that followed the run had read, and what it has not yet."""
    import atexit, os, shutil, tempfile
    src = run_dir / "events.jsonl"
    size = src.stat().st_size
    with open(src, "rb") as fh:
        fh.seek(max(0, size - TAIL_BYTES - (1 << 16)))
        before = fh.tell()
        head = fh.read(size - TAIL_BYTES - before)
        cut = before + head.rindex(b"\n") + 1
        fh.seek(cut)
        rest = fh.read()
    where = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, where)
    with open(src, "rb") as a, open(where / "events.jsonl", "wb") as b:
        os.copy_file_range(a.fileno(), b.fileno(), cut)
    return where, rest

def followed_exit():
    """The exit with the launcher's follower, which read the run as it grew: all but the newest TAIL_BYTES were
    read before the exit (untimed: the run's life); the exit reads those and sums up."""
    from resilient.launcher.report import CheckpointFollower
    where, rest = cut_copy()
    f = CheckpointFollower(where, "bench", from_start=True)
    f.poll()
    with open(where / "events.jsonl", "ab") as fh:
        fh.write(rest)
    global t0
    t0 = time.perf_counter()
    return new_exit(f, where)

def cached_restart():
    """A restart of rank 0 whose predecessor's tuner wrote its cache TAIL_BYTES before the ledger's end (untimed: the
    run's life, a start and a look while training); the restart reads on from it."""
    where, rest = cut_copy()
    t = IntervalTuner.from_run_dir(where)
    t.follow_every_s = 0.0
    t.interval_steps()  # the save thread's look after a save, then the cache written
    assert t.write_cache()
    with open(where / "events.jsonl", "ab") as fh:
        fh.write(rest)
    global t0
    t0 = time.perf_counter()
    got = IntervalTuner.from_run_dir(where).inputs()
    assert got["ledger_cache_used"], "the cache was not used"
    return got["uptime_seconds"]

work = {("restart", "new"): lambda: IntervalTuner.from_run_dir(run_dir).inputs()["uptime_seconds"],
        ("restart", "old"): old_tuner,
        ("exit", "new"): new_exit, ("exit", "old"): old_exit,
        ("exit-followed", "new"): followed_exit, ("exit-followed", "old"): new_exit,
        ("restart-cached", "new"): cached_restart,
        ("restart-cached", "old"): lambda: IntervalTuner.from_run_dir(run_dir).inputs()["uptime_seconds"],
        ("report", "new"): lambda: report_for_run(run_dir).goodput,
        ("report", "old"): lambda: compute_report(old_events()).goodput}[(reader, mode)]
t0 = time.perf_counter()
answer = work()
took = time.perf_counter() - t0
print(json.dumps({"seconds": took, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "answer": answer}))
'''

STEP_LINE = ('{"kind":"step","node":"bench","rank":0,"attempt":%d,"details":{"step":%d,"seconds":%r,'
             '"compute_seconds":%r},"wall":%r,"mono":%r,"schema":1}\n')


def make_ledger(run_dir: Path, steps: int) -> int:
    """A run of ``steps`` steps of ~1 s: returns the ledger's size in bytes."""
    sys.path.insert(0, str(ROOT))
    from resilient.events.api import Event, EventKind

    run_dir.mkdir(parents=True)
    t0 = 1.7e9
    attempt = 0
    with open(run_dir / "events.jsonl", "w") as f:
        def emit(kind: EventKind, wall: float, **details: object) -> None:
            ev = Event(kind, node="bench", rank=0, attempt=attempt, details=dict(details), wall=wall, mono=wall)
            f.write(json.dumps(ev.to_json()) + "\n")

        emit(EventKind.RUN_START, t0)
        for s in range(steps):
            wall = t0 + s * 1.0
            if s and s % 50_000 == 0:
                attempt += 1
                emit(EventKind.RESTART, wall, attempt=attempt, cause="worker_failed")
            sec = 0.98 + (s % 7) * 0.005
            f.write(STEP_LINE % (attempt, s, sec, sec - 0.01, wall, wall))
            if s % 100 == 0:
                emit(EventKind.CKPT_SAVE, wall + 0.5, step=s, blocking_seconds=0.02, bytes=1 << 20, mode="async")
                emit(EventKind.CKPT_TIER_DONE, wall + 0.7, step=s, tier="local", seconds=0.2)
    return (run_dir / "events.jsonl").stat().st_size


def measure(reader: str, mode: str, run_dir: Path, timeout: float, tail_bytes: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", CHILD, reader, mode, str(run_dir), str(tail_bytes)],
                       capture_output=True, text=True,
                       timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{reader}/{mode} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="20000,200000,1000000", help="comma-separated run lengths in steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--readers", default=",".join(READERS), help=f"comma-separated, of {', '.join(READERS)}")
    ap.add_argument("--quick", action="store_true", help="one small ledger, one repetition (a smoke run)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ledger_read.json"))
    a = ap.parse_args()
    sizes = [20000] if a.quick else [int(x) for x in a.steps.split(",")]
    reps = 1 if a.quick else a.reps
    readers = [r for r in a.readers.split(",") if r]
    if not readers or set(readers) - set(READERS):
        ap.error(f"--readers takes some of {', '.join(READERS)}, got {a.readers!r}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in sizes:
            run_dir = Path(tmp) / f"run-{steps}"
            size = make_ledger(run_dir, steps)
            for reader in readers:
                got: dict[str, list[dict]] = {"new": [], "old": []}
                for _ in range(reps):
                    for mode in ("new", "old"):  # interleaved: machine noise hits both alike
                        got[mode].append(measure(reader, mode, run_dir, a.timeout, size * TAIL_STEPS // steps))
                row = {"steps": steps, "ledger_mib": round(size / 2**20, 1), "reader": reader, "reps": reps}
                for mode in ("new", "old"):
                    secs = [g["seconds"] for g in got[mode]]
                    row[f"{mode}_seconds"] = statistics.median(secs)
                    row[f"{mode}_seconds_min"], row[f"{mode}_seconds_max"] = min(secs), max(secs)
                    row[f"{mode}_peak_rss_mib"] = max(g["peak_rss_mib"] for g in got[mode])
                row["speedup"] = row["old_seconds"] / row["new_seconds"] if row["new_seconds"] else None
                # both readers must reach the same answer (the tuner's uptime, the report's goodput), or the
                # comparison is of two different things
                new, old = got["new"][0]["answer"], got["old"][0]["answer"]
                row["same_answer"] = (new is None and old is None) or (
                    new is not None and old is not None and abs(new - old) <= 1e-9 * max(1.0, abs(old)))
                if not row["same_answer"]:
                    raise SystemExit(f"{reader} at {steps} steps: new reader answered {new!r}, old {old!r}")
                rows.append(row)
                print(f"{steps:>8d} steps {reader:13s} new {row['new_seconds']:7.2f} s  old {row['old_seconds']:7.2f} s",
                      flush=True)
    print(f"\n{'steps':>8s} {'MiB':>6s} {'reader':13s} {'new s':>7s} {'old s':>7s} {'×':>6s} "
          f"{'new RSS':>8s} {'old RSS':>8s}")
    for r in rows:
        print(f"{r['steps']:8d} {r['ledger_mib']:6.1f} {r['reader']:13s} {r['new_seconds']:7.2f} {r['old_seconds']:7.2f} "
              f"{r['speedup']:6.1f} {r['new_peak_rss_mib']:7.0f}M {r['old_peak_rss_mib']:7.0f}M")
    if not a.quick or a.out != ap.get_default("out"):
        write_results(a, rows)
    return 0


def write_results(a: argparse.Namespace, rows: list[dict]) -> None:
    """The rows and the arguments that made them, to ``a.out`` (a quick run writes only where told to)."""
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        args = {**vars(a), "out": os.path.relpath(a.out, ROOT)}  # no path of this machine in the results
        json.dump({"args": args, "rows": rows, "python": sys.version.split()[0], "cpus": os.cpu_count(),
                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
