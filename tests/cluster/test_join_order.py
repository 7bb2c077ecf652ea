"""Nodes of one job start in any order, and one that waits for the others says so.

A node started before the one hosting the store, and a host whose peers are late, used to wait in silence for up
to ``--rendezvous-timeout`` / ``join_timeout`` (900 s / 600 s): to a user that looks like a hang.
"""

from __future__ import annotations

import json

import pytest

from .conftest import wait_for


@pytest.mark.timeout(240)
def test_nodes_started_in_any_order_say_what_they_wait_for_and_form_the_job(cluster_factory, tmp_path) -> None:
    c = cluster_factory("3")
    out = tmp_path / "out"
    args = ["--steps", "3", "--out", str(out)]
    # a node that never hosts, started first: nothing listens at the endpoint yet
    early = c.start("early", args, extra=["--rdzv-conf", "is_host=false"])
    wait_for(lambda: "no job's store answers at 127.0.0.1" in early.text(), 60,
             "the early node to say it waits for the store", proc=early.proc)
    host = c.start("host", args)
    # two of three joined: the host's supervisor says the job is forming, with who came
    wait_for(lambda: "the job is forming: 2 of --nnodes MIN 3 node(s) joined" in host.text(), 60,
             "the host to say the job is forming", proc=host.proc)
    assert early.proc.poll() is None, early.output()
    last = c.start("last", args)
    nodes = [early, host, last]
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 150, "the job to end")
    assert [n.proc.returncode for n in nodes] == [0, 0, 0], [n.output() for n in nodes]
    assert sorted(p.name for p in out.glob("rank*.pt")) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    # the lines are progress, not failures: none of torch's connect traces while the early node waited
    assert "TCP client failed to connect" not in early.text(), early.output()


PROBE = """import json, os, sys
keys = ("RANK", "GROUP_RANK", "LOCAL_RANK", "RESILIENT_NODE")
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
"""


@pytest.mark.timeout(240)
def test_static_rendezvous_gives_group_ranks_by_node_rank_not_by_join_order(cluster_factory, tmp_path) -> None:
    # torchrun's static rendezvous: --node-rank N gets group rank N, whoever joins first (scripts and schedulers
    # rely on node 0 holding rank 0). Node rank 1 starts first and has joined before node rank 0 is started.
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    c = cluster_factory("2", nproc=2, script=probe)
    static = ["--rdzv-backend", "static", "--node-rank"]
    first = c.start("first", [str(out)], extra=[*static, "1"], env={"RESILIENT_LOG_LEVEL": "INFO"})
    wait_for(lambda: "joined (2 workers)" in first.text(), 90, "node rank 1 to join", proc=first.proc)
    second = c.start("second", [str(out)], extra=[*static, "0"])
    nodes = [first, second]
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 150, "the job to end")
    assert [n.proc.returncode for n in nodes] == [0, 0], [n.output() for n in nodes]
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(got) == [0, 1, 2, 3], got
    node_of = {f"{n}": d["RESILIENT_NODE"].rsplit(":", 1)[1] for n, d in got.items()}
    assert {node_of["0"], node_of["1"]} == {str(second.proc.pid)}, (got, second.proc.pid)
    assert {node_of["2"], node_of["3"]} == {str(first.proc.pid)}, (got, first.proc.pid)
    assert [got[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"], got
    assert [got[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"], got
