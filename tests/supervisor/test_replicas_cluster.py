"""Replicas as the unit of elasticity, on real processes: four agents (1 worker each, each its own session and local
tier) run ``--nodes-per-replica 2 --nnodes 2:4``, two replicas of two nodes, no spare. A node of the replica that
does not host the store is lost (SIGKILL of its session, its local tier deleted): the job drops that replica and goes
on with the other (2 nodes, data-parallel size 1), the broken replica's healthy node a warm spare at once (ledger
``node_benched``); a fresh agent in the lost node's place makes a replica again with the benched one, and the job
grows back to 2 replicas at the next checkpoint boundary and finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.events.api import EventKind
from tests.cluster.conftest import cluster_factory, wait_for  # noqa: F401 - the fixture is used by name
from tests.cluster.test_node_loss import _listening, at_gate, node_name


def assignments(evs: list) -> list[tuple[str, dict]]:
    """(action, assignment) of every decision that set one, in ledger order."""
    return [(e.details["action"], e.details["assignment"]) for e in evs
            if e.kind == EventKind.ACTION and isinstance(e.details.get("assignment"), dict)]


@pytest.mark.timeout(300)
def test_lost_node_drops_its_replica_benches_its_partner_and_the_job_grows_back(cluster_factory, tmp_path: Path):
    # the gates are pauses this test makes, not hangs: a fixed heartbeat timeout longer than any of them; a restored
    # attempt waits at its gate again, so the scale-up (at a checkpoint boundary) comes before the job's end
    c = cluster_factory("2:4", flags=["--nodes-per-replica", "2", "--max-restarts", "6", "--node-timeout", "20",
                                      "--heartbeat-timeout", "300", "--rdzv-conf", "last_call_timeout=300"])
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", "14", "--out", str(out), "--gate", str(gate), "--gate-step", "4", "8", "12", "--gate-on-resume"]
    host = c.start("a", args)
    wait_for(lambda: _listening(c.port) or host.proc.poll() is not None, 60, "the first agent to host the store")
    agents = [host] + [c.start(n, args) for n in ("b", "c", "d")]
    by_name = {node_name(n): n for n in agents}
    wait_for(lambda: at_gate(gate, 4) or any(n.proc.poll() is not None for n in agents), 120, "4 ranks at the gate")
    assert at_gate(gate, 4), host.output()

    [(kind, start)] = assignments(c.events())
    assert kind == "start" and start["nodes_per_replica"] == 2 and len(start["members"]) == 4, start
    replicas = [start["members"][:2], start["members"][2:]]
    broken = next(r for r in replicas if node_name(host) not in r)
    kept = next(r for r in replicas if r is not broken)
    victim, partner = by_name[broken[1]], by_name[broken[0]]
    victim.kill()
    wait_for(lambda: any(k == "scale_down" for k, _ in assignments(c.events())) or host.proc.poll() is not None, 60,
             "the broken replica to be dropped")
    # the fresh agent warms up (seconds of imports) while the job goes on on one replica
    repaired = c.start("repaired", args)
    (gate / "go").touch()

    wait_for(lambda: at_gate(gate, 2, "-8") or host.proc.poll() is not None, 90, "the job to go on on one replica")
    evs = c.events()
    benched = [e.details for e in evs if e.kind == EventKind.NODE_BENCHED]
    assert [(b["node"], b["replica_nodes"]) for b in benched] == [(broken[0], broken)], benched
    assert benched[0]["reason"] and isinstance(benched[0]["replica"], int)
    assert partner.proc.poll() is None  # its agent waits, warm

    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(repaired) for e in c.events())
             or host.proc.poll() is not None, 90, "the fresh agent to join")
    (gate / "go-8").touch()
    wait_for(lambda: any(k == "scale_up" for k, _ in assignments(c.events())) or host.proc.poll() is not None, 120,
             "the scale-up to be carried out")
    (gate / "go-12").touch()
    live = [by_name[n] for n in kept] + [partner, repaired]
    wait_for(lambda: all(n.proc.poll() is not None for n in live), 150, "the job to end")
    assert all(n.proc.returncode == 0 for n in live), "\n".join(n.output() for n in live)

    seq = [(k, a["members"], a["dp_size"], a["previous_dp_size"]) for k, a in assignments(c.events())]
    grown = [k for k, *_ in seq].index("scale_up")
    assert seq[:2] == [("start", start["members"], 2, None), ("scale_down", kept, 1, 2)], seq
    up = seq[grown]
    assert up[1][:2] == kept and set(up[1][2:]) == {broken[0], node_name(repaired)} and up[2:] == (2, 1), seq
    assert all(k == "restart" for k, *_ in seq[2:grown]), seq  # nothing else moved in between
    assert all((out / f"rank{r}.pt").exists() for r in range(4))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
