"""The headline benchmark: goodput of one training job under one seeded fault schedule, three ways.

The job is ``recipes/pytorch/train.py`` (the small GPT on the shipped corpus, DDP on gloo, 2 ranks), run
unchanged through a thin wrapper that is the same for every launcher: it logs each step's start and end
(rank 0), gives the process group a collective timeout (``--pg-timeout``; torchrun and ft_launcher have no
hang detection of their own for an unmodified script, and gloo's default is 30 min), and for the baselines
puts plain synchronous DCP in place of ``resilient.CheckpointManager``.

* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 --max-restarts R`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the documented workaround that makes its gloo restarts work);
  the job saves model, optimizer and each rank's data position with synchronous ``dcp.save`` to the
  persistent tier (a local directory standing in for ``file://`` storage) every N steps, N chosen by
  Young/Daly from the save cost measured in a fault-free run and the MTBF; it restores the newest step whose
  ``.metadata`` (DCP's commit marker) exists.
* ``ft_launcher``: nvidia-resiliency-ext's launcher, same command and the same job as torchrun.
* ``resilient-run``: 2 nodes x 1 worker simulated on this machine (one agent per session, each with its own
  local tier, c10d rendezvous over loopback) plus 1 warm spare, the same persistent directory, the job's
  ``CheckpointManager`` with every other setting at its default; faults through ``--inject`` at the same times.

The baselines get their faults from this driver, at the same times after the job's first worker started:
``kill-worker`` SIGKILLs the rank's pid, ``hang-worker`` SIGSTOPs it, ``kill-node`` SIGKILLs every process
of the node. The baselines run on one node (torchrun cannot replace a lost node inside a job), so their node
loss kills the launcher and both workers; the driver then starts the same command again at once (a
scheduler's requeue with a replacement node ready: generous to the baselines, which in real life wait
minutes). The same requeue happens whenever a launcher exits before the job is done, resilient-run included (a
scheduler requeues any job that exits early; its faults still to come keep their times on the first launch's
clock). A fault that falls due while its target is not running (between attempts, or its launcher being
started again) is carried out as soon as the target runs again, as resilient-run's injector does (its agent fires
a due fault at its next pass while workers run): every launcher takes every fault of the schedule (``deferred``
counts those carried out more than 0.5 s late; ``skipped``, those whose target never ran again). Until
2026-12-03 the driver skipped them, so a baseline that was slow to restart took fewer faults than resilient-run.

Goodput = useful steps x clean step time / wall time, the same for all three: useful steps are the job's
steps (every run ends at the same step), the clean step time is the median step time of a fault-free run
of the same job under the same launcher (run just before the faulted one; the faulted run's own median step
when that is lower, as the machine's load drifts: a step time the launcher beat under faults would give a
goodput above 1), the wall time runs from the first launch to the last exit. Beside it: resilient-run's
ledger figure (``resilient goodput RUN_DIR --json``), and every launcher's goodput with torchrun's clean step
time (one yardstick: a launcher's own clean step could hide a slower step).

    python bench/goodput.py                  # full: ~10 min of training per launcher, MTBF 60 s
    python bench/goodput.py --quick          # CI: a tiny job, one worker kill each, about a minute

Prints a table and writes bench/results/goodput.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests._helpers (process and port helpers) come from this checkout
RECIPE = REPO / "recipes" / "pytorch" / "train.py"
BIN = Path(sys.executable).parent
CONFIGS = ("torchrun", "ft_launcher", "resilient-run")
FAULT_KINDS = ("kill-worker", "hang-worker", "kill-node")
WORLD = 2

# The wrapper every launcher runs. Its configuration comes from a file named by an environment variable:
# launchers parse (abbreviations of) their own flags among script arguments.
JOB = r'''
import datetime, json, os, runpy, sys, time
T_START = time.time()
cfg = json.load(open(os.environ["GOODPUT_BENCH_CFG"]))
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
log = open(os.path.join(cfg["out"], f"r{rank}-{os.getpid()}.jsonl"), "a")


def rec(**kw):
    log.write(json.dumps({"rank": rank, "pid": os.getpid(), "attempt": attempt, **kw}) + "\n")
    log.flush()


rec(event="start", t=T_START)
import torch.distributed as dist
import resilient

_init = dist.init_process_group


def init_process_group(*a, **kw):
    # the same collective timeout under every launcher: it is what ends a hang where nothing else watches
    kw.setdefault("timeout", datetime.timedelta(seconds=cfg["pg_timeout"]))
    return _init(*a, **kw)


dist.init_process_group = init_process_group
_steps = resilient.steps


def steps(start, stop=None, **kw):
    rec(event="resume", t=time.time(), start=start)
    for s in _steps(start, stop, **kw):
        t0 = time.time()
        yield s
        if rank == 0:
            rec(event="step", step=s, t0=t0, t1=time.time())


resilient.steps = steps

if cfg["mode"] == "dcp":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    class PlainDCP:
        """What a torchrun user writes: synchronous dcp.save every N steps, the newest committed step back."""

        def __init__(self, root, every):
            self.root, self.every = root, every

        @classmethod
        def from_env(cls, **_):
            return cls(cfg["persistent"], cfg["every"])

        def _sd(self, state):
            msd, osd = get_state_dict(state["model"], state["optim"])
            sd = {"model": msd, "optim": osd}
            for k, v in state.items():  # per-rank state under per-rank keys (DCP merges one key across ranks)
                if k not in ("model", "optim"):
                    sd[f"{k}-rank{rank}"] = v.state_dict()
            return sd

        def restore(self, state):
            done = sorted(int(d.split("-")[1]) for d in os.listdir(self.root) if d.startswith("step-")
                          and os.path.exists(os.path.join(self.root, d, ".metadata")))
            if not done:
                return 0
            sd = self._sd(state)
            dcp.load(sd, checkpoint_id=os.path.join(self.root, f"step-{done[-1]}"))
            set_state_dict(state["model"], state["optim"], model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
            for k, v in state.items():
                if k not in ("model", "optim"):
                    v.load_state_dict(sd[f"{k}-rank{rank}"])
            rec(event="restored", t=time.time(), step=done[-1])
            return done[-1] + 1

        def save(self, step, state, force=False):
            if not force and (step + 1) % self.every:
                return False
            t = time.time()
            dcp.save(self._sd(state), checkpoint_id=os.path.join(self.root, f"step-{step}"))
            if rank == 0:
                rec(event="save", step=step, seconds=time.time() - t)
            return True

        def wait(self, timeout=None):
            return None

        def close(self):
            return None

    resilient.CheckpointManager = PlainDCP

sys.argv = [cfg["script"], *cfg["args"]]
try:
    runpy.run_path(cfg["script"], run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code or 0
if code == 0 and rank == 0:
    rec(event="end", t=time.time())
sys.exit(code)
'''


# --------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Fault:
    kind: str  # one of FAULT_KINDS
    target: int  # a rank, or for kill-node a node's group rank
    at: float  # seconds after the job's first worker started
    at_step: int | None = None  # instead: once rank 0 finished this step (quick mode: start-up time varies)

    def inject(self) -> str:
        return f"{self.kind}:{self.target}@" + (f"step{self.at_step}" if self.at_step is not None else f"{self.at:.1f}s")

    def due(self, t0: float | None, now: float, last_step: int) -> bool:
        if self.at_step is not None:
            return last_step >= self.at_step
        return t0 is not None and now >= t0 + self.at


def fault_schedule(seed: int, n: int, span: float, mtbf: float) -> list[Fault]:
    """``n`` faults: one node loss, about a quarter hangs, the rest worker kills; exponential gaps with mean
    ``mtbf``, squeezed into ``span`` seconds when they would run past it (every run lasts at least that long,
    so every launcher meets every fault). The node lost is group rank 1: node 0 hosts resilient-run's store
    and supervisor (a standalone supervisor is how that node is made losable)."""
    rng = random.Random(seed)
    kinds = ["kill-node"] + ["hang-worker"] * max(1, round(n / 4))
    kinds += ["kill-worker"] * max(0, n - len(kinds))
    kinds = kinds[:n]
    rng.shuffle(kinds)
    gaps = [rng.expovariate(1.0 / mtbf) for _ in range(n)]
    gaps = [max(g, 0.1 * mtbf) for g in gaps]  # a fault during the previous recovery is not a new MTBF sample
    total = sum(gaps)
    scale = min(1.0, span / total) if total > 0 else 1.0
    out, t = [], 0.0
    for k, g in zip(kinds, gaps):
        t += g * scale
        out.append(Fault(k, 1 if k == "kill-node" else rng.randrange(WORLD), round(t, 1)))
    return out


def young_daly(delta: float, mtbf: float) -> float:
    """Optimal seconds between checkpoints for a blocking cost ``delta`` and a mean time between failures."""
    return max(delta, math.sqrt(2.0 * delta * mtbf) - delta)


# ---------------------------------------------------------------------------------------------- helpers
def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # two ranks (three with a spare) share two cores
    env.update(extra or {})
    return env


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and everything it started (a node lost, or the end of a run): its process tree
    (torchrun starts each worker in a session of its own) and its session (a process whose parent died
    is no longer in the tree)."""
    from tests._helpers.procs import kill_sessions

    kill_sessions([proc])


def job_proc(rec: dict) -> Any:
    """The live worker a ``start`` record names, or None: a pid the system has given to another process since
    (the process started after the record, or runs something else) is never signalled."""
    import psutil

    try:
        p = psutil.Process(rec["pid"])
        if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) or p.create_time() > rec["t"] + 1.0 \
                or not any(a.endswith("job.py") for a in p.cmdline()):
            return None
        return p
    except psutil.Error:
        return None


def kill_workers(log: "StepLog") -> None:
    import psutil

    procs = [p for p in map(job_proc, log.of("start")) if p is not None]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


class StepLog:
    """The wrapper's records, read as they are appended."""

    def __init__(self, out: Path):
        self.out = out
        self.pos: dict[Path, int] = {}
        self.records: list[dict] = []

    def poll(self) -> list[dict]:
        new: list[dict] = []
        for f in sorted(self.out.glob("r*.jsonl")):
            with open(f, "rb") as fh:
                fh.seek(self.pos.get(f, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self.pos[f] = self.pos.get(f, 0) + end
            new += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self.records += new
        return new

    def of(self, event: str) -> list[dict]:
        return [r for r in self.records if r["event"] == event]


def step_stats(log: StepLog, skip: int) -> dict[str, Any]:
    """Median step time (the first ``skip`` steps of each attempt are warm-up) and the save cost."""
    steps = log.of("step")
    seen: set[tuple[int, int]] = set()
    durs, save_durs = [], []
    saves = {r["step"]: r["seconds"] for r in log.of("save")}
    first: dict[int, int] = {}
    for r in steps:
        first.setdefault(r["pid"], r["step"])
        if r["step"] - first[r["pid"]] < skip or (r["pid"], r["step"]) in seen:
            continue
        seen.add((r["pid"], r["step"]))
        (save_durs if r["step"] in saves else durs).append(r["t1"] - r["t0"])
    clean = statistics.median(durs + save_durs) if durs or save_durs else None
    base = statistics.median(durs) if durs else clean
    return {"clean_step_s": clean, "plain_step_s": base,
            "save_blocking_s": (statistics.median(save_durs) - base) if save_durs and base else None,
            "dcp_save_s": statistics.median(saves.values()) if saves else None, "steps_measured": len(durs) + len(save_durs)}


def write_cfg(d: Path, mode: str, job_args: list[str], persistent: Path, every: int, pg_timeout: float) -> Path:
    out = d / "out"
    out.mkdir(parents=True, exist_ok=True)
    persistent.mkdir(parents=True, exist_ok=True)
    p = d / "cfg.json"
    p.write_text(json.dumps({"mode": mode, "out": str(out), "script": str(RECIPE), "args": job_args,
                             "persistent": str(persistent), "every": every, "pg_timeout": pg_timeout}))
    return p


# ------------------------------------------------------------------------------ (a) and (b): the baselines
def baseline_cmd(name: str, max_restarts: int, job: Path) -> list[str]:
    head = [sys.executable, "-m", "torch.distributed.run"] if name == "torchrun" else [str(BIN / "ft_launcher")]
    return [*head, "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts", str(max_restarts), str(job)]


def run_baseline(name: str, d: Path, job: Path, job_args: list[str], faults: list[Fault], every: int,
                 a: argparse.Namespace) -> dict[str, Any]:
    import psutil

    cfg = write_cfg(d, "dcp", job_args, d / "persistent", every, a.pg_timeout)
    env = child_env({"GOODPUT_BENCH_CFG": str(cfg)})
    if name == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # pytorch#135712: gloo restarts fail without it
    cmd = baseline_cmd(name, a.max_restarts, job)
    log = StepLog(d / "out")
    pending = list(faults)
    waiting: list[tuple[Fault, float]] = []  # fell due while the target was not running: (fault, when it fell due)
    res: dict[str, Any] = {"config": name, "injected": [], "skipped": [], "requeues": 0, "stall_requeues": 0,
                           "finished": False}
    launches = 0
    last_launch = 0.0

    def launch() -> subprocess.Popen:
        nonlocal launches, last_launch
        last_launch = time.time()
        f = open(d / f"launcher-{launches}.log", "wb")
        launches += 1
        p = subprocess.Popen(cmd, cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        f.close()
        return p

    t_launch = time.time()
    deadline = time.monotonic() + a.timeout
    proc = launch()
    t0: float | None = None
    seen, quiet_since = 0, time.monotonic()
    try:
        while True:
            log.poll()
            starts = log.of("start")
            if t0 is None and starts:
                t0 = min(r["t"] for r in starts)
            if log.of("end") and (proc.poll() is not None or time.monotonic() - quiet_since > a.stall):
                res["finished"], res["launcher_exit"] = True, proc.poll()  # the training is done either way
                break
            now = time.time()
            last = max((r["step"] for r in log.of("step")), default=-1)
            while pending and pending[0].due(t0, now, last):
                waiting.append((pending.pop(0), now))
            if waiting:
                newest: dict[int, dict] = {}
                for r in starts:  # the newest process of each rank
                    newest[r["rank"]] = r
                still = []
                for f, fell_due in waiting:
                    entry = {**asdict(f), "wall": now, "late_s": round(now - fell_due, 3)}
                    if f.kind == "kill-node":
                        # the node's launcher and workers: once the job runs on it again (after a requeue, once a
                        # worker of the new launch started)
                        if proc.poll() is None and any(r["t"] > last_launch for r in starts):
                            kill_session(proc)
                            res["injected"].append(entry)
                        else:
                            still.append((f, fell_due))
                        continue
                    target = job_proc(newest[f.target]) if f.target in newest else None
                    try:
                        # a stopped (hung) target takes it as resilient-run's injector gives it: a kill ends it, a
                        # second stop does nothing more
                        if target is None or proc.poll() is not None:
                            raise ProcessLookupError
                        target.send_signal(signal.SIGKILL if f.kind == "kill-worker" else signal.SIGSTOP)
                        res["injected"].append({**entry, "pid": target.pid})
                    except (ProcessLookupError, psutil.Error):  # not running now (between attempts): when it is
                        still.append((f, fell_due))
                waiting = still
            if log.records and len(log.records) != seen:
                seen, quiet_since = len(log.records), time.monotonic()
            stalled = time.monotonic() - quiet_since > a.stall
            if stalled and proc.poll() is None:
                # nothing written for --stall seconds: the job is stuck (a restart that never completes); what an
                # operator or a progress watchdog does to a stuck torchrun job is what the scheduler does here
                res["stall_requeues"] += 1
            if (proc.poll() is not None or stalled) and not log.of("end"):
                # the launcher gave up (or its node was lost): the scheduler runs the same command again at once
                kill_session(proc)
                kill_workers(log)  # a worker whose launcher died first is in neither its tree nor its session
                res["requeues"] += 1
                proc = launch()
                quiet_since = time.monotonic()
            if time.monotonic() > deadline:
                res["error"] = f"not done within {a.timeout:.0f} s"
                break
            time.sleep(0.05)  # polling files the job appends to; the job never waits on the driver
    finally:
        kill_session(proc)
        log.poll()
        kill_workers(log)
    res["wall_s"] = time.time() - t_launch
    res["t0_after_launch_s"] = (t0 - t_launch) if t0 else None
    res["skipped"] = [{**asdict(f), "fell_due": w} for f, w in waiting]  # the job ended before its target ran again
    res["deferred"] = sum(1 for e in res["injected"] if e.get("late_s", 0) > 0.5)
    res.update(progress(log))
    if not res["finished"]:
        res["log_tail"] = (d / f"launcher-{launches - 1}.log").read_text(errors="replace")[-3000:]
    res["_log"] = log
    return res


def progress(log: StepLog) -> dict[str, Any]:
    steps = log.of("step")
    done = {r["step"] for r in steps}
    return {"steps_done": (max(done) + 1) if done else 0, "step_records": len(steps),
            "steps_redone": len(steps) - len(done), "attempts_seen": len({r["pid"] for r in log.of("start") if r["rank"] == 0})}


# --------------------------------------------------------------------------------- (c) resilient-run
SPARE_GRACE_S = 30.0  # how long the spare may outlive both of the job's first nodes (a swapped-in spare ends with them)

def run_resilient(d: Path, job: Path, job_args: list[str], faults: list[Fault], a: argparse.Namespace,
                  spare: bool = True) -> dict[str, Any]:
    from resilient.events.ledger import read_events
    from tests._helpers.gcs import free_port

    cfg = write_cfg(d, "resilient", job_args, d / "persistent", 0, a.pg_timeout)
    env = child_env({"GOODPUT_BENCH_CFG": str(cfg)})
    res: dict[str, Any] = {"config": "resilient-run", "finished": False, "inject": None, "requeues": 0,
                           "run_dirs": []}
    nodes: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, run_dir: Path, port: int, inject: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "resilient.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "goodput",
               "--local-addr", "127.0.0.1", "--max-restarts", str(a.max_restarts), "--run-dir", str(run_dir),
               "--ckpt-local", str(d / f"local-{name}"), "--ckpt-persistent", (d / "persistent").as_uri()]
        if spare:
            cmd += ["--spare-nodes", "1"]
        if inject:
            cmd += ["--inject", inject]
        cmd.append(str(job))
        with open(d / f"{name}.log", "ab") as f:
            p = subprocess.Popen(cmd, cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        nodes.append((name, p))
        return p

    def events(run_dir: Path) -> list:
        try:
            return list(read_events(run_dir))
        except FileNotFoundError:
            return []

    def wait(pred, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.05)  # polling a socket or a file the agents append to

    def launch(run_dir: Path, inject: str) -> list[subprocess.Popen]:
        port = free_port()
        # both nodes at once, as a scheduler starts them (the baselines run on one node and pay no such wait):
        # the agent that binds the endpoint first hosts the store, the other one connects to it
        na = start("a", run_dir, port, inject)
        nb = start("b", run_dir, port, inject)
        out = [na, nb]
        if spare:
            # the spare joins once the supervisor gave a and b the job's places, as in the demo
            wait(lambda: any(e.kind.value == "action" and e.details.get("action") == "start" for e in events(run_dir))
                 or nb.poll() is not None, "the job's places to be given", 180)
            out.append(start("spare", run_dir, port, inject))
        return out

    t_launch = time.time()
    log = StepLog(d / "out")
    deadline = time.monotonic() + a.timeout
    left = list(faults)  # time-based faults still to come, on the first launch's clock
    last: list[tuple[str, subprocess.Popen]] = []  # the newest launch's agents
    try:
        while True:
            run_dir = d / ("run" if not res["run_dirs"] else f"run-requeue{len(res['run_dirs'])}")
            res["run_dirs"].append(run_dir)
            log.poll()
            starts = log.of("start")
            if starts:
                # a requeue (the same treatment the baselines get when their launcher exits early): the faults
                # still to come keep their times on the first launch's clock, less this launch's start-up
                t0 = min(r["t"] for r in starts)
                shift = time.time() + (res.get("t0_after_launch_s") or 0.0) - t0
                left = [Fault(f.kind, f.target, round(f.at - shift, 1), f.at_step) for f in left
                        if f.at_step is None and f.at - shift > 0.5]
            inject = ",".join(f.inject() for f in left)
            res["inject"] = res["inject"] or inject or None
            n_before = len(nodes)
            procs = launch(run_dir, inject)
            last = nodes[n_before:]
            both_gone: float | None = None
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    res["error"] = f"not done within {a.timeout:.0f} s"
                    break
                if both_gone is None and all(p.poll() is not None for p in procs[:2]):
                    both_gone = time.monotonic()
                if both_gone is not None and time.monotonic() - both_gone > SPARE_GRACE_S:
                    # a and b are gone and the spare is not: it started after the job had stopped (a node lost
                    # before it joined) and waits out the rendezvous' join timeout, as a late torchrun node does
                    print(f"  the spare outlived both nodes by {SPARE_GRACE_S:g} s: ended", file=sys.stderr, flush=True)
                    break
                time.sleep(0.1)  # waiting for the agents to end; they never wait on the driver
            if res.get("t0_after_launch_s") is None:
                log.poll()
                st = log.of("start")
                res["t0_after_launch_s"] = (min(r["t"] for r in st) - t_launch) if st else None
            log.poll()
            if log.of("end") or res.get("error") or time.monotonic() > deadline:
                break
            for p in procs:  # the job stopped early: what a scheduler does, as for the baselines
                kill_session(p)
            res["requeues"] += 1
            print(f"  resilient-run exited before the job's end (exit {[p.returncode for p in procs]}): "
                  f"started again, as the baselines are", file=sys.stderr, flush=True)
    except TimeoutError as e:
        res["error"] = str(e)
    finally:
        for _, p in nodes:
            kill_session(p)
    res["wall_s"] = time.time() - t_launch
    log.poll()
    res["exit"] = {n: p.returncode for n, p in last}
    res["finished"] = bool(log.of("end"))
    starts = log.of("start")
    res["t0_after_launch_s"] = (min(r["t"] for r in starts) - t_launch) if starts else None
    res.update(progress(log))
    evs = [e for rd in res["run_dirs"] for e in events(rd)]
    named = {"kill": "kill-worker", "stop": "hang-worker"}  # a step fault is recorded by the worker, as its "how"
    res["injected"] = [{"fault": named.get(e.details.get("fault"), e.details.get("fault")),
                        "target": e.details.get("target"), "wall": e.wall}
                       for e in evs if e.kind.value == "fault_injected"]
    left = [asdict(f) for f in faults]
    for e in res["injected"]:  # a fault whose target was not running when it fell due is dropped by the agent
        m = next((f for f in left if f["kind"] == e["fault"] and f["target"] == e["target"]), None)
        if m is not None:
            left.remove(m)
    res["skipped"] = left
    res["actions"] = [e.details.get("action") for e in evs if e.kind.value == "action"]

    def ledger(run_dir: Path) -> dict[str, Any]:
        try:
            rep = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(run_dir), "--json"],
                                 capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO)
            j = json.loads(rep.stdout) if rep.returncode == 0 else None
            return {k: j.get(k) for k in ("goodput", "wall_seconds", "productive_seconds", "badput_seconds",
                                          "disruptions", "restarts", "last_step")} if j else \
                {"error": (rep.stderr or rep.stdout).strip()[-500:]}
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            return {"error": str(e)}

    res["ledger"] = ledger(res["run_dirs"][0])  # the first launch's ledger; each requeue has its own below
    if len(res["run_dirs"]) > 1:
        res["ledger_requeues"] = [ledger(rd) for rd in res["run_dirs"][1:]]
    res["run_dirs"] = [str(rd.relative_to(d)) for rd in res["run_dirs"]]
    if not res["finished"]:
        res["log_tail"] = (d / "a.log").read_text(errors="replace")[-3000:] if (d / "a.log").exists() else ""
    res["_log"] = log
    return res


# ----------------------------------------------------------------------------------------------- main
def run_one(name: str, wd: Path, tag: str, job: Path, job_args: list[str], faults: list[Fault], every: int,
            a: argparse.Namespace, spare: bool = True) -> dict[str, Any]:
    d = wd / f"{name}-{tag}"
    d.mkdir(parents=True)
    load = os.getloadavg()[0]
    if name == "resilient-run":
        r = run_resilient(d, job, job_args, faults, a, spare=spare and not a.no_spare)
    else:
        r = run_baseline(name, d, job, job_args, faults, every, a)
    r["load1_at_start"], r["load1_at_end"] = load, os.getloadavg()[0]
    print(f"  {tag:<6} {name:<14} finished={r['finished']!s:<5} wall={r['wall_s']:.1f}s steps={r['steps_done']} "
          f"faults={len(r.get('injected', []))} load={load:.1f}" + (f" error={r['error']}" if r.get("error") else ""),
          file=sys.stderr, flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI: a tiny job, one worker kill per launcher, no clean runs")
    ap.add_argument("--minutes", type=float, default=10.0, help="fault-free training time of the job (full mode)")
    ap.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--pg-timeout", type=float, default=30.0,
                    help="collective timeout of the job's process group, every launcher (gloo's default: 1800 s)")
    ap.add_argument("--max-restarts", type=int, default=100)
    ap.add_argument("--stall", type=float, default=150.0,
                    help="a baseline job that writes nothing for this long is stuck: killed and started again "
                         "(longer than --pg-timeout plus torchrun's 30 s SIGTERM grace plus a restart)")
    ap.add_argument("--step-sleep", type=float, default=0.2,
                    help="the recipe's --step-sleep in full mode: seconds a step waits, standing in for a bigger model")
    ap.add_argument("--no-spare", action="store_true", help="resilient-run without the spare node")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a run may take (default: 4x its length)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "goodput.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, ledgers) and print its path")
    a = ap.parse_args()
    names = [n for n in a.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    nums = (a.minutes, a.mtbf, a.pg_timeout, a.stall) + ((a.timeout,) if a.timeout is not None else ())
    if bad or not names or not all(math.isfinite(v) and v > 0 for v in nums) or a.max_restarts < 1:
        what = f"unknown configuration(s) {bad}: choose from {','.join(CONFIGS)}" if bad or not names else \
            "--minutes, --mtbf, --pg-timeout, --stall and --timeout must be finite positive seconds, --max-restarts >= 1"
        print(f"goodput.py: {what}", file=sys.stderr)
        return 2
    if "ft_launcher" in names and not (BIN / "ft_launcher").exists():
        print("goodput.py: ft_launcher is not installed (pip install nvidia-resiliency-ext); "
              "leave it out with --configs", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="goodput-")
    wd = Path(tmp)
    if a.keep:
        print(f"work directory: {wd}", file=sys.stderr)
    job = wd / "job.py"
    job.write_text(JOB)
    results: dict[str, Any] = {}
    clean: dict[str, dict] = {}
    try:
        if a.quick:
            model = ["--n-layer", "1", "--d-model", "32", "--global-batch", "4", "--micro-batch", "2",
                     "--step-sleep", "0.05", "--log-every", "1000"]
            steps, every, delta, step0 = 40, 10, None, None
            faults = [Fault("kill-worker", 1, 0.0, at_step=15)]
            a.timeout = a.timeout or 300.0
            a.no_spare = True  # one worker kill: the spare would only add its start-up to a one-minute check
            # no hang is injected here, so a minute of silence is a stuck restart (torchrun's gloo restarts still
            # hang now and then with the workaround): started again sooner than in the full mode
            a.stall = min(a.stall, 45.0)
        else:
            model = ["--step-sleep", str(a.step_sleep), "--log-every", "1000"]
            # a fault-free run under torchrun: the step time sizes the job, the save cost sets N (Young/Daly)
            probe_every = 5
            a.timeout = a.timeout or 600.0

            def measure_clean(n: str) -> None:
                # resilient-run without its spare here: on a real cluster the spare is another machine, here its
                # warm-up (importing torch) would take the two cores from the steps being timed
                r = run_one(n, wd, "clean", job, [*model, "--steps", "60"], [], probe_every, a, spare=False)
                clean[n] = {**step_stats(r.pop("_log"), skip=5), "wall_s": r["wall_s"], "finished": r["finished"],
                            "startup_s": r["t0_after_launch_s"], "load1_at_start": r["load1_at_start"]}

            measure_clean(names[0])  # torchrun's, when it runs: it sets the job's length and its interval
            base = clean[names[0]]
            step0 = base["plain_step_s"] or base["clean_step_s"]
            if step0 is None:
                print("goodput.py: the fault-free run recorded no steps; see --keep", file=sys.stderr)
                return 1
            delta = max(base.get("save_blocking_s") or 0.0, base.get("dcp_save_s") or 0.0, 1e-3)
            every = max(1, round(young_daly(delta, a.mtbf) / step0))
            steps = max(20, round(a.minutes * 60.0 / step0))
            n_faults = max(3, round(a.minutes * 60.0 / a.mtbf))
            faults = fault_schedule(a.seed, n_faults, 0.85 * a.minutes * 60.0, a.mtbf)
            a.timeout = max(a.timeout, 4.0 * a.minutes * 60.0)
            print(f"clean step {step0:.3f} s, dcp.save blocks {delta:.3f} s → every {every} steps (Young/Daly, "
                  f"MTBF {a.mtbf:g} s); {steps} steps; faults: {', '.join(f.inject() for f in faults)}",
                  file=sys.stderr, flush=True)
        job_args = [*model, "--steps", str(steps)]
        for n in names:
            if not a.quick and n not in clean:
                measure_clean(n)  # just before its faulted run: the machine's load drifts over a long benchmark
            r = run_one(n, wd, "faults", job, job_args, faults, every, a)
            log = r.pop("_log")
            r["faulted_median_step_s"] = step_stats(log, skip=5)["clean_step_s"]
            if a.quick:  # no clean runs: the faulted run's median step stands in for it
                clean[n] = {**step_stats(log, skip=3), "from": "the faulted run (quick mode)"}
            # the fault-free run's median step, or the faulted run's own median when the machine was less loaded
            # then: never a step time longer than the launcher showed under faults (goodput above 1 otherwise)
            cs = min(v for v in (clean[n]["clean_step_s"], r["faulted_median_step_s"]) if v) \
                if clean[n]["clean_step_s"] or r["faulted_median_step_s"] else None
            r["clean_step_s"] = cs
            r["useful_steps"] = steps if r["finished"] else r["steps_done"]
            r["goodput"] = (r["useful_steps"] * cs / r["wall_s"]) if cs and r["wall_s"] > 0 else None
            results[n] = r
        ref = (results.get("torchrun") or {}).get("clean_step_s")
        for r in results.values():  # one yardstick for all: torchrun's clean step (a launcher's own could hide a slower step)
            r["goodput_at_torchrun_step"] = (r["useful_steps"] * ref / r["wall_s"]) if ref and r["wall_s"] > 0 else None
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    base = results.get("torchrun", {}).get("goodput")
    for r in results.values():
        r["ratio_to_torchrun"] = (r["goodput"] / base) if r.get("goodput") and base else None
    print_table(results, a)
    for r in results.values():
        if r.get("finished"):
            r.pop("log_tail", None)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "mode": "quick" if a.quick else "full", "results": results, "clean": clean, "steps": steps,
        "ckpt_every_steps_baselines": every, "dcp_save_blocking_s": delta, "clean_step_s_torchrun": step0,
        "mtbf_s": a.mtbf, "seed": a.seed, "faults": [asdict(f) for f in faults], "pg_timeout_s": a.pg_timeout,
        "max_restarts": a.max_restarts, "persistent_tier": "a local directory (file://), the same for all three",
        "baselines_node_loss": "one node: launcher and both workers SIGKILLed, the same command started again at once",
        "goal": "resilient-run goodput >= 0.95 and >= 1.3x torchrun",
        "goal_met": bool(results.get("resilient-run", {}).get("goodput") and
                         results["resilient-run"]["goodput"] >= 0.95 and
                         (results["resilient-run"].get("ratio_to_torchrun") or 0) >= 1.3),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
        "command": "python bench/goodput.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    print(f"\nwrote {a.out}")
    return 0


def print_table(results: dict[str, dict], a: argparse.Namespace) -> None:
    fmt = lambda v, p=3: f"{v:.{p}f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
    print(f"\ngoodput = useful steps x clean step time / wall time ({'quick' if a.quick else 'full'} mode, "
          f"MTBF {a.mtbf:g} s, seed {a.seed})")
    print(f"{'launcher':<15}{'goodput':>9}{'÷ torchrun':>12}{'ledger':>9}{'at tr step':>12}{'steps':>7}{'redone':>8}"
          f"{'wall s':>9}{'startup s':>11}{'clean step s':>14}{'faults':>8}{'late':>6}{'skipped':>9}{'requeues':>10}")
    for n, r in results.items():
        ledger = (r.get("ledger") or {}).get("goodput")
        print(f"{n:<15}{fmt(r.get('goodput')):>9}{fmt(r.get('ratio_to_torchrun'), 2):>12}{fmt(ledger):>9}"
              f"{fmt(r.get('goodput_at_torchrun_step')):>12}{r.get('useful_steps', 0):>7}{r.get('steps_redone', 0):>8}"
              f"{fmt(r['wall_s'], 1):>9}{fmt(r.get('t0_after_launch_s'), 1):>11}{fmt(r.get('clean_step_s'), 4):>14}"
              f"{len(r.get('injected', [])):>8}{r.get('deferred', '-'):>6}{len(r.get('skipped', [])):>9}"
              f"{r.get('requeues', '-'):>10}")
    print("ledger: resilient-run's own figure (resilient goodput RUN_DIR --json); at tr step: goodput with torchrun's "
          "clean step time for every launcher; startup: launch to the first worker's start")


if __name__ == "__main__":
    sys.exit(main())
