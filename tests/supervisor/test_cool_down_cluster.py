"""A benched node comes back, on real processes: three agents (2 nodes and a spare) under the real launcher; a
worker kill makes the policy swap its node out with a 1 s cool-down; the node's agent, still connected, is a
spare again after it; then the node that took its place is SIGKILLed whole, and the benched node takes the place back and the job
finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.events.api import EventKind
from tests.cluster.conftest import cluster_factory, wait_for  # noqa: F401 - the fixture is used by name
from tests.cluster.test_node_loss import NPROC, WORLD, _listening, node_name

# blames a node at its first failure (bad luck 50% < 99%): the swap this test needs, at once
POLICY = ("from resilient.supervisor.default_policy import DefaultPolicy\n\n"
          "policy = DefaultPolicy(failures_to_swap=1, luck=0.99, cool_down=1.0)\n")


GATE = 6  # the gate's step: the worker kill (at 3 s) comes before it or while the ranks wait there


def actions(evs: list, kind: str) -> list[dict]:
    return [e.details for e in evs if e.kind == EventKind.ACTION and e.details.get("action") == kind]


@pytest.mark.timeout(240)
def test_benched_node_returns_as_a_spare_and_takes_a_place_again(cluster_factory, tmp_path: Path) -> None:
    (tmp_path / "policy.py").write_text(POLICY)
    out = tmp_path / "out"
    # the killed worker is the last rank: on group rank 1's node, which b and the spare race for
    # the ranks wait at the gate (no steps, no heartbeats: no hang must be declared) from step GATE until the
    # benched node is back and the node that took its place is lost: the job cannot end before, however slow a
    # phase is under load, and runs only a few steps after
    c = cluster_factory("2", nproc=NPROC,
                        flags=["--spare-nodes", "1", "--max-restarts", "5", "--node-timeout", "20",
                               "--heartbeat-timeout", "600", "--policy", str(tmp_path / "policy.py"),
                               "--inject", f"kill-worker:{WORLD - 1}@3s"])
    gate = tmp_path / "gate"
    gate.mkdir()
    # 14 steps x 8 samples per rank, 4 ranks: within one epoch of 8192. A run restored at the gate step (after the
    # worker kill, or the node loss) waits there too
    args = ["--steps", "14", "--step-sleep", "0.12", "--samples", "8192", "--out", str(out),
            "--gate", str(gate), "--gate-step", str(GATE), "--gate-on-resume"]
    a = c.start("a", args)
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "the first agent to host the store")
    nodes = {node_name(n): n for n in (a, c.start("b", args), c.start("spare", args))}

    wait_for(lambda: actions(c.events(), "hot_swap") or a.proc.poll() is not None, 120, "the first swap")
    (swap,) = actions(c.events(), "hot_swap")
    benched, taker = swap["action_args"]["node"], swap["action_args"]["spare"]
    # b and the spare join together: either may hold group rank 1 (killed) and the other wait as the spare
    assert swap["action_args"]["cool_down"] == 1.0 and nodes[benched] is not a and nodes[taker] is not a, swap
    benched_node, taker_node = nodes[benched], nodes[taker]

    def back() -> list:
        return [e for e in c.events() if e.kind == EventKind.NODE_JOINED and e.node == benched
                and e.details.get("after") == "cool_down"]

    wait_for(lambda: back() or a.proc.poll() is not None, 60, "the benched node to be a spare again")
    assert back(), a.output()
    assert benched_node.proc.poll() is None  # its agent waited, warm, the whole time

    # every rank of the round after the swap at the gate (its file written after that round's start): the node loss
    # below then finds no step running, the same for every run
    def round_at_gate() -> bool:
        since = [e.wall for e in c.events() if e.kind == EventKind.ATTEMPT_START and (e.attempt or 0) >= 1]
        files = [gate / f"at-{r}" for r in range(WORLD)]
        return bool(since) and all(f.exists() and f.stat().st_mtime >= max(since) for f in files)

    wait_for(lambda: round_at_gate() or a.proc.poll() is not None, 60, "the round after the swap at the gate")
    assert round_at_gate(), a.output()
    taker_node.kill()  # the node that took its place is lost: the benched one, a spare again, takes it back
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and benched_node.proc.poll() is not None, 180, "the job to finish")
    assert a.proc.returncode == 0 and benched_node.proc.returncode == 0, a.output() + benched_node.output()
    swaps = [d["action_args"] for d in actions(c.events(), "hot_swap")]
    assert [(x["node"], x["spare"]) for x in swaps] == [(benched, taker), (taker, benched)], swaps
    assert swaps[1]["cool_down"] is None  # a lost node needs no bench: it comes back by joining
    assert all((out / f"rank{r}.pt").exists() for r in range(WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
