"""Real agents: two partner nodes lost at once, their shards only on each other. The spares take their places,
every worker's restore finds no usable step, and the job stops within that one attempt naming the missing shards
(not a round of restarts that can only fail the same way)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from tests._helpers.procs import kill_sessions
from tests.cluster.conftest import REPO, cluster_factory, wait_for  # noqa: F401 - the fixture

from tests.cluster.test_node_loss import _listening, node_name


@pytest.mark.timeout(300)
def test_two_partner_nodes_lost_stop_naming_the_missing_shards(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    # one worker per node: the point is the restore's failure class and its stop, not the worker count (five
    # agents of two workers each would cost a loaded machine more than the case is worth)
    c = cluster_factory("3", flags=["--spare-nodes", "2", "--max-restarts", "100", "--node-timeout", "20",
                                    "--heartbeat-timeout", "300"])
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", "8", "--out", str(out), "--gate", str(gate), "--gate-step", "3"]
    a = c.start("a", args)
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "the first agent to host the store")
    others = [c.start(n, args) for n in ("n1", "n2", "n3", "n4")]  # start together: their imports overlap
    wait_for(lambda: all((gate / f"at-{r}").exists() for r in range(3)), 150, "every rank at the gate")
    ranks = {e.node: e.details["group_rank"] for e in c.events() if e.kind == EventKind.RENDEZVOUS_DONE}
    by_rank = {ranks.get(node_name(n)): n for n in [a, *others]}
    assert by_rank[0] is a, ranks
    b, cc = by_rank[1], by_rank[2]
    spares = [n for n in others if n not in (b, cc)]
    wait_for(lambda: {node_name(s) for s in spares} <= _warm_spares(c.events()), 90, "both spares to be warm")
    # rank 1's shards are on its node and on its partner, rank 2's node (the peer ring sends node i's to node i+1)
    kill_sessions([b.proc, cc.proc])  # both nodes at once: agents, fork servers, workers
    for n in (b, cc):
        shutil.rmtree(n.local, ignore_errors=True)  # and their local disks
    wait_for(lambda: a.proc.poll() is not None and all(s.proc.poll() is not None for s in spares), 150,
             "the job to end")
    assert a.proc.returncode == 1, a.output()
    evs = c.events()
    acts = [e.details for e in evs if e.kind == EventKind.ACTION]
    kinds = [d["action"] for d in acts]
    brief = [(d["action"], d.get("cause"), d.get("cause_node"), d.get("failure_class"), str(d.get("reason"))[:120])
             for d in acts]  # the whole list, which pytest's repr of the dicts would cut in the middle
    assert kinds[-1] == "stop" and "restart" not in kinds, brief
    stop = acts[-1]
    assert stop["failure_class"] == "state_unrecoverable", stop
    assert "rank(s) 1" in stop["reason"] and "persistent tier" in stop["reason"], stop["reason"]
    # one attempt after the swaps, not a round of futile restarts
    failed_attempts = {e.attempt for e in evs if e.kind == EventKind.WORKER_EXIT
                       and e.details.get("failure_class") == "state_unrecoverable"}
    assert len(failed_attempts) == 1, failed_attempts
    assert max(e.attempt for e in evs if e.kind == EventKind.ATTEMPT_START) == failed_attempts.pop()
    undefined = [e for e in evs if e.kind == EventKind.CKPT_TIER_FAILED and e.details.get("state_undefined")]
    assert undefined and undefined[0].details["restore"]["why"], [e.details for e in undefined]
    report = _goodput(c.run_dir)  # what the ledger records, the report shows
    assert "state undefined: committed steps" in report and "persistent tier" in report, report
    assert "failures by class:" in report and "state_unrecoverable" in report, report


def _warm_spares(events: list) -> set[str]:
    """The nodes the ledger shows waiting as warm spares (an agent joins only once its fork server is warm): those
    that joined after the job started (``node_joined`` with ``spare``), and those that joined before the first
    decision and were left out of it, named only in the start action's ``spares`` (under load, every agent can
    join before the supervisor starts the job)."""
    warm = {e.node for e in events if e.kind == EventKind.NODE_JOINED and e.details.get("spare")}
    for e in events:
        if e.kind == EventKind.ACTION and e.details.get("action") == "start":
            warm |= set((e.details.get("assignment") or {}).get("spares") or ())
    return warm


def _goodput(run_dir: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(run_dir)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.timeout(240)
def test_a_spare_killed_while_waiting_is_in_the_ledger(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    # one worker per node: the point is the ledger's record of a lost spare (which runs no workers)
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "20",
                                    "--heartbeat-timeout", "300"])
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", "5", "--out", str(out), "--gate", str(gate), "--gate-step", "2"]
    a = c.start("a", args)
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "the first agent to host the store")
    b, spare = c.start("b", args), c.start("spare", args)  # the later of the two to join is the spare
    wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 150, "both ranks at the gate")
    ranks = {e.node: e.details["group_rank"] for e in c.events() if e.kind == EventKind.RENDEZVOUS_DONE}
    if node_name(spare) in ranks and node_name(b) not in ranks:
        b, spare = spare, b
    wait_for(lambda: node_name(spare) in _warm_spares(c.events()), 90, "the spare to join")
    spare.kill()
    wait_for(lambda: any(e.kind == EventKind.SPARE_LOST for e in c.events()), 60, "the spare's loss in the ledger")
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to end")
    assert a.proc.returncode == 0 and b.proc.returncode == 0, a.output()  # a lost spare decides nothing
    lost = [e for e in c.events() if e.kind == EventKind.SPARE_LOST]
    assert [(e.node, e.details["cause"]) for e in lost] == [(node_name(spare), "disconnected")], lost
    assert f"spares lost: 1: {node_name(spare)} (disconnected)" in _goodput(c.run_dir)


SLOW_WARM = '''
import os
import time

with open(os.environ["WARM_DIR"] + "/warming", "w"):
    pass
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["WARM_DIR"] + "/warm") and time.monotonic() < deadline:
    time.sleep(0.02)
'''


@pytest.mark.timeout(300)
def test_a_lost_node_waits_for_a_spare_still_warming(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "20",
                                    "--heartbeat-timeout", "300"])
    gate, out, warm = tmp_path / "gate", tmp_path / "out", tmp_path / "warm"
    gate.mkdir()
    warm.mkdir()
    (warm / "slowwarm.py").write_text(SLOW_WARM)
    args = ["--steps", "5", "--out", str(out), "--gate", str(gate), "--gate-step", "2"]
    a = c.start("a", args)
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "the first agent to host the store")
    b = c.start("b", args)
    wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 150, "both ranks at the gate")
    # a spare whose fork server is still importing (a preload that waits for WARM_DIR/warm)
    spare = c.start("spare", args, extra=["--preload", "slowwarm"],
                    env={"WARM_DIR": str(warm), "PYTHONPATH": os.pathsep.join([str(warm), str(REPO)])})
    wait_for(lambda: any(e.kind == EventKind.NODE_ARRIVING and e.node == node_name(spare) for e in c.events()), 90,
             "the spare to connect")
    b.kill()
    wait_for(lambda: any(e.kind == EventKind.ACTION and e.details["action"] == "ignore"
                         and "joining spare" in e.details["reason"] for e in c.events()), 60,
             "the supervisor to wait for the joining spare")
    (warm / "warm").touch()  # the spare finishes warming up and joins
    wait_for(lambda: any(e.kind == EventKind.ACTION and e.details["action"] == "hot_swap" for e in c.events()), 90,
             "the swap")
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and spare.proc.poll() is not None, 150, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert spare.proc.returncode == 0, spare.output()
    acts = [e.details for e in c.events() if e.kind == EventKind.ACTION and e.details["action"] != "start"]
    assert [d["action"] for d in acts[:2]] == ["ignore", "hot_swap"], acts
    assert acts[1]["action_args"] == {"action": "hot_swap", "node": node_name(b), "spare": node_name(spare),
                                      "cool_down": None, "reason": acts[1]["reason"]}, acts[1]
    assert "stop" not in [d["action"] for d in acts], acts
