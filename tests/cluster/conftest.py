"""Several node agents on one machine: each its own session (so a node is killed as a whole), its own local
tier, one rendezvous endpoint over loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from tests._helpers.gcs import free_port
from tests._helpers.procs import kill_sessions, session_procs
from tests._helpers.wait import wait_for  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).resolve().parent / "train.py"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


class Node:
    def __init__(self, name: str, proc: subprocess.Popen, local: Path, log: Path):
        self.name, self.proc, self.local, self.log = name, proc, local, log

    def kill(self) -> None:
        """A lost node: agent, fork server and workers SIGKILLed at once, its local disk gone."""
        kill_sessions([self.proc])
        shutil.rmtree(self.local, ignore_errors=True)

    def output(self) -> str:
        """The log's end, for assertion messages."""
        return self.text()[-6000:]

    def text(self) -> str:
        """The whole log, for searching (torch's C++ tracebacks can push a line out of the end)."""
        return self.log.read_text(errors="replace")


# per-step lines: they would drown out the decisions in a failure report
_CHATTY = {EventKind.STEP, EventKind.LOG, EventKind.SECTION, EventKind.CKPT_SAVE, EventKind.CKPT_TIER_DONE}


class Cluster:
    def __init__(self, tmp: Path, nnodes: str, *, flags: list[str] | None = None, port: int | None = None,
                 nproc: int = 1, script: Path = TRAIN):
        self.tmp, self.nnodes, self.flags, self.nproc, self.script = tmp, nnodes, list(flags or []), nproc, script
        self.port = port or free_port()
        self.run_dir = tmp / "run"
        self.nodes: list[Node] = []

    def agent_cmd(self, local: Path, script_args: list[str], extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "resilient.run", "--nnodes", self.nnodes, "--nproc-per-node", str(self.nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "cluster",
                "--local-addr", "127.0.0.1", "--run-dir", str(self.run_dir), "--ckpt-local", str(local),
                *self.flags, *extra, str(self.script), *script_args]

    def start(self, name: str, script_args: list[str], *, extra: list[str] | None = None,
              env: dict[str, str] | None = None) -> Node:
        local = self.tmp / f"local-{name}"
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(self.agent_cmd(local, script_args, extra or []), cwd=REPO, env=child_env(env),
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(name, p, local, log)
        self.nodes.append(node)
        return node

    def start_supervisor(self, flags: list[str], env: dict[str, str] | None = None, name: str = "supervisor") -> Node:
        """``resilient supervisor`` on its own (a CPU host in real life), hosting the job's store."""
        log = self.tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "resilient.cli", "supervisor", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
               "--nnodes", self.nnodes, "--run-dir", str(self.run_dir), "--advertise-addr", "127.0.0.1", *flags]
        with open(log, "ab") as f:
            p = subprocess.Popen(cmd, cwd=REPO, env=child_env(env), stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        node = Node(name, p, self.tmp / f"none-{name}", log)
        self.nodes.append(node)
        return node

    def events(self) -> list:
        try:
            return list(read_events(self.run_dir))
        except FileNotFoundError:
            return []

    def close(self) -> None:
        kill_sessions([n.proc for n in self.nodes])

    def describe(self, tail: int = 2500) -> str:
        """Each node's exit status (or "running") and the end of its log."""
        out = []
        for n in self.nodes:
            rc = n.proc.poll()
            try:
                log = n.text()[-tail:]
            except OSError as e:
                log = f"(no log: {e})"
            out.append(f"--- {self.tmp.name}/{n.name} (pid {n.proc.pid}): {'running' if rc is None else f'exit {rc}'}\n{log}")
        # the ledger's decisions and joins say what the supervisor knew: a node log alone cannot say whether an
        # agent had joined, as what, or what the job was waiting for
        lines = [f"{e.kind.value} {e.node} {json.dumps(e.details, default=str)[:300]}" for e in self.events()
                 if e.kind not in _CHATTY]
        out.append(f"--- {self.tmp.name} ledger ({len(lines)} lines without steps and logs)\n" + "\n".join(lines[-40:]))
        return "\n".join(out)

    def leftovers(self) -> list[psutil.Process]:
        return session_procs(*(n.proc.pid for n in self.nodes))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A cluster test that failed reports each node's state and log end: a CI run keeps nothing else of them, and
    "timed out waiting for X" alone does not say whether a node had exited, was still starting, or hung."""
    rep = yield
    clusters = getattr(item, "_clusters", None)
    if rep.when == "call" and rep.failed and clusters:
        rep.sections.append(("cluster nodes at the failure", "\n".join(c.describe() for c in clusters)))
    return rep


@pytest.fixture
def cluster_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    made: list[Cluster] = []
    request.node._clusters = made

    def make(nnodes: str, **kw) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", nnodes, **kw)
        c.tmp.mkdir(parents=True, exist_ok=True)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
