"""The main job: a real 2-worker training run under ``resilient-run`` with faults injected.

What happens (``make demo``):
  1. a real GCS API server starts on loopback (fake-gcs-server) as the persistent tier;
  2. ``resilient-run --standalone --nproc-per-node 2`` trains examples/train.py with a local tier,
     gs:// uploads, hang detection and up to 5 restarts;
  3. faults are injected from outside, driven by the run's own ledger:
       * rank 1 is SIGKILLed mid-run                    → exit detected, in-job restart, local restore
       * rank 0 is frozen with SIGSTOP                  → heartbeat timeout, restart, local restore
       * the local tier is wiped, then rank 0 SIGKILLed → restore falls back to the gs:// copy
  4. the goodput report is printed, the timeline drawn to RUN_DIR/goodput.png, the tiers listed.
Then a second act, a node lost and replaced by a warm spare (RUN_DIR/nodes):
  5. three ``resilient-run`` agents on this machine, each in its own session (a node = a session) with its own
     local tier: ``--nnodes 2 --nproc-per-node 1 --spare-nodes 1`` on one c10d endpoint over loopback; the
     first hosts the store and the supervisor, the second joins, the third joins as a spare as soon as the
     supervisor gave the first two the job's places (it warms up, torch imported, while they train);
  6. ``--inject kill-node:1@Ts``: the agent of group rank 1 SIGKILLs its whole node (agent, fork server,
     worker); the demo deletes that node's local tier once its agent is gone (a lost disk);
  7. the supervisor sees the closed connection, hot-swaps the spare in; the spare's rank restores its shards
     from the peer tier (the survivor holds them); both remaining agents end with exit 0;
  8. the ledger's fault, loss, swap and restore lines are printed, the time from the kill to the first step
     after the swap, and the goodput report of that run.

SIGTERM, SIGHUP or Ctrl-C stop it cleanly: the run(s) get SIGTERM (then SIGKILL, every session the demo
started), the GCS server is stopped, and no process the demo started is left behind.

    python examples/demo.py [--steps 400] [--node-steps 400] [--kill-at 10] [--run-dir runs/demo-...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TERM_TIMEOUT = 10.0  # the run's --term-timeout: how long its workers get after SIGTERM


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _descendants(keep: frozenset[int] = frozenset()) -> list:
    """This process's descendants, except ``keep`` (the GCS server, which outlives the first act)."""
    import psutil

    try:
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
    except psutil.Error:
        return []


def _stop_run(agent: subprocess.Popen, known: list, keep: frozenset[int] = frozenset()) -> None:
    """SIGTERM the run, SIGKILL it after its own grace, then anything it started that outlived it."""
    import psutil

    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(TERM_TIMEOUT + 15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)
    left = []
    for proc in known + _descendants(keep):
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                left.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)


def tail_steps(ledger: Path, pos: int) -> tuple[int, list[dict]]:
    """New complete lines of the ledger since byte ``pos``."""
    if not ledger.exists():
        return pos, []
    with open(ledger, "rb") as f:
        f.seek(pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    out = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return pos + end, out


class Node:
    """One ``resilient-run`` agent in a session of its own: killing the session is losing the node."""

    def __init__(self, name: str, proc: subprocess.Popen, local: Path, log: Path):
        self.name, self.proc, self.local, self.log = name, proc, local, log
        self.disk_deleted = False

    @property
    def ident(self) -> str:  # how the ledger names this node's agent (several agents share one host)
        return f"{socket.gethostname()}:{self.proc.pid}"


def _session_procs(sids: set[int]) -> list:
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) in sids and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def _stop_nodes(nodes: list[Node]) -> None:
    """SIGTERM every live agent (they forward it to their workers), then SIGKILL every session the demo started
    and whatever is left in them: a worker whose agent died can outlive it, but not its session."""
    import psutil

    live = [n for n in nodes if n.proc.poll() is None]
    for n in live:
        n.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERM_TIMEOUT + 15
    for n in live:
        try:
            n.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    sids = {n.proc.pid for n in nodes}
    for sid in sids:
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    left = _session_procs(sids)  # a process that left the session's process group is still in the session
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)
    for n in nodes:
        try:
            n.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def single_node_act(run_dir: Path, env: dict[str, str], args: argparse.Namespace, keep: frozenset[int]) -> int:
    """Act 1: one node, two workers, three faults injected from outside. Returns resilient-run's exit code;
    a stop signal is raised again once the run is stopped."""
    local = run_dir / "ckpt-local"
    env = dict(env)
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "5",
           "--run-dir", str(run_dir), "--ckpt-local", str(local), "--ckpt-persistent", "gs://demo-bucket/run",
           "--ckpt-interval", "25", "--ckpt-persistent-every", "2", "--heartbeat-timeout", "3", "--tee", "3",
           "--term-timeout", str(TERM_TIMEOUT),
           "--local-ranks-filter", "0", str(ROOT / "examples" / "train.py"), "--steps", str(args.steps),
           "--step-sleep", "0.03"]
    print("$ " + " ".join(cmd[2:]), flush=True)
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT)

    # (attempt, step at which to strike, what to do)
    third = args.steps // 4
    plan = [(0, third, "kill"), (1, 2 * third, "freeze"), (2, 3 * third, "wipe+kill")]
    pids: dict[int, dict[int, int]] = {}
    ledger = run_dir / "events.jsonl"
    pos = 0
    deadline = time.monotonic() + args.timeout
    known: list = []
    next_scan = 0.0
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        while agent.poll() is None:
            if time.monotonic() > deadline:
                print(f"demo: run did not finish within {args.timeout:.0f}s; stopping it", file=sys.stderr)
                agent.send_signal(signal.SIGTERM)
                agent.wait(60)
                break
            pos, events = tail_steps(ledger, pos)
            for ev in events:
                if ev["kind"] == "attempt_start":
                    pids[ev["attempt"]] = {int(r): p for r, p in ev["details"]["pids"].items()}
                if ev["kind"] != "step" or not plan:
                    continue
                attempt, at, what = plan[0]
                if ev["attempt"] == attempt and ev["details"]["step"] >= at and attempt in pids:
                    plan.pop(0)
                    if what == "kill":
                        print(f"\n>>> demo: SIGKILL rank 1 at step {ev['details']['step']}\n", flush=True)
                        os.kill(pids[attempt][1], signal.SIGKILL)
                    elif what == "freeze":
                        print(f"\n>>> demo: SIGSTOP rank 0 at step {ev['details']['step']} (a hang)\n", flush=True)
                        os.kill(pids[attempt][0], signal.SIGSTOP)
                    else:
                        print(f"\n>>> demo: wipe the local tier and SIGKILL rank 0 at step {ev['details']['step']}\n",
                              flush=True)
                        shutil.rmtree(local, ignore_errors=True)
                        os.kill(pids[attempt][0], signal.SIGKILL)
            if time.monotonic() >= next_scan:  # the run's processes, while they are still our descendants
                known, next_scan = _descendants(keep) or known, time.monotonic() + 1.0
            time.sleep(0.05)  # polling a file the run appends to; the run itself never waits on us
        code = agent.wait()
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        try:
            _stop_run(agent, known, keep)
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)
    print(f"\nresilient-run exited with {code}\n", flush=True)
    report = [sys.executable, "-m", "resilient.cli", "goodput", str(run_dir), "--plot", str(run_dir / "goodput.png")]
    subprocess.run(report, check=False)
    subprocess.run([sys.executable, "-m", "resilient.cli", "ckpt", "ls", str(local / "node0") if (local / "node0").exists()
                    else str(local)], check=False)
    print(f"\nrun directory: {run_dir}\n  ledger: {ledger}\n  timeline: {run_dir / 'goodput.png'}", flush=True)
    return code


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


def node_act(run_dir: Path, env: dict[str, str], args: argparse.Namespace, nodes: list[Node]) -> int:
    """Act 2: two nodes and a warm spare; node 1 is lost (whole node SIGKILLed, disk deleted) and the spare takes
    its place. ``nodes`` is filled as agents start, so that the caller can stop every session on any exit.
    Returns 0 when both remaining agents ended with 0 after a hot swap."""
    from resilient.testing.gcs import free_port

    run_dir.mkdir(parents=True)
    env = dict(env, OMP_NUM_THREADS="1")  # three single-worker nodes share two cores
    port = free_port()
    ledger = run_dir / "events.jsonl"

    def start(name: str) -> Node:
        local = run_dir / f"ckpt-local-{name}"
        cmd = [sys.executable, "-m", "resilient.run", "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "demo-nodes",
               "--local-addr", "127.0.0.1", "--max-restarts", "3", "--run-dir", str(run_dir),
               # a killed node's closed connection is seen at once whatever this says; it only bounds how long an
               # agent may stay silent, and one whose fork server imports torch on two busy cores can be for 10 s
               "--node-timeout", "30",
               "--ckpt-local", str(local), "--ckpt-persistent", "gs://demo-bucket/nodes", "--ckpt-interval", "10",
               "--ckpt-persistent-every", "5", "--term-timeout", str(TERM_TIMEOUT),
               "--inject", f"kill-node:1@{args.kill_at:g}s",
               str(ROOT / "examples" / "train.py"), "--steps", str(args.node_steps), "--step-sleep", "0.03"]
        log = run_dir / f"{name}.log"
        if not nodes:
            print("$ " + " ".join(cmd[2:]), flush=True)
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node = Node(name, proc, local, log)
        nodes.append(node)
        print(f">>> demo: node {name} started (agent pid {proc.pid}, session {proc.pid}, local tier {local.name}, "
              f"log {log.name})", flush=True)
        return node

    a = start("a")
    _wait(lambda: _listening(port), 90, "node a to host the store and the supervisor", nodes)
    b = start("b")
    pos = 0

    def placed() -> bool:
        """The supervisor gave the job's two places to a and b: a node joining from now on waits as a spare."""
        nonlocal pos
        pos, evs = tail_steps(ledger, pos)
        return any(e["kind"] == "action" and e["details"].get("action") == "start"
                   and {a.ident, b.ident} <= set(e["details"]["assignment"]["members"]) for e in evs)

    _wait(placed, 120, "the supervisor to give the job's places to nodes a and b", nodes)
    # started now rather than once training runs: importing torch takes its fork server seconds on two busy
    # cores, and a spare lost into before that is a cold one
    print(">>> demo: nodes a and b hold the job's two places; a third node joins as the spare", flush=True)
    spare = start("spare")
    warm = _WarmWatch(spare)
    pos = 0
    deadline = time.monotonic() + args.timeout
    while [n.proc.poll() for n in nodes].count(None):  # every node polled: the lost one is seen at once
        for n in nodes:
            if n.proc.returncode == -signal.SIGKILL and not n.disk_deleted:
                shutil.rmtree(n.local, ignore_errors=True)  # a lost node's disk is lost with it
                n.disk_deleted = True
                print(f"\n>>> demo: node {n.name} is gone (agent SIGKILLed by --inject); deleted its local tier "
                      f"{n.local.name} (a lost disk)\n", flush=True)
        if warm.check():
            print(f">>> demo: the spare is warm: its fork server imported torch and idles "
                  f"({warm.seconds:.1f} s after the spare started)", flush=True)
        pos, evs = tail_steps(ledger, pos)
        for e in evs:
            if e["kind"] == "node_joined" and e["node"] == spare.ident:
                print(">>> demo: the spare joined; it waits with no workers while its fork server imports torch",
                      flush=True)
            elif e["kind"] == "attempt_start" and e["node"] in (a.ident, b.ident) and e["attempt"] == 0:
                print(f">>> demo: node {'a' if e['node'] == a.ident else 'b'} trains (group rank "
                      f"{e['details'].get('group_rank')})", flush=True)
            elif e["kind"] == "action" and e["details"].get("action") == "hot_swap":
                print(f">>> demo: supervisor: {e['details'].get('reason')}", flush=True)
        if time.monotonic() > deadline:
            print(f"demo: the node-loss run did not finish within {args.timeout:.0f}s; stopping it", file=sys.stderr)
            return 1
        time.sleep(0.05)  # polling files the agents append to; they never wait on us
    codes = {n.name: n.proc.returncode for n in nodes}
    print("\nagents exited: " + ", ".join(f"{k} {'SIGKILL' if c == -signal.SIGKILL else c}" for k, c in codes.items()),
          flush=True)
    return report_node_loss(run_dir, nodes, warm.wall)


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
            kids = [c for c in psutil.Process(self.node.proc.pid).children()
                    if "resilient.launcher.zygote" in " ".join(c.cmdline())]
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


def report_node_loss(run_dir: Path, nodes: list[Node], warm_wall: float | None = None) -> int:
    """What the ledger says about the node loss, then the run's goodput report."""
    _, evs = tail_steps(run_dir / "events.jsonl", 0)
    names = {n.ident: n.name for n in nodes}
    name = lambda ident: f"{names.get(ident, ident)} ({ident})"  # noqa: E731
    t0 = min(e["wall"] for e in evs)
    kill = next((e for e in evs if e["kind"] == "fault_injected" and e["details"].get("fault") == "kill-node"), None)
    lost = next((e for e in evs if e["kind"] == "agent_lost"), None)
    swap = next((e for e in evs if e["kind"] == "action" and e["details"].get("action") == "hot_swap"), None)
    spare = swap["details"]["action_args"]["spare"] if swap else None
    restore = next((e for e in evs if swap and e["kind"] == "ckpt_restore" and e["node"] == spare
                    and e["wall"] > swap["wall"]), None)
    after = [e for e in evs if swap and e["kind"] == "step" and e["wall"] > swap["wall"]]
    print(f"\nthe node loss, from the ledger {run_dir / 'events.jsonl'}:")
    if kill:
        d = kill["details"]
        print(f"  +{kill['wall'] - t0:6.2f} s  fault_injected  {d['at']} on node {name(kill['node'])}: "
              f"agent, fork server and worker SIGKILLed")
    if lost:
        print(f"  +{lost['wall'] - t0:6.2f} s  agent_lost      node {name(lost['node'])}, reason "
              f"\"{lost['details'].get('reason')}\"")
    if swap:
        args_ = swap["details"]["action_args"]
        print(f"  +{swap['wall'] - t0:6.2f} s  action hot_swap  {name(args_['node'])} → spare {name(args_['spare'])} "
              f"(round {swap['details'].get('round')}: {swap['details'].get('reason')})")
    if restore:
        d = restore["details"]
        print(f"  +{restore['wall'] - t0:6.2f} s  ckpt_restore    rank {restore['rank']} on the spare: step {d['step']} "
              f"from tier \"{d['tier']}\" ({d.get('bytes', 0) / 2**20:.1f} MiB in {d.get('seconds', 0):.2f} s)")
    if kill:
        print("  the spare was " + (f"warm at the kill (since +{warm_wall - t0:.2f} s)" if warm_wall and
                                    warm_wall <= kill["wall"] else "still importing torch at the kill (a cold swap)"))
    if kill and after:
        first = after[0]
        print(f"  kill → first step after the swap: {first['wall'] - kill['wall']:.2f} s "
              f"(step {first['details']['step']}, rank {first['rank']})")
    ok = (kill is not None and lost is not None and swap is not None and restore is not None and bool(after)
          and all(n.proc.returncode == 0 for n in nodes if n.ident != kill["node"]))
    if not ok:
        print("demo: the node loss was not handled as expected; see the agents' logs in " + str(run_dir),
              file=sys.stderr)
    print(flush=True)
    subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(run_dir), "--plot",
                    str(run_dir / "goodput.png")], check=False)
    print(f"\nrun directory: {run_dir}\n  ledger: {run_dir / 'events.jsonl'}\n  timeline: {run_dir / 'goodput.png'}"
          f"\n  agents' logs: " + ", ".join(n.log.name for n in nodes), flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--node-steps", type=int, default=400, help="steps of the second act (node lost, spare in)")
    ap.add_argument("--kill-at", type=float, default=10.0,
                    help="seconds after node 1's workers started at which --inject kills it (second act)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    if not (args.kill_at > 0 and args.kill_at < args.timeout) or args.steps < 4 or args.node_steps < 1:
        ap.error("--kill-at must be above 0 and below --timeout; --steps at least 4; --node-steps at least 1")
    # the default action of SIGTERM/SIGHUP ends this process at once and orphans the runs and the GCS server
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stopped)

    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)

    from resilient.testing.gcs import LocalGCS

    gcs = LocalGCS(run_dir / "gcs-data")
    nodes: list[Node] = []
    stopped: BaseException | None = None
    code = 1
    try:
        gcs.start()
        gcs.make_bucket("demo-bucket")
        env = dict(os.environ, **gcs.env())
        code = single_node_act(run_dir, env, args, keep=frozenset({gcs.proc.pid}) if gcs.proc else frozenset())
        if gcs.proc is None or gcs.proc.poll() is not None:
            raise RuntimeError("the GCS server stopped during the first act; the second needs it")
        print("\n" + "=" * 100 + "\nact 2: a node lost and replaced by a warm spare\n" + "=" * 100, flush=True)
        code = node_act(run_dir / "nodes", env, args, nodes) or code
    except (_Stopped, KeyboardInterrupt) as e:
        stopped = e
        code = 128 + (e.signum if isinstance(e, _Stopped) else signal.SIGINT)
    except RuntimeError as e:  # an act could not go on (a node died early, a wait timed out)
        print(f"demo: {e}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        try:
            _stop_nodes(nodes)
        finally:
            gcs.stop()
    if stopped is not None:
        print(f"\ndemo: stopped by {stopped or 'SIGINT'}; the runs and the GCS server were stopped", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
