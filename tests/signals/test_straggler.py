"""Straggler detection: real gloo ranks, one slowed by a sleep, on a hand-written loop and on DDP."""
import os
import random
import statistics
import time

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.signals.straggler import StragglerConfig, StragglerScorer
from tests._helpers.load import cpu_burners
from tests.signals.harness import kinds


def run(a, nproc, env, timeout=120):
    a.spawn(nproc, env)
    a.pump(lambda ev: a.all_exited(), timeout)
    a.pump_for(0.3)
    assert [p.returncode for p in a.procs] == [0] * nproc
    return kinds(a.events, EventKind.STRAGGLER)


@pytest.mark.timeout(150)
def test_slow_rank_flagged_in_allreduce_loop_and_healthy_ranks_never(make_agent):
    # three ranks on two shared cores (noisy), rank 2 made 2x slower from step 10
    a = make_agent(heartbeat_timeout=30.0)
    found = run(a, 3, {"T_STEPS": "40", "T_MODE": "allreduce", "T_WORK": "0.03", "T_SLOW_RANK": "2",
                       "T_SLOW_EXTRA": "0.03", "T_SLOW_FROM": "10"})
    assert {e.rank for e in found} == {2}, [(e.rank, e.details) for e in found]
    first = min(found, key=lambda e: e.details["step"])
    assert first.details["reference"] == "peers" and first.details["step"] <= 10 + 20
    assert first.details["score"] < 0.75 and first.details["local_rank"] == 2
    # the node summary a supervisor would compare across nodes
    summ = a.monitor.summary(time.monotonic())
    assert summ["ranks"][2]["peers_score"] < 0.75 <= summ["ranks"][0]["peers_score"]
    assert summ["ranks"][2]["median_compute"] > summ["ranks"][0]["median_compute"] > 0
    assert summ["heartbeat_timeout"] == 30.0 and all(r["done"] for r in summ["ranks"].values())


@pytest.mark.timeout(150)
def test_slow_rank_flagged_in_unmodified_ddp_script(make_agent):
    a = make_agent(heartbeat_timeout=30.0)
    found = run(a, 2, {"T_STEPS": "35", "T_MODE": "ddp", "T_WORK": "0.03", "T_SLOW_RANK": "1",
                       "T_SLOW_EXTRA": "0.03", "T_SLOW_FROM": "5"})
    assert {e.rank for e in found} == {1}, [(e.rank, e.details) for e in found]
    assert min(e.details["step"] for e in found) <= 5 + 20


@pytest.mark.timeout(150)
def test_no_straggler_among_equal_ranks_under_cpu_contention(make_agent):
    a = make_agent(heartbeat_timeout=30.0)
    found = run(a, 3, {"T_STEPS": "50", "T_MODE": "ddp", "T_WORK": "0.02"})
    assert not found, [(e.rank, e.details) for e in found]


@pytest.mark.timeout(150)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one shared with burners, one not")
def test_a_rank_kept_waiting_for_a_cpu_is_not_a_straggler(make_agent):
    # Equal work (20 ms of CPU a step) on both ranks. Once both run steps, rank 0's training thread shares its CPU
    # with two busy processes and is niced below them; rank 1's has a CPU to itself. Rank 0's steps then take far
    # longer, but the extra is time it was runnable and waiting for the core (its run-queue delay), not its own
    # work: no straggler. Before that delay was taken out of own work, rank 0 was flagged.
    cpu0, cpu1 = sorted(os.sched_getaffinity(0))[:2]
    a = make_agent(heartbeat_timeout=60.0, straggler_window=6, straggler_confirm=3)
    procs = a.spawn(2, {"T_STEPS": "30", "T_MODE": "allreduce", "T_WORK": "0.02"})
    a.pump(lambda ev: all((v["step"] or 0) >= 1 for v in a.monitor.summary(time.monotonic())["ranks"].values()), 90)
    with cpu_burners(2, max_seconds=120) as burners:
        for b in burners:
            os.sched_setaffinity(b.pid, {cpu0})
        os.sched_setaffinity(procs[0].pid, {cpu0})  # the process's first thread: the training thread
        os.setpriority(os.PRIO_PROCESS, procs[0].pid, 5)
        os.sched_setaffinity(procs[1].pid, {cpu1})
        a.pump(lambda ev: a.all_exited(), 110)
    a.pump_for(0.3)
    assert [p.returncode for p in a.procs] == [0, 0]
    found = kinds(a.events, EventKind.STRAGGLER)
    assert not found, [(e.rank, e.details) for e in found]
    # the contention was real: rank 0's steps (ledger: rank 0 records them) took over twice its own work
    steps = [e.details for e in read_events(a.run_dir) if e.kind == EventKind.STEP and e.details["step"] >= 8]
    wall = statistics.median(d["seconds"] for d in steps)
    own = statistics.median(d["compute_seconds"] for d in steps)
    assert wall > 2 * own, (wall, own, len(steps))


def _feed(scorer, series):
    out = []
    for step, row in enumerate(series):
        for rank, x in enumerate(row):
            out += scorer.add(rank, step, x)
    return out


def test_scores_against_peers_and_own_history():
    cfg = StragglerConfig(window=5, confirm=2, min_gap=0.001, warmup=1)
    rng = random.Random(0)
    sc = StragglerScorer(cfg)
    sc.reset({0, 1})
    # 20 healthy steps with +-20% noise, then rank 1 doubles its work
    series = [[0.1 * rng.uniform(0.8, 1.2), 0.1 * rng.uniform(0.8, 1.2)] for _ in range(20)]
    assert _feed(sc, series) == []
    slow = [[0.1 * rng.uniform(0.8, 1.2), 0.2 * rng.uniform(0.8, 1.2)] for _ in range(10)]
    found = _feed(sc, slow)
    refs = {(f.rank, f.reference) for f in found}
    assert refs == {(1, "peers"), (1, "history")}
    assert all(f.step < 20 + 8 for f in found)
    peers, hist = sc.scores()[1]
    assert peers < 0.75 and hist < 0.75
    # flagged once per episode
    assert _feed(sc, slow) == []


def test_whole_node_slowdown_shows_in_history_only():
    sc = StragglerScorer(StragglerConfig(window=4, confirm=2, min_gap=0.001, warmup=0))
    sc.reset({0})
    found = _feed(sc, [[0.1]] * 10 + [[0.3]] * 10)
    assert [(f.rank, f.reference) for f in found] == [(0, "history")]
    assert found[0].history_score == pytest.approx(1 / 3)


def test_below_min_gap_is_noise():
    sc = StragglerScorer(StragglerConfig(window=4, confirm=1, min_gap=0.01, warmup=0))
    sc.reset({0, 1})
    assert _feed(sc, [[0.001, 0.004]] * 20) == []  # 4x slower, but by 3 ms only


def test_peers_are_the_same_position_in_every_replica():
    # replicas of two ranks {0, 1} and {2, 3}: position 1 does 3x the work of position 0 (another shard)
    sc = StragglerScorer(StragglerConfig(window=4, confirm=2, min_gap=0.001, warmup=0))
    sc.reset({0, 1, 2, 3}, ranks_per_replica=2)
    assert _feed(sc, [[0.1, 0.3, 0.1, 0.3]] * 12) == []
    assert {r: round(p, 3) for r, (p, _h) in sc.scores().items()} == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    found = _feed(sc, [[0.1, 0.3, 0.1, 0.6]] * 8)  # rank 3 slows down: its peer is rank 1
    peers = [f for f in found if f.reference == "peers"]
    assert [(f.rank, f.reference_seconds) for f in peers] == [(3, 0.3)]
    # the same series with every rank a replica: position 1 is a straggler from the start
    sc.reset({0, 1, 2, 3})
    assert {f.rank for f in _feed(sc, [[0.1, 0.3, 0.1, 0.3]] * 12) if f.reference == "peers"} == {1, 3}
    with pytest.raises(ValueError, match="ranks_per_replica"):
        sc.reset({0}, ranks_per_replica=0)
