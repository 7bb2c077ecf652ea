"""``make demo``: the recipe's GPT on 2 nodes and a warm spare, losing a worker, a hang and a node; then a second
node with no spare left (its replica dropped) and the node coming back (the replica added again).

What happens:
  1. ``resilient supervisor`` starts on its own (a CPU host in real life): it hosts the job's store, so no
     training node is special. Three ``resilient-run`` agents start on this machine at once, each a node: a
     session of its own (killing the session is losing the node) with its own local checkpoint tier,
     ``--nnodes 1:2 --nproc-per-node 1 --spare-nodes 1 --nodes-per-replica 1``: each node is a data-parallel
     replica, and the job may shrink to one. The supervisor gives the job's two places to the first two that
     join; the third waits as the warm spare (its fork server imports torch while the others train).
     They train ``recipes/pytorch/train.py`` (a byte-level GPT on the corpus shipped in the repository) with
     three checkpoint tiers: local (each node's own directory), peer (each node's shards replicated to the other
     node) and persistent (a ``file://`` directory; ``gs://`` on a GCS API server started on loopback with
     ``--gcs``);
  2. ``resilient-run --inject`` (targets drawn from ``--seed``) carries out three faults, each written to the
     ledger as ``fault_injected`` before it happens:
       * ``kill-worker``  a worker SIGKILLed            → exit seen, both nodes restart in place, restore
       * ``hang-worker``  a worker frozen with SIGSTOP  → heartbeat timeout, restart, restore
       * ``kill-node``    a node SIGKILLed whole (agent, fork server, worker; the demo deletes its local tier, a
                          lost disk) → its closed connection is seen at once, the spare is hot-swapped in and
                          restores the lost rank from the peer tier;
       * ``kill-node``    again, with no spare left → its replica is dropped (scale down): the job goes on with
                          one replica, the same global batch (twice the gradient accumulation), restored from
                          the peer tier;
     and once the replica is dropped the demo starts a fresh node for the lost one (``node back``): it joins
     as a spare and the supervisor adds it as a replica again at the next checkpoint (scale up);
     a line is printed for each fault, detection, action and restore as the ledger shows them, and a progress
     line every tenth of the run;
  3. at the end: a table of the faults (detection, action, what was restored from where, fault to first step
     after), the goodput report (``resilient goodput``; also RUN_DIR/goodput.json) and its timeline,
     RUN_DIR/goodput.png. RUN_DIR/demo.json keeps what the table shows.

SIGTERM, SIGHUP or Ctrl-C stop it cleanly: the agents and the supervisor get SIGTERM (then every session the demo
started is SIGKILLed), the GCS server is stopped, and no process the demo started is left behind.

    python examples/demo.py [--quick] [--gcs] [--seed 4] [--steps N] [--inject SPEC] [--run-dir runs/demo-...]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a fresh clone: the package is this repository
TRAIN = ROOT / "recipes" / "pytorch" / "train.py"
TERM_TIMEOUT = 10.0  # the agents' --term-timeout: how long their workers get after SIGTERM
SECRET_FILE = "job-secret"
BUCKET = "demo-bucket"

# Faults fall due in seconds after training started; the gaps leave each recovery time to finish on two busy
# cores before the next fault. The steps are enough that training outlasts the last fault even on an idle
# machine (a step is at least its --step-sleep), and few enough for the time box on a loaded one.
FULL = {"steps": 700, "inject": "kill-worker@10s,hang-worker@25s,kill-node@40s,kill-node@55s"}
QUICK = {"steps": 420, "inject": "kill-worker@5s,hang-worker@13s,kill-node@21s,kill-node@29s"}
STEP_SLEEP = 0.1  # seconds a step: stands in for a bigger model, and keeps the run's length predictable
HEARTBEAT_TIMEOUT = 3.0


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


_tails: dict[Path, object] = {}


def tail_events(ledger: Path, pos: int) -> tuple[int, list[dict]]:
    """The run's new events (every writer's file beside ``ledger``) since the last call; ``pos`` 0: from the start."""
    from resilient.events.follow import LedgerTail
    if pos == 0 or ledger not in _tails:
        _tails[ledger] = LedgerTail(ledger.parent)
    return pos + 1, [e.to_json() for e in _tails[ledger].read_new(None)]  # type: ignore[attr-defined]


class Node:
    """One ``resilient-run`` agent in a session of its own: killing the session is losing the node."""

    def __init__(self, name: str, proc: subprocess.Popen, local: Path, log: Path):
        self.name, self.proc, self.local, self.log = name, proc, local, log
        self.disk_deleted = False

    @property
    def ident(self) -> str:  # how the ledger names this node's agent (several agents share one host)
        return f"{socket.gethostname()}:{self.proc.pid}"


def _stop_nodes(nodes: list[Node]) -> None:
    """SIGTERM every live agent (they forward it to their workers), then SIGKILL every session the demo started
    and whatever is left in them: a worker whose agent died can outlive it, but not its session."""
    from tests._helpers.procs import stop_sessions

    stop_sessions([n.proc for n in nodes], grace=TERM_TIMEOUT + 15)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(pred, timeout: float, what: str, nodes: list[Node]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        gone = [n for n in nodes if n.proc.poll() is not None]
        if gone:
            raise RuntimeError(f"node {gone[0].name} exited with {gone[0].proc.returncode} while waiting for {what}; "
                               f"see {gone[0].log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)  # polling a socket or a file the agents append to


class _WarmWatch:
    """Whether a spare's fork server finished its imports: it then sleeps on its socket using no CPU."""

    QUIET = 1.0  # seconds of no CPU at all

    def __init__(self, node: Node):
        self.node, self.t0 = node, time.monotonic()
        self.wall: float | None = None  # when it was first seen warm
        self.seconds = 0.0
        self._last: tuple[float, float] | None = None  # (cpu seconds, since when)

    def check(self) -> bool:
        """True once, when the spare is first seen warm."""
        import psutil

        if self.wall is not None:
            return False
        try:
            from resilient.launcher.zygote import is_server_process

            kids = [c for c in psutil.Process(self.node.proc.pid).children() if is_server_process(c.pid)]
            if not kids:
                return False
            z, now = kids[0], time.monotonic()
            cpu = sum(z.cpu_times()[:2])
            if z.status() != psutil.STATUS_SLEEPING or self._last is None or cpu != self._last[0]:
                self._last = (cpu, now)
                return False
            if now - self._last[1] < self.QUIET:
                return False
        except psutil.Error:
            return False
        self.wall, self.seconds = time.time() - self.QUIET, now - self.QUIET - self.t0
        return True


_LOSS = re.compile(rb"\[train\] step (\d+) loss ([\d.]+)")


class Progress:
    """Turns the ledger's new lines into the demo's terminal lines: one per fault, detection, action and
    restore, and one every tenth of the run."""

    def __init__(self, nodes: list[Node], steps: int):
        self.nodes, self.steps = nodes, steps
        self.t0: float | None = None
        self.every = max(1, steps // 10)
        self.next_step = self.every
        self.open_fault: dict | None = None  # the fault whose recovery is being followed
        self.attempt = 0  # the newest attempt the ledger has shown
        self.faults: list[dict] = []  # one row per injected fault, for the summary
        self.newest: dict[str, int] = {}  # tier -> newest step done there
        self.loss: tuple[int, float] | None = None
        self.rank0: Node | None = None  # the node of group rank 0: its log has the recipe's loss lines
        self.spare: Node | None = None  # the node the supervisor left out of the first round
        self.warm_wall: float | None = None  # when the spare was first seen warm
        self._log_pos = 0
        self._trained = False
        self.want_node_back = False  # a replica was dropped: the demo brings a node back

    def name(self, ident: str | None) -> str:
        return next((n.name for n in self.nodes if n.ident == ident), ident or "?")

    def node_back(self, node: Node, wall: float) -> None:
        """The demo started a fresh agent for the lost node: a row of the fault table of its own."""
        row = {"fault": "node back", "kind": "node-back", "target": None, "node": node.name, "wall": wall,
               "attempt": self.attempt}
        self.faults.append(row)
        self.open_fault = row
        self.say(wall, f"NODE     {node.name} started for the lost node (a repaired machine): it joins as a spare")

    def say(self, wall: float, text: str) -> None:
        print(f"  +{wall - (self.t0 or wall):6.1f} s  {text}", flush=True)

    def _read_loss(self) -> None:
        """The recipe's rank 0 prints its loss; group rank 0 keeps its node throughout (the swap replaces group
        rank 1)."""
        if self.rank0 is None:
            return
        log = self.rank0.log
        try:
            with open(log, "rb") as f:
                f.seek(self._log_pos)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self._log_pos += end
        for m in _LOSS.finditer(data[:end]):
            self.loss = (int(m[1]), float(m[2]))

    def feed(self, e: dict) -> None:
        kind, d, wall = e["kind"], e.get("details") or {}, e["wall"]
        if self.t0 is None:
            self.t0 = wall
        if isinstance(e.get("attempt"), int):
            self.attempt = max(self.attempt, e["attempt"])
        f = self.open_fault
        if kind == "run_start":
            self.say(wall, f"node {self.name(e['node'])}: agent up")
        elif kind == "action" and d.get("action") == "start" and self.spare is None:
            members = (d.get("assignment") or {}).get("members") or []
            by_ident = {n.ident: n for n in self.nodes}
            self.rank0 = by_ident.get(members[0]) if members else None
            self.spare = next((n for n in self.nodes if n.ident not in members), None)
            placed = ", ".join(f"node {self.name(m)} group rank {i}" for i, m in enumerate(members))
            self.say(wall, f"supervisor: the job's places go to {placed}"
                           + (f"; node {self.spare.name} is the spare" if self.spare else ""))
        elif kind == "workers_ready" and not self._trained:
            self._trained = True
            self.say(wall, f"training: first step done on node {self.name(e['node'])}")
        elif kind == "fault_injected":
            row = {"fault": d.get("at"), "kind": d.get("fault"), "target": d.get("target"),
                   "node": self.name(e["node"]), "ident": e["node"], "wall": wall, "attempt": self.attempt}
            self.faults.append(row)
            self.open_fault = row
            what = {"kill-worker": f"SIGKILL rank {d.get('target')}", "hang-worker": f"SIGSTOP rank {d.get('target')} "
                    "(a hang: alive, silent)", "kill-node": "SIGKILL the whole node: agent, fork server, worker"}
            self.say(wall, f"FAULT    {d.get('at')} on node {self.name(e['node'])}: "
                           f"{what.get(d.get('fault'), d.get('fault'))}")
        elif kind == "worker_exit" and f and "detected" not in f:
            f.update(detected=kind, detect_s=wall - f["wall"])
            self.say(wall, f"detected rank {e.get('rank')} on node {self.name(e['node'])} exited "
                           f"({d.get('signal') or 'exit code ' + str(d.get('exit_code'))})")
        elif kind == "hang" and f and "detected" not in f:
            f.update(detected=kind, detect_s=wall - f["wall"])
            # the frozen rank's peers stop too (they wait for it in the next all-reduce): whichever node's
            # heartbeat timeout expires first reports the hang
            self.say(wall, f"detected a hang: rank {e.get('rank')} on node {self.name(e['node'])} sent no heartbeat "
                           f"for {float(d.get('last_heartbeat_age') or 0):.1f} s (timeout {d.get('timeout')} s)")
        elif kind == "agent_lost":
            if f and "detected" not in f:
                f.update(detected=kind, detect_s=wall - f["wall"])
            self.say(wall, f"detected node {self.name(e['node'])} lost ({d.get('reason')})")
        elif kind == "node_joined" and f and f["kind"] == "node-back" and "detected" not in f:
            f.update(detected=kind, detect_s=wall - f["wall"])
            self.say(wall, f"node {self.name(e['node'])} joined as a spare")
        elif kind == "action" and d.get("action") not in ("start", "ignore"):
            # a lost node is answered by the decision on its loss: a survivor's worker, cut off from it, may exit
            # (and be restarted) a few milliseconds before the supervisor hears that the node is gone
            answers = f is not None and (f["kind"] != "kill-node" or (
                d.get("cause") == "agent_lost" and d.get("cause_node") == f.get("ident")))
            if f and "action" not in f and answers:
                f["action"] = d.get("action")
                f["into"] = [(d.get("action_args") or {}).get("spare")] if d.get("action") == "hot_swap" else None
            if d.get("action") == "hot_swap" and self.rank0 is not None and self.spare is not None and \
                    (d.get("action_args") or {}).get("node") == self.rank0.ident:
                self.rank0, self._log_pos = self.spare, 0  # the spare took group rank 0: the loss is in its log
            members = (d.get("assignment") or {}).get("members") or []
            first = next((n for n in self.nodes if members and n.ident == members[0]), None)
            if first is not None and first is not self.rank0:
                self.rank0, self._log_pos = first, 0  # group rank 0 moved (a replica dropped or added)
            if d.get("action") == "scale_down":
                self.want_node_back = True
            self.say(wall, f"ACTION   supervisor: {d.get('action')} ({d.get('reason')})")
        elif kind == "ckpt_restore":
            src = "+".join(d.get("sources") or [d.get("tier") or "?"])
            # the restore that matters is the hit rank's; for a node loss, the lost rank's on the spare
            # a scale-down or scale-up restores every rank: the first one seen stands for them
            mine = f is not None and (e["node"] in f["into"] if f.get("into") else True if f["kind"] in (
                "kill-node", "node-back") else e.get("rank") == f["target"])
            if f and "restored_from" not in f and wall > f["wall"] and mine:
                f.update(restored_from=src, restored_tier=d.get("tier"), restored_step=d.get("step"),
                         restored_rank=e.get("rank"), restored_node=self.name(e["node"]))
            self.say(wall, f"restored rank {e.get('rank')} on node {self.name(e['node'])}: step {d.get('step')} from "
                           f"{src} ({float(d.get('bytes') or 0) / 2**20:.1f} MiB in {float(d.get('seconds') or 0):.2f} s)")
        elif kind == "ckpt_tier_failed":
            why = re.sub(r"\[/[^\]]*\]\s*", "", str(d.get("error") or "")).split(". ")[0]  # no source paths
            self.say(wall, f"checkpoint step {d.get('step')} not complete on the {d.get('tier')} tier (rank "
                           f"{e.get('rank')}: {why[:100]}); a restore takes only complete steps")
        elif kind == "ckpt_tier_done":
            self.newest[d.get("tier", "?")] = max(self.newest.get(d.get("tier", "?"), -1), int(d.get("step", -1)))
        elif kind == "step":
            step = int(d.get("step", 0))
            # training again = a step of a later attempt (a survivor's step in flight at the fault is not)
            if f and "first_step_s" not in f and "action" in f and (e.get("attempt") or 0) > f["attempt"]:
                f.update(first_step_s=wall - f["wall"], first_step=step)
                self.say(wall, f"training again at step {step}, {wall - f['wall']:.2f} s after the fault")
                self.open_fault = None
            if step >= self.next_step:
                self.next_step = (step // self.every + 1) * self.every
                self._read_loss()
                loss = f" · loss {self.loss[1]:.3f} (step {self.loss[0]})" if self.loss else ""
                tiers = ", ".join(f"{t} {s}" for t, s in sorted(self.newest.items()))
                self.say(wall, f"step {step}/{self.steps} · {float(d.get('seconds') or 0) * 1000:.0f} ms/step{loss}"
                               + (f" · checkpoints: {tiers}" if tiers else ""))
        elif kind == "run_end":
            self.say(wall, f"node {self.name(e['node'])} ended: {d.get('reason')} (exit {d.get('exit_code')})")


def agent_cmd(args: argparse.Namespace, run_dir: Path, port: int, local: Path, persistent: str) -> list[str]:
    return [sys.executable, "-m", "resilient.run", "--nnodes", "1:2", "--nproc-per-node", "1", "--spare-nodes", "1",
            "--nodes-per-replica", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "demo",
            # the supervisor hosts the store: an agent started before it listens must wait for it, not host one
            "--rdzv-conf", "is_host=false", "--job-secret-file", str(run_dir / SECRET_FILE),
            "--local-addr", "127.0.0.1", "--max-restarts", "8", "--run-dir", str(run_dir),
            # a killed node's closed connection is seen at once whatever this says; it only bounds how long an
            # agent may stay silent, and one whose fork server imports torch on two busy cores can be for 10 s
            "--node-timeout", "30", "--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT:g}",
            "--ckpt-local", str(local), "--ckpt-persistent", persistent, "--ckpt-interval", "10",
            "--ckpt-persistent-every", "5", "--term-timeout", f"{TERM_TIMEOUT:g}",
            "--inject", args.inject, "--inject-seed", str(args.seed),
            str(TRAIN), "--steps", str(args.steps), "--step-sleep", f"{STEP_SLEEP:g}", "--log-every", "10"]


def supervisor_cmd(run_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "resilient.cli", "supervisor", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--nnodes", "1:2", "--nproc-per-node", "1", "--spare-nodes", "1", "--nodes-per-replica", "1",
            "--max-restarts", "8", "--node-timeout", "30",
            # the job forms as soon as MAX (2) have joined; with MIN 1 a last call of 0 would start it on the
            # first node to join
            "--last-call-timeout", "60", "--advertise-addr", "127.0.0.1",
            "--job-secret-file", str(run_dir / SECRET_FILE), "--run-dir", str(run_dir)]


def run_job(run_dir: Path, env: dict[str, str], args: argparse.Namespace, persistent: str,
            procs: list[Node]) -> tuple[Progress, Node]:
    """Start the supervisor and the three nodes, follow the ledger until every agent has exited. ``procs`` is
    filled as they start, so that the caller can stop every session on any exit."""
    from tests._helpers.gcs import free_port

    env = dict(env, OMP_NUM_THREADS="1")  # three single-worker nodes share two cores
    for k in [k for k in env if k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_"))]:
        del env[k]  # a variable left by an outer run would reconfigure these agents
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    secret = run_dir / SECRET_FILE  # signs the messages between agents and supervisor
    secret.touch(mode=0o600)
    secret.write_text(secrets.token_hex(32))
    port = free_port()
    ledger = run_dir / "events.jsonl"
    agents: list[Node] = []
    progress = Progress(agents, args.steps)

    def start(name: str, cmd: list[str], local: Path) -> Node:
        log = run_dir / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node = Node(name, proc, local, log)
        procs.append(node)
        return node

    # The supervisor on its own (a CPU host in real life) hosts the store: no training node is special, and
    # losing the node of group rank 0 is like losing any other.
    cmd = supervisor_cmd(run_dir, port)
    print("$ resilient " + " ".join(cmd[3:]), flush=True)
    sup = start("supervisor", cmd, run_dir / "none")
    print(f"  supervisor started (pid {sup.proc.pid}, a session of its own, log {sup.log.name})", flush=True)
    # All three nodes at once, as a job scheduler starts them: the supervisor gives the job's two places to the
    # first two that join, and the third waits as the spare (its fork server imports torch meanwhile, so it is
    # warm when a node is lost). Agents reach the store once the supervisor listens: its clients retry until then.
    for name in ("a", "b", "c"):
        local = run_dir / f"ckpt-local-{name}"
        cmd = agent_cmd(args, run_dir, port, local, persistent)
        if not agents:
            print("$ resilient-run " + " ".join(cmd[3:]), flush=True)
        node = start(name, cmd, local)
        agents.append(node)
        print(f"  node {name} started (agent pid {node.proc.pid}, a session of its own, local tier {local.name}, "
              f"log {node.log.name})", flush=True)
    warm: _WarmWatch | None = None
    pos = 0
    deadline = time.monotonic() + args.timeout
    while [n.proc.poll() for n in agents].count(None):  # every node polled: the lost one is seen at once
        for n in agents:
            if n.proc.returncode == -signal.SIGKILL and not n.disk_deleted:
                shutil.rmtree(n.local, ignore_errors=True)  # a lost node's disk is lost with it
                n.disk_deleted = True
                progress.say(time.time(), f"node {n.name} is gone; the demo deleted its local tier {n.local.name} "
                                          "(a lost disk)")
            elif n.proc.returncode is not None and progress.spare is None:
                raise RuntimeError(f"node {n.name} exited with {n.proc.returncode} before training started; "
                                   f"see {n.log}")
        if sup.proc.poll() is not None and progress.spare is None:
            raise RuntimeError(f"the supervisor exited with {sup.proc.returncode} before training started; see "
                               f"{sup.log}")
        if warm is None and progress.spare is not None:
            warm = _WarmWatch(progress.spare)
        if warm is not None and warm.check():
            progress.say(time.time(), f"the spare, node {progress.spare.name}, is warm: its fork server imported "
                                      "torch and idles")
        pos, evs = tail_events(ledger, pos)
        for e in evs:
            progress.feed(e)
        if progress.want_node_back and progress.open_fault is None and not any(n.name == "d" for n in agents):
            # the repaired machine: a fresh agent (empty local tier) for the node whose replica was dropped, once
            # the job trains with one replica fewer (that row of the table is complete)
            local = run_dir / "ckpt-local-d"
            node = start("d", agent_cmd(args, run_dir, port, local, persistent), local)
            agents.append(node)
            print(f"  node d started (agent pid {node.proc.pid}, a session of its own, local tier {local.name}, "
                  f"log {node.log.name})", flush=True)
            progress.node_back(node, time.time())
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run did not finish within {args.timeout:.0f}s (--timeout); stopping it")
        time.sleep(0.05)  # polling files the agents append to; they never wait on us
    try:
        sup.proc.wait(30)  # it ends with the job: every place reported done
    except subprocess.TimeoutExpired:
        pass
    pos, evs = tail_events(ledger, pos)
    for e in evs:
        progress.feed(e)
    progress.warm_wall = warm.wall if warm is not None else None
    return progress, sup


def _secs(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f} s"


def summarize(run_dir: Path, args: argparse.Namespace, nodes: list[Node], progress: Progress) -> int:
    """The faults as the ledger tells them, the goodput report and its timeline. 0 when every fault was handled
    as expected: each one injected, detected and followed by training again; the node loss by a hot swap and a
    restore of the lost rank on the spare; a second one by a scale-down and the node back by a scale-up; the
    supervisor and every node but the lost ones ended with 0."""
    codes = {n.name: n.proc.returncode for n in nodes}
    print("\nexited: " + ", ".join(f"{'' if k == 'supervisor' else 'node '}{k} "
                                   f"{'SIGKILL' if c == -signal.SIGKILL else 'still running' if c is None else c}"
                                   for k, c in codes.items()), flush=True)
    _, evs = tail_events(run_dir / "events.jsonl", 0)
    swap = next((e for e in evs if e["kind"] == "action" and e["details"].get("action") == "hot_swap"), None)
    scaled = {a: [e for e in evs if e["kind"] == "action" and e["details"].get("action") == a]
              for a in ("scale_down", "scale_up")}
    benched = [e["details"] for e in evs if e["kind"] == "node_benched"]
    print("\nthe faults, from the ledger (times from each fault):")
    rows = [("fault", "node", "detected by", "after", "action", "restored", "training again")]
    for f in progress.faults:
        restored = (f"rank {f['restored_rank']} on {f['restored_node']}: step {f['restored_step']} from "
                    f"{f['restored_from']}" if "restored_from" in f else "–")
        rows.append((f["fault"] or "?", f["node"], f.get("detected", "–"), _secs(f.get("detect_s")),
                     f.get("action", "–"), restored, _secs(f.get("first_step_s"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.rjust(w) if i in (3, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    node_loss = next((f for f in progress.faults if f["kind"] == "kill-node"), None)
    if node_loss is not None:
        warm = progress.warm_wall is not None and progress.warm_wall <= node_loss["wall"]
        print("  the spare was " + ("warm at the node loss (its fork server had imported torch)" if warm
                                    else "still importing torch at the node loss (a cold swap)"))
        if "first_step_s" in node_loss:
            print(f"  node kill → first step after the swap: {node_loss['first_step_s']:.2f} s")
    drop = next((f for f in progress.faults if f.get("action") == "scale_down"), None)
    if drop is not None and "first_step_s" in drop:
        print(f"  node kill with no spare → first step with one replica fewer: {drop['first_step_s']:.2f} s")
    back = next((f for f in progress.faults if f["kind"] == "node-back"), None)
    if back is not None and "first_step_s" in back:
        print(f"  node back → first step with the replica added again: {back['first_step_s']:.2f} s")
    expected = {f.kind.value for f in args.faults}
    kinds = {f["kind"] for f in progress.faults}
    lost = {n.name for n in nodes if n.proc.returncode == -signal.SIGKILL}
    problems = []
    if not expected <= kinds:
        problems.append(f"faults never injected: {', '.join(sorted(expected - kinds))} (did training end first? "
                        "give more --steps)")
    for f in progress.faults:
        if "first_step_s" not in f:
            problems.append(f"{f['fault']}: no training step after it")
    if "kill-node" in expected and swap is None:
        problems.append("no hot swap to the spare")
    if sum(f.kind.value == "kill-node" for f in args.faults) >= 2:
        if not scaled["scale_down"]:
            problems.append("no replica dropped (scale down) after the node loss with no spare left")
        if not scaled["scale_up"]:
            problems.append("the node that came back was not added as a replica (no scale up); give more --steps")
    if node_loss is not None and node_loss.get("restored_tier") not in ("local", "peer", "persistent"):
        problems.append("the lost rank was not restored on the spare")
    bad = {k: c for k, c in codes.items() if k not in lost and c != 0}
    if bad:
        problems.append("agents ended with " + ", ".join(f"{k} {c}" for k, c in bad.items()))
    (run_dir / "demo.json").write_text(json.dumps({
        "inject": args.inject, "seed": args.seed, "steps": args.steps, "exit_codes": codes,
        "faults": [{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items() if k != "wall"}
                   for f in progress.faults],
        "hot_swap": {"lost": progress.name(swap["details"]["action_args"].get("node")),
                     "spare": progress.name(swap["details"]["action_args"].get("spare"))} if swap else None,
        "scale_down": [d["details"].get("reason") for d in scaled["scale_down"]],
        "scale_up": [d["details"].get("reason") for d in scaled["scale_up"]],
        "benched": [progress.name(b.get("node")) for b in benched],
        "problems": problems}, indent=2) + "\n")
    print(flush=True)
    cli = [sys.executable, "-m", "resilient.cli", "goodput", str(run_dir)]
    subprocess.run(cli + ["--plot", str(run_dir / "goodput.png")], check=False, cwd=ROOT)
    try:
        from resilient.goodput.calculator import report_for_run

        (run_dir / "goodput.json").write_text(json.dumps(report_for_run(run_dir).to_json(), indent=2) + "\n")
    except Exception as e:  # noqa: BLE001 - the table above already told the user; the file is an extra
        print(f"demo: could not write goodput.json: {e}", file=sys.stderr)
    print(f"\nrun directory: {run_dir}\n  ledger: events.jsonl · timeline: goodput.png · report: goodput.json, "
          f"demo.json · logs: " + ", ".join(n.log.name for n in nodes), flush=True)
    for p in problems:
        print(f"demo: {p}; see the agents' logs in {run_dir}", file=sys.stderr)
    return 1 if problems else 0


def _bad(message: str) -> int:
    """Bad input: one line saying what is wrong and what to do, exit code 2, nothing started."""
    print(f"demo: {message}", file=sys.stderr)
    return 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a shorter run ({QUICK['steps']} steps, faults sooner)")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps (default {FULL['steps']})")
    ap.add_argument("--inject", default=None, help=f"the faults (default {FULL['inject']})")
    ap.add_argument("--seed", type=int, default=4,
                    help="--inject-seed: draws the targets the faults leave open (default 4: rank 0 killed, rank 1 "
                         "frozen, the node of group rank 0 lost)")
    ap.add_argument("--gcs", action="store_true",
                    help="persistent tier gs://demo-bucket on a GCS API server on loopback (default: a file:// "
                         "directory in the run directory)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the run may take before it is stopped")
    args = ap.parse_args()
    preset = QUICK if args.quick else FULL
    args.steps = preset["steps"] if args.steps is None else args.steps
    args.inject = preset["inject"] if args.inject is None else args.inject
    if args.steps < 1:
        return _bad(f"--steps must be at least 1, got {args.steps}")
    if not args.timeout > 0:
        return _bad(f"--timeout must be above 0 seconds, got {args.timeout}")
    from resilient.drill.spec import FaultSpecError, parse_inject

    try:
        args.faults = parse_inject(args.inject, args.seed, world_size=2, nnodes=2)
    except FaultSpecError as e:
        return _bad(f"{e}")
    # SIGUSR1 prints every thread's stack: where a demo that seems stuck is waiting
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # the default action of SIGTERM/SIGHUP ends this process at once and orphans the agents and the GCS server
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stopped)
    # Ctrl-C even when started with SIGINT ignored (a background job of a shell, or a parent that ignores it):
    # Python installs its own handler only over the default, and an ignored SIGINT would leave the demo running
    signal.signal(signal.SIGINT, signal.default_int_handler)

    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        return _bad(f"--run-dir {run_dir} is a file; give a directory for the run")
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / "events.jsonl").exists():  # only an earlier run's directory is ever deleted
            return _bad(f"--run-dir {run_dir} exists and holds no earlier run (no events.jsonl), so it is left alone; "
                        "give a new or empty directory")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)

    from tests._helpers.gcs import LocalGCS

    gcs = LocalGCS(run_dir / "gcs-data") if args.gcs else None
    nodes: list[Node] = []
    stopped: BaseException | None = None
    code = 1
    t_start = time.monotonic()
    try:
        env = dict(os.environ)
        if gcs is not None:
            gcs.start()
            gcs.make_bucket(BUCKET)
            env.update(gcs.env())
            persistent = f"gs://{BUCKET}/run"
        else:
            persistent = (run_dir / "persistent").as_uri()
        print(f"the recipe's GPT on 2 nodes x 1 worker (each a data-parallel replica) and a warm spare; tiers: local, "
              f"peer, persistent ({persistent}); "
              f"faults: {', '.join(f.describe() for f in args.faults)} (targets drawn with seed {args.seed})",
              flush=True)
        progress, _ = run_job(run_dir, env, args, persistent, nodes)
        code = summarize(run_dir, args, nodes, progress)
    except (_Stopped, KeyboardInterrupt) as e:
        stopped = e
        code = 128 + (e.signum if isinstance(e, _Stopped) else signal.SIGINT)
    except RuntimeError as e:  # the run could not go on (a node died early, a wait timed out)
        print(f"demo: {e}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        try:
            _stop_nodes(nodes)
        finally:
            if gcs is not None:
                gcs.stop()
    if stopped is not None:
        print(f"\ndemo: stopped by {stopped or 'SIGINT'}; the supervisor, the agents"
              f"{' and the GCS server' if gcs is not None else ''} were stopped", file=sys.stderr)
    else:
        print(f"demo: {time.monotonic() - t_start:.0f} s in all", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
