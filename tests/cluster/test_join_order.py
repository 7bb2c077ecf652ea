"""Nodes of one job start in any order, and one that waits for the others says so.

A node started before the one hosting the store, and a host whose peers are late, used to wait in silence for up
to ``--rendezvous-timeout`` / ``join_timeout`` (900 s / 600 s): to a user that looks like a hang.
"""

from __future__ import annotations

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
