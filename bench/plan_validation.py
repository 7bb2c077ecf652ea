"""How good are ``resilient plan``'s predictions? Real drills on this machine against the planner's figure.

Each drill is a real job: two node agents of one worker each plus a warm spare (``--nnodes 2 --spare-nodes 1``,
each agent in its own session with its own local tier, as ``tests/cluster`` runs them), the deterministic
data-parallel script of ``tests/cluster/train.py`` (a checkpoint every step), and a seeded ``--inject``
schedule of worker kills, hangs (SIGSTOP, caught by the heartbeat timeout) and node losses (SIGKILL of a
whole node, its disk deleted: the spare takes its place; always the second node, as the first hosts the store).

For each drill the measured goodput comes from its ledger (``resilient.goodput.calculator.report_for_run``);
the prediction is ``resilient plan RUN_DIR --rate-from-run``: the figures measured from the same ledger,
the failure rate and fault mix the drill met (faults ÷ node-time running), the same nodes, spare, interval,
steps and policy, averaged over seeded trials. A second prediction replays the drill's own fault times
(``PlannedFault``), which removes the dice from the comparison. Goal: within 3 points in every drill.

    python bench/plan_validation.py [--drills 3] [--seed 0] [--steps 600] [--out bench/results/plan_validation.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from resilient.goodput.calculator import report_for_run  # noqa: E402
from resilient.plan.api import ClusterConfig  # noqa: E402
from resilient.plan.inputs import figures_from, measure_run  # noqa: E402
from resilient.plan.sim import simulate  # noqa: E402
from tests.cluster.conftest import Cluster, wait_for  # noqa: E402
from tests.cluster.test_node_loss import _listening  # noqa: E402

KINDS = ("kill-worker", "hang-worker", "kill-node")


def schedule(seed: int, faults: int, span: float) -> list[tuple[str, int, float]]:
    """``faults`` faults spread over ``span`` seconds: (kind, target, at). At most one node loss (one spare)."""
    rng = random.Random(seed)
    kinds = ["kill-node"] + [rng.choice(KINDS[:2]) for _ in range(faults - 1)] if seed % 3 == 2 else \
        [rng.choice(KINDS[:2]) for _ in range(faults)]
    rng.shuffle(kinds)
    gap = span / (faults + 1)
    out = []
    for i, k in enumerate(kinds):
        at = round(gap * (i + 1) + rng.uniform(-0.3, 0.3) * gap, 1)
        target = rng.randrange(2)
        # the first node's agent hosts the store and the supervisor here: losing it leaves the job without
        # its control plane (the survivors retry the store for good), which is no drill of the planner
        out.append((k, 1 if k == "kill-node" else target, at))
    return out


def run_drill(base: Path, seed: int, faults: int, steps: int, step_sleep: float) -> dict:
    plan = schedule(seed, faults, span=steps * step_sleep * 0.8)
    spec = ",".join(f"{k}:{t}@{at:g}s" for k, t, at in plan)
    c = Cluster(base, "2", flags=["--spare-nodes", "1", "--max-restarts", "10", "--node-timeout", "20",
                                  "--heartbeat-timeout", "3", "--inject", spec])
    c.tmp.mkdir(parents=True, exist_ok=True)
    # enough samples that the sampler never runs dry (2 ranks × batch 8 per step)
    args = ["--steps", str(steps), "--step-sleep", str(step_sleep), "--samples", str(16 * steps + 64),
            "--out", str(base / "out")]
    t0 = time.monotonic()
    try:
        first = c.start("a", args)
        wait_for(lambda: _listening(c.port) or first.proc.poll() is not None, 90, "the first agent to host the store")
        nodes = [first, c.start("b", args), c.start("spare", args)]
        wait_for(lambda: sum(n.proc.poll() is not None for n in nodes) == 3, 600, "every agent to exit")
    finally:
        c.close()
    codes = [n.proc.returncode for n in c.nodes]
    return {"seed": seed, "inject": spec, "run_dir": str(c.run_dir), "exit_codes": codes,
            "seconds": round(time.monotonic() - t0, 1)}


def predict(run_dir: str, trials: int, seed: int) -> dict:
    m = measure_run(run_dir)
    rep = m.report
    assert rep is not None
    figures = figures_from(m, {})
    nodes = m.nodes or 2
    cluster = ClusterConfig(
        nodes=nodes, gpus_per_node=m.gpus_per_node or 1, spares=m.spares or 0, ckpt_interval=m.ckpt_interval or 1,
        failures_per_node_day=m.failures_per_node_day or 0.0, node_loss_share=m.node_loss_share or 0.0,
        hang_share=m.hang_share or 0.0, steps=(rep.last_step or 0) + 1, repair_hours=1e6,  # no node comes back
        tiers=m.tiers or ("local", "peer", "persistent"),
        max_restarts=m.max_restarts if m.max_restarts is not None else 1_000_000)
    policy = str(REPO / "policies" / "default.py")
    by_rate = simulate(cluster, figures, policy, seed=seed, trials=trials)
    # the drill's own faults: time from the launch, kind and node as the job saw them
    planned = m.schedule
    by_schedule = simulate(cluster, figures, policy, seed=seed, trials=1, faults=planned)
    return {"measured": rep.goodput, "predicted_rate": by_rate.goodput, "predicted_schedule": by_schedule.goodput,
            "faults": m.faults, "failures_per_node_day": m.failures_per_node_day, "wall_s": rep.wall_seconds,
            "predicted_wall_s": by_rate.time_to_finish_s, "steps": cluster.steps,
            "figures": figures.to_json(), "measured_badput": rep.badput_seconds,
            "predicted_badput": by_rate.badput_seconds}


def _write(out: str, rows: list[dict], *, summary: dict | None = None, partial: bool = False) -> None:
    """After every drill too, so that an interrupted validation keeps what it measured."""
    clean = [{k: v for k, v in d.items() if k != "run_dir"} for d in rows]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"summary": summary or {"drills": len(rows), "partial": partial},
                                     "drills": clean}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drills", type=int, default=3)
    ap.add_argument("--faults", type=int, default=3, help="faults per drill")
    ap.add_argument("--seed", type=int, default=0, help="drill i uses seed SEED + i")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--step-sleep", type=float, default=0.1)
    ap.add_argument("--trials", type=int, default=400, help="planner trials per prediction")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_validation.json"))
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = Path(tempfile.mkdtemp(prefix="resilient-planval-"))
    rows = []
    try:
        for i in range(a.drills):
            d = run_drill(base / f"d{i}", a.seed + i, a.faults, a.steps, a.step_sleep)
            d.update(predict(d["run_dir"], a.trials, a.seed + i))
            d["error_points"] = round(100 * (d["predicted_rate"] - d["measured"]), 2)
            d["error_points_schedule"] = round(100 * (d["predicted_schedule"] - d["measured"]), 2)
            rows.append(d)
            _write(a.out, rows, partial=True)
            print(f"drill {i} ({d['inject']}): measured {d['measured']:.1%}, predicted {d['predicted_rate']:.1%} "
                  f"(rate), {d['predicted_schedule']:.1%} (its fault times); faults {d['faults']}; "
                  f"exit codes {d['exit_codes']}", flush=True)
    finally:
        if a.keep:
            print(f"drills kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"{'drill':<6} {'faults (inject)':<48} {'measured':>9} {'planned':>8} {'error':>7} {'replayed':>9} {'error':>7}")
    for i, d in enumerate(rows):
        print(f"{i:<6} {d['inject']:<48} {d['measured']:>9.1%} {d['predicted_rate']:>8.1%} "
              f"{d['error_points']:>+6.1f}p {d['predicted_schedule']:>9.1%} {d['error_points_schedule']:>+6.1f}p")
    worst = max((abs(d["error_points"]) for d in rows), default=0.0)
    summary = {"drills": len(rows), "worst_error_points": worst, "within_3_points": worst <= 3.0,
               "worst_error_points_schedule": max((abs(d["error_points_schedule"]) for d in rows), default=0.0)}
    print(f"worst error {worst:.1f} points (goal: 3)")
    _write(a.out, rows, summary=summary)
    print(f"wrote {a.out}")
    return 0 if summary["within_3_points"] else 1


if __name__ == "__main__":
    sys.exit(main())
