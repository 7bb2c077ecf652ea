"""Hang detection latency: a rank frozen with SIGSTOP right after a heartbeat, under ``resilient-run``
and under nvidia-resiliency-ext's ``ft_launcher`` (heartbeat API), on the same 2-rank gloo script on CPU.

For every repetition the frozen rank writes the wall time just before it stops itself; the driver then
watches the frozen process until it is gone (killed by the launcher: detection and reaction) and the
restarted ranks report their first step (training resumed). With a heartbeat timeout T:

* ``detect``: stop → frozen process killed; the goal is T + < 0.5 s.
* ``resume``: stop → every rank of the next attempt inside its first step.

``ft_launcher`` is run twice: with its default rank-check interval (5 s) and with the interval set to
0.1 s, so the comparison is not won by a default alone.

``--learned`` runs resilient-run alone with its defaults (no ``--heartbeat-timeout``): the timeout is learned
from the run, max(1 s, 3 × the longest step seen). A rank freezes in each of the first ``--stops`` attempts
(default 2), so the later hangs show that a hang does not loosen the next one's bound. Each hang is reported
against its bound, the timeout the ledger's ``hang`` event says was in force, checked to be max(1 s,
3 × its ``longest_step_seconds``).

    python bench/detect.py [--reps 3] [--timeout 2]
    python bench/detect.py --learned [--reps 5] [--stops 2] [--step 0.01]

Worker mode (used by the launchers): ``detect.py worker ours|nvrx OUT_DIR`` (positional: the launchers
parse abbreviations of their own flags in script arguments).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FREEZE_STEP = 8
# learned: each rank's first 3 steps of an attempt are its warm-up, and 3 steps more are needed to learn from
FREEZE_STEP_LEARNED = 20
STEPS_AFTER_RESTART = 3
STOPS_ENV = "DETECT_STOPS"  # attempts in which a rank freezes (the driver sets it)
FREEZE_ENV = "DETECT_FREEZE_STEP"
STEP_ENV = "DETECT_STEP_SECONDS"  # busy seconds per step (default 0.01)


# --------------------------------------------------------------------------------------------- worker
def worker(kind: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stops = int(os.environ.get(STOPS_ENV, "1"))
    freeze = int(os.environ.get(FREEZE_ENV, str(FREEZE_STEP)))
    work = float(os.environ.get(STEP_ENV, "0.01"))
    n = freeze + 1000 if attempt < stops else STEPS_AFTER_RESTART
    t = torch.zeros(1)

    def step_body(step: int) -> None:
        if attempt < stops and step == freeze and rank == 1:
            _write(out / f"stopped{attempt}", f"{time.time()} {os.getpid()}")
            os.kill(os.getpid(), signal.SIGSTOP)
        if attempt > 0 and step == 0:
            _write(out / f"resumed{attempt}-{rank}", str(time.time()))
        end = time.perf_counter() + work
        while time.perf_counter() < end:
            pass
        dist.all_reduce(t)

    if kind == "ours":
        import resilient

        for s in resilient.steps(0, n):  # the heartbeat goes out as each step begins
            step_body(s)
    else:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()
        for s in range(n):
            client.send_heartbeat()
            step_body(s)
        client.shutdown_workload_monitoring()
    dist.destroy_process_group()


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- driver
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        if proc.poll() is not None and not pred():
            raise RuntimeError(f"launcher exited with {proc.returncode} before {what}")
        time.sleep(0.001)  # polling a file/process; the resolution of the measurement is this poll


def one_run(system: str, timeout: float | None, work: Path, stops: int = 1,
            step_seconds: float = 0.01) -> list[dict[str, float]]:
    """One launch; a rank freezes in each of the first ``stops`` attempts; one result per hang. ``timeout``
    None: resilient-run with its learned default."""
    out = work / "out"
    shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env.pop("OMP_NUM_THREADS", None)
    env[STOPS_ENV] = str(stops)
    env[FREEZE_ENV] = str(FREEZE_STEP if timeout is not None else FREEZE_STEP_LEARNED)
    env[STEP_ENV] = repr(step_seconds)
    me = str(Path(__file__).resolve())
    if system == "resilient-run":
        cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(stops), "--run-dir", str(work / "run")]
        if timeout is not None:
            cmd += ["--heartbeat-timeout", str(timeout)]
        cmd += [me, "worker", "ours", str(out)]
    else:
        if timeout is None:
            raise ValueError(f"{system} has no learned default here: give it a timeout")
        ft = shutil.which("ft_launcher") or str(Path(sys.executable).with_name("ft_launcher"))
        cmd = [ft, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(stops),
               "--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", str(timeout)]
        if system == "ft_launcher (check 0.1 s)":
            cmd += ["--ft-workload-check-interval", "0.1"]
        cmd += [me, "worker", "nvrx", str(out)]
    log = open(work / "launcher.log", "w")
    p = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    found: list[dict[str, float]] = []
    try:
        for a in range(stops):
            stopped = out / f"stopped{a}"
            _wait(stopped.exists, 180, f"the rank to freeze (attempt {a})", p)
            t_stop_s, pid_s = stopped.read_text().split()
            t_stop, pid = float(t_stop_s), int(pid_s)
            _wait(lambda: _gone(pid), 120, "the frozen rank to be killed", p)
            t_gone = time.time()
            resumed = [out / f"resumed{a + 1}-{r}" for r in (0, 1)]
            _wait(lambda: all(f.exists() for f in resumed), 180, "the restarted ranks", p)
            t_resume = max(float(f.read_text()) for f in resumed)
            found.append({"stop": t_stop, "detect": t_gone - t_stop, "resume": t_resume - t_stop})
        rc = p.wait(120)
        if rc != 0:
            raise RuntimeError(f"{system} exited with {rc}; see {work / 'launcher.log'}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        log.close()
    if system == "resilient-run":
        from resilient.events import EventKind, read_events

        hangs = {e.attempt: e for e in read_events(work / "run") if e.kind == EventKind.HANG}
        for a, r in enumerate(found):
            h = hangs.get(a)
            if h is None:
                continue
            r["hang_event"] = h.wall - r["stop"]
            r["timeout"] = float(h.details["timeout"])
            if "longest_step_seconds" in h.details:
                r["longest_step"] = float(h.details["longest_step_seconds"])
                r["learned_rule"] = max(1.0, 3 * r["longest_step"])
    for r in found:
        del r["stop"]  # a wall time: no figure
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        if len(argv) != 3 or argv[1] not in ("ours", "nvrx"):
            raise SystemExit("usage: detect.py worker ours|nvrx OUT_DIR")
        worker(argv[1], Path(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=2.0, help="heartbeat timeout (s) for both launchers")
    ap.add_argument("--systems", default="resilient-run,ft_launcher,ft_launcher (check 0.1 s)")
    ap.add_argument("--learned", action="store_true",
                    help="resilient-run alone, with its learned default timeout (no --heartbeat-timeout)")
    ap.add_argument("--stops", type=int, default=2, help="--learned: attempts in which a rank freezes")
    ap.add_argument("--step", type=float, default=0.01,
                    help="--learned: busy seconds per step (above 1/3 s the learned timeout is above its 1 s floor)")
    ap.add_argument("--out", default=None,
                    help="results file (default bench/results/detect.json, with --learned detect-learned.json)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(Path(__file__).parent / "results" / ("detect-learned.json" if args.learned else "detect.json"))
    if args.learned:
        return learned(args.reps, max(1, args.stops), Path(args.out), args.step)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    errors: dict[str, list[str]] = {s: [] for s in systems}
    base = Path(tempfile.mkdtemp(prefix="resilient-detect-"))
    try:
        for rep in range(args.reps):  # interleaved, so machine load drifts hit every system alike
            for s in systems:
                try:
                    (r,) = one_run(s, args.timeout, base / f"{s.replace(' ', '_')}-{rep}")
                    results[s].append(r)
                    print(f"rep {rep} {s:<28} detect {r['detect']:.3f} s  resume {r['resume']:.3f} s", flush=True)
                except (RuntimeError, TimeoutError) as e:
                    errors[s].append(str(e))
                    print(f"rep {rep} {s:<28} FAILED: {e}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    T = args.timeout
    summary: dict[str, object] = {"timeout": T, "reps": args.reps, "freeze_step": FREEZE_STEP, "systems": {}}
    print(f"\nheartbeat timeout {T:.1f} s, {args.reps} repetitions; medians (min–max), seconds after SIGSTOP")
    print(f"{'launcher':<28}{'detect':>20}{'over T':>9}{'resume':>20}{'ok':>5}")
    med: dict[str, dict[str, float]] = {}
    for s in systems:
        rs = results[s]
        if not rs:
            print(f"{s:<28}{'no successful run':>20}")
            summary["systems"][s] = {"runs": [], "errors": errors[s]}  # type: ignore[index]
            continue
        d = [r["detect"] for r in rs]
        u = [r["resume"] for r in rs]
        med[s] = {"detect": statistics.median(d), "resume": statistics.median(u)}
        print(f"{s:<28}{med[s]['detect']:>8.3f} ({min(d):.2f}–{max(d):.2f}){med[s]['detect'] - T:>9.3f}"
              f"{med[s]['resume']:>8.3f} ({min(u):.2f}–{max(u):.2f}){len(rs):>3}/{args.reps}")
        summary["systems"][s] = {"runs": rs, "errors": errors[s], "median_detect": med[s]["detect"],  # type: ignore[index]
                                 "median_resume": med[s]["resume"], "median_detect_over_timeout": med[s]["detect"] - T}
    ours = med.get("resilient-run")
    if ours:
        ratios = {}
        for s, m in med.items():
            if s == "resilient-run":
                continue
            # beyond-the-timeout times are compared as differences: ours is within the 1 ms poll resolution
            ratios[s] = {"detect": m["detect"] / ours["detect"], "resume": m["resume"] / ours["resume"],
                         "resume_over_timeout": (m["resume"] - T) / max(ours["resume"] - T, 1e-3)}
            print(f"{s} / resilient-run: detect ×{ratios[s]['detect']:.2f}, resume ×{ratios[s]['resume']:.2f} "
                  f"(beyond the timeout: detect +{m['detect'] - T:.3f} vs +{ours['detect'] - T:.3f} s, resume "
                  f"+{m['resume'] - T:.2f} vs +{ours['resume'] - T:.2f} s, ×{ratios[s]['resume_over_timeout']:.1f})")
        summary["ratios_vs_resilient_run"] = ratios
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


def learned(reps: int, stops: int, out: Path, step_seconds: float = 0.01) -> int:
    """resilient-run with its defaults: each hang's latency against the timeout in force, which must be the
    learned rule max(1 s, 3 × the longest step seen)."""
    runs: list[list[dict[str, float]]] = []
    errors: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="resilient-detect-"))
    try:
        for rep in range(reps):
            try:
                hangs = one_run("resilient-run", None, base / f"learned-{rep}", stops, step_seconds)
            except (RuntimeError, TimeoutError) as e:
                errors.append(str(e))
                print(f"rep {rep} FAILED: {e}", flush=True)
                continue
            runs.append(hangs)
            for i, r in enumerate(hangs):
                print(f"rep {rep} hang {i}: timeout {r.get('timeout', math.nan):.3f} s (longest step "
                      f"{r.get('longest_step', math.nan):.3f} s)  decided {r.get('hang_event', math.nan):.3f} s  "
                      f"killed {r['detect']:.3f} s  resumed {r['resume']:.3f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    per_hang: list[dict[str, object]] = []
    print(f"\nlearned timeout, {len(runs)}/{reps} runs of {stops} hangs; medians (min–max), seconds after SIGSTOP")
    print(f"{'hang':<6}{'timeout':>20}{'killed - timeout':>24}{'resumed - timeout':>24}")
    for i in range(stops):
        rs = [run[i] for run in runs if len(run) > i and "timeout" in run[i]]
        if not rs:
            continue
        t = [r["timeout"] for r in rs]
        late = [r["detect"] - r["timeout"] for r in rs]
        res = [r["resume"] - r["timeout"] for r in rs]
        row = {"hang": i, "n": len(rs), "timeout_median": statistics.median(t), "timeout_min": min(t),
               "timeout_max": max(t), "killed_after_timeout_median": statistics.median(late),
               "killed_after_timeout_min": min(late), "killed_after_timeout_max": max(late),
               "resumed_after_timeout_median": statistics.median(res), "resumed_after_timeout_max": max(res),
               # the timeout in force is the learned rule (not doubled by an earlier hang, not a default)
               "timeout_is_learned_rule": all(abs(r["timeout"] - r.get("learned_rule", math.nan)) < 1e-6 for r in rs)}
        per_hang.append(row)
        print(f"{i:<6}{statistics.median(t):>8.3f} ({min(t):.2f}–{max(t):.2f}){statistics.median(late):>10.3f} "
              f"({min(late):.3f}–{max(late):.3f}){statistics.median(res):>10.3f} ({min(res):.2f}–{max(res):.2f})"
              f"  rule {'ok' if row['timeout_is_learned_rule'] else 'NOT MET'}")
    summary = {"mode": "learned", "reps": reps, "stops": stops, "freeze_step": FREEZE_STEP_LEARNED,
               "step_seconds": step_seconds,
               "runs": runs, "errors": errors, "per_hang": per_hang}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0 if runs and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
