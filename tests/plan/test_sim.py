"""The planner's arithmetic, on the real supervisor core and the shipped policy files."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.goodput.api import CATEGORIES
from resilient.plan.api import ClusterConfig, Figures, PlanInputError, PlannedFault
from resilient.plan.sim import _FastCore, simulate, sweep
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.policy import load_policy

POLICIES = Path(__file__).resolve().parents[2] / "policies"
ZERO = {"worker_exit": 0.0, "hang": 0.0, "agent_lost": 0.0}


def figures(**kw) -> Figures:
    base = dict(step_s=1.0, save_stall_s=0.0, startup_s=5.0, launch_s=10.0,
                detect_s={"worker_exit": 2.0, "hang": 4.0, "agent_lost": 6.0},
                recovery_s={"restart": 3.0, "hot_swap": 7.0, "scale_down": 7.0, "scale_up": 7.0},
                restore_s={"local": 1.0, "peer": 2.0, "persistent": 9.0})
    base.update(kw)
    return Figures(**base)


def test_one_failure_no_checkpoint_loses_everything_since_the_start() -> None:
    """Launch 10 s, 40 steps of 1 s, a crash at 50 s: detection 2, recovery 3, start-up 5, no checkpoint to
    restore, then all 100 steps again."""
    c = ClusterConfig(nodes=2, ckpt_interval=None, steps=100, failures_per_node_day=0)
    r = simulate(c, figures(), POLICIES / "default.py", trials=1, faults=[PlannedFault(50.0, "worker_exit", 1)])
    assert r.wall_seconds == pytest.approx(10 + 40 + 2 + 3 + 5 + 100)
    assert r.productive_seconds == pytest.approx(100)
    b = r.badput_seconds
    assert (b["startup"], b["wasted_progress"], b["detection"], b["recovery"]) == pytest.approx((15, 40, 2, 3))
    assert b["checkpoint_restore"] == 0 and set(b) == set(CATEGORIES)
    assert r.goodput == pytest.approx(100 / 160) and r.time_to_finish_s == pytest.approx(160)
    assert r.actions == {"restart": 1.0} and r.failures == 1


def test_checkpoints_bound_the_loss_and_cost_their_stall() -> None:
    """Same crash with a save every 10 steps (2 s stall): back to step 30, restore from the local tier."""
    c = ClusterConfig(nodes=2, ckpt_interval=10, steps=100, failures_per_node_day=0)
    # 10 s launch, then cycles of 12 s: the crash at 50 s is 4 s into the 4th cycle (3 saves done, step 34 in flight)
    r = simulate(c, figures(save_stall_s=2.0), POLICIES / "default.py", trials=1,
                 faults=[PlannedFault(50.0, "worker_exit", 0)])
    b = r.badput_seconds
    assert b["wasted_progress"] == pytest.approx(4.0)  # steps 30–33
    assert b["checkpoint_restore"] == pytest.approx(1.0)
    saves = 3 + 7  # before the crash, and steps 30..99 after it
    assert b["checkpoint_save_stall"] == pytest.approx(2.0 * saves)
    assert r.wall_seconds == pytest.approx(10 + 40 + 2 + 3 + 5 + 1 + 70 + 2 * 7)


def test_node_loss_without_a_peer_tier_goes_back_to_the_persistent_checkpoint() -> None:
    c = ClusterConfig(nodes=2, spares=1, ckpt_interval=10, persistent_every=3, tiers=("local", "persistent"),
                      steps=100, failures_per_node_day=0)
    r = simulate(c, figures(), POLICIES / "default.py", trials=1, faults=[PlannedFault(65.0, "agent_lost", 1)])
    # 55 steps done at 65 s; the newest persistent copy is step 30; the spare restores it (9 s)
    assert r.actions == {"hot_swap": 1.0}
    assert r.badput_seconds["wasted_progress"] == pytest.approx(25.0)
    assert r.badput_seconds["checkpoint_restore"] == pytest.approx(9.0)
    assert r.badput_seconds["detection"] == pytest.approx(6.0) and r.badput_seconds["recovery"] == pytest.approx(7.0)


def test_spares_exhausted_hot_swap_first_waits_for_a_repair() -> None:
    """Two node losses a minute apart, one spare: the first is swapped, the second finds no spare, the policy
    (hot swap first, then the default: at --nnodes min it stops) stops, and the job waits for a repaired node."""
    c = ClusterConfig(nodes=2, spares=1, ckpt_interval=10, steps=300, failures_per_node_day=0, repair_hours=0.5)
    losses = [PlannedFault(50.0, "agent_lost", 0), PlannedFault(110.0, "agent_lost", 1)]
    pol = POLICIES / "hot_swap_first.py"
    one = simulate(c, figures(), pol, trials=1, faults=losses[:1])
    two = simulate(c, figures(), pol, trials=1, faults=losses)
    roomy = simulate(replace(c, spares=2), figures(), pol, trials=1, faults=losses)
    assert one.actions == {"hot_swap": 1.0} and roomy.actions == {"hot_swap": 2.0}
    assert two.actions == {"hot_swap": 1.0, "stop": 1.0} and two.stops == 1
    # the second loss is at 110 s; the first lost node is back 30 min after 50 s (+detection): the wait
    wait = two.badput_seconds["waiting_for_spares"]
    assert wait == pytest.approx(50 + 6 + 1800 - (110 + 6), abs=1e-6)
    assert two.goodput < roomy.goodput - 0.5
    assert two.wall_seconds == pytest.approx(roomy.wall_seconds - 7 - 5 + 10 + wait, abs=1e-6)


def test_young_daly_optimum_is_found_by_the_sweep() -> None:
    """Save cost 10 s, job MTBF 10,000 s, steps of 1 s: the best interval is near √(2·δ·M) ≈ 447 steps."""
    rate = 86400 / 10_000 / 2  # per node-day, 2 nodes
    c = ClusterConfig(nodes=2, failures_per_node_day=rate, node_loss_share=0.0, hang_share=0.0, days=60)
    f = figures(save_stall_s=10.0, startup_s=0.0, launch_s=0.0, detect_s=ZERO,
                recovery_s={"restart": 0.0, "hot_swap": 0.0, "scale_down": 0.0, "scale_up": 0.0},
                restore_s={"local": 0.0, "peer": 0.0, "persistent": 0.0})
    sw = sweep(c, f, POLICIES / "default.py", trials=1, max_spares=0)
    young = math.sqrt(2 * 10.0 * 10_000)
    assert sw.young_daly_steps == pytest.approx(young)
    assert abs(sw.best_interval - young) / young < 0.25, [(p.ckpt_interval, round(p.goodput, 4)) for p in sw.points]


def test_same_seed_same_result_other_seed_other_draws() -> None:
    c = ClusterConfig(nodes=64, spares=2, failures_per_node_day=0.05, days=20)
    pol = POLICIES / "default.py"
    a = simulate(c, Figures(), pol, seed=7, trials=3)
    b = simulate(c, Figures(), pol, seed=7, trials=3)
    other = simulate(c, Figures(), pol, seed=8, trials=3)
    assert a.to_json() == b.to_json()
    assert other.failures != a.failures or other.goodput != a.goodput


@pytest.mark.parametrize("policy", sorted(p.name for p in POLICIES.glob("*.py")))
def test_every_shipped_policy_plans(policy: str) -> None:
    c = ClusterConfig(nodes=256, spares=4, min_nodes=250)
    r = simulate(c, Figures(), POLICIES / policy, trials=1)
    assert 15 < r.failures < 60 and 0.5 < r.goodput < 1.0
    assert r.productive_seconds + sum(r.badput_seconds.values()) == pytest.approx(r.wall_seconds)


def test_a_16k_gpu_month_is_planned_fast() -> None:
    """2,048 nodes × 8 GPUs for 30 days at Llama 3's rate: about 270 failures decided by the real core."""
    import time

    t = time.process_time()
    r = simulate(ClusterConfig(nodes=2048, spares=8), Figures(), POLICIES / "default.py", trials=1)
    assert time.process_time() - t < 10
    assert 150 < r.failures < 450 and 0.5 < r.goodput < 1.0


def test_fast_core_views_equal_the_core_views() -> None:
    """The planner's core renders the same views as the supervisor's, decision after decision."""
    rng = random.Random(3)
    cfg = SupervisorConfig(min_nodes=4, max_nodes=6, nproc_per_node=2, max_restarts=1000, node_timeout=1e12)
    pol = load_policy(POLICIES / "default.py")
    cores = [SupervisorCore(cfg, pol), _FastCore(cfg, load_policy(POLICIES / "default.py"))]
    for core in cores:
        for i in range(8):
            core.join(f"n{i}", 2, 0.0)
        core.form(0.0)
    t, k = 0.0, 8
    for _ in range(60):
        t += rng.uniform(1, 900)
        members = cores[0].assignment.members
        kind = rng.choice(["worker_exit", "hang", "agent_lost", "join"])
        outs = []
        for core in cores:
            if kind == "join":
                outs.append(core.join(f"n{k}", 2, t))
            else:
                node = members[int(t) % len(members)]
                ev = Event(kind=EventKind(kind), node=node, rank=0, attempt=None if kind == "agent_lost" else
                           core.assignment.attempt, details={"exit_code": 1}, wall=t, mono=t)
                outs.append(core.handle(ev, t))
        k += kind == "join"
        assert [d.action for d in outs[0]] == [d.action for d in outs[1]]
        v0, v1 = cores[0].view(t), cores[1].view(t)
        assert dict(v0.nodes) == dict(v1.nodes) and v0.members == v1.members and v0.spares == v1.spares
        if cores[0].stopped:
            break


@pytest.mark.parametrize("kw,what", [({"failures_per_node_day": -1.0}, "failure rate"), ({"nodes": 0}, "nodes"),
                                     ({"node_loss_share": 1.5}, "node_loss_share"), ({"ckpt_interval": 0}, "ckpt_interval"),
                                     ({"tiers": ("ssd",)}, "tiers"), ({"min_nodes": 9, "nodes": 4}, "min_nodes")])
def test_bad_cluster_config_is_refused_by_name(kw: dict, what: str) -> None:
    with pytest.raises(PlanInputError, match=what):
        ClusterConfig(**kw)


def test_bad_figures_are_refused_by_name() -> None:
    with pytest.raises(PlanInputError, match="step_s"):
        Figures(step_s=0)
    with pytest.raises(PlanInputError, match="detect_s"):
        Figures(detect_s={"worker_exit": 1.0})
