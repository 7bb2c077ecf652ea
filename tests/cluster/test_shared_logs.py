"""Nodes that share one run directory (the default when it is on a shared volume) each keep their own worker logs
and error files: two agents of two workers each (local ranks 0 and 1 on both), one ``--run-dir``. Keyed by local rank, the
second node's worker wrote over the first node's files, and an agent could read the other node's error file, or
one being truncated (its worker's failure then read as unknown, and restarted rather than stopped on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient.events.api import EventKind

from .conftest import cluster_factory, wait_for  # noqa: F401 - the fixture

SCRIPT = Path(__file__).resolve().parent / "one_rank_fails.py"


@pytest.mark.timeout(240)
def test_two_nodes_in_one_run_dir_keep_their_own_logs_and_error_files(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    c = cluster_factory("2", flags=["--max-restarts", "0", "--redirects", "3"], nproc=2,
                          script=SCRIPT)
    nodes = [c.start(n, []) for n in ("a", "b")]
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 180, "the job to end")
    assert all(n.proc.returncode != 0 for n in nodes), [n.output() for n in nodes]
    logs = c.run_dir / "logs" / "attempt_0"
    for rank in range(4):
        out = (logs / str(rank) / "stdout.log").read_text()
        assert out.startswith(f"rank {rank} of 4 on pid "), (rank, out)
    err = json.loads((logs / "3" / "error.json").read_text())
    assert "rank 3 fails on purpose" in err["message"]["message"], err
    for rank in range(3):  # they ended cleanly: no other node's failure in their place
        assert not (logs / str(rank) / "error.json").exists(), rank
    exits = [e for e in c.events() if e.kind == EventKind.WORKER_EXIT]
    assert [(e.rank, e.details.get("exc_type"), e.details.get("failure_class")) for e in exits] == \
        [(3, "ValueError", "software")], [e.details for e in exits]
    assert "rank 3 fails on purpose" in exits[0].details["message"]
