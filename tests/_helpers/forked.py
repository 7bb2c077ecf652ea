"""Ranks forked from one fork server per test process, behind the part of ``subprocess.Popen`` tests use.

The fork server is the product's own (:class:`resilient.launcher.starters.ForkServer`, as ``resilient-run`` starts
workers): a rank then costs a fork instead of a fresh interpreter importing torch, DCP and our checkpointer, about
3 s of CPU each, which was the largest share of this suite's time on two cores. A test whose script checks what it
imports itself starts a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from resilient.launcher.api import WorkerCommand
from resilient.launcher.starters import ForkServer, WorkerProc

REPO = Path(__file__).resolve().parents[2]
#: what forked ranks find imported: what the worker scripts of this suite import anyway (soft: a module that fails
#: to import only costs speed)
PRELOAD = tuple(f"?{m}" for m in (
    "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.nn.parallel",
    "resilient.checkpoint.save.manager", "resilient.worker.steps"))
_server: ForkServer | None = None


def fork_server() -> ForkServer:
    """This test process's fork server, started on first use (its imports take a few seconds once), ended with the
    process."""
    global _server
    if _server is None or not _server.alive():
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + old if old else "")  # scripts import tests._helpers
        try:
            _server = ForkServer(PRELOAD, tag="tests")
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _server.wait_ready(180)
        atexit.register(_server.close)
    return _server


class ForkedProc:
    """A process forked from :func:`fork_server`: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``kill`` and ``terminate`` as ``subprocess.Popen`` has them. It leads a process group of its own, as a Popen
    with ``start_new_session=True`` does."""

    def __init__(self, w: WorkerProc) -> None:
        self._w = w

    @property
    def pid(self) -> int:
        assert self._w.pid is not None
        return self._w.pid

    @property
    def returncode(self) -> int | None:
        return self._w.exit_code

    def poll(self) -> int | None:
        if self._w.exit_code is None:
            fork_server().poll_exits()  # marks every exited rank of the server, this one included
        return self._w.exit_code

    def wait(self, timeout: float | None = None) -> int:
        server = fork_server()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0)
            if not server.buffered():
                select.select([server.fileno()], [], [], left)
        return self._w.exit_code  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def fork(script: str | Path, args: list[str], env: dict[str, str], *, stdout_fd: int = 1, stderr_fd: int = 2,
         cwd: str | None = None) -> ForkedProc:
    """Run ``python SCRIPT ARGS`` with ``env`` (the whole environment) in a process forked from the fork server;
    its output goes to ``stdout_fd`` and ``stderr_fd`` of this process."""
    w = WorkerProc(local_rank=0, rank=0, env=dict(env), stdout_fd=stdout_fd, stderr_fd=stderr_fd)
    fork_server().start(WorkerCommand(str(script), tuple(args)), [w], cwd or os.getcwd())
    return ForkedProc(w)
