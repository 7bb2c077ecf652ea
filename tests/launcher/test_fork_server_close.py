"""Closing a fork server does not wait for it to end (a process that imported torch takes a fifth of a second or
more to tear down, on the exit's and a restart's critical path), yet a live agent never leaves it running or a
zombie: a background reaper waits for it, bounded, and SIGKILLs one that does not end."""
import os
import signal

import psutil
import pytest

from resilient.launcher import starters
from resilient.launcher.starters import ForkServer
from tests._helpers.wait import wait_for


def _ready_server() -> ForkServer:
    fs = ForkServer(tag="close-test")
    fs.wait_ready(90)
    return fs


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: the signal takes effect only once the process runs again,
    which on a loaded machine can be a while after kill() returned (until then it shows as running)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 60, f"process {pid} to stop")


@pytest.mark.timeout(120)
def test_close_returns_while_the_server_still_runs_and_the_server_is_reaped_once_it_ends():
    fs = _ready_server()
    pid = fs.proc.pid
    _stop(pid)  # it cannot take the quit until it runs again
    try:
        fs.close()
        # close() returned without waiting: the server is still there, stopped (a waiting close would have killed
        # and reaped it)
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
    finally:
        os.kill(pid, signal.SIGCONT)
    # returncode is set only by a wait: the background reaper's (nothing here polls the process)
    wait_for(lambda: fs.proc.returncode is not None, 60, "the fork server reaped in the background")
    assert fs.proc.returncode == 0  # it read the quit and ended by itself


@pytest.mark.timeout(120)
def test_a_server_that_never_ends_is_killed_and_reaped_after_the_bound(monkeypatch):
    monkeypatch.setattr(starters, "_REAP_GRACE", 0.5)
    fs = _ready_server()
    pid = fs.proc.pid
    _stop(pid)  # never runs again: only SIGKILL ends it
    try:
        fs.close()
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
        wait_for(lambda: fs.proc.returncode is not None, 60, "the stuck fork server killed and reaped")
    finally:
        if fs.proc.returncode is None:
            os.kill(pid, signal.SIGKILL)
    assert fs.proc.returncode == -signal.SIGKILL
