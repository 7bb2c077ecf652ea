"""Finding and ending every process a launched job started: the one helper tests, benchmarks and the demo share.

A launcher started with ``start_new_session=True`` is a node: everything it starts stays in its Unix session
(a worker that moves to a process group of its own, or whose parent died, is still there), so the session id —
the leader's pid — is how a whole node is found and ended. torchrun is the exception: it starts each worker in
a session of its own, so the live process tree is collected as well.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Iterable

import psutil

from tests._helpers.wait import wait_for


def session_procs(*sids: int, tree_of: Iterable[int] = (), mark: str | None = None) -> list[psutil.Process]:
    """Live (not zombie) processes whose session is one of ``sids``, the descendants of ``tree_of`` (pass only
    pids not yet reaped: a reaped pid may belong to anyone), and with ``mark`` every process whose command line
    contains it (a run's own directory: torchrun's workers sit in sessions of their own)."""
    want = set(sids)
    found: dict[int, psutil.Process] = {}
    for root in tree_of:
        try:
            for p in psutil.Process(root).children(recursive=True):
                found[p.pid] = p
        except psutil.Error:
            pass
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and (
                    os.getsid(p.pid) in want or (mark and any(mark in a for a in p.cmdline()))):
                found[p.pid] = p
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return [p for p in found.values() if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_sessions(procs: Iterable[subprocess.Popen], timeout: float = 10.0, *, mark: str | None = None) -> int:
    """SIGKILL each leader's process group, session and process tree at once (a lost node, or the end of a run),
    and with ``mark`` every process naming it; reap the leaders; return how many processes were alive."""
    procs = list(procs)
    left = session_procs(*(p.pid for p in procs), tree_of=[p.pid for p in procs if p.poll() is None], mark=mark)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for q in left:
        try:
            q.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=timeout)
    _reap(procs, timeout)
    return len(left)


def _reap(procs: list[subprocess.Popen], within: float) -> None:
    """Wait for the leaders to exit, ``within`` seconds in all (a leader still running is left to the caller)."""
    deadline = time.monotonic() + within
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def stop_sessions(procs: Iterable[subprocess.Popen], grace: float, timeout: float = 10.0) -> int:
    """SIGTERM every live leader (a launcher forwards it to its workers) and give them ``grace`` seconds in all to
    exit, then :func:`kill_sessions` what is left; returns what that found alive."""
    procs = list(procs)
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    _reap(live, grace)
    return kill_sessions(procs, timeout)


# the system calls of a loop's wait between its passes, by number on x86-64 (selectors: epoll_wait, epoll_pwait; poll,
# select, pselect6, ppoll where those are used)
_WAITING_SYSCALLS = {7, 23, 232, 270, 271, 281}


def waiting(pid: int) -> bool:
    """Whether ``pid``'s main thread is blocked in its wait between passes (``/proc/PID/syscall``)."""
    call = open(f"/proc/{pid}/syscall").read().split()[0]
    return call.isdigit() and int(call) in _WAITING_SYSCALLS


def stop_in_its_wait(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` (an agent) while its main thread waits between passes, so that what happens meanwhile reaches
    it in one wake-up, before its next pass looks at anything else. The caller sends SIGCONT."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 10, f"process {pid} to stop")
        if waiting(pid):
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"process {pid} was never stopped in its wait within {timeout:g} s")
