"""Where a training step's time goes while a checkpoint is written in the background: the headline's job, measured
from inside the training thread.

The job is the headline's (``bench/goodput.py``): ``recipes/pytorch/train.py`` with ``--step-sleep 0.2`` under
resilient-run, the manager at its defaults (a save every 10 steps). Two shapes:

* ``two-nodes``: 2 agents x 1 worker on this machine (the headline's shape), local + peer + ``file://`` persistent
  tiers, ``OMP_NUM_THREADS=1`` as in the headline (two ranks share two cores);
* ``one-rank``: 1 worker, the local tier only: no collective to wait on, so a step's time off the CPU beyond its
  sleep is the GIL (and the thread's own I/O).

A wrapper around ``resilient.steps`` records, for every step of rank 0, on the training thread: the step's wall
time; the thread's CPU time (``time.thread_time``); its run-queue wait (``/proc/thread-self/schedstat``: runnable
but not on a CPU, i.e. CPU contention); the rest beyond the step's sleep (off the CPU: the GIL, waiting for the
other rank in a collective, I/O); and the CPU time of the process's other threads (the checkpointer's, gloo's).
Steps are split into the step right after a save (its background work overlaps that step) and the others (neither
that step nor the saving step itself); the table gives their medians and the difference, per repetition.

    python bench/step_anatomy.py [--reps 2] [--steps 150] [--shapes two-nodes,one-rank]

Prints a table and writes bench/results/step_anatomy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pytorch" / "train.py"
SHAPES = ("two-nodes", "one-rank")
SLEEP = 0.2
EVERY = 10  # the manager's default interval
FIELDS = ("wall", "cpu", "runq", "off_cpu", "others")

# the wrapper the launcher runs: the recipe unchanged, its steps timed from the training thread
PROBE = r'''
import json, os, runpy, sys, time
import resilient

out = open(os.path.join(os.environ["ANATOMY_OUT"], f"r{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl"), "w")


def sched():
    with open("/proc/thread-self/schedstat") as f:  # ns on a CPU, ns runnable but waiting for one
        run, wait, _ = f.read().split()
    return int(run) / 1e9, int(wait) / 1e9


def others():
    main = os.path.realpath("/proc/thread-self").rsplit("/", 1)[1]
    total = 0
    for t in os.listdir("/proc/self/task"):
        if t != main:
            try:
                with open(f"/proc/self/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # a thread that ended meanwhile
                pass
    return total / 1e9


_steps = resilient.steps


def steps(start, stop=None, **kw):
    for s in _steps(start, stop, **kw):
        w0, c0, (r0, q0), o0 = time.perf_counter(), time.thread_time(), sched(), others()
        yield s
        w1, c1, (r1, q1), o1 = time.perf_counter(), time.thread_time(), sched(), others()
        out.write(json.dumps({"step": s, "wall": w1 - w0, "cpu": c1 - c0, "runq": q1 - q0, "others": o1 - o0}) + "\n")
        out.flush()


resilient.steps = steps
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_shape(shape: str, d: Path, steps: int, timeout: float) -> Path:
    d.mkdir(parents=True)
    (d / "out").mkdir()
    probe = d / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_"))}
    env.update(ANATOMY_OUT=str(d / "out"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    job = [str(probe), str(RECIPE), "--step-sleep", str(SLEEP), "--log-every", "100000", "--steps", str(steps)]
    run = [sys.executable, "-m", "resilient.run", "--run-dir", str(d / "run")]
    if shape == "one-rank":
        cmds = {"a": [*run, "--standalone", "--nproc-per-node", "1", "--ckpt-local", str(d / "local"), *job]}
    else:
        port = free_port()
        cmds = {n: [*run, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "anatomy", "--local-addr", "127.0.0.1",
                    "--ckpt-local", str(d / f"local-{n}"), "--ckpt-persistent", (d / "persistent").as_uri(), *job]
                for n in ("a", "b")}
    procs = []
    for n, cmd in cmds.items():
        with open(d / f"{n}.log", "wb") as f:
            procs.append(subprocess.Popen(cmd, cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{shape}: not done within {timeout:.0f} s; see {d}")
    bad = [(n, p.returncode) for n, p in zip(cmds, procs) if p.returncode != 0]
    if bad:
        raise SystemExit(f"{shape}: launcher exit {bad}; see {d}/*.log")
    (f,) = (d / "out").glob("r0-*.jsonl")
    return f


def summarise(rows: list[dict], skip: int) -> dict:
    rows = [r for r in rows if r["step"] >= skip]  # the first steps: start-up, not interference
    for r in rows:
        r["off_cpu"] = r["wall"] - r["cpu"] - r["runq"] - SLEEP
    after = [r for r in rows if r["step"] % EVERY == 0]  # saves at steps 9, 19, ...: their work overlaps the next
    clean = [r for r in rows if r["step"] % EVERY not in (0, EVERY - 1)]
    out = {"n_after_save": len(after), "n_clean": len(clean)}
    for name, rs in (("after_save", after), ("clean", clean)):
        out[name] = {k: round(statistics.median(r[k] for r in rs) * 1000, 2) for k in FIELDS}
    out["delta"] = {k: round(out["after_save"][k] - out["clean"][k], 2) for k in FIELDS}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--skip", type=int, default=11, help="first steps left out (start-up, the first save's set-up)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_anatomy.json"))
    a = ap.parse_args()
    shapes = a.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    if a.steps < a.skip + 3 * EVERY or a.reps < 1:
        ap.error(f"--steps must be >= --skip + {3 * EVERY} and --reps >= 1")
    results: dict[str, list[dict]] = {s: [] for s in shapes}
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="anatomy-") as tmp:
        for rep in range(a.reps):
            for shape in (shapes if rep % 2 == 0 else shapes[::-1]):
                f = run_shape(shape, Path(tmp) / f"{shape}-{rep}", a.steps, a.timeout)
                results[shape].append(summarise([json.loads(x) for x in f.read_text().splitlines()], a.skip))
    print(f"\nrank 0's training thread, median ms per step (clean step: {SLEEP * 1000:.0f} ms of sleep plus compute); "
          f"load {load[0]}")
    print(f"{'shape':>10} {'rep':>3} {'steps':>14} {'wall':>7} {'cpu':>6} {'run-queue':>9} {'off-CPU':>8} "
          f"{'other threads':>13}")
    for shape, reps in results.items():
        for i, r in enumerate(reps):
            for name in ("clean", "after_save", "delta"):
                v = r[name]
                label = {"clean": "clean", "after_save": "after a save", "delta": "difference"}[name]
                print(f"{shape:>10} {i:>3} {label:>14} {v['wall']:>7.1f} {v['cpu']:>6.1f} {v['runq']:>9.1f} "
                      f"{v['off_cpu']:>8.1f} {v['others']:>13.1f}")
    print("run-queue: runnable, waiting for a CPU (contention); off-CPU: beyond the sleep, neither running nor "
          "runnable (the GIL, a collective waiting for the other rank, I/O)")
    out = {"results": results, "steps": a.steps, "skip": a.skip, "reps": a.reps, "step_sleep_s": SLEEP,
           "interval": EVERY, "loadavg_before": load, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
           "cpus": os.cpu_count(), "command": "python bench/step_anatomy.py " + " ".join(sys.argv[1:]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
