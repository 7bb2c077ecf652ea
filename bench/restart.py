"""Crash-restart benchmark: resilient-run against torchrun and nvidia-resiliency-ext's ft_launcher.

The same unmodified 2-rank gloo script runs under each launcher with ``--max-restarts 1``: rank 1
SIGKILLs itself right after its first all_reduce on attempt 0. A repetition succeeds when the launcher
exits 0 and both ranks of attempt 1 completed an all_reduce. The restart time is from the kill to the
end of the first collective after the restart (the latest rank). Launchers run interleaved, so machine
noise hits all of them alike.

    python bench/restart.py [--reps 5] [--timeout 90]
    python bench/restart.py --heavy transformers --train-seconds 15   # automatic preload vs --preload

``--heavy MODULE``: the script imports MODULE first (transformers, lightning: seconds of imports) and trains
``--train-seconds`` before the kill (a real failure comes after a while, and automatic preload warms its fork
server meanwhile). Then the launchers are resilient-run with no flag (automatic preload) and resilient-run with
the best hand-written ``--preload MODULE`` (``--with-spawn`` adds fresh interpreters, no fork server), their
order alternating between repetitions; the goal is no flag within 10% of ``--preload`` (median restart). Each
run also records how long automatic preload took to warm its copy of the fork server (from its log).

``--kills N`` (default 2 with ``--heavy``, else 1): rank 1 kills itself in each of the first N attempts (the later
ones after ``--train2-seconds``), so the second restart is measured too: the first tears down workers the launcher
started before it learned anything, the second workers forked from the warmed fork server. Each restart is split
from resilient-run's ledger into when the agent saw the exit, when the attempt's other workers were gone and when
the new ones were spawned (seconds after the kill).

``--job hf|lightning``: the heavy imports of an HF Trainer job (``from transformers import Trainer,
TrainingArguments``, ``import accelerate``) or a Lightning job, written in a local module the script imports, so
the fork server reads them before the first spawn (resilient-run, no flag), against the same imports made by name
at run time, which no static read sees (``imports hidden``: the behaviour before the static read) and against
that with the hand-written ``--preload``. Reports the first attempt's start (launch to the first collective) too.

    python bench/restart.py --job hf --train-seconds 2.3 --reps 3

Prints a table and writes bench/results/restart.json (restart-preload-MODULE.json with ``--heavy``,
restart-static-JOB.json with ``--job``).
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

SCRIPT = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
HEAVY = os.environ.get("BENCH_HEAVY")
if HEAVY:  # imported by name at run time: a static read of the script cannot see them
    for m in HEAVY.split(","):
        mod, _, attr = m.partition(":")
        # __import__: the import statement's own path (automatic preload learns from its audit events)
        got = __import__(mod, fromlist=[attr] if attr else [])
        if attr:
            getattr(got, attr)
out = sys.argv[1]
T_IMPORTED = time.time()
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
t = torch.ones(1)
dist.all_reduce(t)
done = time.time()
with open(os.path.join(out, f"a{attempt}_r{rank}.json"), "w") as f:
    json.dump({"sum": t.item(), "t": done, "imported": T_IMPORTED}, f)
kills = int(os.environ.get("BENCH_KILLS", "1"))
train_s = float(os.environ.get("BENCH_TRAIN_S" if attempt == 0 else "BENCH_TRAIN2_S", "0"))
if attempt < kills and train_s > 0:
    t_end = time.time() + train_s
    go = torch.ones(1)
    while go.item() > 0:  # rank 0 decides when training ends, so both ranks leave the loop together
        go.fill_(1.0 if time.time() < t_end else 0.0)
        dist.broadcast(go, 0)
        time.sleep(0.01)
if rank == 1 and attempt < kills:
    with open(os.path.join(out, f"kill{attempt}.json"), "w") as f:
        json.dump({"t": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
'''

# --job: the same script, its heavy imports written out in a local module it imports (what a static read sees)
JOBS = {
    "hf": ("from transformers import Trainer, TrainingArguments\nimport accelerate\n",
           "transformers:Trainer,transformers:TrainingArguments,accelerate", "transformers,accelerate"),
    "lightning": ("import lightning\nfrom lightning import Trainer, LightningModule\n",
                  "lightning,lightning:Trainer,lightning:LightningModule", "lightning"),
}

BIN = Path(sys.executable).parent
LAUNCHERS = {
    "resilient-run": [sys.executable, "-m", "resilient.run"],
    "resilient-run (spawn)": [sys.executable, "-m", "resilient.run", "--worker-launch", "spawn"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "ft_launcher": [str(BIN / "ft_launcher")],
}


def reap(p: subprocess.Popen) -> None:
    """Kill the launcher and every process it started: a hung launcher's workers (some in sessions of
    their own) must not outlive the repetition and slow down the next ones."""
    import psutil

    try:
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for q in procs:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    p.wait(timeout=10)


def one(name: str, cmd: list[str], workdir: Path, timeout: float, extra_env: dict | None = None,
        kills: int = 1) -> dict:
    out = Path(tempfile.mkdtemp(prefix="out-", dir=workdir))
    script = workdir / ("crash_static.py" if (extra_env or {}).get("BENCH_STATIC") else "crash.py")
    args = [*cmd, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(kills)]
    if name.startswith("resilient"):
        args += ["--run-dir", str(out / "run")]
    args += [str(script), str(out)]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra_env or {})
    env["BENCH_KILLS"] = str(kills)
    t0 = time.time()
    p = subprocess.Popen(args, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code: int | str = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = "timeout"
    wall = time.time() - t0
    reap(p)
    ok = code == 0 and all((out / f"a{kills}_r{r}.json").exists() for r in (0, 1))
    # restart k: from rank 1's kill in attempt k to the end of the first collective of attempt k+1 (latest rank)
    restarts: list[float | None] = []
    kill_walls: list[float | None] = []
    for k in range(kills):
        kf = out / f"kill{k}.json"
        done = [out / f"a{k + 1}_r{r}.json" for r in (0, 1)]
        if ok and kf.exists() and all(f.exists() for f in done):
            kt = json.loads(kf.read_text())["t"]
            kill_walls.append(kt)
            restarts.append(max(json.loads(f.read_text())["t"] for f in done) - kt)
        else:
            kill_walls.append(None)
            restarts.append(None)
    r = {"launcher": name, "ok": ok, "exit": code, "restart_s": restarts[0], "wall_s": wall}
    first = [out / f"a0_r{r}.json" for r in (0, 1)]
    if all(f.exists() for f in first):  # launch -> the first collective of the first attempt (latest rank)
        r["start_s"] = max(json.loads(f.read_text())["t"] for f in first) - t0
    if kills > 1:
        r["restart2_s"] = restarts[1]
    r.update(_preload_log(out / "run" / "logs" / "agent.jsonl", kill_walls[0]))
    phases = _restart_phases(out / "run" / "events.jsonl", kill_walls)
    if phases:
        r["phases"] = phases
    return r


def _restart_phases(path: Path, kill_walls: list[float | None]) -> list[dict]:
    """Where each restart's time went, from resilient-run's ledger (seconds after the kill): the agent saw the
    exit (``exit_seen``), the attempt's other workers were gone (``stopped``: its ``attempt_end``), the new
    workers were spawned (``spawned``: the next ``attempt_start``)."""
    from resilient.events.follow import read_events
    if not path.exists():
        return []
    events = [e.to_json() for e in read_events(path)]  # every writer's file: workers' marks are not the agent's
    out = []
    for k, kt in enumerate(kill_walls):
        if kt is None:
            out.append({})
            continue

        def first(kind: str, attempt: int) -> float | None:
            for e in events:
                if e.get("kind") == kind and e.get("attempt") == attempt and e.get("wall", 0) >= kt - 1:
                    return round(e["wall"] - kt, 4)
            return None

        out.append({"exit_seen": first("worker_exit", k), "stopped": first("attempt_end", k),
                    "spawned": first("attempt_start", k + 1)})
    return out


def _preload_log(path: Path, kill: float | None) -> dict:
    """From resilient-run's log: how long automatic preload took to warm, and whether it was warm before the kill."""
    import re

    if not path.exists():
        return {}
    warm_s, warm_wall = None, None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        m = re.search(r"automatic preload: fork server ready with \d+ learned modules \(warm ([\d.]+)s",
                      rec.get("message", ""))
        if m and warm_wall is None:
            warm_s, warm_wall = float(m.group(1)), rec.get("wall")
    if warm_s is None:
        return {"preload_warm_s": None, "warm_before_kill": False}
    return {"preload_warm_s": warm_s,
            "warm_before_kill": kill is not None and warm_wall is not None and warm_wall < kill}


def _second_restart(summary: dict, kills: int) -> dict:
    if kills < 2:
        return {}
    auto = summary.get("resilient-run", {}).get("median_restart2_s")
    hand = summary.get("resilient-run --preload", {}).get("median_restart2_s")
    return {"median_no_flag_second_s": auto, "median_preload_second_s": hand,
            "no_flag_over_preload_second": auto / hand if auto and hand else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=90.0, help="a run longer than this counts as a hang")
    ap.add_argument("--launchers", default=None, help="which launchers to run (default: all of the mode's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--heavy", default=None, help="modules the script imports first (e.g. transformers)")
    ap.add_argument("--job", choices=sorted(JOBS), default=None,
                    help="hf or lightning: no flag with the imports written in a local module the script imports "
                         "(the fork server reads them before the first spawn), against the same imports made by name "
                         "at run time (no static read: as before) and with a hand-written --preload")
    ap.add_argument("--train-seconds", type=float, default=15.0, help="with --heavy: training before the kill")
    ap.add_argument("--with-spawn", action="store_true", help="with --heavy: also fresh interpreters (no fork server)")
    ap.add_argument("--kills", type=int, default=None,
                    help="rank 1 kills itself in each of the first N attempts (default: 2 with --heavy, else 1)")
    ap.add_argument("--train2-seconds", type=float, default=3.0,
                    help="with --kills 2 or more: training in each later attempt before its kill")
    a = ap.parse_args()
    kills = a.kills if a.kills is not None else (2 if a.heavy or a.job else 1)
    if kills < 1:
        ap.error(f"--kills must be >= 1, got {kills}")
    extra: dict = {"BENCH_TRAIN2_S": str(a.train2_seconds)}
    per_launcher: dict[str, dict] = {}
    if a.job:
        source, dynamic, hand = JOBS[a.job]
        a.heavy = dynamic
        LAUNCHERS.clear()
        LAUNCHERS["resilient-run"] = [sys.executable, "-m", "resilient.run"]
        LAUNCHERS["resilient-run (imports hidden)"] = [sys.executable, "-m", "resilient.run"]
        LAUNCHERS["resilient-run --preload"] = [sys.executable, "-m", "resilient.run", "--preload", hand]
        a.launchers = a.launchers or ",".join(LAUNCHERS)
        extra.update(BENCH_TRAIN_S=str(a.train_seconds), RESILIENT_LOG_LEVEL="INFO")
        per_launcher = {"resilient-run": {"BENCH_STATIC": "1"},
                        "resilient-run (imports hidden)": {"BENCH_HEAVY": dynamic},
                        "resilient-run --preload": {"BENCH_HEAVY": dynamic}}
    elif a.heavy:
        LAUNCHERS.clear()
        LAUNCHERS["resilient-run"] = [sys.executable, "-m", "resilient.run"]
        LAUNCHERS["resilient-run --preload"] = [sys.executable, "-m", "resilient.run", "--preload", a.heavy]
        if a.with_spawn:
            LAUNCHERS["resilient-run (spawn)"] = [sys.executable, "-m", "resilient.run", "--worker-launch", "spawn"]
        a.launchers = a.launchers or ",".join(LAUNCHERS)
        # INFO: the agent's log then says when automatic preload was warm (both launchers log alike)
        extra.update(BENCH_HEAVY=a.heavy, BENCH_TRAIN_S=str(a.train_seconds), RESILIENT_LOG_LEVEL="INFO")
    a.out = a.out or str(Path(__file__).parent / "results" / (
        f"restart-static-{a.job}.json" if a.job else "restart.json" if not a.heavy else
        f"restart-preload-{a.heavy.replace(',', '+')}.json"))
    names = [n for n in (a.launchers or ",".join(LAUNCHERS)).split(",") if n]
    if any(n not in LAUNCHERS for n in names):
        ap.error(f"--launchers: choose from {list(LAUNCHERS)}")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        wd = Path(d)
        (wd / "crash.py").write_text(SCRIPT)
        if a.job:
            (wd / "jobimports.py").write_text(JOBS[a.job][0])
            (wd / "crash_static.py").write_text("import jobimports  # noqa: F401\n" + SCRIPT)
        for rep in range(a.reps):
            for n in (names if rep % 2 == 0 else names[::-1]):  # alternate the order: no launcher always goes first
                r = one(n, LAUNCHERS[n], wd, a.timeout, {**extra, **per_launcher.get(n, {})}, kills)
                r["rep"] = rep
                runs.append(r)
                rnd = lambda v: v if v is None else round(v, 3)  # noqa: E731
                print(f"  rep {rep} {n:<22} ok={r['ok']!s:<5} start={rnd(r.get('start_s'))} restart={rnd(r['restart_s'])}"
                      + (f" second={rnd(r.get('restart2_s'))}" if kills > 1 else "")
                      + (f" phases={r['phases']}" if r.get("phases") else ""), file=sys.stderr, flush=True)
    summary = {}
    for n in names:
        rs = [r for r in runs if r["launcher"] == n]
        times = [r["restart_s"] for r in rs if r["restart_s"] is not None]
        starts = [r["start_s"] for r in rs if r.get("start_s") is not None]
        summary[n] = {"successes": sum(r["ok"] for r in rs), "reps": len(rs),
                      "median_start_s": statistics.median(starts) if starts else None,
                      "min_start_s": min(starts) if starts else None, "max_start_s": max(starts) if starts else None,
                      "median_restart_s": statistics.median(times) if times else None,
                      "min_restart_s": min(times) if times else None, "max_restart_s": max(times) if times else None}
        if kills > 1:
            t2 = [r["restart2_s"] for r in rs if r.get("restart2_s") is not None]
            summary[n]["median_restart2_s"] = statistics.median(t2) if t2 else None
            for i, key in enumerate(("first", "second")):
                for ph in ("exit_seen", "stopped", "spawned"):
                    v = [r["phases"][i][ph] for r in rs if len(r.get("phases", [])) > i and r["phases"][i].get(ph) is not None]
                    summary[n][f"median_{key}_{ph}_s"] = statistics.median(v) if v else None
    base = summary.get("resilient-run", {}).get("median_restart_s")
    print(f"\n{'launcher':<32}{'restarts ok':>12}{'median s':>10}{'min s':>9}{'max s':>9}{'÷ resilient-run':>17}"
          + (f"{'2nd restart s':>15}" if kills > 1 else "") + f"{'start s (min-max)':>22}")
    for n, s in summary.items():
        med = s["median_restart_s"]
        ratio = f"{med / base:.1f}x" if med and base else "-"
        fmt = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        print(f"{n:<32}{s['successes']:>5}/{s['reps']:<6}{fmt(med):>10}{fmt(s['min_restart_s']):>9}{fmt(s['max_restart_s']):>9}{ratio:>17}"
              + (f"{fmt(s.get('median_restart2_s')):>15}" if kills > 1 else "")
              + f"{fmt(s.get('median_start_s')):>10} ({fmt(s.get('min_start_s'))}-{fmt(s.get('max_start_s'))})")
        s["ratio_to_resilient_run"] = (med / base) if med and base else None
    doc: dict = {"summary": summary, "runs": runs, "reps": a.reps, "kills": kills,
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.heavy:
        hand = summary.get("resilient-run --preload", {}).get("median_restart_s")
        ratio = base / hand if base and hand else None
        auto = [r for r in runs if r["launcher"] == "resilient-run"]
        warm = [r["preload_warm_s"] for r in auto if r.get("preload_warm_s") is not None]
        doc["automatic_preload"] = {
            "heavy": a.heavy, "train_seconds": a.train_seconds,
            "median_no_flag_s": base, "median_preload_s": hand,
            "no_flag_over_preload": ratio, "goal": "<= 1.10", "goal_met": ratio is not None and ratio <= 1.10,
            **_second_restart(summary, kills),
            "median_warm_s": statistics.median(warm) if warm else None,
            "warm_before_kill": f"{sum(bool(r.get('warm_before_kill')) for r in auto)}/{len(auto)}",
            "load_avg_1m_at_end": round(os.getloadavg()[0], 1),
        }
        print(f"\nno flag / --preload {a.heavy}: " + (f"{ratio:.2f}" if ratio else "-")
              + f" (goal <= 1.10); automatic preload warm after {doc['automatic_preload']['median_warm_s']} s (median)")
        second = doc["automatic_preload"].get("no_flag_over_preload_second")
        if kills > 1:
            print("second restart, no flag / --preload: " + (f"{second:.2f}" if second else "-"))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
