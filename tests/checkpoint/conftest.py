"""Fixtures for checkpoint tests: real worker processes on real gloo groups, a real GCS API server."""

from __future__ import annotations

import os
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
from tests._helpers.forked import fork

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


class Workers:
    """Starts ``nproc`` ranks of a script like torchrun would; kills them all on failure or teardown.

    As torchrun does, the survivors are killed as soon as one rank fails. Ranks are forked from this process's fork
    server (as ``resilient-run`` starts them) unless ``fresh``: a fresh interpreter each, as torchrun starts them,
    for a script that checks what it imports itself.
    """

    def __init__(self) -> None:
        self.procs: list = []  # subprocess.Popen or tests._helpers.forked.ForkedProc

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
        procs: list = []
        for e, log in zip(envs, logs):
            if fresh:
                procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            else:
                procs.append(fork(script, args, e, stdout_fd=log.fileno(), stderr_fd=log.fileno()))
        self.procs.extend(procs)
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
        out = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            p.wait(10)
            log.seek(0)
            out.append(Result(r, p.returncode, log.read().decode(errors="replace")))
            log.close()
            os.unlink(log.name)
        return out

    @staticmethod
    def kill(procs: list) -> None:
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
