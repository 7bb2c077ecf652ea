"""A fake fleet for ``bench/supervisor_scale.py``: light node agents without workers, speaking the node agent's
exact protocol (``resilient/launcher/control.py``) to a real ``resilient supervisor`` process.

One process hosts many agents on one thread, driven by a timer heap: a process with 132 agents makes about
400 store calls a second, each a short blocking round trip, so threads would only add switching. Each
agent has its own TCPStore client (``--shared-client``: one per process) and its own presence connection
with a signed hello, as a real agent does. Per agent:

* join: ``JOIN`` (nproc, pid, host), wait for the presence address, open the presence connection; from then on
  its messages go over that connection (``AgentChannel.attach``), unless ``--via store`` (the store queue, the
  fallback path and the protocol of earlier versions);
* every second, ``HB`` (round, active);
* the supervisor's signed notice of a new round on the presence connection: look for the plan at once;
* every ``--poll`` seconds (0.5 by default, random phase), look for the next plan as ``ControlClient._new_plan``
  does (``has_round(r+1)``, then ``latest``, then the signed plan); a new one is taken and acknowledged (``ACK``);
  when each agent finished reading each plan is kept (per round: how many read it, the first and the last read,
  and the longest read, from the start of the poll that found it), so the bench can say when the last agent had
  the plan, not only when it was published;
* while measuring, random failures: ``EVENT`` with a ``worker_exit`` (exit code 1) of a random rank of a
  random active agent of this process, at most one per agent and round (a real agent's workers are stopped
  after their first failure until the next plan).

Every agent reads every plan from the store (the bytes cross the wire once per agent, as in a real fleet), but
one process checks the signature of, parses and indexes identical plan bytes once for all its agents: the
bench measures the supervisor and its store, and a fleet that spent its CPU parsing the same 100 KB plan two
hundred times would itself be what runs late. How late the fleet ran (its timer heap's lateness) is reported
per phase.

Driven by the bench over stdin/stdout, one JSON object a line. Commands: ``spares`` (join the spare
agents: they must come after the first assignment), ``phase NAME RATE`` (start a measured phase: its own
counters, and worker exits at RATE per second from this process; ``measure`` is ``phase measure`` at
``--fault-rate``), ``stop`` (end the phase and print the figures of every phase), ``exit`` or end of input
(leave: close everything and exit).
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import random
import selectors
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from resilient.events.api import Event, EventKind  # noqa: E402
from resilient.supervisor import transport as T  # noqa: E402
from resilient.supervisor import wire  # noqa: E402

HB_PERIOD = 1.0


def say(**kv: object) -> None:
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


class PlanCache:
    """The plans this process has opened: identical bytes are checked, parsed and indexed once for all its agents
    (every agent still reads them from the store); per round, when its agents finished reading it."""

    def __init__(self, signer: T.Signer):
        self.signer = signer
        self._raw: dict[int, tuple[bytes, dict, dict[str, int]]] = {}  # round -> (bytes, plan, base rank per member)
        self.reads: dict[int, list[float]] = {}  # round -> [n, first done, last done, longest read]
        self._notices: dict[bytes, tuple[int, object] | None] = {}  # a notice line -> (round, term)

    def open(self, keys: T.Keys, store: object, round_: int, term: int | None) -> tuple[dict, dict[str, int]] | None:
        """``AgentChannel.plan``'s checks, on bytes read by this agent's own client."""
        raw = store.get(keys.plan(round_))  # type: ignore[attr-defined]
        hit = self._raw.get(round_)
        if hit is not None and hit[0] == raw:
            plan, ranks = hit[1], hit[2]
        else:
            try:
                plan = self.signer.open(raw)
            except T.BadMessage:
                return None
            ranks: dict[str, int] = {}
            if not plan.get("final"):
                a = plan["assignment"]
                r = 0
                for m in a["members"]:
                    ranks[m] = r
                    r += int(a["nproc"][m])
            self._raw[round_] = (raw, plan, ranks)
            for old in [k for k in self._raw if k < round_ - 2]:
                del self._raw[old]
        if plan.get("round") != round_ or not isinstance(plan.get("term"), int):
            return None
        if term is not None and plan["term"] < term:
            return None
        return plan, ranks

    def notice(self, line: bytes, term: int | None) -> int | None:
        """The round a supervisor's notice announces (checked once per distinct line), None if it is none."""
        if line not in self._notices:
            try:
                body = self.signer.open(line)
                ok = body.get("type") == wire.PLAN_NOTICE and isinstance(body.get("round"), int)
                self._notices[line] = (int(body["round"]), body.get("term")) if ok else None
            except (T.BadMessage, ValueError, TypeError):
                self._notices[line] = None
            if len(self._notices) > 4096:
                self._notices.pop(next(iter(self._notices)))
        got = self._notices.get(line)
        if got is None or (term is not None and isinstance(got[1], int) and got[1] < term):
            return None
        return got[0]

    def read(self, round_: int, started: float, done: float) -> None:
        r = self.reads.get(round_)
        if r is None:
            self.reads[round_] = [1, done, done, done - started]
        else:
            r[0] += 1
            r[1] = min(r[1], done)
            r[2] = max(r[2], done)
            r[3] = max(r[3], done - started)


class FakeAgent:
    def __init__(self, name: str, nproc: int, store: object, signer: T.Signer, stats: dict[str, int],
                 plans: PlanCache):
        self.name, self.nproc, self.stats = name, nproc, stats
        self.store, self.plans = store, plans
        self.chan = T.AgentChannel(store, signer, name)
        self.round, self.active, self.base_rank, self.final = -1, False, 0, False
        self.reported_round: int | None = None
        self.presence: socket.socket | None = None
        self.lines = wire.LineBuffer()

    def send(self, kind: str, **body: object) -> bool:
        try:
            self.chan.send(kind, **body)
        except Exception:  # noqa: BLE001 - counted: the bench reports store errors
            self.stats["errors"] += 1
            return False
        self.stats[f"push_{kind}"] += 1
        return True

    def join(self, presence_addr: str | None, signer: T.Signer, timeout: float, via_presence: bool) -> str:
        self.send(T.MessageKind.JOIN, nproc=self.nproc, pid=os.getpid(), host=socket.gethostname())
        if presence_addr is None:
            self.store.wait([self.chan.keys.presence], timedelta(seconds=timeout))
            presence_addr = self.store.get(self.chan.keys.presence).decode()
        self.presence = T.presence_connect(presence_addr, signer, self.name, timeout=timeout, term=self.chan.term)
        if via_presence:
            self.chan.attach(self.presence)
        return presence_addr

    def on_presence(self) -> bool | None:
        """Lines from the supervisor (its clock reply, notices of new plans): True when a newer round was announced,
        None when the connection closed."""
        try:
            data = self.presence.recv(wire.RECV_BYTES, socket.MSG_DONTWAIT)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.stats["errors"] += 1
            return None
        newer = False
        for line in self.lines.feed(data):
            r = self.plans.notice(line, self.chan.term)
            newer |= r is not None and r > self.round
        return newer

    def heartbeat(self) -> None:
        self.send(T.MessageKind.HB, round=self.round, active=self.active)

    def poll(self) -> bool:
        """``ControlClient._new_plan`` and what follows it (take the round, acknowledge); True when a plan came."""
        s = self.stats
        started = time.monotonic()
        try:
            s["check"] += 1
            if not self.chan.has_round(self.round + 1):
                return False
            s["get"] += 2
            latest = self.chan.latest_round()
            got = self.plans.open(self.chan.keys, self.store, latest if latest > self.round else self.round + 1,
                                  self.chan.term)
        except Exception:  # noqa: BLE001
            s["errors"] += 1
            return False
        if got is None or int(got[0].get("round", -1)) <= self.round:
            return False
        plan, ranks = got
        self.plans.read(int(plan["round"]), started, time.monotonic())
        self.chan.term = plan["term"]
        s["plans"] += 1
        self.round = int(plan["round"])
        self.send(T.MessageKind.ACK, round=self.round)
        if plan.get("final"):
            self.final, self.active = True, False
            return True
        self.active = self.name in ranks
        self.base_rank = ranks.get(self.name, 0)
        return True

    def fail(self, rng: random.Random) -> float | None:
        """Report a worker exit of this node; the push's start time, or None if it could not be sent."""
        local = rng.randrange(self.nproc)
        ev = Event(EventKind.WORKER_EXIT, node=self.name, rank=self.base_rank + local, attempt=self.round,
                   details={"pid": 0, "exit_code": 1, "signal": None, "local_rank": local, "detect_seconds": 0.0})
        t = time.monotonic()
        if not self.send(T.MessageKind.EVENT, event=ev.to_json()):
            return None
        self.reported_round = self.round
        return t

    def close(self) -> None:
        if self.presence is not None:
            self.presence.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True, help="HOST:PORT of the supervisor's store")
    ap.add_argument("--active", default="", help="comma-separated names of the agents that join first")
    ap.add_argument("--spares", default="", help="comma-separated names of the agents that join on `spares`")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--fault-rate", type=float, default=0.25, help="worker exits per second from this process")
    ap.add_argument("--shared-client", action="store_true", help="one TCPStore client for all agents")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between two plan checks of an agent")
    ap.add_argument("--timeout", type=float, default=30.0, help="bound on every store call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--via", choices=("presence", "store"), default="presence",
                    help="where the agents' messages go after the join (store: the fallback path)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    host, port = args.endpoint.rsplit(":", 1)
    secret = T.load_secret()
    if secret is None:
        print("fake_fleet: set RESILIENT_JOB_SECRET", file=sys.stderr)
        return 2
    signer = T.Signer(secret)
    plans = PlanCache(signer)
    poll_period = args.poll
    rng = random.Random(args.seed)
    stats: dict[str, int] = {k: 0 for k in ("push_join", "push_hb", "push_event", "push_ack", "check", "get",
                                            "plans", "errors")}
    shared = T.connect_store(host, int(port), args.timeout) if args.shared_client else None
    agents: list[FakeAgent] = []
    heap: list[tuple[float, int, int, str]] = []
    seq = 0
    presence_addr: str | None = None

    def add(names: list[str]) -> None:
        nonlocal seq, presence_addr
        if shared is not None:
            stores = [shared] * len(names)
        else:
            # concurrently: torch's client socket looks up its own address's name (getnameinfo) for its log,
            # and where no DNS server answers that lookup waits out the resolver's 5 s timeout now and then;
            # one client at a time, a 132-agent process would take half a minute or more to join
            with ThreadPoolExecutor(max(1, len(names))) as ex:
                stores = list(ex.map(lambda _n: T.connect_store(host, int(port), args.timeout), names))
        for name, store in zip(names, stores):
            ag = FakeAgent(name, args.nproc, store, signer, stats, plans)
            presence_addr = ag.join(presence_addr, signer, args.timeout, args.via == "presence")
            agents.append(ag)
            sel.register(ag.presence, selectors.EVENT_READ, len(agents) - 1)
            now = time.monotonic()
            i = len(agents) - 1
            heapq.heappush(heap, (now + rng.random() * HB_PERIOD, seq, i, "hb"))
            heapq.heappush(heap, (now + rng.random() * poll_period, seq + 1, i, "poll"))
            seq += 2

    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    t0 = time.monotonic()
    add([n for n in args.active.split(",") if n])
    say(joined=len(agents), seconds=round(time.monotonic() - t0, 3))

    inbuf = b""
    ready_said = False
    spares_joined = not args.spares
    # the phase being measured: its name, counters at its start, start time, fault rate, lateness samples
    phase: dict | None = None
    phases: dict[str, dict] = {}
    faults: list[dict] = []
    next_fault = float("inf")

    def end_phase() -> None:
        nonlocal phase, next_fault
        if phase is None:
            return
        late = sorted(phase["late"])
        phases[phase["name"]] = {
            "wall": time.monotonic() - phase["t0"], "rate": phase["rate"],
            "counts": {k: stats[k] - phase["m0"].get(k, 0) for k in stats},
            "late_p50": late[len(late) // 2] if late else None,
            "late_p99": late[int(0.99 * (len(late) - 1))] if late else None,
            "late_max": late[-1] if late else None,
            "late_over_100ms": sum(1 for x in late if x > 0.1) / len(late) if late else None,
        }
        phase, next_fault = None, float("inf")

    def start_phase(name: str, rate: float) -> None:
        nonlocal phase, next_fault
        end_phase()
        now = time.monotonic()
        phase = {"name": name, "rate": rate, "m0": dict(stats), "t0": now, "late": []}
        next_fault = (now + rng.expovariate(rate)) if rate > 0 else float("inf")

    try:
        while True:
            now = time.monotonic()
            due = heap[0][0] if heap else now + 1.0
            timeout = max(0.0, min(due, next_fault) - now)
            for key, _ in sel.select(timeout=min(timeout, 0.2)):
                if key.data is not None:
                    ag = agents[key.data]
                    newer = ag.on_presence()
                    if newer is None:
                        sel.unregister(key.fileobj)  # the supervisor closed it: the agent polls on
                    elif newer:
                        ag.poll()
                    continue
                data = os.read(sys.stdin.fileno(), 4096)
                if not data:
                    return 0
                inbuf += data
            while b"\n" in inbuf:
                line, inbuf = inbuf.split(b"\n", 1)
                cmd = line.decode().split()
                if not cmd:
                    continue
                if cmd[0] == "exit":
                    return 0
                if cmd[0] == "spares" and not spares_joined:
                    add([n for n in args.spares.split(",") if n])
                    spares_joined = True
                elif cmd[0] == "measure":
                    start_phase("measure", args.fault_rate)
                elif cmd[0] == "phase" and len(cmd) == 3:
                    start_phase(cmd[1], float(cmd[2]))
                elif cmd[0] == "stop":
                    end_phase()
                    one = next(iter(phases.values()), {})
                    say(result={
                        "agents": len(agents), "faults": faults, "phases": phases,
                        "plan_reads": {str(k): v for k, v in plans.reads.items()},
                        "rounds": sorted({a.round for a in agents}),
                        # the first phase's figures under the keys of earlier versions
                        "wall": one.get("wall"), "counts": one.get("counts", {}),
                        "late_p50": one.get("late_p50"), "late_p99": one.get("late_p99"),
                        "late_max": one.get("late_max"),
                    })
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                due, s, i, kind = heapq.heappop(heap)
                ag = agents[i]
                if phase is not None:
                    phase["late"].append(now - due)
                if kind == "hb":
                    ag.heartbeat()
                    nxt = due + HB_PERIOD
                else:
                    ag.poll()
                    nxt = due + poll_period
                # far behind (a starved process): skip ahead rather than burst
                heapq.heappush(heap, (max(nxt, now), s, i, kind))
                now = time.monotonic()
            if not ready_said and spares_joined and agents and all(a.round >= 0 for a in agents):
                ready_said = True
                say(ready=True, agents=len(agents))
            if phase is not None and now >= next_fault:
                next_fault += rng.expovariate(phase["rate"])
                cands = [a for a in agents if a.active and not a.final and a.reported_round != a.round]
                if cands:
                    ag = rng.choice(cands)
                    t = ag.fail(rng)
                    if t is not None:
                        faults.append({"node": ag.name, "attempt": ag.round, "t": t, "phase": phase["name"]})
    finally:
        for a in agents:
            a.close()


if __name__ == "__main__":
    sys.exit(main())
