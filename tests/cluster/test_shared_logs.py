"""Nodes that share one run directory (the default when it is on a shared volume) each keep their own worker logs
and error files: two agents, one worker each (both local rank 0), one ``--run-dir``. Keyed by local rank, the
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
    c = cluster_factory("2", flags=["--max-restarts", "0", "--redirects", "3"], script=SCRIPT)
    nodes = [c.start(n, []) for n in ("a", "b")]
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 180, "the job to end")
    assert all(n.proc.returncode != 0 for n in nodes), [n.output() for n in nodes]
    logs = c.run_dir / "logs" / "attempt_0"
    for rank in (0, 1):
        out = (logs / str(rank) / "stdout.log").read_text()
        assert out.startswith(f"rank {rank} of 2 on pid "), (rank, out)
    err = json.loads((logs / "1" / "error.json").read_text())
    assert "rank 1 fails on purpose" in err["message"]["message"], err
    assert not (logs / "0" / "error.json").exists()  # rank 0 ended cleanly: no other node's failure in its place
    exits = [e for e in c.events() if e.kind == EventKind.WORKER_EXIT]
    assert [(e.rank, e.details.get("exc_type"), e.details.get("failure_class")) for e in exits] == \
        [(1, "ValueError", "software")], [e.details for e in exits]
    assert "rank 1 fails on purpose" in exits[0].details["message"]
