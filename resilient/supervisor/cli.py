"""``resilient policy check FILE [--ledger RUN_DIR/events.jsonl] [--json]``: try a policy offline.

Loads the policy and replays through a real :class:`SupervisorCore` either a recorded ledger or, without
``--ledger``, the shipped scenario table, printing every decision (time, event, action, reason, and why
the policy was overruled when it was).

The policy runs in a process of its own under the limits a job gives it (:class:`PolicyLimits`): a file
that ends its process, loops, allocates past the memory limit or forks, while loading or deciding, is
refused with one line and exit status 2 within a bounded time (the load time, or a few decisions'
``--policy-timeout``). A policy that raises or returns nonsense is shown overruled in the table, as in a job.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import Policy, PolicyError
from resilient.supervisor.config import SupervisorConfig, add_policy_limit_arguments
from resilient.supervisor.core import Decision, SupervisorCore
from resilient.supervisor.policy import IsolatedPolicy, PolicyLimits, load_policy

logger = logging.getLogger(__name__)

PROG = "resilient policy"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Check a supervisor policy offline.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="replay a ledger or the scenario table through a policy")
    c.add_argument("file", help="the policy file (defines decide(event, view), or a class with that method)")
    c.add_argument("--ledger", metavar="EVENTS", help="a run's events.jsonl (or its run directory) to replay")
    c.add_argument("--json", action="store_true", help="print the decisions as JSON")
    c.add_argument("--nnodes", help="MIN:MAX for a ledger replay (default: from the ledger's run_start)")
    c.add_argument("--nproc-per-node", type=int, help="for a ledger replay (default: from the ledger)")
    c.add_argument("--max-restarts", type=int, default=3, help="restart budget of the replay (default 3)")
    c.add_argument("--policy-timeout", type=float, default=1.0, help="seconds a decision may take (default 1)")
    add_policy_limit_arguments(c)
    return p


# --------------------------------------------------------------------------------------------- rows
def _fallback_line(fb: str | None) -> str:
    if not fb:
        return ""
    lines = [ln for ln in fb.strip().splitlines() if ln.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1].strip()}"


def _row(t: float | None, d: Decision) -> dict[str, Any]:
    c = d.cause
    desc = (f"{c.kind.value} {c.node}" + (f" rank {c.rank}" if c.rank is not None else "")) if c is not None else "timer"
    return {"time": t, "id": d.id, "event": desc, "action": d.action.kind, "action_args": d.action.to_json(),
            "reason": d.action.reason, "members": list(d.assignment.members) if d.assignment else None,
            "round": d.assignment.round if d.assignment else None, "pending": d.pending, "fallback": d.fallback}


def _args_text(r: dict[str, Any]) -> str:
    a = {k: v for k, v in r["action_args"].items() if k not in ("action", "reason")}
    s = " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in a.items())
    if r["members"] is not None:
        s += f" → round {r['round']}: {','.join(r['members'])}"
    if r["pending"]:
        s += " (at the next checkpoint)"
    return s.strip()


def _table(title: str, rows: list[dict[str, Any]], note: str | None = None) -> Any:
    from rich.table import Table

    t = Table(title=title, caption=note, title_justify="left")
    for col in ("time", "event", "action", "reason", "overruled"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row("" if r["time"] is None else f"+{r['time']:.1f} s", r["event"],
                  f"{r['action']} {_args_text(r)}".strip(), r["reason"], _fallback_line(r["fallback"]))
    return t


def _console() -> Any:
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=160)


def _harmful(policy: Policy, file: str, where: str) -> int | None:
    """Exit status 2 with one line when the policy's process died, overran, hit a limit or forked."""
    failures = policy.failures if isinstance(policy, IsolatedPolicy) else []
    if not failures:
        return None
    print(f"{PROG} check: {file}: {failures[0]} ({where})", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------------------------- scenarios
def check_scenarios(policy: Policy, name: str, as_json: bool, file: str | None = None) -> int:
    from resilient.supervisor.scenarios import SCENARIOS, check, run_scenario

    report = []
    differ = 0
    for sc in SCENARIOS:
        out = run_scenario(sc, policy)
        bad = _harmful(policy, file or name, f"scenario {sc.name}")
        if bad is not None:
            return bad
        rows = [_row(getattr(step, "at", None), d) for step, d in out.decisions]
        problems = check(out, name)
        differ += bool(problems)
        report.append({"scenario": sc.name, "doc": sc.doc, "broken_policy": sc.wrap, "decisions": rows,
                       "expected": [e.describe() for e in sc.expected(name)], "differences": problems})
    if as_json:
        print(json.dumps({"policy": name, "scenarios": report, "differing": differ}, indent=1, default=str))
        return 0
    con = _console()
    ref = name if any(name in sc.overrides for sc in SCENARIOS) else "default"
    for r in report:
        title = f"{r['scenario']}: {r['doc']}" + (f" [policy wrapped: {r['broken_policy']}]" if r["broken_policy"] else "")
        note = ("as expected" if not r["differences"]
                else f"differs from the {ref} policy: " + "; ".join(r["differences"]))
        con.print(_table(title, r["decisions"], note))
    con.print(f"[bold]{len(report)} scenarios[/bold]; {differ} differ from what the {ref} policy does")
    return 0


# --------------------------------------------------------------------------------------------- ledger replay
def _bounds(events: list[Event], nnodes: str | None) -> tuple[int, int] | None:
    spec = nnodes
    if spec is None:
        start = next((e for e in events if e.kind is EventKind.RUN_START and e.details.get("nnodes")), None)
        spec = str(start.details["nnodes"]) if start is not None else None
    if spec is None:
        return None
    lo, _, hi = str(spec).partition(":")
    return int(lo), int(hi or lo)


def _nodes_per_replica(events: list[Event]) -> int | None:
    """The run's --nodes-per-replica, as its first assignment recorded it (None: every rank a replica)."""
    a = next((e.details["assignment"] for e in events if e.kind is EventKind.ACTION
              and isinstance(e.details.get("assignment"), dict)), None)
    k = a.get("nodes_per_replica") if a is not None else None
    return k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else None


def _initial_nodes(events: list[Event]) -> list[tuple[str, int]]:
    """The nodes of the first assignment: those that joined (node_joined) or formed a rendezvous or ran
    an attempt before anything else happened, in group-rank order when the ledger tells it."""
    seen: dict[str, tuple[int, int]] = {}  # node → (sort key, nproc)
    for i, e in enumerate(events):
        if e.kind in (EventKind.NODE_JOINED, EventKind.RENDEZVOUS_DONE, EventKind.ATTEMPT_START):
            if e.kind is EventKind.ATTEMPT_START and (e.details.get("attempt") or e.attempt or 0) > 0:
                continue
            gr = e.details.get("group_rank")
            nproc = e.details.get("nproc") or e.details.get("local_world_size") or 1
            key = gr if isinstance(gr, int) else 10_000 + i
            if e.node not in seen or key < seen[e.node][0]:
                seen[e.node] = (key, int(nproc))
        elif e.kind in _FAULTS and seen:
            break
    return [(n, v[1]) for n, v in sorted(seen.items(), key=lambda kv: kv[1][0])]


_FAULTS = {EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST, EventKind.STRAGGLER}
_REPLAYED = {EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST, EventKind.STRAGGLER,
             EventKind.HOST_UNHEALTHY, EventKind.GPU_UNHEALTHY, EventKind.PREEMPTION_NOTICE, EventKind.NODE_JOINED,
             EventKind.CKPT_TIER_DONE}


def replay(policy: Policy, events: Iterable[Event], *, nnodes: str | None = None, nproc_per_node: int | None = None,
           max_restarts: int = 3, policy_timeout: float = 1.0) -> list[dict[str, Any]]:
    evs = sorted(events, key=lambda e: e.wall)
    if not evs:
        raise ValueError("the ledger holds no events")
    initial = _initial_nodes(evs)
    if not initial:
        raise ValueError("the ledger names no node (no node_joined, rendezvous_done or attempt_start event)")
    bounds = _bounds(evs, nnodes) or (len(initial), len(initial))
    nproc = nproc_per_node or initial[0][1]
    cfg = SupervisorConfig(min_nodes=bounds[0], max_nodes=max(bounds[1], 1), nproc_per_node=nproc,
                           max_restarts=max_restarts, policy_timeout=policy_timeout,
                           node_timeout=1e12,  # liveness is not in the ledger: only its agent_lost events count
                           nodes_per_replica=_nodes_per_replica(evs))
    core = SupervisorCore(cfg, policy)
    t0 = evs[0].wall
    for n, k in initial:
        core.join(n, k, 0.0)
    core.form(0.0)
    rows: list[dict[str, Any]] = []
    init = {n for n, _ in initial}
    for e in evs:
        t = e.wall - t0
        if e.kind not in _REPLAYED or (e.kind is EventKind.NODE_JOINED and e.node in init):
            continue
        if core.stopped:
            break
        for d in core.tick(t) + core.handle(e, t):
            rows.append(_row(t, d))
    return rows


def check_ledger(policy: Policy, args: argparse.Namespace) -> int:
    from resilient.events.ledger import read_events

    path = Path(args.ledger)
    try:
        events = list(read_events(path))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        print(f"{PROG} check: no ledger at {path}: pass a run's events.jsonl or its run directory", file=sys.stderr)
        return 2
    try:
        rows = replay(policy, events, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                      max_restarts=args.max_restarts, policy_timeout=args.policy_timeout)
    except ValueError as e:
        print(f"{PROG} check: cannot replay {path}: {e}", file=sys.stderr)
        return 2
    bad = _harmful(policy, args.file, f"replaying {path}")
    if bad is not None:
        return bad
    if args.json:
        print(json.dumps({"policy": args.file, "ledger": str(path), "decisions": rows}, indent=1, default=str))
        return 0
    con = _console()
    con.print(_table(f"{Path(args.file).name} on {path}", rows, f"{len(events)} events, {len(rows)} decisions"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # every overruled decision is in the printed table, with its traceback in --json
    logging.getLogger("resilient.supervisor.core").addHandler(logging.NullHandler())
    if args.nnodes is not None:
        try:
            lo, _, hi = args.nnodes.partition(":")
            if int(lo) < 1 or int(hi or lo) < int(lo):
                raise ValueError
        except ValueError:
            print(f"{PROG} check: --nnodes {args.nnodes!r} is not N or MIN:MAX with 1 <= MIN <= MAX", file=sys.stderr)
            return 2
    if args.policy_timeout <= 0 or args.max_restarts < 0:
        print(f"{PROG} check: --policy-timeout must be > 0 and --max-restarts >= 0", file=sys.stderr)
        return 2
    try:
        limits = PolicyLimits(timeout=args.policy_timeout, memory_mb=args.policy_memory_mb,
                              cpu_seconds=args.policy_cpu_seconds)
        policy = load_policy(args.file, limits=limits)
    except PolicyError as e:
        print(f"{PROG} check: {e}", file=sys.stderr)
        return 2
    try:
        if args.ledger:
            return check_ledger(policy, args)
        return check_scenarios(policy, Path(args.file).stem, args.json, args.file)
    finally:
        policy.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
