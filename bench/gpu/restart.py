"""Warm restarts on a GPU: kill -> first step after the restart, for the GPT recipe on CUDA, under resilient-run and
under torchrun (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), eager and under ``torch.compile``.

    python3 bench/gpu/restart.py --out DIR [--dry-run] [--budget 190]

One worker (``--nproc-per-node 1``, the recipe with ``--init-group`` so the process group is set up as on every rank
of a real job) checkpoints every step to a local directory; once it has made four steps and a checkpoint is
committed (its ``COMMITTED`` marker, watched on disk), this script SIGKILLs the worker, and the launcher
(``--max-restarts 1``) starts a new one, which restores and trains on. The recipe's ``BENCH_TIMELINE`` marks say
when each phase of a worker's start-up ended, so each restart splits into: the new process (kill -> process
created), interpreter start, imports (torch), group set-up, CUDA init, model (build, to the GPU, DDP's first
broadcast), restore (with the corpus and the checkpointer set up), and the first step; compile = what the first
three steps took beyond a steady one (the fourth). The compile ratio is the restart's compile time / the first
attempt's (goal <= 0.2): under resilient-run the restarted worker loads the caches the first attempt saved
(``resilient.compile_cache``, in the run directory); under torchrun it finds what the first attempt left in the
local Inductor/Triton cache directories (the same node). Each run starts with empty cache directories.

The fork server cannot carry a CUDA context across ``fork()`` (it never touches CUDA), so a worker it forks skips
the imports but still pays CUDA init, as a fresh interpreter does; the split shows both. The script also reads the
fork server's ``/proc/PID/maps`` during each resilient-run run (no ``libcuda``/``libnvidia-ml`` may be loaded
there), and, if time is left, shows why: a child forked after the parent asked ``torch.cuda.is_available()``
cannot use CUDA.

Writes ``DIR/restart.json`` and prints a table. About 100-150 s on an H100 (import torch 4.6 s, compile 9 s).
``--dry-run``: CPU, gloo, a tiny model, eager only (compiling the recipe on a CPU takes minutes: skipped, and said
so in the JSON); figures not meaningful. Under 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "pytorch" / "train.py"
GUARDED = ("libcuda.so", "libnvidia-ml.so")
GOAL_COMPILE_RATIO = 0.2
POLL_S = 0.05  # how often the runs' marks and checkpoints are looked at (seconds)
PHASES = ("process_start", "interpreter", "imports", "group", "cuda_init", "model", "restore", "first_step",
          "compile")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: no psutil needed on the device)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_fork_server(pid: int) -> bool:
    """As resilient.launcher.zygote.is_server_process (kept free of imports here): a server forked from the agent by
    its name, one started by exec by its command line."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "resilient-fork":
            return True
    except OSError:
        return False
    return "resilient.launcher.zygote" in _cmdline(pid)


def _fork_servers_clean(launcher_pid: int) -> dict | None:
    """CUDA or NVML libraries mapped in the fork servers (and their copies) of a resilient-run. Mapped is not
    initialised (a CUDA build of torch maps libcuda at import): whether the servers stayed uninitialised shows in
    ``resilient_worker_start_methods`` (a server that finds CUDA initialised refuses to fork: Spawn appears)."""
    servers = [p for p in _descendants(launcher_pid) if _is_fork_server(p)]
    if not servers:
        return None
    found = {}
    for p in servers:
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
        except OSError:
            continue
        found[p] = sorted({lib for lib in GUARDED if f"/{lib}" in maps})
    return {"servers": len(found), "clean": all(not v for v in found.values()),
            "libraries": sorted({lib for v in found.values() for lib in v})}


def _stop(p: subprocess.Popen) -> None:
    """The launcher and everything it started, whatever state they are in."""
    procs = _descendants(p.pid)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    for q in [p.pid, *procs]:
        try:
            os.kill(q, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _marks(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _ledger(run_dir: Path) -> list[dict]:
    """Every writer's events of a run (the agent's file is one of several: each worker process writes its own)."""
    from resilient.events.follow import read_events
    return [e.to_json() for e in read_events(run_dir)] if (run_dir / "events.jsonl").exists() else []


def split(marks: list[dict], attempt: int, since: float) -> dict:
    """One attempt's start-up, phase by phase (seconds), from the recipe's marks; ``since``: the kill (or launch)."""
    m: dict[str, float] = {}
    steps: list[float] = []
    created = None
    for r in marks:
        if r.get("attempt") != attempt:
            continue
        if r["mark"] == "step":
            steps.append(r["t"])
        else:
            m.setdefault(r["mark"], r["t"])
        if r["mark"] == "script":
            created = r.get("created")
    if "script" not in m:
        return {}

    def d(a: float | None, b: float | None) -> float | None:
        return round(b - a, 4) if a is not None and b is not None else None

    after_imports = m.get("group", m.get("imports"))
    after_cuda = m.get("cuda", after_imports)
    first = steps[0] if steps else None
    first_step = d(m.get("restored"), first)
    # compile: what the first three steps took beyond a steady one (the fourth); a graph may compile in any of them
    steady = steps[3] - steps[2] if len(steps) >= 4 else None
    compile_s = None
    if first_step is not None and steady is not None:
        compile_s = sum(max(0.0, x - steady) for x in (first_step, steps[1] - steps[0], steps[2] - steps[1]))
    out = {
        "process_start": d(since, created), "interpreter": d(created, m["script"]),
        "imports": d(m["script"], m.get("imports")), "group": d(m.get("imports"), m.get("group")),
        "cuda_init": d(after_imports, m.get("cuda")), "model": d(after_cuda, m.get("model")),
        "restore": d(m.get("model"), m.get("restored")), "first_step": first_step,
        "steady_step": round(steady, 4) if steady is not None else None,
        "compile": round(compile_s, 4) if compile_s is not None else None,
        "to_first_step": d(since, first),
    }
    return out


def run_one(launcher: str, compiled: bool, work: Path, model_args: list[str], timeout: float, py: str) -> dict:
    name = f"{launcher}-{'compile' if compiled else 'eager'}"
    d = work / name
    d.mkdir(parents=True)
    ckpt, timeline = d / "ckpt", d / "timeline.jsonl"
    env = dict(os.environ)
    # Triton's cache defaults to a directory inside Inductor's, which is what resilient.compile_cache keeps
    env.pop("TRITON_CACHE_DIR", None)
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT),
               BENCH_TIMELINE=str(timeline), TORCHINDUCTOR_CACHE_DIR=str(d / "inductor"), PYTHONUNBUFFERED="1",
               RESILIENT_CKPT_LOCAL=str(ckpt), RESILIENT_CKPT_INTERVAL="1")
    recipe = [str(RECIPE), "--steps", "100000", "--init-group", "--log-every", "1000000", *model_args]
    if compiled:
        recipe.append("--compile")
    flags = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1"]
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # without it a restart can read the dead rank's address
        cmd = [py, "-m", "torch.distributed.run", *flags, *recipe]
    else:
        cmd = [py, "-m", "resilient.run", *flags, "--run-dir", str(d / "run"), "--ckpt-local", str(ckpt),
               "--ckpt-interval", "1", *recipe]
    res: dict = {"launcher": launcher, "compiled": compiled, "ok": False}
    log = open(d / "launcher.log", "wb")
    t_launch = time.time()
    p = subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        # the event: attempt 0's first checkpoint committed on disk
        while True:
            if time.monotonic() > deadline:
                res["error"] = "no checkpoint committed in time"
                return res
            if p.poll() is not None:
                res["error"] = f"launcher exited ({p.returncode}) before the first checkpoint"
                return res
            first = [r for r in _marks(timeline) if r.get("attempt") == 0]
            pid = next((r["pid"] for r in first if r["mark"] == "script"), None)
            # four steps (the first attempt's compile is measured over them) and a committed checkpoint
            if sum(r["mark"] == "step" for r in first) >= 4 and any(ckpt.rglob("COMMITTED")):
                break
            # every figure is read from the recipe's own marks, not from when this loop saw them: a slower poll
            # changes none, and the job's cores are not spent re-reading its timeline
            time.sleep(POLL_S)
        if launcher != "torchrun":
            res["fork_server_before_kill"] = _fork_servers_clean(p.pid)
        kill_t = time.time()
        os.kill(pid, signal.SIGKILL)
        # the event: attempt 1's fourth step
        while sum(1 for r in _marks(timeline) if r.get("attempt") == 1 and r["mark"] == "step") < 4:
            if time.monotonic() > deadline:
                res["error"] = "the restarted worker made no 4 steps in time"
                break
            if p.poll() is not None:
                res["error"] = f"launcher exited ({p.returncode}) before 4 steps after the restart"
                break
            time.sleep(POLL_S)
        if launcher != "torchrun":
            res["fork_server_after_restart"] = _fork_servers_clean(p.pid)
        if launcher != "torchrun":  # whether the fork server started the workers, from the run's ledger
            res["methods"] = [e.get("details", {}).get("method") for e in _ledger(d / "run")
                              if e.get("kind") == "attempt_start"]
        marks = _marks(timeline)
        res["first_attempt"] = split(marks, 0, t_launch)
        res["restart"] = split(marks, 1, kill_t)
        res["kill_to_first_step_s"] = res["restart"].get("to_first_step")
        f0, f1 = res["first_attempt"].get("compile"), res["restart"].get("compile")
        res["compile_ratio"] = round(f1 / f0, 3) if compiled and f0 and f1 is not None else None
        res["ok"] = "error" not in res and res["kill_to_first_step_s"] is not None
        return res
    finally:
        _stop(p)
        log.close()
        if not res.get("ok"):
            res["log_tail"] = (d / "launcher.log").read_text(errors="replace")[-1500:]


FORK_PROBE = r"""
import os, sys
import torch

def child_uses_cuda():
    pid = os.fork()
    if pid == 0:
        try:
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            os._exit(0)
        except BaseException as e:
            sys.stderr.write(f"child: {type(e).__name__}: {e}\n")
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0

clean = child_uses_cuda()  # the parent has touched nothing of CUDA
torch.cuda.is_available()  # what the fork server used to ask
after = child_uses_cuda()
print(f"{clean} {after}")
"""


def fork_probe(py: str, timeout: float) -> dict:
    r = subprocess.run([py, "-c", FORK_PROBE], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or len(r.stdout.split()) != 2:
        return {"ok": False, "stderr": r.stderr[-800:]}
    clean, after = (w == "True" for w in r.stdout.split())
    return {"ok": True, "child_cuda_works_parent_clean": clean, "child_cuda_works_after_is_available": after,
            "child_error": r.stderr.strip()[-300:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all runs (default 190; 25 dry)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    t_start = time.monotonic()
    budget = a.budget if a.budget is not None else (25.0 if a.dry_run else 190.0)
    import torch

    cuda = torch.cuda.is_available() and not a.dry_run  # this process is no fork server: asking is fine
    if a.dry_run or not cuda:
        model_args = ["--n-layer", "1", "--d-model", "32", "--micro-batch", "4", "--global-batch", "4"]
        plan = [("resilient-run", False), ("torchrun", False)]
        note = ("dry run: CPU, gloo, tiny model, eager only; compiling the recipe on a CPU takes minutes "
                "(C++ kernels), so no compile run; figures not meaningful")
    else:
        # about 3 M parameters (40 MB of checkpoint with AdamW's state): a step of tens of ms, saved every step
        model_args = ["--n-layer", "4", "--d-model", "256", "--micro-batch", "16", "--global-batch", "32"]
        plan = [("resilient-run", False), ("torchrun", False), ("resilient-run", True), ("torchrun", True)]
        note = ""
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu-restart-") as tmp:
        for i, (launcher, compiled) in enumerate(plan):
            left = budget - (time.monotonic() - t_start)
            need = (45.0 if compiled else 20.0) if not a.dry_run else 5.0
            if left < need:
                runs.append({"launcher": launcher, "compiled": compiled, "ok": False,
                             "error": f"skipped: {left:.0f} s of the budget left"})
                continue
            # a run may use what is left, less what the runs after it need at least
            after = sum((45.0 if c else 20.0) if not a.dry_run else 5.0 for _, c in plan[i + 1:])
            r = run_one(launcher, compiled, Path(tmp), model_args, max(need, left - after), py)
            runs.append(r)
            print(f"  {launcher:<14} {'compile' if compiled else 'eager':<8} ok={r['ok']} "
                  f"kill->first step={r.get('kill_to_first_step_s')} s"
                  + (f"  ({r['error']})" if r.get("error") else ""),
                  flush=True)
        probe = None
        left = budget - (time.monotonic() - t_start)
        if cuda and left > 20:
            try:
                probe = fork_probe(py, min(60.0, left))
            except subprocess.TimeoutExpired:
                probe = {"ok": False, "error": "timed out"}

    def get(launcher: str, compiled: bool) -> dict:
        return next((r for r in runs if r["launcher"] == launcher and r["compiled"] == compiled), {})

    doc: dict = {"dry_run": a.dry_run, "cuda": cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                 "torch": torch.__version__, "model_args": model_args, "note": note, "runs": runs}
    for compiled in (False, True):
        mode = "compile" if compiled else "eager"
        rr, tr = get("resilient-run", compiled), get("torchrun", compiled)
        a_s, b_s = rr.get("kill_to_first_step_s"), tr.get("kill_to_first_step_s")
        doc[f"{mode}_resilient_kill_to_first_step_s"] = a_s
        doc[f"{mode}_torchrun_kill_to_first_step_s"] = b_s
        doc[f"{mode}_resilient_over_torchrun"] = round(a_s / b_s, 3) if a_s and b_s else None
    for launcher, key in (("resilient-run", "resilient"), ("torchrun", "torchrun")):
        r = get(launcher, True)
        doc[f"compile_first_attempt_{key}_s"] = r.get("first_attempt", {}).get("compile")
        doc[f"compile_restart_{key}_s"] = r.get("restart", {}).get("compile")
        doc[f"compile_ratio_{key}"] = r.get("compile_ratio")
        for mode, compiled in (("eager", False), ("compile", True)):
            sp = get(launcher, compiled).get("restart", {})
            doc[f"{mode}_{key}_restart_imports_s"] = sp.get("imports")
            doc[f"{mode}_{key}_restart_cuda_init_s"] = sp.get("cuda_init")
    doc["goal"] = f"restart compile / first attempt compile <= {GOAL_COMPILE_RATIO} (resilient-run, compile cache)"
    ratio = doc["compile_ratio_resilient"]
    doc["met"] = bool(not a.dry_run and ratio is not None and ratio <= GOAL_COMPILE_RATIO)
    clean = [r.get(k) for r in runs for k in ("fork_server_before_kill", "fork_server_after_restart") if r.get(k)]
    doc["fork_server_maps_no_cuda_libraries"] = all(c["clean"] for c in clean) if clean else None
    doc["resilient_worker_start_methods"] = sorted({m for r in runs for m in r.get("methods", []) if m})
    doc["fork_probe"] = probe
    doc["seconds"] = round(time.monotonic() - t_start, 1)
    (out / "restart.json").write_text(json.dumps(doc, indent=2) + "\n")

    print(f"\nkill -> first step after the restart ({doc['device']}, torch {doc['torch']}"
          + (", DRY RUN: not meaningful" if a.dry_run else "") + ")")
    head = f"{'run':<30}{'total':>8}" + "".join(f"{p[:9]:>10}" for p in PHASES)
    print(head)
    for r in runs:
        label = f"{r['launcher']} {'compile' if r['compiled'] else 'eager'}"
        if not r.get("ok"):
            print(f"{label:<30}{'-':>8}  {r.get('error', 'failed')}")
            continue
        for which in ("first_attempt", "restart"):
            s = r[which]
            tot = s.get("to_first_step")
            cells = "".join(f"{s.get(p):>10.3f}" if s.get(p) is not None else f"{'-':>10}" for p in PHASES)
            print(f"{label + (' (1st)' if which == 'first_attempt' else ' (restart)'):<30}"
                  f"{tot if tot is not None else float('nan'):>8.2f}{cells}")
    print(f"compile ratio (restart / first attempt; goal <= {GOAL_COMPILE_RATIO}): resilient-run "
          f"{doc['compile_ratio_resilient']}, torchrun {doc['compile_ratio_torchrun']}; met: {doc['met']}")
    print(f"fork server maps no CUDA/NVML library: {doc['fork_server_maps_no_cuda_libraries']}; resilient-run started "
          f"workers with {doc['resilient_worker_start_methods']}")
    if probe:
        print(f"fork probe: {probe}")
    print(f"wrote {out / 'restart.json'} in {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
