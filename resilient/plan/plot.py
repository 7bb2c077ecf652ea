"""``resilient plan --plot FILE.png``: goodput and cost per useful step against cluster size, one line per policy."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from resilient.plan.api import ClusterConfig, Figures, PlanInputError

logger = logging.getLogger(__name__)

SIZES_GPUS = (8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384)


def plot_sizes(cluster: ClusterConfig, figures: Figures, policy_dir: str | os.PathLike[str],
               path: str | os.PathLike[str], *, seed: int = 0, sizes: tuple[int, ...] = SIZES_GPUS) -> dict:
    """Simulate every ``policy_dir/*.py`` at every size (same failure rate per node, same figures; spares and
    ``--nnodes MIN`` scaled with the size as in ``cluster``) and draw both panels. Returns the points."""
    from resilient.plan.sim import simulate

    policies = sorted(p for p in Path(policy_dir).glob("*.py") if not p.name.startswith("_"))
    if not policies:
        raise PlanInputError(f"--plot: no policy files (*.py) in {policy_dir}")
    points: dict[str, list[tuple[int, float, float]]] = {}
    spare_share = cluster.spares / cluster.nodes
    shrink = (cluster.nodes - (cluster.min_nodes or cluster.nodes)) / cluster.nodes
    for pol in policies:
        row = []
        for gpus in sizes:
            nodes = max(1, gpus // cluster.gpus_per_node)
            c = replace(cluster, nodes=nodes, spares=round(spare_share * nodes),
                        min_nodes=max(1, nodes - round(shrink * nodes)))
            # small clusters see few failures per run: more trials there, one where failures average out anyway
            trials = max(1, min(16, 4096 // max(1, gpus)))
            r = simulate(c, figures, pol, seed=seed, trials=trials)
            # per node: a step on more nodes does proportionally more work (data parallel, weak scaling)
            row.append((nodes * cluster.gpus_per_node, r.goodput, r.cost_per_useful_step / nodes))
        points[pol.stem] = row
    _draw(points, cluster, path)
    return points


def _draw(points: dict[str, list[tuple[int, float, float]]], cluster: ClusterConfig, path: str | os.PathLike[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_g, ax_c) = plt.subplots(1, 2, figsize=(13, 5))
    fig.suptitle(f"planned goodput by cluster size · {cluster.failures_per_node_day:.4g} failures per node-day, "
                 f"{cluster.node_loss_share:.0%} lose a node · spares {cluster.spares / cluster.nodes:.1%} of nodes · "
                 f"interval {cluster.ckpt_interval or 'none'}", fontsize=11)
    for name, row in points.items():
        xs = [p[0] for p in row]
        ax_g.plot(xs, [100 * p[1] for p in row], "o-", ms=4, label=name)
        ax_c.plot(xs, [p[2] for p in row], "o-", ms=4, label=name)
    for ax in (ax_g, ax_c):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(True, alpha=0.3)
    ax_g.set_ylabel("expected goodput (%)")
    ax_c.set_ylabel(f"cost per useful step, per node ({'node-hours' if cluster.cost_per_node_hour == 1 else 'price units'})")
    ax_g.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
