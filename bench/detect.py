"""Hang detection latency: a rank frozen with SIGSTOP right after a heartbeat, under ``resilient-run``
and under nvidia-resiliency-ext's ``ft_launcher`` (heartbeat API), on the same 2-rank gloo script on CPU.

For every repetition the frozen rank writes the wall time just before it stops itself; the driver then
watches the frozen process until it is gone (killed by the launcher: detection and reaction) and the
restarted ranks report their first step (training resumed). With a heartbeat timeout T:

* ``detect``: stop → frozen process killed; the goal is T + < 0.5 s.
* ``resume``: stop → every rank of the next attempt inside its first step.

``ft_launcher`` is run twice: with its default rank-check interval (5 s) and with the interval set to
0.1 s, so the comparison is not won by a default alone.

    python bench/detect.py [--reps 3] [--timeout 2]

Worker mode (used by the launchers): ``detect.py worker ours|nvrx OUT_DIR`` (positional: the launchers
parse abbreviations of their own flags in script arguments).
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FREEZE_STEP = 8
STEPS_AFTER_RESTART = 3


# --------------------------------------------------------------------------------------------- worker
def worker(kind: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    n = FREEZE_STEP + 1000 if attempt == 0 else STEPS_AFTER_RESTART
    t = torch.zeros(1)

    def step_body(step: int) -> None:
        if attempt == 0 and step == FREEZE_STEP and rank == 1:
            _write(out / "stopped", f"{time.time()} {os.getpid()}")
            os.kill(os.getpid(), signal.SIGSTOP)
        if attempt > 0 and step == 0:
            _write(out / f"resumed{rank}", str(time.time()))
        end = time.perf_counter() + 0.01
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


def one_run(system: str, timeout: float, work: Path) -> dict[str, float]:
    out = work / "out"
    shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env.pop("OMP_NUM_THREADS", None)
    me = str(Path(__file__).resolve())
    if system == "resilient-run":
        cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               "--heartbeat-timeout", str(timeout), "--run-dir", str(work / "run"), me, "worker", "ours", str(out)]
    else:
        ft = shutil.which("ft_launcher") or str(Path(sys.executable).with_name("ft_launcher"))
        cmd = [ft, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               "--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", str(timeout)]
        if system == "ft_launcher (check 0.1 s)":
            cmd += ["--ft-workload-check-interval", "0.1"]
        cmd += [me, "worker", "nvrx", str(out)]
    log = open(work / "launcher.log", "w")
    p = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: (out / "stopped").exists(), 180, "the rank to freeze", p)
        t_stop_s, pid_s = (out / "stopped").read_text().split()
        t_stop, pid = float(t_stop_s), int(pid_s)
        _wait(lambda: _gone(pid), 120, "the frozen rank to be killed", p)
        t_gone = time.time()
        _wait(lambda: all((out / f"resumed{r}").exists() for r in (0, 1)), 180, "the restarted ranks", p)
        t_resume = max(float((out / f"resumed{r}").read_text()) for r in (0, 1))
        rc = p.wait(120)
        if rc != 0:
            raise RuntimeError(f"{system} exited with {rc}; see {work / 'launcher.log'}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        log.close()
    r = {"detect": t_gone - t_stop, "resume": t_resume - t_stop}
    if system == "resilient-run":
        from resilient.events.api import EventKind
        from resilient.events.ledger import read_events

        hangs = [e for e in read_events(work / "run") if e.kind == EventKind.HANG]
        if hangs:
            r["hang_event"] = hangs[0].wall - t_stop
    return r


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
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "detect.json"))
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    errors: dict[str, list[str]] = {s: [] for s in systems}
    base = Path(tempfile.mkdtemp(prefix="resilient-detect-"))
    try:
        for rep in range(args.reps):  # interleaved, so machine load drifts hit every system alike
            for s in systems:
                try:
                    r = one_run(s, args.timeout, base / f"{s.replace(' ', '_')}-{rep}")
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


if __name__ == "__main__":
    sys.exit(main())
