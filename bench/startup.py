"""Start-up benchmark: launch → first training step done, resilient-run against torchrun and a bare worker.

The same 2-rank gloo training script (import torch, ``init_process_group("gloo")`` through env://, a tiny DDP
model, one forward/backward/optimizer step) runs as:

* ``bare``: two plain ``python train.py`` processes against a TCPStore this bench hosts (as an agent's store is
  given to workers: ``TORCHELASTIC_USE_AGENT_STORE``); nothing but the worker's own cost;
* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 train.py``;
* ``resilient-run``: ``resilient-run --nproc-per-node 2 train.py`` (default flags);
* ``resilient-run --preload``: the same with ``--preload torch.nn.parallel`` written by hand (``--preload``);
* ``resilient-run exec-server``: the same with its fork server started by exec (it imports torch again) instead of
  forked from the agent after the agent's import (``RESILIENT_FAST_EXIT=0`` makes the launcher do that).

The figure is wall time from the moment the launcher process is started (``Popen``) to the latest rank's
first step done (each worker writes ``time.time()``: one clock, one machine). Cases run interleaved in a
shuffled order per repetition, so machine noise hits all alike; each repetition has its bare baseline.
For resilient-run the time is split by what it already records: the ledger (``run_start``: the agent's
imports and argument parsing done; ``rendezvous_done``: the first plan received; ``attempt_start``: workers
forked), the fork server's ready time (its log line at INFO) and the worker's own marks (script start,
imports, process group, step).

    python bench/startup.py [--reps 5] [--cases bare,torchrun,resilient-run] [--out bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = r'''
import time
T0 = time.time()
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
T1 = time.time()
dist.init_process_group("gloo")
T2 = time.time()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 32)).pow(2).mean()
loss.backward()
opt.step()
T3 = time.time()
with open(os.path.join(sys.argv[1], f"r{dist.get_rank()}.json"), "w") as f:
    json.dump({"start": T0, "imported": T1, "pg": T2, "step": T3}, f)
dist.destroy_process_group()
'''

PY = sys.executable
CASES = {
    "bare": None,
    "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "resilient-run": [PY, "-m", "resilient.run", "--nproc-per-node", "2"],
    "resilient-run --preload": [PY, "-m", "resilient.run", "--nproc-per-node", "2", "--preload", "torch.nn.parallel"],
    # the fork server started by exec, as before it was forked from the agent after the agent's import of torch (the
    # fast exit off is what makes the launcher start it that way; exit comes after what this bench measures)
    "resilient-run exec-server": [PY, "-m", "resilient.run", "--nproc-per-node", "2"],
}
CASE_ENV = {"resilient-run exec-server": {"RESILIENT_FAST_EXIT": "0"}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bare(script: Path, out: Path, timeout: float) -> tuple[float, list[subprocess.Popen]]:
    """Two workers against a store hosted here, started as a launcher starts them; returns the launch wall."""
    from torch.distributed import TCPStore

    port = _free_port()
    store = TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    t0 = time.time()
    procs = [subprocess.Popen([PY, "-u", str(script), str(out)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdin=subprocess.DEVNULL, cwd=out.parent) for r in range(2)]
    for p in procs:
        p.wait(timeout=timeout)
    del store
    return t0, procs


def one(case: str, script: Path, work: Path, timeout: float) -> dict:
    out = work / "out"
    out.mkdir(parents=True)
    run_dir = work / "run"
    t0 = time.time()
    if case == "bare":
        t0, procs = _bare(script, out, timeout)
        rc = max(p.returncode for p in procs)
    else:
        cmd = CASES[case]
        if case.startswith("resilient-run"):
            cmd = [*cmd, "--run-dir", str(run_dir)]
        env = dict(os.environ, RESILIENT_LOG_LEVEL="INFO") if case.startswith("resilient-run") else dict(os.environ)
        env.update(CASE_ENV.get(case, {}))
        t0 = time.time()
        p = subprocess.Popen([*cmd, str(script), str(out)], cwd=work, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        rc = p.returncode
        if rc != 0:
            sys.stderr.write(err.decode(errors="replace")[-3000:])
    marks = [json.loads(f.read_text()) for f in sorted(out.glob("r*.json"))]
    r: dict = {"case": case, "rc": rc, "ok": rc == 0 and len(marks) == 2}
    if not r["ok"]:
        return r
    r["seconds"] = max(m["step"] for m in marks) - t0
    last = max(marks, key=lambda m: m["step"])
    r["worker"] = {"start": min(m["start"] for m in marks) - t0, "imports": last["imported"] - last["start"],
                   "process_group": last["pg"] - last["imported"], "first_step": last["step"] - last["pg"]}
    if case.startswith("resilient-run"):
        r["phases"] = _phases(run_dir, t0, marks)
    return r


def _phases(run_dir: Path, t0: float, marks: list[dict]) -> dict:
    """Where resilient-run's time went, each phase in seconds, from the ledger, its log and the workers' marks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from resilient.events.follow import read_events

    ev = {}
    for e in read_events(run_dir):
        ev.setdefault(e.kind.value, e.wall)
    ready = None
    log = run_dir / "logs" / "agent.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            m = re.search(r"^fork server ready at ([\d.]+)", str(rec.get("msg", rec.get("message", ""))))
            if m:
                ready = float(m.group(1))
                break
    start = min(m["start"] for m in marks)
    last = max(marks, key=lambda m: m["step"])
    # seconds after launch: the fork server ready (its own clock), the agent's modules imported (run_start), the
    # supervisor's first plan (action), the agent's reading of it (rendezvous_done), workers forked (attempt_start)
    p = {"agent_start_imports": ev.get("run_start", t0) - t0}
    if ready is not None:
        p["fork_server_ready_at"] = ready - t0
        p["fork_server_ready_after_run_start"] = ready - ev.get("run_start", t0)
        p["ready_to_first_plan"] = ev.get("rendezvous_done", 0) - ready
    p["first_plan_at"] = ev.get("rendezvous_done", 0) - t0
    p["run_start_to_first_plan"] = ev.get("rendezvous_done", 0) - ev.get("run_start", 0)
    if "action" in ev:
        p["supervisor_plan_at"] = ev["action"] - t0
    p["plan_to_spawned"] = ev.get("attempt_start", 0) - ev.get("rendezvous_done", 0)
    p["spawned_to_script_start"] = start - ev.get("rendezvous_done", 0)
    p["worker_imports"] = last["imported"] - last["start"]
    p["process_group"] = last["pg"] - last["imported"]
    p["first_step"] = last["step"] - last["pg"]
    return {k: round(v, 4) for k, v in p.items()}


def _summary(rows: list[dict]) -> dict:
    ok = [r["seconds"] for r in rows if r.get("ok")]
    if not ok:
        return {"runs": len(rows), "ok": 0}
    return {"runs": len(rows), "ok": len(ok), "median_s": round(statistics.median(ok), 4),
            "min_s": round(min(ok), 4), "max_s": round(max(ok), 4), "all_s": [round(x, 4) for x in ok]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="bare,torchrun,resilient-run")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="a note stored with the result (e.g. the code's state)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.json"))
    a = ap.parse_args()
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {list(CASES)}")
    rng = random.Random(a.seed)
    rows: list[dict] = []
    loads = []
    with tempfile.TemporaryDirectory(prefix="startup-") as d:
        script = Path(d) / "train.py"
        script.write_text(SCRIPT)
        for rep in range(a.reps):
            order = cases[:]
            rng.shuffle(order)
            for case in order:
                loads.append(os.getloadavg()[0])
                work = Path(d) / f"{rep}-{case.replace(' ', '_')}"
                r = one(case, script, work, a.timeout)
                r["rep"] = rep
                rows.append(r)
                print(f"rep {rep} {case:26s} {r.get('seconds', float('nan')):7.3f}s"
                      f"{'' if r['ok'] else '  FAILED rc=' + str(r['rc'])}"
                      f"{'  ' + json.dumps(r['phases']) if 'phases' in r else ''}", flush=True)
    summary = {c: _summary([r for r in rows if r["case"] == c]) for c in cases}
    base = summary.get("bare", {}).get("median_s")
    for c in cases:
        m = summary[c].get("median_s")
        if base and m:
            summary[c]["over_bare"] = round(m / base, 3)
        per = []
        for rep in range(a.reps):
            b = [r["seconds"] for r in rows if r["rep"] == rep and r["case"] == "bare" and r.get("ok")]
            x = [r["seconds"] for r in rows if r["rep"] == rep and r["case"] == c and r.get("ok")]
            if b and x:
                per.append(round(x[0] / b[0], 3))
        summary[c]["over_bare_per_rep"] = per
        ph = [r["phases"] for r in rows if r["case"] == c and "phases" in r]
        if ph:
            summary[c]["median_phases"] = {k: round(statistics.median(p[k] for p in ph if k in p), 4)
                                           for k in ph[0]}
    doc = {"label": a.label, "reps": a.reps, "cases": cases, "load_avg_1m": [round(min(loads), 2), round(max(loads), 2)],
           "cpus": os.cpu_count(), "summary": summary, "rows": rows,
           "goal": "resilient-run <= 1.15 x bare (launch -> first step)"}
    print(json.dumps({c: {k: v for k, v in s.items() if k != "all_s"} for c, s in summary.items()}, indent=1))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(out.read_text()) if out.exists() else {}
    runs = prev.get("runs", []) if isinstance(prev, dict) else []
    runs.append(doc)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
