"""The supervisor's control plane at fleet scale: 512 nodes × 8 ranks (4,096 ranks) + 16 spares.

Default (transport): a real ``resilient supervisor`` process (``python -m resilient.cli supervisor``, with
``RESILIENT_JOB_SECRET``) hosting the job's store on a free loopback port, and a fake fleet
(``bench/fake_fleet.py``: agents without workers, several per process, each with its own TCPStore client
and presence connection) speaking the agents' exact protocol: signed JOIN, a HB summary every second, a
plan poll every 0.5 s, an ACK of each new plan, and random ``worker_exit`` EVENTs (``--fault-rate``).
Measured over ``--seconds``: decision latency from the push of a fault to the publication of the plan that
answers it (seen by one client polling every 5 ms; the supervisor's ledger names each decision's cause),
the supervisor process's CPU (psutil, per thread too) and RSS, the queue's and the store's throughput, the
queue's backlog, and the load average.

Then, for comparison (``--core-only`` alone): the decision core fed directly, without the transport: every
node reports once a second, the core ticks ten times a second, faults arrive as a Poisson stream (worker
exits, hangs, stragglers, checkpoint completions, now and then a node that goes silent and joins back as a
spare), with the shipped ``policies/default.py`` loaded like a user's ``--policy`` and with the built-in
default.

    python bench/supervisor_scale.py [--seconds 40] [--fault-rate 1] [--procs 4] [--shared-client]
    python bench/supervisor_scale.py --core-only [--seconds 20] [--fault-rate 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from resilient.events.api import Event, EventKind  # noqa: E402
from resilient.supervisor.config import SupervisorConfig  # noqa: E402
from resilient.supervisor.core import SupervisorCore  # noqa: E402
from resilient.supervisor.policy import load_policy  # noqa: E402
from tests._helpers.procs import stop_sessions  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_core(nodes: int, nproc: int, spares: int, seconds: float, fault_rate: float, builtin: bool,
             seed: int) -> dict:
    rng = random.Random(seed)
    policy = None if builtin else load_policy(REPO / "policies" / "default.py")
    cfg = SupervisorConfig(min_nodes=nodes // 2, max_nodes=nodes, nproc_per_node=nproc, max_restarts=10**9,
                           node_timeout=5.0, scale_up_wait=3.0, failure_window=60.0)
    core = SupervisorCore(cfg, policy)
    names = [f"node{i:04d}" for i in range(nodes + spares)]
    t0 = time.monotonic()
    for n in names:
        core.join(n, nproc, 0.0)
    core.form(0.0)

    silent: dict[str, float] = {}  # node → when it comes back as a spare
    decision_lat: list[float] = []
    kinds: dict[str, int] = {}
    seen_lat: list[float] = []
    tick_lat: list[float] = []
    step = 0
    # every node reports once a second, spread evenly over the second
    period = 1.0 / len(names)
    next_report = 0.0
    next_tick = 0.0
    next_fault = rng.expovariate(fault_rate)
    ri = 0
    cpu0, wall0 = time.process_time(), time.monotonic()

    def timed(fn, *a) -> list:
        s = time.perf_counter()
        ds = fn(*a)
        dt = time.perf_counter() - s
        if ds:
            decision_lat.append(dt)
            for d in ds:
                kinds[d.action.kind] = kinds.get(d.action.kind, 0) + 1
        return ds

    while True:
        now = time.monotonic() - t0
        if now >= seconds:
            break
        due = min(next_report, next_tick, next_fault)
        if due > now:
            time.sleep(min(due - now, 0.05))  # the fleet's pacing, not a synchronisation
            continue
        if next_report <= now:
            n = names[ri % len(names)]
            ri += 1
            next_report += period
            if n in silent:
                if now >= silent[n]:
                    del silent[n]
                    timed(core.join, n, nproc, now)
                continue
            s = time.perf_counter()
            core.seen(n, now)
            seen_lat.append(time.perf_counter() - s)
        elif next_tick <= now:
            next_tick += 0.1
            s = time.perf_counter()
            ds = timed(core.tick, now)
            tick_lat.append(time.perf_counter() - s)
            if core.stopped:
                break
            del ds
        else:
            next_fault += rng.expovariate(fault_rate)
            a = core.assignment
            assert a is not None
            node = rng.choice(a.members)
            r = rng.random()
            base = a.base_rank(node)
            if r < 0.1:
                silent[node] = now + cfg.node_timeout + 5.0  # lost, then back as a spare
                continue
            if r < 0.4:
                ev = Event(EventKind.WORKER_EXIT, node=node, rank=base + rng.randrange(nproc), attempt=a.attempt,
                           details={"exit_code": 1, "signal": None})
            elif r < 0.5:
                ev = Event(EventKind.HANG, node=node, rank=base, attempt=a.attempt, details={"timeout": 30})
            elif r < 0.8:
                ev = Event(EventKind.STRAGGLER, node=node, rank=base, attempt=a.attempt, details={"score": 0.4})
            else:
                step += 10
                ev = Event(EventKind.CKPT_TIER_DONE, node=node, rank=base, attempt=a.attempt,
                           details={"step": step, "tier": "local"})
            timed(core.handle, ev, now)
            if core.stopped:
                break
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    a = core.assignment
    return {
        "mode": "core-only",
        "nodes": nodes, "spares": spares, "nproc_per_node": nproc, "ranks": nodes * nproc, "seconds": round(wall, 2),
        "policy": "builtin default" if builtin else "policies/default.py (policy thread)",
        "fault_rate_per_s": fault_rate, "decisions": sum(kinds.values()), "decisions_by_kind": kinds,
        "decision_calls": len(decision_lat),
        "decision_ms": {"p50": pct(decision_lat, 0.5) * 1e3, "p99": pct(decision_lat, 0.99) * 1e3,
                        "max": max(decision_lat, default=float("nan")) * 1e3},
        "seen_us": {"p50": pct(seen_lat, 0.5) * 1e6, "p99": pct(seen_lat, 0.99) * 1e6, "calls": len(seen_lat)},
        "tick_ms": {"p50": pct(tick_lat, 0.5) * 1e3, "p99": pct(tick_lat, 0.99) * 1e3, "calls": len(tick_lat)},
        "cpu_share_of_one_core": cpu / wall, "final_round": a.round if a else None,
        "final_members": len(a.members) if a else None, "stopped": core.stopped,
    }


# ---------------------------------------------------------------------------------------------- transport
def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


class _Lines:
    """JSON lines from a child's stdout, read by a thread (every wait on them has a timeout)."""

    def __init__(self, p: subprocess.Popen, name: str):
        self.p, self.name, self.items, self.cv = p, name, [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            with self.cv:
                self.items.append(obj)
                self.cv.notify_all()
        with self.cv:
            self.items.append({"eof": True})
            self.cv.notify_all()

    def wait_for(self, key: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for it in self.items:
                    if key in it:
                        return it
                    if "eof" in it:
                        raise RuntimeError(f"{self.name} exited (code {self.p.poll()}) before saying {key!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name} did not say {key!r} within {timeout:g} s")
                self.cv.wait(left)

    def send(self, cmd: str) -> None:
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass


class _Observer(threading.Thread):
    """One fast client: polls for the next plan key every 5 ms and notes when each appears; samples the
    queue's backlog every 100 ms (how far the supervisor is behind its agents)."""

    def __init__(self, store, signer, poll: float = 0.005):
        super().__init__(daemon=True, name="plan-observer")
        self.store, self.signer, self.poll = store, signer, poll
        self.plans: list[dict] = []
        self.backlog: list[tuple[float, int]] = []
        self.plan_bytes = 0
        self.stop = threading.Event()
        self.first = threading.Event()  # the first assignment is published
        self.error: str | None = None

    def run(self) -> None:
        from resilient.supervisor import transport as T

        nxt, last_q = 0, 0.0
        try:
            while not self.stop.is_set():
                if self.store.check([T.Keys(T.DEFAULT_JOB).plan(nxt)]):
                    t = time.monotonic()
                    raw = self.store.get(T.Keys(T.DEFAULT_JOB).plan(nxt))
                    plan = self.signer.open(raw)
                    self.plan_bytes = len(raw)
                    self.plans.append({"round": nxt, "t": t, "id": plan.get("id"), "final": bool(plan.get("final")),
                                       "action": (plan.get("action") or {}).get("action"), "bytes": len(raw)})
                    nxt += 1
                    self.first.set()
                    continue
                now = time.monotonic()
                if now - last_q >= 0.1:
                    last_q = now
                    self.backlog.append((now, self.store.queue_len(T.Keys(T.DEFAULT_JOB).queue)))
                self.stop.wait(self.poll)
        except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on to its cleanup
            self.error = f"{type(e).__name__}: {e}"


def run_transport(nodes: int, nproc: int, spares: int, seconds: float, fault_rate: float, builtin: bool,
                  seed: int, procs: int, shared_client: bool, join_timeout: float = 90.0,
                  keep: bool = False) -> dict:
    """A real ``resilient supervisor`` process and a fake fleet of ``procs`` processes speaking the agents'
    protocol through its store; see the module docstring."""
    import psutil

    from resilient.events.ledger import read_events
    from resilient.supervisor import transport as T

    secret = T.new_secret()
    env = dict(os.environ, RESILIENT_JOB_SECRET=secret.decode(), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    tmp = Path(tempfile.mkdtemp(prefix="sv-scale-"))
    run_dir = tmp / "run"
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "resilient.cli", "supervisor", "--rdzv-endpoint", endpoint,
           "--nnodes", f"{max(1, nodes // 2)}:{nodes}", "--spare-nodes", str(spares), "--run-dir", str(run_dir),
           "--max-restarts", "1000000", "--node-timeout", "10", "--last-call-timeout", "1",
           "--nproc-per-node", str(nproc), "--advertise-addr", "127.0.0.1", "--rdzv-id", T.DEFAULT_JOB]
    if not builtin:
        cmd += ["--policy", str(REPO / "policies" / "default.py")]
    names = [f"node{i:04d}" for i in range(nodes + spares)]
    active, spare = names[:nodes], names[nodes:]
    sup_log = open(tmp / "supervisor.out", "w")
    sup = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sup_log, stderr=subprocess.STDOUT, start_new_session=True)
    fleet: list[subprocess.Popen] = []
    lines: list[_Lines] = []
    fleet_err: list = []
    obs: _Observer | None = None
    try:
        t_start = time.monotonic()
        store = T.connect_store("127.0.0.1", port, 30.0)  # retries until the supervisor listens
        store.wait([T.Keys(T.DEFAULT_JOB).presence], timedelta(seconds=30))
        ps = psutil.Process(sup.pid)
        obs = _Observer(store, T.Signer(secret))
        obs.start()
        for k in range(procs):
            fcmd = [sys.executable, str(REPO / "bench" / "fake_fleet.py"), "--endpoint", endpoint,
                    "--active", ",".join(active[k::procs]), "--spares", ",".join(spare[k::procs]),
                    "--nproc", str(nproc), "--fault-rate", str(fault_rate / procs), "--seed", str(seed * 1000 + k)]
            if shared_client:
                fcmd.append("--shared-client")
            fleet_err.append(open(tmp / f"fleet{k}.err", "w"))
            p = subprocess.Popen(fcmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=fleet_err[-1], text=True, start_new_session=True)
            fleet.append(p)
            lines.append(_Lines(p, f"fleet process {k}"))
        join_s = max(ln.wait_for("joined", join_timeout)["seconds"] for ln in lines)
        t_joined = time.monotonic() - t_start
        if not obs.first.wait(30):
            raise RuntimeError(f"no first assignment within 30 s after all agents joined ({obs.error})")
        t_first = time.monotonic() - t_start
        for ln in lines:
            ln.send("spares")
        for ln in lines:
            ln.wait_for("ready", 30)
        joined_s = time.monotonic() - t_start
        cpu_join = sum(ps.cpu_times()[:2])
        # the measured window
        load0 = os.getloadavg()
        for ln in lines:
            ln.send("measure")
        t0 = time.monotonic()
        c0 = ps.cpu_times()
        th0 = {t.id: t.user_time + t.system_time for t in ps.threads()}
        rounds0 = len(obs.plans)
        time.sleep(seconds)  # the measured window itself: nothing to synchronise on
        c1 = ps.cpu_times()
        t1 = time.monotonic()
        th1 = {t.id: t.user_time + t.system_time for t in ps.threads()}
        names = {}
        for tid in th1:
            try:
                names[tid] = Path(f"/proc/{sup.pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                names[tid] = "?"
        mem = ps.memory_info()
        threads, fds = ps.num_threads(), ps.num_fds()
        load1 = os.getloadavg()
        for ln in lines:
            ln.send("stop")
        results = [ln.wait_for("result", 30)["result"] for ln in lines]
        obs.stop.set()
        obs.join(5)
    except BaseException:
        for name in ["supervisor.out"] + [f"fleet{k}.err" for k in range(len(fleet))]:
            f = tmp / name
            if f.exists():
                tail = f.read_text(errors="replace").strip().splitlines()[-5:]
                if tail:
                    print(f"--- {name}:\n" + "\n".join(tail), file=sys.stderr)
        raise
    finally:
        if obs is not None:
            obs.stop.set()
        # the fleet leaves first, so no agent is left calling a store that went away
        for ln in lines:
            ln.send("exit")
        for p in fleet:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                pass
            stop_sessions([p], grace=5.0)
        stop_sessions([sup], grace=5.0)
        sup_log.close()
        for f in fleet_err:
            f.close()
    wall = t1 - t0
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    # per thread: the control loop (Python) against the store's server thread (C++, libuv) and the rest
    per_thread = sorted(((round((v - th0.get(k, 0.0)) / wall, 4), names.get(k, "?"), k == sup.pid)
                         for k, v in th1.items()), reverse=True)
    # which event each plan answers: the supervisor's ledger names the cause of every decision by id
    actions = {}
    for ev in read_events(run_dir):
        if ev.kind.value == "action" and isinstance(ev.details.get("id"), int):
            actions[ev.details["id"]] = ev
    pushed = {(f["node"], f["attempt"]): f["t"] for r in results for f in r["faults"]}
    lat: list[float] = []
    by_kind: dict[str, int] = {}
    other = 0
    decided: list[float] = []
    other_causes: dict[str, int] = {}
    lost = {}
    for ev in read_events(run_dir):
        if ev.kind.value == "agent_lost":
            r = str(ev.details.get("reason"))
            lost[r] = lost.get(r, 0) + 1
    window_plans = [p for p in obs.plans[rounds0:] if t0 <= p["t"] <= t1 + 1.0]
    for p in window_plans:
        by_kind[p["action"] or "final"] = by_kind.get(p["action"] or "final", 0) + 1
        a = actions.get(p["id"])
        key = (a.details.get("cause_node"), p["round"] - 1) if a is not None else None
        if a is not None and a.details.get("cause") == "worker_exit" and key in pushed:
            lat.append(p["t"] - pushed[key])
            # where the time went: push → decided (the action event's clock) → plan seen
            decided.append(a.mono - pushed[key])
        else:
            other += 1
            why = f"{a.details.get('cause')}" if a is not None else "unknown"
            other_causes[why] = other_causes.get(why, 0) + 1
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
    pushes = sum(v for k, v in counts.items() if k.startswith("push_"))
    observer_calls = int(wall / 0.005)  # its checks, at most
    backlog = [q for t, q in obs.backlog if t0 <= t <= t1]
    fault_n = sum(len(r["faults"]) for r in results)
    out = {
        "mode": "transport",
        "nodes": nodes, "spares": spares, "nproc_per_node": nproc, "ranks": nodes * nproc,
        "seconds": round(wall, 2),
        "policy": "builtin default" if builtin else "policies/default.py (policy thread)",
        "fleet": {"processes": procs, "agents": sum(r["agents"] for r in results),
                  "store_clients": ("one per process (shared by its agents)" if shared_client
                                    else "one per agent"),
                  "presence_connections": "one per agent",
                  "design": "one thread per process, agents driven by a timer heap",
                  "hb_period_s": 1.0, "plan_poll_period_s": 0.5,
                  "schedule_lateness_ms": {
                      "p50_max": max((r["late_p50"] or 0) for r in results) * 1e3,
                      "p99_max": max((r["late_p99"] or 0) for r in results) * 1e3,
                      "max": max((r["late_max"] or 0) for r in results) * 1e3},
                  "store_errors": counts.get("errors", 0)},
        "startup": {"join_to_ready_s": round(joined_s, 2), "supervisor_cpu_s": round(cpu_join, 2),
                    "slowest_fleet_process_join_s": join_s, "all_joined_s": round(t_joined, 2),
                    "first_plan_s": round(t_first, 2)},
        "fault_rate_per_s": fault_rate, "faults_pushed": fault_n,
        "plans": len(window_plans), "plans_by_action": by_kind, "plans_answering_a_fault": len(lat),
        "faults_superseded": fault_n - len(lat),
        "plans_other_cause": other, "other_causes": other_causes, "agents_lost_by_reason": lost,
        "decision_ms": {"p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3,
                        "max": max(lat, default=float("nan")) * 1e3, "n": len(lat),
                        "note": "push of the worker_exit EVENT → plan key seen by a client polling every 5 ms"},
        "decided_ms": {"p50": pct(decided, 0.5) * 1e3, "p99": pct(decided, 0.99) * 1e3,
                       "note": "push → the decision's ledger event (the rest is publishing the plan)"},
        "cpu_share_of_one_core": cpu / wall,
        "supervisor": {"pid_cpu_s": round(cpu, 3),
                       "thread_cpu_shares": [{"share": x, "name": n, "main": m} for x, n, m in per_thread
                                             if x > 0.0005], "rss_mib": round(mem.rss / 2**20, 1), "threads": threads,
                       "fds": fds, "decisions_in_ledger": len(actions)},
        "store": {"queue_msgs_per_s": pushes / wall,
                  "queue_msgs_by_kind_per_s": {k[5:]: v / wall for k, v in counts.items() if k.startswith("push_")},
                  "fleet_reads_per_s": (counts.get("check", 0) + counts.get("get", 0)) / wall,
                  "observer_checks_per_s_max": observer_calls / wall,
                  "requests_per_s": (pushes + counts.get("check", 0) + counts.get("get", 0)) / wall,
                  "plan_bytes": obs.plan_bytes, "plan_reads": counts.get("plans", 0),
                  "plan_read_mib_per_s": counts.get("plans", 0) * obs.plan_bytes / wall / 2**20,
                  "queue_backlog_max": max(backlog, default=None),
                  "queue_backlog_p50": pct(backlog, 0.5) if backlog else None},
        "observer_error": obs.error,
        "load_average": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in load1]},
    }
    if keep:
        out["run_dir"] = str(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--spares", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=40.0, help="measured seconds (transport mode)")
    ap.add_argument("--fault-rate", type=float, default=1.0, help="worker exits per second across the fleet")
    ap.add_argument("--builtin", action="store_true", help="the built-in default policy (no policy thread)")
    ap.add_argument("--core-only", action="store_true",
                    help="feed SupervisorCore directly (no transport), both policies, for --seconds each")
    ap.add_argument("--core-seconds", type=float, default=10.0,
                    help="transport mode: also run the core-only variant this long per policy, for comparison "
                         "(0: skip)")
    ap.add_argument("--procs", type=int, default=4, help="fleet processes")
    ap.add_argument("--shared-client", action="store_true", help="one TCPStore client per fleet process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the supervisor's run directory and logs")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "supervisor_scale.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    for flag in ("nodes", "nproc", "procs"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    for flag in ("seconds", "fault_rate", "core_seconds"):
        v = getattr(args, flag)
        if not (v == v and 0 <= v < float("inf")):
            ap.error(f"--{flag.replace('_', '-')} must be a finite number >= 0")
    if args.spares < 0:
        ap.error("--spares must be >= 0")

    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    transport = None
    if not args.core_only:
        transport = run_transport(args.nodes, args.nproc, args.spares, args.seconds, args.fault_rate, args.builtin,
                                  args.seed, args.procs, args.shared_client, keep=args.keep)
        r = transport
        t = Table(title=f"supervisor through its transport, {args.nodes} nodes × {args.nproc} ranks "
                        f"+ {args.spares} spares, {args.fault_rate:g} worker exits/s, {r['seconds']:g} s")
        for c in ("policy", "plans", "decision p50", "decision p99", "decision max", "CPU (one core)", "RSS",
                  "queue msg/s", "store req/s", "backlog max"):
            t.add_column(c, justify="right" if c != "policy" else "left")
        t.add_row(r["policy"], f"{r['plans']} ({r['decision_ms']['n']} faults)",
                  f"{r['decision_ms']['p50']:.1f} ms", f"{r['decision_ms']['p99']:.1f} ms",
                  f"{r['decision_ms']['max']:.1f} ms", f"{r['cpu_share_of_one_core']:.1%}",
                  f"{r['supervisor']['rss_mib']:.0f} MiB", f"{r['store']['queue_msgs_per_s']:.0f}",
                  f"{r['store']['requests_per_s']:.0f}", str(r["store"]["queue_backlog_max"]))
        console.print(t)
        f = r["fleet"]
        console.print(f"fleet: {f['agents']} agents in {f['processes']} processes, store clients: "
                      f"{f['store_clients']}, presence: {f['presence_connections']}; schedule lateness p99 "
                      f"{f['schedule_lateness_ms']['p99_max']:.0f} ms; plan {r['store']['plan_bytes']} bytes; "
                      f"load average {r['load_average']['start'][0]:.1f} → {r['load_average']['end'][0]:.1f}")
    runs = []
    core_seconds = args.seconds if args.core_only else args.core_seconds
    if core_seconds > 0:
        runs = [run_core(args.nodes, args.nproc, args.spares, core_seconds, args.fault_rate, b, args.seed)
                for b in (False, True)]
        t = Table(title=f"supervisor core only (no transport), {args.nodes} nodes × {args.nproc} ranks, "
                        f"{args.fault_rate:g} faults/s")
        for c in ("policy", "decisions", "decision p50", "decision p99", "decision max", "seen p50", "tick p99",
                  "CPU (one core)"):
            t.add_column(c, justify="right" if c != "policy" else "left")
        for r in runs:
            t.add_row(r["policy"], str(r["decisions"]), f"{r['decision_ms']['p50']:.2f} ms",
                      f"{r['decision_ms']['p99']:.2f} ms", f"{r['decision_ms']['max']:.2f} ms",
                      f"{r['seen_us']['p50']:.1f} µs", f"{r['tick_ms']['p99']:.2f} ms",
                      f"{r['cpu_share_of_one_core']:.1%}")
        console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/supervisor_scale.py " + " ".join(sys.argv[1:]),
                               "python": sys.version.split()[0], "cpus": os.cpu_count(),
                               "load_average": [round(x, 2) for x in os.getloadavg()],
                               "transport": transport, "runs": runs}, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
