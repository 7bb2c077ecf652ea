"""Figures measured from a ledger, and a plan that replays the ledger's own faults gives back its goodput.

The ledger is written here event by event as a two-node drill writes it (``bench/plan_validation.py``): one
rank per node, a save every step, and restarts in place whose restores are labelled ``peer`` because each
rank also reads its partner's replica kept on its own disk. No process runs: this pins the arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.goodput.calculator import compute_report
from resilient.plan.api import ClusterConfig
from resilient.plan.inputs import figures_from, measure_events
from resilient.plan.sim import simulate

K = EventKind
POLICIES = Path(__file__).resolve().parents[2] / "policies"
STEP, STALL, RESTORE, DETECT, RECOVERY = 1.0, 0.1, 0.4, 0.05, 0.5


def ev(kind: EventKind, wall: float, attempt: int | None = None, node: str = "a", rank: int | None = None,
       **details) -> Event:
    return Event(kind=kind, node=node, rank=rank, attempt=attempt, details=details, wall=wall, mono=wall)


def drill_ledger(steps: int = 60, fault_after: tuple[int, ...] = (15, 30, 45),
                 startups: tuple[float, ...] = (0.6, 3.0, 0.9), fault_nodes: str = "bab") -> list[Event]:
    """Launch (2 s to the first step), steps of 1 s with a 0.1 s save stall inside, and after each step in
    ``fault_after`` a worker killed 0.3 s into the next step; each restart spends its ``startups`` entry before
    a 0.4 s restore of the last saved step (uneven start-ups: their median is not their mean). A warm spare
    registers just after the job formed, as a spare agent does."""
    members = ["a", "b"]
    out = [ev(K.RUN_START, 0.0, nnodes="2:2", nproc_per_node=1),
           ev(K.ACTION, 0.5, attempt=0, node="supervisor", action="start", round=0,
              assignment={"round": 0, "attempt": 0, "members": members, "spares": [], "nproc": {"a": 1, "b": 1}}),
           ev(K.NODE_JOINED, 0.8, node="s", nproc=1, spare=True)]
    t, attempt, step = 1.0, 0, 0
    out.append(ev(K.ATTEMPT_START, t, attempt=0, world_size=2))
    t += 1.0  # launch → first step
    faults = list(fault_after)
    while step < steps:
        if faults and step == faults[0]:
            faults.pop(0)
            fault, node = t + 0.3, fault_nodes[attempt]
            out += [ev(K.WORKER_EXIT, fault + DETECT, attempt=attempt, node=node, rank=members.index(node),
                       exit_code=-9, signal="SIGKILL", detect_seconds=DETECT),
                    ev(K.ACTION, fault + DETECT, attempt=attempt + 1, node="supervisor", action="restart",
                       round=attempt + 1, cause="worker_exit", cause_node=node,
                       assignment={"round": attempt + 1, "attempt": attempt + 1, "members": members,
                                   "spares": ["s"], "nproc": {"a": 1, "b": 1}}),
                    ev(K.RESTART, fault + DETECT + 0.01, attempt=attempt + 1, cause="peer_failed", detect_seconds=0.0,
                       action="restart")]
            startup = startups[attempt]
            attempt += 1
            t = fault + DETECT + RECOVERY
            out.append(ev(K.ATTEMPT_START, t, attempt=attempt, world_size=2))
            t += startup + RESTORE
            for r, node in enumerate(members):
                out.append(ev(K.CKPT_RESTORE, t, attempt=attempt, node=node, rank=r, step=step - 1, tier="peer",
                              seconds=RESTORE, bytes=60400, sources=["local", "peer"]))
        start, t = t, t + STEP
        out += [ev(K.CKPT_SAVE, start + 0.5, attempt=attempt, rank=0, step=step, blocking_seconds=STALL),
                ev(K.CKPT_TIER_DONE, start + 0.5, attempt=attempt, rank=0, step=step, tier="local", seconds=0.0),
                ev(K.CKPT_TIER_DONE, start + 0.5, attempt=attempt, rank=0, step=step, tier="peer", seconds=0.0),
                ev(K.STEP, t, attempt=attempt, rank=0, step=step, seconds=STEP)]
        step += 1
    out.append(ev(K.RUN_END, t + 0.5, exit_code=0))
    return out


def test_figures_from_a_drill_ledger() -> None:
    """The run restored only from ``peer`` (0.4 s): ``local`` may not keep its 10 s default, ``persistent`` keeps
    its own (slower than peer), a flag still wins."""
    m = measure_events(drill_ledger())
    f = figures_from(m, {})
    assert m.tiers == ("local", "peer") and m.nodes == 2 and m.spares == 1 and m.ckpt_interval == 1
    # each fault at its time from the launch, on the node it hit (index in the attempt's members)
    assert [(round(p.at, 2), p.kind, p.node) for p in m.schedule] == [
        (17.3, "worker_exit", 1), (34.15, "worker_exit", 0), (53.4, "worker_exit", 1)]
    # the plan adds one start-up per restart: the mean gives back the run's total, the median (0.9) would not
    assert f.startup_s == pytest.approx((0.6 + 3.0 + 0.9) / 3)
    assert f.restore_s["peer"] == pytest.approx(RESTORE) and f.source["restore_s[peer]"] == "ledger"
    assert f.restore_s["local"] == pytest.approx(RESTORE) and f.source["restore_s[local]"] == "ledger:peer"
    assert f.restore_s["persistent"] == 120.0 and f.source["restore_s[persistent]"] == "default"
    flagged = figures_from(m, {"restore_s": {"local": 7.0, "persistent": 0.1}})
    assert flagged.restore_s["local"] == 7.0 and flagged.source["restore_s[local]"] == "flag"
    assert flagged.restore_s["persistent"] == 0.1
    # nothing measured: the defaults stand as they are
    assert figures_from(None, {}).restore_s == {"local": 10.0, "peer": 20.0, "persistent": 120.0}
    # a slower tier given below a faster default pulls that default down, never the reverse
    low = figures_from(None, {"restore_s": {"peer": 3.0}})
    assert low.restore_s["local"] == 3.0 and low.source["restore_s[local]"] == "flag:peer"
    high = figures_from(None, {"restore_s": {"peer": 200.0}})
    assert high.restore_s["persistent"] == 200.0 and high.restore_s["local"] == 10.0


def test_replaying_a_drill_gives_back_its_goodput_category_by_category() -> None:
    """The plan of the ledger's own faults, with the figures measured from it, spends what the run spent (the
    restores: 3 × 0.4 s, not 3 × 10 s) and lands on its goodput. Even start-ups here: a replay puts each fault
    at its time from the launch, so a start-up off the mean would move the later faults within their step."""
    events = drill_ledger(startups=(1.2, 1.2, 1.2))
    rep = compute_report(events)
    m = measure_events(events)
    f = figures_from(m, {})
    cluster = ClusterConfig(nodes=m.nodes, gpus_per_node=1, spares=m.spares, ckpt_interval=m.ckpt_interval,
                            steps=rep.last_step + 1, failures_per_node_day=0.0, tiers=m.tiers)
    plan = simulate(cluster, f, POLICIES / "default.py", trials=1, faults=m.schedule)
    assert plan.actions == {"restart": 3.0}
    for cat in ("checkpoint_restore", "startup", "checkpoint_save_stall", "detection", "recovery",
                "wasted_progress"):
        assert plan.badput_seconds[cat] == pytest.approx(rep.badput_seconds[cat], abs=0.05), cat
    assert plan.wall_seconds == pytest.approx(rep.wall_seconds, abs=0.2)
    assert abs(plan.goodput - rep.goodput) < 0.005, (plan.goodput, rep.goodput)


def test_three_failures_of_one_node_replay_as_the_policy_decided() -> None:
    """scale_down_first drops a node at its third failure within the hour (the default policy asks for more:
    3 of 3 on one of 2 nodes is bad luck): a replay that keeps each fault on its node (and knows the spare
    that joined after the start) makes the same decision."""
    m = measure_events(drill_ledger(fault_nodes="bbb"))
    assert [p.node for p in m.schedule] == [1, 1, 1] and m.spares == 1
    c = ClusterConfig(nodes=2, gpus_per_node=1, spares=m.spares, ckpt_interval=1, steps=60,
                      failures_per_node_day=0.0, tiers=m.tiers, min_nodes=1)
    f = figures_from(m, {})
    assert simulate(c, f, POLICIES / "scale_down_first.py", trials=1, faults=m.schedule).actions == {
        "restart": 2.0, "scale_down": 1.0}
