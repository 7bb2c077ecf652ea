"""Node-loss benchmark: how fast a job resumes after a whole node is lost, resilient-run against torchrun.

Several node agents run on this machine over one loopback rendezvous, each in its own session (so a node
is killed as a whole) with its own local checkpoint tier, one worker per node (``--nproc 2``: two), a deterministic
data-parallel job that checkpoints every step. Once the step-4 checkpoint is complete everywhere, the
workers pause at a gate; the bench SIGKILLs every process of node "b" (agent, fork server, workers),
deletes its local tier and opens the gate. Measured: from the kill to the end of the first training step
after training resumed (the latest rank to finish it; workers write wall-clock timestamps per step).

* ``hot-swap``: ``resilient-run --nnodes 2 --spare-nodes 1``, 2 active agents and 1 warm spare (the kill
  waits until the spare's fork server has finished importing torch, as a spare that has waited for a
  while has); the spare takes the lost node's group rank and restores its shards from a surviving tier.
  Opt-in ``hot-swap-cold``: the node is killed as soon as the spare has joined, before it is warm. The final model and
  optimizer are compared with an uninterrupted run (bit-exact or not).
* ``scale-down``: ``resilient-run --nnodes 1:2``, 2 agents, no spare: the job goes on with one node.
* ``torchrun``: the same script saving and loading with plain synchronous ``torch.distributed.checkpoint``
  to a shared directory (standing in for persistent storage), ``torchrun --nnodes 2`` with c10d rendezvous.
  The node loss makes the job fail; when the surviving agent has exited (or was killed after
  ``--give-up`` s: recorded as hung), the same command is run again on 2 agents and restores from the
  shared directory. The time includes the survivor giving up and the re-run's start.

``--lose host``: the node lost is the one hosting the rendezvous store (and, under resilient-run, the
supervisor): the first agent, which bound the endpoint. resilient-run's other active node takes the store and
the supervisor over (succession, no new job generation); torchrun's rendezvous dies with it. Without the flag,
the other active node is lost. Results go to bench/results/node_loss_host.json then.

Variants run interleaved over the repetitions, so machine noise hits all of them alike. The goal check is
"resumed within --node-timeout + 2 s"; a SIGKILLed node is seen at once (its agent's connection to the
supervisor closes), so the node timeout is only an upper bound on detection.

    python bench/node_loss.py [--reps 3] [--node-timeout 10] [--nproc 1] [--lose host]

Prints a table and writes bench/results/node_loss.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from resilient.events.api import EventKind  # noqa: E402
from resilient.events.ledger import read_events  # noqa: E402
from resilient.launcher.zygote import is_server_process  # noqa: E402
from tests._helpers.gcs import free_port  # noqa: E402
from tests._helpers.procs import kill_sessions, session_procs  # noqa: E402
from tests._helpers.wait import wait_for as _wait_for  # noqa: E402

STEPS = 8
GATE_STEP = 4
VARIANTS = ("hot-swap", "scale-down", "torchrun")
OPT_IN = ("hot-swap-cold",)  # the node is killed as soon as the spare has joined, its fork server still importing

# One script for every launcher. Its only argument is a JSON config file: the launchers parse abbreviations
# of their own flags among script arguments, so the script takes no flags of its own.
SCRIPT = r'''
import json, os, sys, time
T_START = time.time()
import torch
import torch.distributed as dist

cfg = json.load(open(sys.argv[1]))
out, mode = cfg["out"], cfg["mode"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(1234)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
log = open(os.path.join(out, f"steps-{os.getpid()}.jsonl"), "a")


def rec(event, **kw):
    log.write(json.dumps({"event": event, "pid": os.getpid(), "rank": rank, "world": world, "attempt": attempt,
                          **kw}) + "\n")
    log.flush()


rec("start", t=T_START)
if mode == "resilient":
    import resilient
    from resilient.checkpoint.manager import CheckpointManager

    ck = CheckpointManager.from_env(interval="1")
    state = {"model": model, "optim": optim}
    start = ck.restore(state)
    steps = resilient.steps(start, cfg["steps"])
else:  # plain DCP, synchronous, to a shared directory
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    shared = cfg["shared"]
    done = sorted(int(d.split("-")[1]) for d in os.listdir(shared)
                  if d.startswith("step-") and os.path.exists(os.path.join(shared, d, ".metadata")))
    start = 0
    if done:
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(shared, f"step-{done[-1]}"))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = done[-1] + 1
    steps = range(start, cfg["steps"])
rec("restored", t=time.time(), start=start)
for step in steps:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optim.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([gr.reshape(-1) for gr in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for gr in grads:
        gr.copy_(flat[off:off + gr.numel()].view_as(gr))
        off += gr.numel()
    optim.step()
    if mode == "resilient":
        ck.save(step, state)
    else:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(shared, f"step-{step}"))
    rec("step", step=step, t=time.time())
    if step == cfg["gate_step"]:
        if mode == "resilient":
            ck.wait()
        with open(os.path.join(cfg["gate"], f"at-{rank}"), "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(cfg["gate"], "go")) and time.monotonic() < deadline:
            time.sleep(0.01)
if mode == "resilient":
    ck.wait()
    ck.close()
torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, os.path.join(out, f"final-{rank}.pt"))
rec("end", t=time.time())
dist.barrier()
dist.destroy_process_group()
'''


# ------------------------------------------------------------------------------------------- helpers
class Timeout(Exception):
    pass


def wait_for(pred, timeout: float, what: str, poll: float = 0.02) -> None:
    try:
        _wait_for(pred, timeout, what, interval=poll)
    except AssertionError as e:
        raise Timeout(str(e)) from None


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def fork_server_idle(agent_pid: int, quiet: float = 1.0, timeout: float = 90.0) -> float:
    """Wait until the agent's fork server has finished its imports: it then sleeps on its socket using no
    CPU. A spare is warm only then; one killed into right after it joined would be measured cold.
    Returns the seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last: tuple[float, float] | None = None  # (cpu seconds, when first seen at that value)
    while time.monotonic() < deadline:
        try:
            kids = [c for c in psutil.Process(agent_pid).children() if is_server_process(c.pid)]
            if kids:
                z = kids[0]
                cpu = sum(z.cpu_times()[:2])
                now = time.monotonic()
                if z.status() != psutil.STATUS_SLEEPING or last is None or cpu != last[0]:
                    last = (cpu, now)
                elif now - last[1] >= quiet:
                    return now - t0
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)
    raise Timeout(f"timed out after {timeout:.0f}s waiting for the spare's fork server to finish its imports")


class Node:
    def __init__(self, name: str, proc: subprocess.Popen, local: Path | None, log: Path):
        self.name, self.proc, self.local, self.log = name, proc, local, log

    @property
    def ident(self) -> str:  # how the ledger names this node's agent
        return f"{socket.gethostname()}:{self.proc.pid}"

    def kill(self) -> float:
        """A lost node: every process of its session and its tree SIGKILLed at once, its local disk gone. Returns the
        wall time of the kill."""
        procs = session_procs(self.proc.pid, tree_of=[self.proc.pid])  # found first: the kill itself is timed
        t = time.time()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)
        if self.local is not None:
            shutil.rmtree(self.local, ignore_errors=True)
        return t

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""


class Job:
    """The agents of one repetition; ``close`` leaves no process of theirs behind."""

    def __init__(self, root: Path):
        self.root = root
        self.nodes: list[Node] = []

    def start(self, name: str, cmd: list[str], local: Path | None, env: dict[str, str] | None = None) -> Node:
        log = self.root / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(cmd, cwd=self.root, env=child_env(env), stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        n = Node(name, p, local, log)
        self.nodes.append(n)
        return n

    def close(self) -> int:
        """Kill every process of the repetition; return how many were still alive."""
        root = str(self.root)  # torchrun's workers are found by the repetition's directory on their command line
        n_alive = kill_sessions([n.proc for n in self.nodes], mark=root)
        still = {p.pid for p in session_procs(*(n.proc.pid for n in self.nodes), mark=root)}
        if still:
            print(f"  WARNING: {len(still)} process(es) survived SIGKILL: {sorted(still)}", file=sys.stderr)
        return n_alive


def records(out: Path) -> list[dict]:
    recs = []
    for f in out.glob("steps-*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by the SIGKILL
    return recs


def resumed(out: Path, t_kill: float) -> dict[str, Any]:
    """Phases of the recovery from the workers' own timestamps: only processes started after the kill count."""
    recs = records(out)
    new = {r["pid"] for r in recs if r["event"] == "start" and r["t"] > t_kill}
    post = [r for r in recs if r["pid"] in new]
    steps = [r for r in post if r["event"] == "step"]
    res: dict[str, Any] = {"resume_s": None}
    starts = [r["t"] for r in post if r["event"] == "start"]
    if starts:
        res["workers_started_s"] = min(starts) - t_kill
    restored = [r for r in post if r["event"] == "restored"]
    if restored:
        res["restored_s"] = max(r["t"] for r in restored) - t_kill
        res["restored_from_step"] = min(r["start"] for r in restored) - 1
    if steps:
        first = min(steps, key=lambda r: r["t"])
        s0, world = first["step"], first["world"]
        per_rank: dict[int, float] = {}
        for r in steps:
            if r["step"] == s0:
                per_rank[r["rank"]] = min(per_rank.get(r["rank"], float("inf")), r["t"])
        if len(per_rank) == world:
            res.update(resume_s=max(per_rank.values()) - t_kill, first_step=s0, world_after=world)
    return res


def same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def final_state(out: Path, world: int) -> list[dict] | None:
    import torch

    try:
        return [torch.load(out / f"final-{r}.pt", weights_only=False) for r in range(world)]
    except FileNotFoundError:
        return None


def write_cfg(d: Path, mode: str, shared: Path | None = None) -> Path:
    for sub in ("out", "gate"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    cfg = {"mode": mode, "out": str(d / "out"), "gate": str(d / "gate"), "gate_step": GATE_STEP, "steps": STEPS,
           "shared": str(shared) if shared else None}
    p = d / "cfg.json"
    p.write_text(json.dumps(cfg))
    return p


# ------------------------------------------------------------------------------------------ variants
def resilient_cmd(port: int, d: Path, local: Path, nnodes: str, extra: list[str], script: Path, cfg: Path,
                  node_timeout: float, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "resilient.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
            "--local-addr", "127.0.0.1", "--run-dir", str(d / "run"), "--ckpt-local", str(local),
            "--max-restarts", "3", "--node-timeout", str(node_timeout), *extra, str(script), str(cfg)]


def run_resilient(variant: str, d: Path, script: Path, a: argparse.Namespace, reference: list[dict] | None) -> dict:
    cfg = write_cfg(d, "resilient")
    out, gate, run_dir = d / "out", d / "gate", d / "run"
    port = free_port()
    hot = variant.startswith("hot-swap")
    nnodes, extra = ("2", ["--spare-nodes", "1"]) if hot else ("1:2", [])
    job = Job(d)
    res: dict[str, Any] = {"variant": variant, "ok": False, "lost": a.lose}
    # the agents' INFO line naming the succession they read: the kill waits until the successor knows the spare
    env = {"RESILIENT_LOG_LEVEL": "INFO"} if a.lose == "host" else None

    def events() -> list:
        try:
            return list(read_events(run_dir))
        except FileNotFoundError:
            return []

    def agent(name: str) -> Node:
        local = d / f"local-{name}"
        return job.start(name, resilient_cmd(port, d, local, nnodes, extra, script, cfg, a.node_timeout,
                                                 a.nproc), local, env)

    try:
        na = agent("a")
        wait_for(lambda: listening(port) or na.proc.poll() is not None, 60, "the first agent to host the store")
        nb = agent("b")
        wait_for(lambda: len({e.node for e in events() if e.kind == EventKind.ATTEMPT_START}) == 2
                 or na.proc.poll() is not None or nb.proc.poll() is not None, 90, "both nodes' workers to start")
        victim, survivor = (na, nb) if a.lose == "host" else (nb, na)
        survivors = [survivor]
        if hot:
            spare = agent("spare")
            wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == spare.ident for e in events()), 60,
                     "the spare to join")
            if variant == "hot-swap":
                res["spare_warm_wait_s"] = fork_server_idle(spare.proc.pid)
            survivors.append(spare)
            if a.lose == "host":
                wait_for(lambda: any("succession: " in line and spare.ident in line
                                     for line in survivor.log.read_text(errors="replace").splitlines()), 30,
                         "the successor to know the spare", poll=0.1)
        wait_for(lambda: all((gate / f"at-{r}").exists() for r in range(2 * a.nproc)), 90, "every rank at the gate")
        t_kill = victim.kill()
        (gate / "go").touch()
        wait_for(lambda: all(n.proc.poll() is not None for n in survivors), a.timeout, "the job to end", poll=0.1)
        res["exit"] = [n.proc.returncode for n in survivors]
        evs = events()
        res.update(resumed(out, t_kill))
        lost = [e for e in evs if e.kind == EventKind.AGENT_LOST and e.node == victim.ident]
        if lost:
            res["detected_s"] = lost[0].wall - t_kill
            res["lost_reason"] = lost[0].details.get("reason")
        acts = [e for e in evs if e.kind == EventKind.ACTION and e.wall > t_kill]
        res["actions"] = [e.details.get("action") for e in acts]
        if acts:
            res["decided_s"] = acts[0].wall - t_kill
        restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.wall > t_kill]
        res["restore_tiers"] = sorted({e.details.get("tier") for e in restores})
        if hot and reference is not None:
            got = final_state(out, 2 * a.nproc)
            res["bit_exact"] = got is not None and all(
                same(r["model"], g["model"]) and same(r["optim"], g["optim"]) for r, g in zip(reference, got))
        want = "hot_swap" if hot else "scale_down"
        res["ok"] = (all(c == 0 for c in res["exit"]) and res["resume_s"] is not None and want in res["actions"])
        taken = [e for e in evs if e.kind == EventKind.LOG and "succession" in e.details]
        if taken:
            res["taken_over_s"] = taken[0].wall - t_kill
        if not res["ok"]:
            res["log_tail"] = survivor.tail()
    except Timeout as e:
        res["error"] = str(e)
        res["log_tail"] = job.nodes[-1].tail() if job.nodes else ""
    finally:
        res["left_behind"] = job.close()
    return res


def torchrun_cmd(port: int, script: Path, cfg: Path, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
            "--local-addr", "127.0.0.1", str(script), str(cfg)]


def run_torchrun(d: Path, script: Path, a: argparse.Namespace, reference: list[dict] | None) -> dict:
    shared = d / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    cfg = write_cfg(d, "dcp", shared)
    out, gate = d / "out", d / "gate"
    port = free_port()
    cmd = torchrun_cmd(port, script, cfg, a.nproc)
    job = Job(d)
    res: dict[str, Any] = {"variant": "torchrun", "ok": False, "survivor_hung": False, "lost": a.lose}
    try:
        na = job.start("a", cmd, None)
        wait_for(lambda: listening(port) or na.proc.poll() is not None, 60, "the first agent to host the store")
        nb = job.start("b", cmd, None)
        victim, survivor = (na, nb) if a.lose == "host" else (nb, na)
        wait_for(lambda: all((gate / f"at-{r}").exists() for r in range(2 * a.nproc)), 90, "every rank at the gate")
        t_kill = victim.kill()
        (gate / "go").touch()
        try:
            survivor.proc.wait(a.give_up)
        except subprocess.TimeoutExpired:
            res["survivor_hung"] = True
            kill_sessions([survivor.proc])
        t_rerun = time.time()
        res["survivor_exit"] = survivor.proc.returncode
        res["survivor_gave_up_s"] = t_rerun - t_kill
        # the same command again, both agents at once as a scheduler would; the c10d backend makes the one
        # that binds the port the store host and the other its client
        ra, rb = job.start("a2", cmd, None), job.start("b2", cmd, None)
        wait_for(lambda: ra.proc.poll() is not None and rb.proc.poll() is not None, a.timeout, "the re-run to end",
                 poll=0.1)
        res["exit"] = [ra.proc.returncode, rb.proc.returncode]
        res.update(resumed(out, t_kill))
        if reference is not None:
            got = final_state(out, 2 * a.nproc)
            res["bit_exact"] = got is not None and all(
                same(r["model"], g["model"]) and same(r["optim"], g["optim"]) for r, g in zip(reference, got))
        res["ok"] = all(c == 0 for c in res["exit"]) and res["resume_s"] is not None
        if not res["ok"]:
            res["log_tail"] = ra.tail()
    except Timeout as e:
        res["error"] = str(e)
        res["log_tail"] = job.nodes[0].tail() if job.nodes else ""
    finally:
        res["left_behind"] = job.close()
    return res


def run_reference(wd: Path, script: Path, timeout: float, nproc: int = 1) -> list[dict] | None:
    """The same job on 2 nodes' ranks, never interrupted: what a node loss must not change."""
    d = wd / "reference"
    d.mkdir()
    cfg = write_cfg(d, "resilient")
    (d / "gate" / "go").touch()
    job = Job(d)
    try:
        n = job.start("ref", [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", str(2 * nproc),
                              "--run-dir", str(d / "run"), "--ckpt-local", str(d / "local"), str(script), str(cfg)],
                      None)
        wait_for(lambda: n.proc.poll() is not None, timeout, "the reference run", poll=0.1)
        if n.proc.returncode != 0:
            print(f"reference run failed ({n.proc.returncode}):\n{n.tail()}", file=sys.stderr)
            return None
        return final_state(d / "out", 2 * nproc)
    except Timeout as e:
        print(f"reference run: {e}", file=sys.stderr)
        return None
    finally:
        job.close()


# ------------------------------------------------------------------------------------------------ main
def summarize(runs: list[dict], names: list[str], budget: float) -> dict:
    summary: dict[str, dict] = {}
    for n in names:
        rs = [r for r in runs if r["variant"] == n]
        times = [r["resume_s"] for r in rs if r.get("ok") and r.get("resume_s") is not None]
        s: dict[str, Any] = {
            "successes": sum(bool(r.get("ok")) for r in rs), "reps": len(rs),
            "median_resume_s": statistics.median(times) if times else None,
            "min_resume_s": min(times) if times else None, "max_resume_s": max(times) if times else None,
            "within_goal": sum(t <= budget for t in times),
            "left_behind": sum(r.get("left_behind", 0) for r in rs),
        }
        for phase in ("detected_s", "taken_over_s", "workers_started_s", "restored_s"):  # each from the kill
            v = [r[phase] for r in rs if r.get("ok") and r.get(phase) is not None]
            if v:
                s[f"median_{phase}"] = statistics.median(v)
        if n == "torchrun":
            s["survivor_hung"] = sum(r.get("survivor_hung", False) for r in rs)
            gave = [r["survivor_gave_up_s"] for r in rs if r.get("survivor_gave_up_s") is not None]
            s["median_survivor_gave_up_s"] = statistics.median(gave) if gave else None
        exact = [r["bit_exact"] for r in rs if "bit_exact" in r]
        if exact:
            s["bit_exact"] = sum(exact)
        summary[n] = s
    base = summary.get("torchrun", {}).get("median_resume_s")
    for s in summary.values():
        med = s["median_resume_s"]
        s["ratio_to_torchrun"] = (med / base) if med and base else None
    return summary


def print_table(summary: dict, budget: float, node_timeout: float, nproc: int = 1, lose: str = "node") -> None:
    fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    print(f"\n2 nodes x {nproc} worker(s); {'the node hosting the store' if lose == 'host' else 'a node'} lost (SIGKILL of agent + workers, local tier deleted) → end of the first step after resuming; "
          f"goal ≤ --node-timeout {node_timeout:g} + 2 = {budget:g} s")
    print(f"{'variant':<14}{'ok':>6}{'median s':>10}{'min–max s':>14}{'÷ torchrun':>12}{'≤ goal':>8}{'bit-exact':>11}"
          f"{'detect s':>10}{'workers s':>11}{'restored s':>12}")
    for n, s in summary.items():
        rng = f"{fmt(s['min_resume_s'])}–{fmt(s['max_resume_s'])}"
        ratio = f"{s['ratio_to_torchrun']:.3f}" if s["ratio_to_torchrun"] else "-"
        exact = f"{s['bit_exact']}/{s['reps']}" if "bit_exact" in s else "-"
        print(f"{n:<14}{s['successes']:>3}/{s['reps']:<2}{fmt(s['median_resume_s']):>10}{rng:>14}{ratio:>12}"
              f"{s['within_goal']:>5}/{s['reps']:<2}{exact:>11}{fmt(s.get('median_detected_s')):>10}"
              f"{fmt(s.get('median_workers_started_s')):>11}{fmt(s.get('median_restored_s')):>12}")
    t = summary.get("torchrun")
    if t:
        print(f"torchrun: the surviving agent gave up {fmt(t.get('median_survivor_gave_up_s'))} s after the kill "
              f"(median), hung {t.get('survivor_hung', 0)}/{t['reps']}; then the same command was run again")
    print("phases are medians from the kill: loss detected (ledger), first new worker started, last rank restored")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1,
                    help="workers per node (the job shape: 1, or 2 standing in for nodes of 8 GPUs)")
    ap.add_argument("--node-timeout", type=float, default=10.0, help="resilient-run --node-timeout (seconds)")
    ap.add_argument("--give-up", type=float, default=60.0,
                    help="seconds the surviving torchrun agent gets to exit after the kill before it counts as hung")
    ap.add_argument("--timeout", type=float, default=180.0, help="a run longer than this counts as a hang")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated; also {','.join(OPT_IN)}: the spare is lost into before it is warm")
    ap.add_argument("--lose", choices=("node", "host"), default="node",
                    help="host: lose the node hosting the rendezvous store (and the supervisor) instead of another")
    ap.add_argument("--out", default=None, help="default: bench/results/node_loss.json (node_loss_host.json with "
                                                "--lose host)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, ledgers) and print its path")
    a = ap.parse_args()
    if a.out is None:
        a.out = str(Path(__file__).parent / "results" / ("node_loss_host.json" if a.lose == "host" else "node_loss.json"))
    names = [n for n in a.variants.split(",") if n]
    bad = [n for n in names if n not in VARIANTS + OPT_IN]
    secs = (a.node_timeout, a.give_up, a.timeout)
    if bad or a.reps < 1 or a.nproc < 1 or not all(math.isfinite(v) and v > 0 for v in secs):
        what = f"unknown variant(s) {bad}: choose from {','.join(VARIANTS + OPT_IN)}" if bad else \
            "--reps and --nproc must be ≥ 1 and --node-timeout, --give-up, --timeout finite positive seconds"
        print(f"node_loss.py: {what}", file=sys.stderr)
        sys.exit(2)
    budget = a.node_timeout + 2.0
    load_before = os.getloadavg()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        wd = Path(tempfile.mkdtemp(prefix="node-loss-")) if a.keep else Path(tmp)
        if a.keep:
            print(f"work directory: {wd}", file=sys.stderr)
        script = wd / "train.py"
        script.write_text(SCRIPT)
        reference = run_reference(wd, script, a.timeout, a.nproc)
        for rep in range(a.reps):
            for n in names:
                d = wd / f"{n}-{rep}"
                d.mkdir()
                load = os.getloadavg()[0]
                r = run_torchrun(d, script, a, reference) if n == "torchrun" else \
                    run_resilient(n, d, script, a, reference)
                r.update(rep=rep, load1_at_start=load)
                runs.append(r)
                rs = r.get("resume_s")
                print(f"  rep {rep} {n:<11} ok={r['ok']!s:<5} resume={'-' if rs is None else f'{rs:.2f}'}s "
                      f"exact={r.get('bit_exact', '-')} left={r.get('left_behind')} load={load:.1f}"
                      + (f" error={r['error']}" if r.get("error") else ""), file=sys.stderr, flush=True)
    summary = summarize(runs, names, budget)
    print_table(summary, budget, a.node_timeout, a.nproc, a.lose)
    for r in runs:  # keep the JSON readable: logs only for failures, cut short
        if r.get("ok"):
            r.pop("log_tail", None)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "summary": summary, "runs": runs, "reps": a.reps, "node_timeout_s": a.node_timeout, "goal_s": budget,
        "give_up_s": a.give_up, "lost": a.lose, "steps": STEPS, "killed_after_step": GATE_STEP, "nproc_per_node": a.nproc,
        "reference_ok": reference is not None,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
        "command": "python bench/node_loss.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
