"""Fixtures for checkpoint tests: real worker processes on real gloo groups, a real GCS API server."""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._helpers.gcs import LocalGCS as GCS
from tests._helpers.gcs import free_port
from resilient.launcher.starters import signal_workers

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "ckpt_train.py"
WORKER = Path(__file__).resolve().parent / "_worker.py"


@dataclass
class Result:
    rank: int
    returncode: int
    output: str


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("RESILIENT_", "TORCHELASTIC_")):
            del env[k]
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


#: what ranks forked from the tests' fork server find imported: what the worker scripts here import anyway
#: (soft: a module that fails only costs speed)
FORK_PRELOAD = tuple(f"?{m}" for m in (
    "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.nn.parallel",
    "resilient.checkpoint.save.manager", "resilient.worker.steps"))
_fork_server = None


def fork_server():
    """This test process's fork server (started on first use, ended with the process): the product's own
    (:class:`resilient.launcher.starters.ForkServer`, as ``resilient-run`` starts workers), so that a rank costs a
    fork instead of a fresh interpreter importing torch, DCP and our checkpointer (about 3 s of CPU each, the
    largest share of this suite's time on two cores)."""
    global _fork_server
    from resilient.launcher.starters import ForkServer

    if _fork_server is None or not _fork_server.alive():
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + old if old else "")
        try:
            _fork_server = ForkServer(FORK_PRELOAD, tag="tests")
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _fork_server.wait_ready(180)
        atexit.register(_fork_server.close)
    return _fork_server


class Workers:
    """Starts ``nproc`` ranks of a script like torchrun would; kills them all on failure or teardown.

    As torchrun does, the survivors are killed as soon as one rank fails. Ranks are forked from this process's fork
    server (as ``resilient-run`` starts them) unless ``fresh``: a fresh interpreter each, as torchrun starts them,
    for a script that checks what it imports itself.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.forked: list = []  # WorkerProc of ranks forked from the fork server

    def run(self, script: Path, args: list[str], nproc: int, *, env: dict[str, str] | None = None,
            local_world_size: int | None = None, timeout: float = 120.0, fresh: bool = False) -> list[Result]:
        port = free_port()
        envs, logs = [], []
        for r in range(nproc):
            e = _child_env(env)
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(nproc),
                     LOCAL_WORLD_SIZE=str(local_world_size or nproc),
                     LOCAL_RANK=str(r % (local_world_size or nproc)))
            envs.append(e)
            logs.append(open(_tmp_log(), "w+b"))
        if fresh:
            codes = self._spawned(script, args, envs, logs, timeout)
        else:
            codes = self._forked(script, args, envs, logs, timeout)
        out = []
        for r, (code, log) in enumerate(zip(codes, logs)):
            log.seek(0)
            out.append(Result(r, code, log.read().decode(errors="replace")))
            log.close()
            os.unlink(log.name)
        return out

    def _spawned(self, script: Path, args: list[str], envs: list[dict[str, str]], logs: list, timeout: float
                 ) -> list[int]:
        procs = []
        for e, log in zip(envs, logs):
            p = subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            self.procs.append(p)
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                failed = True
                break
            running = next((p for p in procs if p.poll() is None), None)  # the last one may end between the checks
            if running is None:
                break
            try:
                running.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        if failed:
            self.kill(procs)
        for p in procs:
            p.wait(10)
        return [p.returncode for p in procs]

    def _forked(self, script: Path, args: list[str], envs: list[dict[str, str]], logs: list, timeout: float
                ) -> list[int]:
        from resilient.launcher.api import WorkerCommand
        from resilient.launcher.starters import WorkerProc

        server = fork_server()
        ws = [WorkerProc(local_rank=r, rank=r, env=e, stdout_fd=log.fileno(), stderr_fd=log.fileno())
              for r, (e, log) in enumerate(zip(envs, logs))]
        server.start(WorkerCommand(str(script), tuple(args)), ws, os.getcwd())
        self.forked.extend(ws)
        deadline = time.monotonic() + timeout
        while True:
            server.poll_exits()  # marks the exited ones (exit_code)
            if all(w.exit_code is not None for w in ws):
                break
            if time.monotonic() > deadline or any(w.exit_code not in (None, 0) for w in ws):
                self._kill_forked(ws)
                break
            if not server.buffered():
                select.select([server.fileno()], [], [], 0.05)
        return [w.exit_code for w in ws]

    def _kill_forked(self, ws: list, wait: float = 10.0) -> None:
        signal_workers(ws, signal.SIGKILL)
        server, deadline = fork_server(), time.monotonic() + wait
        while any(w.exit_code is None for w in ws) and time.monotonic() < deadline:
            select.select([server.fileno()], [], [], 0.05)
            server.poll_exits()
        for w in ws:
            if w.exit_code is None:
                w.exit_code = -signal.SIGKILL  # its exit was not heard: count it as the kill it got

    @staticmethod
    def kill(procs: list[subprocess.Popen[bytes]]) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.kill(self.procs)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if any(w.exit_code is None for w in self.forked):
            self._kill_forked(self.forked)


def _tmp_log() -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix="ckpt-worker-", suffix=".log")
    os.close(fd)
    return path


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.close()


def ok(results: list[Result]) -> list[Result]:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n\n".join(f"rank {r.rank} exited {r.returncode}:\n{r.output[-4000:]}" for r in bad)
    return results


@pytest.fixture
def gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[GCS]:
    server = GCS(tmp_path / "gcs-data")
    server.start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    try:
        yield server
    finally:
        server.stop()
