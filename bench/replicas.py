"""Replica benchmark: the GPT recipe in a 2-D configuration loses a node, goes on with one replica fewer at the
same global batch, and grows back when a node returns.

Four node agents run on this machine over one loopback rendezvous, each in its own session with its own local
checkpoint tier, 2 workers each, ``--nodes-per-replica 2 --nnodes 2:4``, no spare: two replicas of two nodes,
tensor parallelism over the 4 ranks of a replica (``--tp 4``), FSDP2 over the replicas, gloo on CPU, fp32, a
tiny model, one epoch of ``steps x global_batch`` samples. Once a few steps are done the bench SIGKILLs every
process of the node holding group rank 1 (agent, fork server, workers) and deletes its local tier: its replica
is dropped, its healthy partner waits as a spare, and the job goes on at data-parallel size 1. Once steps run
at that size, a fresh agent starts for the lost node; with the benched one it makes a replica again, and the
job grows back to 2 replicas at a checkpoint boundary and finishes. The same job never interrupted (one node,
4 workers, ``--tp 4``: data-parallel size 1, the same global batch) is the reference.

Measured:

* node loss → first step at the new size: from the kill to the ledger's first STEP event of the first
  attempt at the smaller world (goal: within ``--node-timeout`` + 2 s);
* restore at the new size: the ``ckpt_restore`` seconds and bytes of the ranks of that attempt (slowest rank),
  against a raw read (``open().read()``) of the same number of bytes of the same step's files on a surviving
  local tier;
* the loss curve: max relative deviation from the reference at every step (each step's record from the last
  attempt that ran it);
* samples per epoch: expected, seen, duplicates, missing (each step's samples from its last attempt).

    python bench/replicas.py [--quick] [--node-timeout 10] [--out bench/results/replicas.json]

``--quick`` (under a minute here) uses 1 worker per node (``--tp 2``) and fewer steps. Prints a table and writes
JSON. ``tests/cluster/test_replicas_2d.py`` runs the full scenario through this command line (``--node-timeout
20``) and checks its figures and its goals.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.node_loss import Job, Node, Timeout, listening, wait_for  # noqa: E402
from resilient.events.api import EventKind  # noqa: E402
from resilient.events.ledger import read_events  # noqa: E402
from tests._helpers.gcs import free_port  # noqa: E402

RECIPE = REPO / "recipes" / "pytorch" / "train.py"


@dataclass(frozen=True)
class Scenario:
    nproc: int = 2  # workers per node
    nodes: int = 4
    nodes_per_replica: int = 2
    steps: int = 48
    global_batch: int = 8
    micro_batch: int = 2
    step_sleep: float = 0.4  # seconds a step sleeps: the job must not end before the node is back
    kill_after: int = 4  # steps done before the kill
    node_timeout: float = 10.0
    ckpt_interval: int = 2
    timeout: float = 420.0  # the whole scenario; longer counts as a failure

    def __post_init__(self) -> None:
        if self.nodes % self.nodes_per_replica or self.nodes // self.nodes_per_replica < 2:
            raise ValueError(f"Scenario: {self.nodes} nodes are not >= 2 replicas of {self.nodes_per_replica}")
        if not (0 < self.kill_after < self.steps):
            raise ValueError(f"Scenario: kill_after {self.kill_after} must be in (0, {self.steps})")
        for name in ("nproc", "steps", "global_batch", "micro_batch", "ckpt_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"Scenario.{name} must be >= 1, got {getattr(self, name)}")
        if not all(math.isfinite(v) and v >= 0 for v in (self.step_sleep, self.node_timeout, self.timeout)):
            raise ValueError("Scenario: step_sleep, node_timeout and timeout must be finite seconds >= 0")

    @property
    def tp(self) -> int:
        return self.nodes_per_replica * self.nproc

    @property
    def samples(self) -> int:
        return self.steps * self.global_batch  # one epoch exactly

    def recipe_args(self) -> list[str]:
        return [str(RECIPE), "--steps", str(self.steps), "--global-batch", str(self.global_batch),
                "--micro-batch", str(self.micro_batch), "--samples", str(self.samples), "--tp", str(self.tp),
                # SGD: the comparison is of the job's mechanics (data order, batch, reshard), and AdamW would
                # turn rounding in a rare byte's near-zero gradient into a full step: a loss 5e-5 off at the one
                # step whose samples hold that byte, the steps around it within 1e-7 (measured here)
                "--optim", "sgd", "--lr", "0.1",
                "--n-layer", "1", "--d-model", "32", "--log-every", "5", "--record",
                "--step-sleep", str(self.step_sleep)]


# ------------------------------------------------------------------------------------ records of a run
def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def _last_attempt(recs: list[dict]) -> dict[int, list[dict]]:
    """step -> the records of the last attempt that ran it (a step redone after a restore counts once)."""
    last: dict[int, float] = {}
    for r in recs:
        last[r["step"]] = max(last.get(r["step"], -math.inf), r["attempt"])
    out: dict[int, list[dict]] = {}
    for r in recs:
        if r["attempt"] == last[r["step"]]:
            out.setdefault(r["step"], []).append(r)
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {s: rs[-1]["loss"] for s, rs in _last_attempt(_jsonl(run_dir / "recipe" / "loss.jsonl")).items()}


def dp_sizes(run_dir: Path) -> list[int]:
    """The data-parallel size of every recorded step, in the order written (attempts included)."""
    return [r["dp_size"] for r in _jsonl(run_dir / "recipe" / "loss.jsonl")]


def samples_seen(run_dir: Path, expected: int) -> dict[str, Any]:
    recs = [r for f in sorted((run_dir / "recipe").glob("samples-dp*.jsonl")) for r in _jsonl(f)]
    seen: list[int] = []
    per_step: set[int] = set()
    for _, rs in sorted(_last_attempt(recs).items()):
        n = 0
        for r in rs:
            seen += r["samples"]
            n += len(r["samples"])
        per_step.add(n)
    dup = len(seen) - len(set(seen))
    missing = len(set(range(expected)) - set(seen))
    return {"expected": expected, "seen": len(seen), "distinct": len(set(seen)), "duplicates": dup,
            "missing": missing, "steps": len({r["step"] for r in recs}), "step_batches": sorted(per_step)}


def max_rel_deviation(a: dict[int, float], b: dict[int, float]) -> float | None:
    common = sorted(set(a) & set(b))
    if not common or set(a) != set(b):
        return None
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in common)


def events(run_dir: Path) -> list:
    try:
        return list(read_events(run_dir))
    except FileNotFoundError:
        return []


def first_step_at(evs: list, world: int, after: float) -> float | None:
    """Wall time of the first STEP after ``after`` of the first attempt started at ``world`` ranks."""
    starts = [e.wall for e in evs if e.kind == EventKind.ATTEMPT_START and e.details.get("world_size") == world
              and e.wall > after]
    if not starts:
        return None
    t0 = min(starts)
    steps = [e.wall for e in evs if e.kind == EventKind.STEP and e.wall > t0]
    return min(steps) if steps else None


def phases(evs: list, lost: str, world: int, t_kill: float) -> dict[str, float | None]:
    """Seconds from the kill to: the loss seen, the scale-down decided, the first worker of the smaller world
    started, the last of its ranks restored (each from the ledger)."""
    def first(pred) -> float | None:
        ts = [e.wall for e in evs if e.wall >= t_kill - 1.0 and pred(e)]
        return min(ts) - t_kill if ts else None

    starts = [e.wall for e in evs if e.kind == EventKind.ATTEMPT_START and e.details.get("world_size") == world
              and e.wall > t_kill]
    restored = [e.wall for e in evs if e.kind == EventKind.CKPT_RESTORE and starts and e.wall > min(starts)]
    return {"detected": first(lambda e: e.kind == EventKind.AGENT_LOST and e.node == lost),
            "scale_down": first(lambda e: e.kind == EventKind.ACTION and e.details.get("action") == "scale_down"),
            "workers_started": min(starts) - t_kill if starts else None,
            "restored": max(restored) - t_kill if restored else None}


def restore_at(evs: list, world: int, after: float) -> dict[str, Any] | None:
    """The slowest rank's restore in the first attempt at ``world`` ranks after ``after``."""
    starts = sorted(e.wall for e in evs if e.kind == EventKind.ATTEMPT_START
                    and e.details.get("world_size") == world and e.wall > after)
    if not starts:
        return None
    later = [e.wall for e in evs if e.kind == EventKind.ATTEMPT_START and e.wall > starts[0] + 1.0
             and e.details.get("world_size") != world]
    end = min(later) if later else math.inf
    rs = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and starts[0] <= e.wall < end]
    if not rs:
        return None
    slow = max(rs, key=lambda e: e.details.get("seconds", 0.0))
    return {"step": slow.details.get("step"), "tier": slow.details.get("tier"),
            "seconds": slow.details.get("seconds"), "bytes": slow.details.get("bytes"), "ranks": len(rs),
            "tiers": sorted({str(e.details.get("tier")) for e in rs})}


def raw_read(local_dirs: list[Path], step: int | None, nbytes: int | None) -> dict[str, Any] | None:
    """Read ``nbytes`` of the files of ``step`` on the surviving local tiers with plain ``open().read()``."""
    if step is None or not nbytes:
        return None
    # the step's data files on the tiers (its own directory, or a peer copy of it); read right after the
    # restore, before later saves replace the step
    files = [p for d in local_dirs if d.exists() for p in sorted(d.rglob("*.distcp"))
             if f"step_{step:08d}" in p.parts]
    t0 = time.perf_counter()
    got = 0
    for p in files:
        with open(p, "rb") as f:
            got += len(f.read(max(0, nbytes - got)))
        if got >= nbytes:
            break
    return {"seconds": time.perf_counter() - t0, "bytes": got}


# ------------------------------------------------------------------------------------------------ runs
def agent_cmd(sc: Scenario, port: int, run_dir: Path, local: Path) -> list[str]:
    # the job forms with every node (MAX joined) however slow a start is under load: last call of 300 s
    return [sys.executable, "-m", "resilient.run", "--nnodes", f"{sc.nodes_per_replica}:{sc.nodes}",
            "--nproc-per-node", str(sc.nproc), "--nodes-per-replica", str(sc.nodes_per_replica),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "replicas",
            "--local-addr", "127.0.0.1", "--run-dir", str(run_dir), "--ckpt-local", str(local),
            "--ckpt-interval", str(sc.ckpt_interval), "--node-timeout", f"{sc.node_timeout:g}",
            "--max-restarts", "4", "--heartbeat-timeout", "300", "--rdzv-conf", "last_call_timeout=300",
            *sc.recipe_args()]


def run_reference(sc: Scenario, d: Path) -> dict[str, Any]:
    """The same job never interrupted: one node, one replica of ``tp`` ranks, the same global batch."""
    d.mkdir(parents=True, exist_ok=True)
    job = Job(d)
    run_dir = d / "run"
    # one replica on one node (the same tensor parallelism; data-parallel size 1) and no sleep. A reference
    # without tensor parallelism differs by more than the data-parallel changes do: 3e-5 after 48 steps, against
    # 1e-7 for the same tensor-parallel layout at dp 2 -> 1 -> 2
    args = sc.recipe_args()
    args[args.index("--step-sleep") + 1] = "0"
    t0 = time.monotonic()
    try:
        n = job.start("reference", [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node",
                                    str(sc.tp), "--run-dir", str(run_dir), "--ckpt-local", str(d / "local"),
                                    "--ckpt-interval", str(sc.ckpt_interval), *args], None)
        wait_for(lambda: n.proc.poll() is not None, sc.timeout, "the reference run", poll=0.1)
        ok = n.proc.returncode == 0
        return {"ok": ok, "seconds": time.monotonic() - t0, "losses": losses(run_dir),
                "samples": samples_seen(run_dir, sc.samples), **({} if ok else {"log_tail": n.tail()})}
    except Timeout as e:
        return {"ok": False, "error": str(e), "losses": {}}
    finally:
        job.close()


def run_replicas(sc: Scenario, d: Path) -> dict[str, Any]:
    """The scenario; returns what was measured (``ok`` False with ``error`` when a phase did not happen)."""
    d.mkdir(parents=True, exist_ok=True)
    run_dir = d / "run"
    port = free_port()
    job = Job(d)
    res: dict[str, Any] = {"ok": False}
    t_begin = time.monotonic()
    deadline = t_begin + sc.timeout

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    def agent(name: str) -> Node:
        local = d / f"local-{name}"
        return job.start(name, agent_cmd(sc, port, run_dir, local), local)

    def done(nodes: list[Node]) -> bool:
        return all(n.proc.poll() is not None for n in nodes)

    phase = "start"
    try:
        first = agent("n0")
        wait_for(lambda: listening(port) or first.proc.poll() is not None, left(), "the first agent's store")
        nodes = [first] + [agent(f"n{i}") for i in range(1, sc.nodes)]
        full = sc.nodes * sc.nproc
        phase = "steps before the kill"
        wait_for(lambda: len([s for s in dp_sizes(run_dir)]) >= sc.kill_after or done(nodes), left(),
                 f"{sc.kill_after} steps at full size", poll=0.05)
        ranks = {e.node: e.details.get("group_rank") for e in events(run_dir) if e.kind == EventKind.RENDEZVOUS_DONE}
        victim = next((n for n in nodes if ranks.get(n.ident) == 1), nodes[1])
        t_kill = victim.kill()
        res.update(killed=victim.name, killed_group_rank=ranks.get(victim.ident))
        phase = "the scale-down"
        wait_for(lambda: any(e.kind == EventKind.ACTION and e.details.get("action") == "scale_down"
                             for e in events(run_dir)) or done(nodes), left(), "the scale-down", poll=0.05)
        # the node comes back as soon as its replica is dropped: an agent's start-up (imports, fork server) is
        # seconds under load, and the job must still be running when it has joined
        back = agent(f"{victim.name}-back")
        phase = "steps at the smaller size"
        small = full - sc.nodes_per_replica * sc.nproc
        wait_for(lambda: first_step_at(events(run_dir), small, t_kill) is not None or done(nodes), left(),
                 "a step at the smaller size", poll=0.05)
        evs = events(run_dir)
        t_small = first_step_at(evs, small, t_kill)
        if t_small is None:
            raise Timeout("the job ended without a step at the smaller size")
        res["loss_to_first_step_s"] = t_small - t_kill
        res["phases_s"] = phases(evs, victim.ident, small, t_kill)
        res["restore"] = restore_at(evs, small, t_kill)
        if res["restore"]:
            res["raw_read"] = raw_read([n.local for n in nodes if n is not victim and n.local is not None],
                                       res["restore"].get("step"), res["restore"].get("bytes"))
        phase = "the job's end"
        wait_for(lambda: done([n for n in nodes if n is not victim] + [back]), left(), "the job to end", poll=0.1)
        survivors = [n for n in nodes if n is not victim] + [back]
        res["exit_codes"] = {n.name: n.proc.returncode for n in survivors}
        evs = events(run_dir)
        acts = [e.details.get("action") for e in evs if e.kind == EventKind.ACTION]
        res["actions"] = acts
        res["attempt_worlds"] = [e.details.get("world_size") for e in evs if e.kind == EventKind.ATTEMPT_START
                                 and e.node == first.ident]
        sizes = dp_sizes(run_dir)
        res["dp_sizes"] = [x for i, x in enumerate(sizes) if i == 0 or sizes[i - 1] != x]
        res["benched"] = [e.details for e in evs if e.kind.value == "node_benched"]
        res["scale_events"] = [e.details for e in evs if e.kind == EventKind.SCALE and e.rank == 0]
        res["losses"] = losses(run_dir)
        res["samples"] = samples_seen(run_dir, sc.samples)
        res["ok"] = all(c == 0 for c in res["exit_codes"].values())
        if not res["ok"]:
            res["log_tail"] = {n.name: n.tail() for n in survivors}
    except Timeout as e:
        res["error"] = f"{phase}: {e}"
        res["log_tail"] = {n.name: n.tail() for n in job.nodes}
    finally:
        res["left_behind"] = job.close()
        res["seconds"] = time.monotonic() - t_begin
    return res


def measure(sc: Scenario, root: Path) -> dict[str, Any]:
    ref = run_reference(sc, root / "reference")
    run = run_replicas(sc, root / "replicas")
    dev = max_rel_deviation(run.get("losses", {}), ref.get("losses", {})) if ref.get("ok") else None
    rest, raw = run.get("restore") or {}, run.get("raw_read") or {}
    return {"scenario": asdict(sc), "goal_s": sc.node_timeout + 2.0, "reference": ref, "run": run,
            "max_rel_loss_deviation": dev,
            "restore_vs_raw": (rest["seconds"] / raw["seconds"]) if rest.get("seconds") and raw.get("seconds")
            else None}


def print_table(doc: dict) -> None:
    run, ref = doc["run"], doc["reference"]
    fmt = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
    sc = doc["scenario"]
    print(f"\n{sc['nodes']} nodes x {sc['nproc']} workers, --nodes-per-replica {sc['nodes_per_replica']} "
          f"(tp {sc['nodes_per_replica'] * sc['nproc']}), global batch {sc['global_batch']}, {sc['steps']} steps")
    rest, raw = run.get("restore") or {}, run.get("raw_read") or {}
    s = run.get("samples") or {}
    rows = [
        ("run finished", str(run.get("ok")) + (f" ({run['error']})" if run.get("error") else "")),
        ("data-parallel sizes", " -> ".join(map(str, run.get("dp_sizes", []))) or "-"),
        (f"node loss -> first step at the new size (goal <= {doc['goal_s']:g} s)",
         f"{fmt(run.get('loss_to_first_step_s'))} s"),
        ("  of which: seen / scale-down / workers started / restored",
         " / ".join(fmt((run.get("phases_s") or {}).get(k)) for k in ("detected", "scale_down", "workers_started",
                                                                        "restored")) + " s after the kill"),
        ("restore at the new size (slowest rank)",
         f"{fmt(rest.get('seconds'), '.3f')} s, {rest.get('bytes', '-')} B from {rest.get('tiers', '-')}"),
        ("raw read of the same bytes", f"{fmt(raw.get('seconds'), '.4f')} s ({raw.get('bytes', '-')} B)"),
        ("restore / raw read", fmt(doc.get("restore_vs_raw"), ".1f")),
        ("loss vs uninterrupted run, max relative deviation", fmt(doc.get("max_rel_loss_deviation"), ".2e")),
        ("samples per epoch: expected / seen / duplicates / missing",
         f"{s.get('expected', '-')} / {s.get('seen', '-')} / {s.get('duplicates', '-')} / {s.get('missing', '-')}"),
        ("reference run (uninterrupted)", f"{ref.get('ok')} in {fmt(ref.get('seconds'), '.1f')} s"),
        ("scenario wall time", f"{fmt(run.get('seconds'), '.1f')} s"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 worker per node, fewer steps (under a minute)")
    ap.add_argument("--node-timeout", type=float, default=10.0, help="resilient-run --node-timeout (seconds)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "replicas.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, ledgers) and print its path")
    a = ap.parse_args()
    try:
        sc = Scenario(nproc=1 if a.quick else 2, steps=a.steps or (32 if a.quick else 48),
                      node_timeout=a.node_timeout, step_sleep=0.5 if a.quick else 0.4)
    except ValueError as e:
        print(f"replicas.py: {e}", file=sys.stderr)
        sys.exit(2)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="replicas-") as tmp:
        root = Path(tempfile.mkdtemp(prefix="replicas-")) if a.keep else Path(tmp)
        if a.keep:
            print(f"work directory: {root}", file=sys.stderr)
        doc = measure(sc, root)
    doc.update(mode="quick" if a.quick else "full", seconds=time.monotonic() - t0, loadavg_before=load_before,
               loadavg_after=os.getloadavg(), cpus=os.cpu_count(),
               command="python bench/replicas.py " + " ".join(sys.argv[1:]),
               when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    for part in (doc["run"], doc["reference"]):  # JSON keys are strings
        part["losses"] = {str(k): v for k, v in part.get("losses", {}).items()}
    print_table(doc)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
