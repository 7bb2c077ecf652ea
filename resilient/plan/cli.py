"""``resilient plan [RUN_DIR] [flags]``: expected goodput, time to finish and cost of a configuration.

Figures (step time, save stall, restore per tier, detection, recovery, start-up) come from the run's ledger
when RUN_DIR is given, else from defaults; any flag overrides. The cluster (size, failure rate, spares,
policy, interval, tiers, price) comes from flags, defaulting to the run's own where it has one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from resilient.goodput.cli import badput_table
from resilient.plan.api import (
    FAULT_KINDS, RECOVERY_ACTIONS, TIERS, ClusterConfig, Figures, PlanInputError, PlanResult, mtbf_to_rate,
)
from resilient.plan.inputs import Measured, figures_from, measure_run

logger = logging.getLogger(__name__)
PROG = "resilient plan"
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanInputError(message)


def _pairs(keys: tuple[str, ...], flag: str):
    def parse(text: str) -> dict[str, float]:
        out = {}
        for part in text.split(","):
            k, sep, v = part.partition("=")
            if not sep or k.strip() not in keys:
                raise argparse.ArgumentTypeError(f"{flag}: expected KEY=SECONDS[,...] with KEY in {', '.join(keys)}, "
                                                 f"got {part!r}")
            try:
                out[k.strip()] = float(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{flag}: {v!r} is not a number of seconds") from None
        return out
    return parse


def _interval(text: str) -> int | None:
    if text.lower() in ("none", "0", "off"):
        return None
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ckpt-interval: expected a number of steps or 'none', got {text!r}") from None
    return v


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Plan goodput, time and cost of a job under failures, by simulation.")
    p.add_argument("run_dir", nargs="?", help="a run directory whose ledger gives the measured figures")
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, help="nodes the job trains on (default: the run's, else 2)")
    g.add_argument("--gpus-per-node", type=int, help="GPUs (workers) per node (default: the run's, else 8)")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--failures-per-node-day", type=float,
                      help="interruptions per node per day (default: Llama 3 405B's, 466 in 54 days on 16,384 GPUs)")
    rate.add_argument("--mtbf-hours", type=float, help="or: the job's mean time between interruptions, in hours")
    rate.add_argument("--rate-from-run", action="store_true", help="or: the rate and fault mix the run itself met")
    g.add_argument("--node-loss-share", type=float, help="share of failures that lose a node (default 0.78)")
    g.add_argument("--hang-share", type=float, help="share of the other failures that hang rather than crash (0.1)")
    g.add_argument("--spares", type=int, help="warm spare nodes (default: the run's, else 0)")
    g.add_argument("--min-nodes", type=int, help="--nnodes MIN: the job may shrink to this (default: --nodes)")
    g.add_argument("--nodes-per-replica", type=int,
                   help="the job grows and shrinks by replicas of this many nodes (default: the run's, else every "
                        "rank a replica); --nodes and --min-nodes multiples of it")
    g.add_argument("--repair-hours", type=float, help="a node taken out is back (repaired or replaced) after this (1)")
    g.add_argument("--policy", help="policy file (default: the run's, else policies/default.py)")
    g.add_argument("--ckpt-interval", type=_interval, default=argparse.SUPPRESS,
                   help="steps between local saves, or 'none' (default: the run's, else 100)")
    g.add_argument("--tiers", help=f"checkpoint tiers, comma-separated among {','.join(TIERS)} (default: the run's, else all)")
    g.add_argument("--persistent-every", type=int, help="local saves per persistent upload (10)")
    g.add_argument("--cost-per-node-hour", type=float, help="price of one node-hour (default 1: costs in node-hours)")
    g.add_argument("--steps", type=int, help="steps to finish (full-size steps); default: the run's own when "
                                             "planning that run (RUN_DIR without --nodes), else simulate --days")
    g.add_argument("--days", type=float, help="the horizon: wall days simulated when --steps is not given (30)")
    g.add_argument("--max-restarts", type=int, help="--max-restarts of each launch (default: unbounded)")
    f = p.add_argument_group("figures (seconds; override the run's)")
    f.add_argument("--step-s", type=float)
    f.add_argument("--step-gap-s", type=float)
    f.add_argument("--save-stall-s", type=float)
    f.add_argument("--startup-s", type=float, help="a restarted attempt's spawn to its first step")
    f.add_argument("--launch-s", type=float, help="a launch to its first step")
    f.add_argument("--teardown-s", type=float)
    f.add_argument("--restore-s", type=_pairs(TIERS, "--restore-s"), help="e.g. local=5,peer=12,persistent=90")
    f.add_argument("--detect-s", type=_pairs(FAULT_KINDS, "--detect-s"), help="e.g. worker_exit=1,hang=60,agent_lost=20")
    f.add_argument("--recovery-s", type=_pairs(RECOVERY_ACTIONS, "--recovery-s"), help="e.g. restart=3,hot_swap=10")
    o = p.add_argument_group("simulation and output")
    o.add_argument("--trials", type=int, default=8, help="seeded runs averaged (8)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--sweep", action="store_true", help="find the best checkpoint interval and number of spares")
    o.add_argument("--max-spares", type=int, help="with --sweep: spares tried from 0 to this")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--plot", metavar="FILE.png", help="draw goodput and cost per useful step against cluster size "
                                                      "for every policy in the policy's directory")
    return p


def build(args: argparse.Namespace) -> tuple[ClusterConfig, Figures, str, Measured | None]:
    measured = measure_run(args.run_dir) if args.run_dir else None
    overrides: dict[str, Any] = {k: getattr(args, k) for k in
                                 ("step_s", "step_gap_s", "save_stall_s", "startup_s", "launch_s", "teardown_s",
                                  "restore_s", "detect_s", "recovery_s")}
    figures = figures_from(measured, overrides)
    m = measured or Measured()
    nodes = args.nodes if args.nodes is not None else (m.nodes or 2)
    kw: dict[str, Any] = {"nodes": nodes}
    if args.gpus_per_node is not None or m.gpus_per_node:
        kw["gpus_per_node"] = args.gpus_per_node if args.gpus_per_node is not None else m.gpus_per_node
    if args.mtbf_hours is not None:
        kw["failures_per_node_day"] = mtbf_to_rate(args.mtbf_hours, nodes)
    elif args.failures_per_node_day is not None:
        kw["failures_per_node_day"] = args.failures_per_node_day
    elif args.rate_from_run:
        if measured is None or measured.failures_per_node_day is None:
            raise PlanInputError("--rate-from-run needs a RUN_DIR whose ledger shows steps (and its faults)")
        kw["failures_per_node_day"] = measured.failures_per_node_day
        if measured.node_loss_share is not None:
            kw["node_loss_share"] = measured.node_loss_share
        if measured.hang_share is not None:
            kw["hang_share"] = measured.hang_share
    # the run's own job, unless told otherwise; a plan for another cluster size (--nodes) is a plan for a fleet,
    # whose few hundred test steps would see no failure at all: it simulates --days of wall time instead
    if measured is not None and args.steps is None and args.days is None and args.nodes is None \
            and measured.report is not None and measured.report.last_step is not None:
        kw["steps"] = measured.report.last_step + 1
    if m.nodes_per_replica is not None:
        kw["nodes_per_replica"] = m.nodes_per_replica
    for name in ("node_loss_share", "hang_share", "min_nodes", "repair_hours", "persistent_every",
                 "cost_per_node_hour", "steps", "days", "max_restarts", "nodes_per_replica"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    spares = args.spares if args.spares is not None else m.spares
    if spares is not None:
        kw["spares"] = spares
    if hasattr(args, "ckpt_interval"):
        kw["ckpt_interval"] = args.ckpt_interval
    elif m.ckpt_interval is not None:
        kw["ckpt_interval"] = m.ckpt_interval
    if args.tiers:
        kw["tiers"] = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    elif m.tiers:
        kw["tiers"] = m.tiers  # a run without a persistent tier is not planned with one
    cluster = ClusterConfig(**kw)
    policy = args.policy or m.policy
    if policy is not None and not Path(policy).is_file():
        if args.policy is None:  # the run's policy path does not exist here: say so, use the default
            logger.warning("the run's policy %s is not on this machine: planning with policies/default.py", policy)
            policy = None
        else:
            raise PlanInputError(f"--policy {policy} does not exist; give a policy .py file")
    return cluster, figures, str(policy or DEFAULT_POLICY), measured


def _fmt_s(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "never"
    if x >= 86400:
        return f"{x / 86400:.2f} d"
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def simulated_line(w: Any, res: PlanResult) -> str:
    """What the plan simulated, so that "0.0 failures" is read against a horizon."""
    what = f"{w.steps:,} steps" if w.steps is not None else f"{_fmt_s(w.horizon_s)} of wall time"
    took = f" (finished in {_fmt_s(res.time_to_finish_s)} on average)" if res.time_to_finish_s else ""
    return (f"simulated: {what}{took} on {w.nodes:,} nodes + {w.spares:,} spare(s), {res.trials} trial(s); "
            f"job MTBF {_fmt_s(w.mtbf_s)}: {w.expected_failures:.3g} failures expected per trial from the rate, "
            f"{res.failures:.3g} simulated; {res.useful_steps:,.0f} steps kept per trial")


def print_table(res: PlanResult, cluster: ClusterConfig, figures: Figures, measured: Measured | None,
                sweep_line: str | None, simulated: str | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    if not con.is_terminal:
        con = Console(width=120)
    fin = f" · {cluster.steps} steps in {_fmt_s(res.time_to_finish_s)}" if cluster.steps else ""
    con.print(f"[bold]expected goodput {res.goodput:.1%}[/bold] · {res.policy} policy · {cluster.nodes} nodes × "
              f"{cluster.gpus_per_node} GPUs + {cluster.spares} spare(s) · interval "
              f"{cluster.ckpt_interval or 'none'} · job MTBF {_fmt_s(cluster.mtbf_hours * 3600)}{fin}")
    con.print(f"cost per useful step {res.cost_per_useful_step:.4g} (at {cluster.cost_per_node_hour:g} per node-hour) · "
              f"{res.failures:.1f} failures, {res.stops:.1f} stops per {_fmt_s(res.wall_seconds)} · "
              f"{res.trials} trials, seed {res.seed}")
    if simulated:
        con.print(escape(simulated))
    if measured is not None and measured.goodput is not None:
        con.print(f"the run itself measured {measured.goodput:.1%}")
    if cluster.nodes_per_replica and res.dp_size_seconds:
        total = sum(res.dp_size_seconds.values()) or 1.0
        sizes = " · ".join(f"{dp} replica(s) {t / total:.1%}" for dp, t in res.dp_size_seconds.items())
        con.print(f"replicas of {cluster.nodes_per_replica} node(s); data-parallel size over the training time: "
                  f"{sizes} (a dropped replica's idle nodes count as waiting_for_spares)")
    con.print(badput_table("where the time would go", res.wall_seconds, res.productive_seconds, res.badput_seconds))
    ft = Table(title="figures used")
    ft.add_column("figure")
    ft.add_column("seconds", justify="right")
    ft.add_column("from")
    for name in ("step_s", "step_gap_s", "save_stall_s", "startup_s", "launch_s", "teardown_s"):
        ft.add_row(name, f"{getattr(figures, name):.4g}", figures.source.get(name, "default"))
    for name in ("restore_s", "detect_s", "recovery_s", "step_extra_s"):
        for k, v in getattr(figures, name).items():
            ft.add_row(escape(f"{name}[{k}]"), f"{v:.4g}", figures.source.get(f"{name}[{k}]", "default"))
    con.print(ft)
    if sweep_line:
        con.print(sweep_line)


def _finite(o: Any) -> Any:
    """JSON has no infinity: a cost that is infinite (nothing useful done) becomes null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def main(argv: list[str] | None = None) -> int:
    from resilient.plan.sim import simulate, sweep, workload

    try:
        args = parser().parse_args(argv)
        cluster, figures, policy, measured = build(args)
        if args.trials < 1:
            raise PlanInputError(f"--trials must be >= 1, got {args.trials}")
        w = workload(cluster, figures, args.trials)
        sw = None
        if args.sweep:
            sw = sweep(cluster, figures, policy, seed=args.seed, trials=args.trials, max_spares=args.max_spares)
            res = simulate(cluster, figures, policy, seed=args.seed, trials=args.trials)
        else:
            res = simulate(cluster, figures, policy, seed=args.seed, trials=args.trials)
        if args.plot:
            from resilient.plan.plot import plot_sizes

            plot_sizes(cluster, figures, Path(policy).parent, args.plot, seed=args.seed)
    except PlanInputError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.json:
        out: dict[str, Any] = {"result": res.to_json(), "cluster": {**cluster.__dict__, "gpus": cluster.gpus,
                                                                    "mtbf_hours": cluster.mtbf_hours},
                               "figures": figures.to_json(), "policy": policy,
                               "simulated": {"horizon_s": w.horizon_s, "steps": w.steps, "nodes": w.nodes,
                                             "spares": w.spares, "trials": w.trials, "mtbf_s": w.mtbf_s,
                                             "expected_failures": w.expected_failures,
                                             "simulated_failures": res.failures}}
        if measured is not None:
            out["measured"] = {"goodput": measured.goodput, "faults": measured.faults,
                               "failures_per_node_day": measured.failures_per_node_day,
                               "running_seconds": measured.running_seconds}
        if sw is not None:
            out["sweep"] = sw.to_json()
        print(json.dumps(_finite(out), indent=2, default=str))
    else:
        line = None
        if sw is not None:
            yd = f" (Young/Daly: {sw.young_daly_steps:.0f})" if sw.young_daly_steps else ""
            line = (f"[bold]sweep[/bold]: best interval {sw.best_interval} steps{yd}, best spares {sw.best_spares}: "
                    f"goodput {sw.best.goodput:.1%}, cost per useful step {sw.best.cost_per_useful_step:.4g}")
        print_table(res, cluster, figures, measured, line, simulated_line(w, res))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
