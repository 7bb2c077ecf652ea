"""Exit benchmark: from the last checkpoint's commit to resilient-run's exit, with and without the fast exit.

A 2-rank gloo job (a small DDP model, ``resilient.steps``, a checkpoint every ``--interval`` steps on a local tier and
a ``file://`` persistent tier, the last step saved) runs under resilient-run; the script never calls ``close()``,
as many do not: the checkpointer finishes at exit. The latency is from the last ``ckpt_tier_done`` line of the
final step in the ledger (the step committed on its last tier) to the launcher's exit as the bench sees it (its
process reaped). Each repetition also checks that nothing was lost: the final step on both tiers, a ``step`` line
for every step, ``run_end`` and exit 0. Runs alternate between the fast exit (the default) and
``RESILIENT_FAST_EXIT=0`` (workers and launcher end through the interpreter's finalisation, as before), so machine
noise hits both alike. With ``RESILIENT_FAST_EXIT=0`` uploads still pending at exit fail (the interpreter's
shutdown refuses new executor work before the checkpointer's exit hook runs), so that mode's runs end 73 and its
latency is counted from the last tier that did commit.

    python bench/exit.py [--reps 10] [--steps 40] [--interval 10]

Prints a table (p50, p90, max, spread) and writes bench/results/exit.json.
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
import sys
import torch
import torch.distributed as dist
import resilient

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps, interval = int(sys.argv[1]), int(sys.argv[2])
ckpt = resilient.CheckpointManager.from_env(interval=interval, persistent_every=1)
state = {"model": model, "optim": opt}
start = ckpt.restore(state)
for step in resilient.steps(start, steps):
    model(torch.randn(32, 256)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(step, state)
'''


def _events(run: Path) -> list[dict]:
    """Every writer's ledger lines (the agent's and each worker's file), merged on wall time."""
    from resilient.events.follow import read_events

    return [e.to_json() for e in read_events(run)]


def one(work: Path, fast: bool, steps: int, interval: int, timeout: float) -> dict:
    tag = "fast" if fast else "finalise"
    d = Path(tempfile.mkdtemp(prefix=f"exit-{tag}-", dir=work))
    (d / "train.py").write_text(SCRIPT)
    run, local, pers = d / "run", d / "local", d / "pers"
    env = dict(os.environ, RESILIENT_FAST_EXIT="1" if fast else "0")
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run),
           "--ckpt-local", str(local), "--ckpt-persistent", f"file://{pers}", "--ckpt-persistent-every", "1",
           str(d / "train.py"), str(steps), str(interval)]
    p = subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=30)
    end = time.time()
    ev = _events(run)
    last = steps - 1
    done = [e for e in ev if e["kind"] == "ckpt_tier_done" and e["details"].get("step") == last]
    tiers = sorted({e["details"].get("tier") for e in done})
    seen_steps = {e["details"].get("step") for e in ev if e["kind"] == "step"}
    lost = []
    if p.returncode != 0:
        lost.append(f"exit {p.returncode}: {err.strip().splitlines()[-1:] if err else ''}")
    if tiers != ["local", "persistent"]:
        lost.append(f"final step {last} committed on {tiers}")
    if not set(range(steps)) <= seen_steps:
        lost.append(f"step lines missing: {sorted(set(range(steps)) - seen_steps)[:5]}")
    if not any(e["kind"] == "run_end" for e in ev):
        lost.append("no run_end")
    lost = [m.replace(str(d), "<run>") for m in lost]  # no path of this machine in the results
    commit = max((e["wall"] for e in done), default=None)
    attempt_end = max((e["wall"] for e in ev if e["kind"] == "attempt_end"), default=None)
    run_end = max((e["wall"] for e in ev if e["kind"] == "run_end"), default=None)
    return {"mode": tag, "exit_s": None if commit is None else end - commit,
            "workers_s": None if commit is None or attempt_end is None else attempt_end - commit,
            "run_end_s": None if commit is None or run_end is None else run_end - commit,
            "lost": lost, "dir": str(d)}


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return {"n": len(xs), "p50": statistics.median(xs), "p90": q(0.9), "min": xs[0], "max": xs[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10, help="runs of each mode (interleaved)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "exit.json"))
    a = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-exit-") as work:
        for i in range(a.reps):
            for fast in ((True, False) if i % 2 == 0 else (False, True)):
                r = one(Path(work), fast, a.steps, a.interval, a.timeout)
                r.pop("dir")
                r["load_avg_1m"] = round(os.getloadavg()[0], 1)
                rows.append(r)
                took = r["exit_s"] if r["exit_s"] is None else round(r["exit_s"], 3)
                print(f"rep {i} {r['mode']:9s} commit->exit {took}"
                      f"  lost: {r['lost'] or 'nothing'}  (load {r['load_avg_1m']})", flush=True)
                _write(a, rows, _summary(rows, quiet=True))  # a bench cut short keeps what it measured
    _write(a, rows, _summary(rows, quiet=False))
    print(f"wrote {a.out}")
    return 0


def _write(a: argparse.Namespace, rows: list[dict], summary: dict) -> None:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "summary": summary, "runs": rows, "python": sys.version.split()[0],
                   "cpus": os.cpu_count()}, f, indent=1)


def _summary(rows: list[dict], quiet: bool) -> dict:
    summary: dict = {}
    if not quiet:
        print(f"\n{'mode':10s} {'what':22s} {'n':>3s} {'p50':>7s} {'p90':>7s} {'min':>7s} {'max':>7s}")
    for mode in ("fast", "finalise"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"lost_runs": sum(1 for r in mine if r["lost"])}
        for key, what in (("workers_s", "commit -> workers gone"), ("run_end_s", "commit -> run_end"),
                          ("exit_s", "commit -> launcher exit")):
            s = _stats([r[key] for r in mine if r[key] is not None])
            summary[mode][key] = s
            if s and not quiet:
                print(f"{mode:10s} {what:22s} {s['n']:3d} {s['p50']:7.3f} {s['p90']:7.3f} {s['min']:7.3f} "
                      f"{s['max']:7.3f}")
        if not quiet:
            print(f"{mode:10s} runs that lost something: {summary[mode]['lost_runs']}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
