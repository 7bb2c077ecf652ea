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


def _sample_threads(ps, pid: int) -> tuple[float, dict[int, float]]:
    c = ps.cpu_times()
    return c.user + c.system, {t.id: t.user_time + t.system_time for t in ps.threads()}


def _thread_shares(pid: int, th0: dict[int, float], th1: dict[int, float], wall: float) -> list[dict]:
    out = []
    for tid, v in th1.items():
        share = round((v - th0.get(tid, 0.0)) / wall, 4)
        if share <= 0.0005:
            continue
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            name = "?"
        out.append({"share": share, "name": name, "main": tid == pid})
    return sorted(out, key=lambda d: -d["share"])


class _Profiled:
    """The supervisor process's profile, per phase (``--profile``): the process runs under
    :func:`profiled_supervisor`, which profiles every pass of the control loop (``SupervisorLoop.step``, on the
    loop's own thread) into the phase named in ``DIR/phase``; the bench names a phase there and sends SIGUSR1.
    The store's server thread is C++ and invisible here: its share is in the per-thread CPU figures."""

    def __init__(self, root: Path, pid: int):
        self.root, self.pid = root, pid

    def phase(self, name: str) -> None:
        (self.root / "phase.tmp").write_text(name)
        os.replace(self.root / "phase.tmp", self.root / "phase")
        os.kill(self.pid, signal.SIGUSR1)

    def summary(self, phase: str, decisions: int, wall: float, top: int = 14) -> dict | None:
        import pstats

        f = self.root / f"{phase}.pstats"
        if not f.exists():
            return None
        st = pstats.Stats(str(f))
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            rows.append((tt, ct, nc, f"{Path(file).name}:{line}({fn})" if line else fn))
        passes = next((nc for tt, ct, nc, name in rows if name.startswith("loop.py") and "(step)" in name), 0)
        per = max(decisions, 1)

        def fmt(r):
            tt, ct, nc, name = r
            return {"function": name, "calls": nc, "tottime_ms": round(tt * 1e3, 1), "cumtime_ms": round(ct * 1e3, 1),
                    "calls_per_decision": round(nc / per, 1), "cum_ms_per_decision": round(ct * 1e3 / per, 2),
                    "cum_share_of_wall": round(ct / wall, 4)}

        return {"passes": passes, "decisions": decisions, "wall_s": round(wall, 2),
                "by_tottime": [fmt(r) for r in sorted(rows, reverse=True)[:top]],
                "by_cumtime": [fmt(r) for r in sorted(rows, key=lambda r: -r[1])[:top]]}


def profiled_supervisor(root: str, argv: list[str]) -> int:
    """``resilient supervisor`` with every control-loop pass profiled per phase (see :class:`_Profiled`)."""
    import atexit
    import cProfile

    from resilient.supervisor import loop as L
    from resilient.supervisor.standalone import main as sup_main

    out = Path(root)
    profiles: dict[str, cProfile.Profile] = {}
    current = ["startup"]

    def on_usr1(_s: int, _f: object) -> None:
        try:
            current[0] = (out / "phase").read_text().strip() or current[0]
        except OSError:
            pass

    signal.signal(signal.SIGUSR1, on_usr1)
    step = L.SupervisorLoop.step

    last = [current[0]]

    def profiled_step(self, now):  # one pass, on the loop's thread: the profiler is enabled there only
        if current[0] != last[0]:
            # the phase just ended is written now, from this thread: a supervisor that is killed at the end (its
            # shutdown overran the bench's grace) still leaves every finished phase's profile
            if last[0] in profiles:
                profiles[last[0]].dump_stats(str(out / f"{last[0]}.pstats"))
            last[0] = current[0]
        prof = profiles.get(current[0])
        if prof is None:
            prof = profiles[current[0]] = cProfile.Profile()
        prof.enable()
        try:
            return step(self, now)
        finally:
            prof.disable()

    L.SupervisorLoop.step = profiled_step  # type: ignore[method-assign]

    def dump() -> None:
        for name, prof in profiles.items():
            if not (out / f"{name}.pstats").exists():
                prof.dump_stats(str(out / f"{name}.pstats"))

    atexit.register(dump)
    return sup_main(argv)


def run_transport(nodes: int, nproc: int, spares: int, seconds: float, fault_rate: float, builtin: bool,
                  seed: int, procs: int, shared_client: bool, join_timeout: float = 90.0,
                  keep: bool = False, steady_seconds: float = 0.0, poll: float = 0.5,
                  profile: bool = False, via: str = "presence") -> dict:
    """A real ``resilient supervisor`` process and a fake fleet of ``procs`` processes speaking the agents'
    protocol through its store; see the module docstring. Two measured phases: ``steady`` (heartbeats and plan
    polls only, ``steady_seconds``; skipped at 0) and ``storm`` (``fault_rate`` worker exits a second,
    ``seconds``)."""
    import psutil

    from resilient.events.ledger import read_events
    from resilient.supervisor import transport as T

    secret = T.new_secret()
    env = dict(os.environ, RESILIENT_JOB_SECRET=secret.decode(), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    tmp = Path(tempfile.mkdtemp(prefix="sv-scale-"))
    run_dir = tmp / "run"
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    sup_args = ["supervisor", "--rdzv-endpoint", endpoint,
                "--nnodes", f"{max(1, nodes // 2)}:{nodes}", "--spare-nodes", str(spares), "--run-dir", str(run_dir),
                "--max-restarts", "1000000", "--node-timeout", "10", "--last-call-timeout", "1",
                "--nproc-per-node", str(nproc), "--advertise-addr", "127.0.0.1", "--rdzv-id", T.DEFAULT_JOB]
    if not builtin:
        sup_args += ["--policy", str(REPO / "policies" / "default.py")]
    prof_dir = tmp / "profile"
    if profile:
        prof_dir.mkdir()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--profiled-supervisor", str(prof_dir), "--",
               *sup_args[1:]]
    else:
        cmd = [sys.executable, "-m", "resilient.cli", *sup_args]
    names = [f"node{i:04d}" for i in range(nodes + spares)]
    active, spare = names[:nodes], names[nodes:]
    sup_log = open(tmp / "supervisor.out", "w")
    sup = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sup_log, stderr=subprocess.STDOUT, start_new_session=True)
    prof = _Profiled(prof_dir, sup.pid) if profile else None
    fleet: list[subprocess.Popen] = []
    lines: list[_Lines] = []
    fleet_err: list = []
    obs: _Observer | None = None
    measured: dict[str, dict] = {}
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
                    "--nproc", str(nproc), "--fault-rate", str(fault_rate / procs), "--seed", str(seed * 1000 + k),
                    "--poll", str(poll), "--via", via]
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
            ln.wait_for("ready", join_timeout)
        joined_s = time.monotonic() - t_start
        cpu_join = sum(ps.cpu_times()[:2])
        phases = [("steady", steady_seconds, 0.0), ("storm", seconds, fault_rate)]
        for name, length, rate in phases:
            if length <= 0:
                continue
            if prof is not None:
                prof.phase(name)
            load0 = os.getloadavg()
            for ln in lines:
                ln.send(f"phase {name} {rate / procs!r}")
            t0 = time.monotonic()
            c0, th0 = _sample_threads(ps, sup.pid)
            rounds0 = len(obs.plans)
            time.sleep(length)  # the measured window itself: nothing to synchronise on
            c1, th1 = _sample_threads(ps, sup.pid)
            t1 = time.monotonic()
            mem = ps.memory_info()
            measured[name] = {"t0": t0, "t1": t1, "cpu": c1 - c0, "threads": _thread_shares(sup.pid, th0, th1, t1 - t0),
                              "rss_mib": round(mem.rss / 2**20, 1), "rounds0": rounds0,
                              "load": [[round(x, 2) for x in load0], [round(x, 2) for x in os.getloadavg()]]}
        # plans of the storm's last seconds are still being read: give every agent two polls to read them
        if prof is not None:
            prof.phase("drain")
        for ln in lines:
            ln.send("phase drain 0")
        time.sleep(2 * poll + 1.0)  # agents poll on their own timers: no event to wait for
        threads, fds = ps.num_threads(), ps.num_fds()
        for ln in lines:
            ln.send("stop")
        results = [ln.wait_for("result", 120)["result"] for ln in lines]  # a starved fleet answers late
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
        stop_sessions([sup], grace=10.0)
        sup_log.close()
        for f in fleet_err:
            f.close()
    agents = sum(r["agents"] for r in results)
    # which event each plan answers: the supervisor's ledger names the cause of every decision by id
    actions = {}
    lost: dict[str, int] = {}
    stalls: list[tuple[float, float]] = []  # (when, seconds): the loop's own stalls, as it recorded them
    for ev in read_events(run_dir):
        if ev.kind.value == "action" and isinstance(ev.details.get("id"), int):
            actions[ev.details["id"]] = ev
        elif ev.kind.value == "log" and isinstance(ev.details.get("supervisor_paused"), (int, float)):
            stalls.append((ev.mono, float(ev.details["supervisor_paused"])))
        elif ev.kind.value == "agent_lost":
            r = str(ev.details.get("reason"))
            lost[r] = lost.get(r, 0) + 1
    pushed = {(f["node"], f["attempt"]): f["t"] for r in results for f in r["faults"]}
    # per round: how many agents read the plan, the last read, the longest read (from the start of its poll)
    reads: dict[int, list] = {}
    for r in results:
        for k, (n, first, last, longest) in r["plan_reads"].items():
            cur = reads.setdefault(int(k), [0, first, last, longest])
            cur[0] += n
            cur[1], cur[2], cur[3] = min(cur[1], first), max(cur[2], last), max(cur[3], longest)

    def phase_figures(name: str) -> dict:
        m = measured[name]
        t0, t1 = m["t0"], m["t1"]
        wall = t1 - t0
        counts: dict[str, int] = {}
        late = [r["phases"].get(name, {}) for r in results]
        for ph in late:
            for k, v in ph.get("counts", {}).items():
                counts[k] = counts.get(k, 0) + v
        pushes = sum(v for k, v in counts.items() if k.startswith("push_"))
        backlog = [q for t, q in obs.backlog if t0 <= t <= t1]
        plans = [p for p in obs.plans[m["rounds0"]:] if t0 <= p["t"] <= t1 + 1.0]
        lat, decided, all_read, all_read_floor, longest = [], [], [], [], []
        by_kind: dict[str, int] = {}
        other_causes: dict[str, int] = {}
        unread = 0
        for p in plans:
            by_kind[p["action"] or "final"] = by_kind.get(p["action"] or "final", 0) + 1
            a = actions.get(p["id"])
            key = (a.details.get("cause_node"), p["round"] - 1) if a is not None else None
            if a is not None and a.details.get("cause") == "worker_exit" and key in pushed:
                lat.append(p["t"] - pushed[key])
                decided.append(a.mono - pushed[key])
                rd = reads.get(p["round"])
                if rd is not None and rd[0] >= agents:
                    all_read.append(rd[2] - pushed[key])
                    # publication (seen by the 5 ms observer) plus the longest read: when every agent could have
                    # had it if each had polled right after publication
                    all_read_floor.append(p["t"] - pushed[key] + rd[3])
                    longest.append(rd[3])
                else:
                    unread += 1  # superseded by the next plan before every agent read it
            else:
                why = f"{a.details.get('cause')}" if a is not None else "unknown"
                other_causes[why] = other_causes.get(why, 0) + 1
        plan_bytes = max((p["bytes"] for p in plans), default=obs.plan_bytes)
        return {
            "seconds": round(wall, 2), "fault_rate_per_s": next((r["phases"][name]["rate"] for r in results
                                                                 if name in r["phases"]), 0.0) * procs,
            "cpu_share_of_one_core": m["cpu"] / wall, "thread_cpu_shares": m["threads"], "rss_mib": m["rss_mib"],
            "faults_pushed": sum(1 for r in results for f in r["faults"] if f.get("phase") == name),
            "plans": len(plans), "plans_by_action": by_kind, "plans_answering_a_fault": len(lat),
            "plans_other_cause": other_causes,
            "decision_ms": {"p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3,
                            "max": max(lat, default=float("nan")) * 1e3, "n": len(lat),
                            "note": "push of the worker_exit EVENT → plan key seen by a client polling every 5 ms"},
            "decided_ms": {"p50": pct(decided, 0.5) * 1e3, "p99": pct(decided, 0.99) * 1e3,
                           "note": "push → the decision's ledger event (the rest is publishing the plan)"},
            "decision_all_read_ms": {
                "p50": pct(all_read, 0.5) * 1e3, "p99": pct(all_read, 0.99) * 1e3,
                "max": max(all_read, default=float("nan")) * 1e3, "n": len(all_read), "superseded_unread": unread,
                "note": f"push → the last of the {agents} agents finished reading the plan (each polls every "
                        f"{poll:g} s, so this includes up to {poll:g} s of waiting for its own next poll)"},
            "decision_readable_by_all_ms": {
                "p50": pct(all_read_floor, 0.5) * 1e3, "p99": pct(all_read_floor, 0.99) * 1e3,
                "note": "push → published, plus the longest single agent's read (poll start → plan in hand): the "
                        "latency with the polling phase taken out"},
            "longest_plan_read_ms": {"p50": pct(longest, 0.5) * 1e3, "p99": pct(longest, 0.99) * 1e3},
            "store": {"queue_msgs_per_s": pushes / wall,
                      "queue_msgs_by_kind_per_s": {k[5:]: v / wall for k, v in counts.items() if k.startswith("push_")},
                      "fleet_reads_per_s": (counts.get("check", 0) + counts.get("get", 0)) / wall,
                      "requests_per_s": (pushes + counts.get("check", 0) + counts.get("get", 0)) / wall,
                      "plan_bytes": plan_bytes, "plan_reads": counts.get("plans", 0),
                      "plan_read_mib_per_s": counts.get("plans", 0) * plan_bytes / wall / 2**20,
                      "queue_backlog_max": max(backlog, default=None),
                      "queue_backlog_p50": pct(backlog, 0.5) if backlog else None,
                      "store_errors": counts.get("errors", 0)},
            "fleet_lateness_ms": {
                "p50_max": max((ph.get("late_p50") or 0) for ph in late) * 1e3,
                "p99_max": max((ph.get("late_p99") or 0) for ph in late) * 1e3,
                "max": max((ph.get("late_max") or 0) for ph in late) * 1e3,
                "share_over_100ms_max": max((ph.get("late_over_100ms") or 0) for ph in late)},
            "load_average": {"start": m["load"][0], "end": m["load"][1]},
            "supervisor_stalls_s": [round(g, 2) for t, g in stalls if t0 <= t <= t1 + 1.0],
        }

    figures = {name: phase_figures(name) for name in measured}
    storm = figures.get("storm") or figures[next(iter(figures))]
    out = {
        "mode": "transport",
        "nodes": nodes, "spares": spares, "nproc_per_node": nproc, "ranks": nodes * nproc,
        "seconds": storm["seconds"],
        "policy": "builtin default" if builtin else "policies/default.py (policy thread)",
        "fleet": {"processes": procs, "agents": agents,
                  "store_clients": ("one per process (shared by its agents)" if shared_client
                                    else "one per agent"),
                  "presence_connections": "one per agent",
                  "design": "one thread per process, agents driven by a timer heap; identical plan bytes parsed "
                            "once per process",
                  "hb_period_s": 1.0, "plan_poll_period_s": poll, "messages_via": via,
                  "schedule_lateness_ms": storm["fleet_lateness_ms"],
                  "store_errors": storm["store"]["store_errors"]},
        "startup": {"join_to_ready_s": round(joined_s, 2), "supervisor_cpu_s": round(cpu_join, 2),
                    "slowest_fleet_process_join_s": join_s, "all_joined_s": round(t_joined, 2),
                    "first_plan_s": round(t_first, 2)},
        # the storm phase under the keys of earlier versions (whose one window had faults)
        "fault_rate_per_s": fault_rate, "faults_pushed": storm["faults_pushed"],
        "plans": storm["plans"], "plans_by_action": storm["plans_by_action"],
        "plans_answering_a_fault": storm["plans_answering_a_fault"],
        "faults_superseded": storm["faults_pushed"] - storm["plans_answering_a_fault"],
        "plans_other_cause": sum(storm["plans_other_cause"].values()), "other_causes": storm["plans_other_cause"],
        "agents_lost_by_reason": lost,
        # gaps of more than 2 s between two passes of the loop (its process stopped, or blocked in a call)
        "supervisor_stalls_s": {"startup": [round(g, 2) for t, g in stalls if t < min(m["t0"] for m in measured.values())],
                                "measured": [round(g, 2) for t, g in stalls
                                             if t >= min(m["t0"] for m in measured.values())]},
        "decision_ms": storm["decision_ms"], "decided_ms": storm["decided_ms"],
        "decision_all_read_ms": storm["decision_all_read_ms"],
        "cpu_share_of_one_core": storm["cpu_share_of_one_core"],
        "steady_cpu_share_of_one_core": figures["steady"]["cpu_share_of_one_core"] if "steady" in figures else None,
        "supervisor": {"thread_cpu_shares": storm["thread_cpu_shares"], "rss_mib": storm["rss_mib"],
                       "threads": threads, "fds": fds, "decisions_in_ledger": len(actions)},
        "store": storm["store"],
        "observer_error": obs.error,
        "load_average": storm["load_average"],
        "phases": figures,
    }
    if prof is not None:
        out["profile"] = {name: prof.summary(name, figures[name]["plans"] if name in figures else 0,
                                             figures[name]["seconds"] if name in figures else 1.0)
                          for name in ("steady", "storm")}
    if keep:
        out["run_dir"] = str(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _auto_procs(agents: int) -> int:
    """Fleet processes: about 200 agents each (at 0.5 s polls, ~600 store calls a second per process), at least 4."""
    return max(4, -(-agents // 200))


def _curve_table(console, curve: list[dict], args) -> None:
    from rich.table import Table

    t = Table(title=f"supervisor through its transport: {args.nproc} ranks a node, +{args.spares} spares, steady "
                    f"(heartbeats only) then {args.fault_rate:g} worker exit/s; load average at the storm's start → end")
    for c in ("nodes", "ranks", "plans (faults)", "published p50/p99", "all read p50/p99", "readable p50/p99",
              "CPU steady", "CPU storm", "store thread storm", "RSS", "queue msg/s", "plan MiB/s", "fleet late p99/max",
              "load"):
        t.add_column(c, justify="right")
    for r in curve:
        st = r["phases"].get("storm", {})
        sd = r["phases"].get("steady", {})
        store_thread = sum(x["share"] for x in st.get("thread_cpu_shares", []) if x["name"].startswith("pt_tcpstore"))
        d, a, rb = r["decision_ms"], r["decision_all_read_ms"], st.get("decision_readable_by_all_ms", {})
        late = r["fleet"]["schedule_lateness_ms"]
        t.add_row(str(r["nodes"]), str(r["ranks"]), f"{r['plans']} ({d['n']})",
                  f"{d['p50']:.0f} / {d['p99']:.0f} ms", f"{a['p50']:.0f} / {a['p99']:.0f} ms",
                  f"{rb.get('p50', float('nan')):.0f} / {rb.get('p99', float('nan')):.0f} ms",
                  f"{sd.get('cpu_share_of_one_core', float('nan')):.1%}", f"{r['cpu_share_of_one_core']:.1%}",
                  f"{store_thread:.1%}", f"{r['supervisor']['rss_mib']:.0f} MiB",
                  f"{r['store']['queue_msgs_per_s']:.0f}", f"{r['store']['plan_read_mib_per_s']:.1f}",
                  f"{late['p99_max']:.0f} / {late['max']:.0f} ms",
                  f"{r['load_average']['start'][0]:.1f} → {r['load_average']['end'][0]:.1f}")
    console.print(t)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--profiled-supervisor":
        rest = sys.argv[3:]
        return profiled_supervisor(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=512, help="nodes (one size; see --sizes for a curve)")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated node counts, one full run each (e.g. 256,512,1024,2048): the curve")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--spares", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=None,
                    help="measured seconds of the failure storm (transport mode; default 40, --short 20)")
    ap.add_argument("--steady-seconds", type=float, default=None,
                    help="measured seconds of heartbeats only, before the storm (default 20, --short 8; 0: skip)")
    ap.add_argument("--short", action="store_true",
                    help="shorter phases (8 s steady, 20 s storm, 3 s core-only per policy): the whole 256-2,048 "
                         "curve in about 10 minutes on 2 cores; p99 then rests on ~15-20 decisions a size")
    ap.add_argument("--fault-rate", type=float, default=1.0, help="worker exits per second across the fleet")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between two plan checks of each fake agent")
    ap.add_argument("--via", choices=("presence", "store"), default="presence",
                    help="where the fake agents send their messages after joining: the presence connection, or the "
                         "store queue (the fallback path, and every message's path in earlier versions)")
    ap.add_argument("--builtin", action="store_true", help="the built-in default policy (no policy thread)")
    ap.add_argument("--core-only", action="store_true",
                    help="feed SupervisorCore directly (no transport), both policies, for --seconds each")
    ap.add_argument("--core-seconds", type=float, default=None,
                    help="transport mode: also run the core-only variant this long per policy, for comparison "
                         "(0: skip; default 10, --short 3)")
    ap.add_argument("--procs", type=int, default=0, help="fleet processes (0: one per ~200 agents, at least 4)")
    ap.add_argument("--shared-client", action="store_true", help="one TCPStore client per fleet process")
    ap.add_argument("--profile", action="store_true",
                    help="profile the supervisor's control loop per phase (cProfile; costs CPU: its CPU figures "
                         "are then not comparable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the supervisor's run directory and logs")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "supervisor_scale.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.seconds is None:
        args.seconds = 20.0 if args.short else 40.0
    if args.steady_seconds is None:
        args.steady_seconds = 8.0 if args.short else 20.0
    if args.core_seconds is None:
        args.core_seconds = 3.0 if args.short else 10.0
    try:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [args.nodes]
    except ValueError:
        ap.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    if any(n < 1 for n in sizes):
        ap.error("--sizes must be >= 1 each")
    for flag in ("nodes", "nproc"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    if args.procs < 0:
        ap.error("--procs must be >= 0")
    for flag in ("seconds", "steady_seconds", "fault_rate", "core_seconds", "poll"):
        v = getattr(args, flag)
        if not (v == v and 0 <= v < float("inf")):
            ap.error(f"--{flag.replace('_', '-')} must be a finite number >= 0")
    if args.poll <= 0:
        ap.error("--poll must be > 0")
    if args.spares < 0:
        ap.error("--spares must be >= 0")

    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    curve: list[dict] = []
    core_runs: dict[int, list[dict]] = {}
    failed: list[dict] = []
    for nodes in sizes:
        if not args.core_only:
            procs = args.procs or _auto_procs(nodes + args.spares)
            try:
                r = run_transport(nodes, args.nproc, args.spares, args.seconds, args.fault_rate, args.builtin,
                                  args.seed, procs, args.shared_client, keep=args.keep,
                                  steady_seconds=args.steady_seconds, poll=args.poll, profile=args.profile,
                                  via=args.via,
                                  join_timeout=max(120.0, nodes / 6))
            except Exception as e:  # noqa: BLE001 - one size that could not run is reported; the curve goes on
                failed.append({"nodes": nodes, "error": f"{type(e).__name__}: {e}"})
                console.print(f"{nodes} nodes: not measured ({type(e).__name__}: {e})")
                continue
            curve.append(r)
            f = r["fleet"]
            console.print(f"{nodes} nodes: {f['agents']} agents in {f['processes']} processes; plan "
                          f"{r['store']['plan_bytes']} bytes; fleet lateness in the storm p99 "
                          f"{f['schedule_lateness_ms']['p99_max']:.0f} ms, max {f['schedule_lateness_ms']['max']:.0f} ms;"
                          f" start-up {r['startup']['join_to_ready_s']:.0f} s")
        core_seconds = args.seconds if args.core_only else args.core_seconds
        if core_seconds > 0:
            core_runs[nodes] = [run_core(nodes, args.nproc, args.spares, core_seconds, args.fault_rate, b, args.seed)
                                for b in (False, True)]
    if curve:
        _curve_table(console, curve, args)
        if args.profile:
            for r in curve:
                for ph, summ in (r.get("profile") or {}).items():
                    if not summ:
                        continue
                    console.print(f"[bold]{r['nodes']} nodes, {ph}[/bold]: {summ['passes']} passes, "
                                  f"{summ['decisions']} decisions; by cumulative time:")
                    for row in summ["by_cumtime"][:10]:
                        console.print(f"  {row['cum_share_of_wall']:6.1%} of wall  {row['calls']:>8} calls  "
                                      f"{row['cum_ms_per_decision']:8.2f} ms/decision  {row['function']}")
    if core_runs:
        t = Table(title=f"supervisor core only (no transport), {args.nproc} ranks a node, {args.fault_rate:g} faults/s")
        for c in ("nodes", "policy", "decisions", "decision p50", "decision p99", "decision max", "seen p50",
                  "tick p99", "CPU (one core)"):
            t.add_column(c, justify="right" if c != "policy" else "left")
        for nodes, runs in core_runs.items():
            for r in runs:
                t.add_row(str(nodes), r["policy"], str(r["decisions"]), f"{r['decision_ms']['p50']:.2f} ms",
                          f"{r['decision_ms']['p99']:.2f} ms", f"{r['decision_ms']['max']:.2f} ms",
                          f"{r['seen_us']['p50']:.1f} µs", f"{r['tick_ms']['p99']:.2f} ms",
                          f"{r['cpu_share_of_one_core']:.1%}")
        console.print(t)
    # "transport" and "runs" keep their earlier meaning (one size: 512 nodes when measured, else the largest);
    # "curve" and "core_curve" hold every size
    pick = next((r for r in curve if r["nodes"] == 512), curve[-1] if curve else None)
    pick_n = pick["nodes"] if pick else (512 if 512 in core_runs else (sizes[-1] if sizes else None))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/supervisor_scale.py " + " ".join(sys.argv[1:]),
                               "python": sys.version.split()[0], "cpus": os.cpu_count(),
                               "load_average": [round(x, 2) for x in os.getloadavg()],
                               "sizes": sizes, "short": args.short,
                               "phases_s": {"steady": args.steady_seconds, "storm": args.seconds},
                               "transport": pick, "runs": core_runs.get(pick_n, []),
                               "curve": curve, "failed": failed,
                               "core_curve": {str(k): v for k, v in core_runs.items()}},
                              indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
