"""A spare that arrives as the job ends: it must end the way the job did, promptly, and never wait on (or fail
against) a store whose host is closing. Its fork server is held mid-import by a ``--preload`` module that waits
for a file the test never writes, so the job's end is certain to come while it warms up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient.events.api import EventKind

from .conftest import REPO, wait_for
from .test_node_loss import node_name

# imported by the spare's fork server: says so, then waits (bounded) for a release the test never gives
SLOW_IMPORT = """\
import os, time
from pathlib import Path

_here = Path(__file__).parent
(_here / f"importing-{os.getpid()}").write_text("")
_deadline = time.monotonic() + 120
while not (_here / "release").exists() and time.monotonic() < _deadline:
    time.sleep(0.05)
"""


@pytest.mark.timeout(200)
def test_spare_warming_up_as_the_job_ends_exits_as_the_job_did(cluster_factory, tmp_path: Path) -> None:
    c = cluster_factory("1", flags=["--spare-nodes", "1", "--node-timeout", "20"])
    out, gate, mods = tmp_path / "out", tmp_path / "gate", tmp_path / "mods"
    for d in (out, gate, mods):
        d.mkdir()
    (mods / "slow_import_gate.py").write_text(SLOW_IMPORT)
    args = ["--out", str(out), "--steps", "4", "--gate", str(gate), "--gate-step", "2"]
    host = c.start("n0", args)
    wait_for(lambda: (gate / "at-0").exists() or host.proc.poll() is not None, 90, "the job to reach its gate")
    assert host.proc.poll() is None, host.output()

    spare = c.start("n1", args, extra=["--preload", "slow_import_gate"],
                    env={"PYTHONPATH": f"{mods}{os.pathsep}{REPO}"})
    wait_for(lambda: any(mods.glob("importing-*")) or spare.proc.poll() is not None, 90,
             "the spare's fork server to start its slow import")
    name = node_name(spare)
    wait_for(lambda: any(e.kind == EventKind.NODE_ARRIVING and e.node == name for e in c.events())
             or spare.proc.poll() is not None, 60, "the supervisor to know the spare as arriving")
    assert spare.proc.poll() is None, spare.output()

    (gate / "go").write_text("")  # the job finishes while the spare is still importing
    wait_for(lambda: host.proc.poll() is not None and spare.proc.poll() is not None, 90, "both agents to exit")
    assert host.proc.returncode == 0, host.output()
    assert spare.proc.returncode == 0, spare.output()
    assert "before this node joined" in spare.text(), spare.output()
    assert not (mods / "release").exists()  # it never finished warming up: it left on the job's end alone
    wait_for(lambda: not c.leftovers(), 30, "nothing of either agent (the spare's fork server included) to outlive it")
    ends = {e.node: e.details["exit_code"] for e in c.events() if e.kind == EventKind.RUN_END}
    assert ends.get(name) == 0, ends
