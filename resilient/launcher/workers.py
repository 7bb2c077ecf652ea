"""Starting, watching and stopping one node's worker processes.

Two ways to start a worker, one interface: :class:`ForkServer` forks from a long-lived process that
already imported torch (restarts in milliseconds), :class:`SpawnStarter` runs a fresh interpreter per
worker exactly as torchrun does (the fallback, and the only way for ``--no-python``). Both report exits
through a file descriptor the agent selects on, so exits are seen the moment they happen.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

from resilient.launcher.api import WorkerCommand

logger = logging.getLogger(__name__)


@dataclass
class WorkerProc:
    local_rank: int
    rank: int
    env: dict[str, str]
    stdout_fd: int | None = None  # fd the child writes its stdout to (None: inherit)
    stderr_fd: int | None = None
    error_file: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    exit_wall: float | None = None
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)


class WorkerStarter(Protocol):
    def start(self, cmd: WorkerCommand, workers: list[WorkerProc], cwd: str) -> None:
        """Start the workers; the caller keeps ownership of (and closes) their output fds."""

    def fileno(self) -> int: ...

    def poll_exits(self) -> list[WorkerProc]:
        """Called when ``fileno()`` is readable: the workers that have exited since the last call."""

    def close(self) -> None: ...


def signal_workers(workers: list[WorkerProc], sig: int) -> None:
    for w in workers:
        if w.pid is not None and w.exit_code is None:
            try:
                os.killpg(w.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                os.kill(w.pid, sig)


class ForkServerError(RuntimeError):
    def __init__(self, why: str, bad_module: str | None = None):
        super().__init__(why)
        self.bad_module = bad_module  # a learned module that made forking unsafe: never preload it again


class ForkServer:
    """Client of :mod:`resilient.launcher.zygote`."""

    def __init__(self, preload: tuple[str, ...] = (), *, tag: str = "", preload_file: str | None = None):
        """``preload_file``: where to write the list when it is long (learned modules), passed as ``@FILE``."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = parent
        self._buf = b""
        self._by_id: dict[str, WorkerProc] = {}
        self._events: list[dict] = []
        self.preload = tuple(preload)
        self.learned: list[str] = []  # modules the workers loaded, in order, as the zygote reported them
        spec = ",".join(preload)
        if preload_file is not None and len(spec) > 8192:
            with open(preload_file, "w") as f:
                f.write("\n".join(preload))
            spec = f"@{preload_file}"
        env = dict(os.environ)
        # numpy's OpenBLAS starts a thread pool at import, and forking a threaded process is unsafe.
        # Workers get the user's environment back, but BLAS calls made from numpy in a forked worker
        # stay single-threaded (torch's own intra-op threads are unaffected).
        env["OPENBLAS_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient.launcher.zygote", str(child.fileno()), spec, tag],
            pass_fds=[child.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self._ready = False

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the fork server has imported torch; it was started in the constructor so that
        this import overlaps the rendezvous."""
        if self._ready:
            return
        msg = self._read_one(timeout)
        self._first(msg)

    def _first(self, msg: dict) -> None:
        if msg.get("ev") != "ready":
            self.close()
            raise ForkServerError(msg.get("why", f"unexpected first message {msg}"), msg.get("bad"))
        self.sock.setblocking(False)
        self._ready = True

    def poll_ready(self) -> bool:
        """Without blocking: has it finished its imports? Raises ForkServerError when it failed."""
        if self._ready:
            return True
        self.sock.setblocking(False)
        try:
            while b"\n" not in self._buf:
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    return False
                if not data:
                    raise ForkServerError(f"fork server exited (code {self.proc.poll()})")
                self._buf += data
        finally:
            if not self._ready:
                self.sock.setblocking(True)
        line, self._buf = self._buf.split(b"\n", 1)
        self._first(json.loads(line))
        return True

    def take_learned(self) -> list[str]:
        out, self.learned = self.learned, []
        return out

    def _read_one(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ForkServerError(f"fork server did not answer within {timeout:.0f}s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                raise ForkServerError(f"fork server exited (code {self.proc.poll()})")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                raise ForkServerError(f"fork server exited (code {self.proc.poll()})")
            self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self._events.append(json.loads(line))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, cmd: WorkerCommand, workers: list[WorkerProc], cwd: str) -> None:
        for w in workers:
            wid = f"{w.local_rank}-{time.monotonic_ns()}"
            fds = [fd for fd in (w.stdout_fd, w.stderr_fd) if fd is not None]
            msg = {
                "op": "spawn", "id": wid, "argv": [cmd.target, *cmd.args], "kind": cmd.kind,
                "env": w.env, "cwd": cwd, "error_file": w.error_file, "nfds": len(fds),
                "stdout": 0 if w.stdout_fd is not None else -1,
                "stderr": (1 if w.stdout_fd is not None else 0) if w.stderr_fd is not None else -1,
            }
            data = (json.dumps(msg) + "\n").encode()
            self.sock.setblocking(True)
            try:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.sendall(data)
            finally:
                self.sock.setblocking(False)
            self._by_id[wid] = w
        # wait for every pid: the agent must be able to signal them right away
        deadline = time.monotonic() + 30
        self.sock.setblocking(True)
        try:
            while any(w.pid is None for w in workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ForkServerError("fork server did not report worker pids within 30s")
                ev = self._read_one(left)
                self._handle(ev)
        finally:
            self.sock.setblocking(False)

    def _handle(self, ev: dict) -> WorkerProc | None:
        if ev.get("ev") == "modules":
            self.learned.extend(ev.get("names", ()))
            return None
        w = self._by_id.get(ev.get("id"))
        if w is None:
            return None
        if ev["ev"] == "spawned":
            w.pid = ev["pid"]
        elif ev["ev"] == "refused":
            raise ForkServerError(ev.get("why", "refused"))
        elif ev["ev"] == "exit":
            w.pid = w.pid or ev["pid"]
            w.exit_code = ev["code"]
            w.exit_wall = ev["t"]
            del self._by_id[ev["id"]]
            return w
        return None

    def fileno(self) -> int:
        return self.sock.fileno()

    def poll_exits(self) -> list[WorkerProc]:
        self._drain()
        out = []
        events, self._events = self._events, []
        for ev in events:
            w = self._handle(ev)
            if w is not None:
                out.append(w)
        return out

    def close(self) -> None:
        try:
            self.sock.setblocking(True)
            self.sock.sendall(b'{"op": "quit"}\n')
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.sock.close()


def _load_prctl() -> object | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: workers are still stopped by a live agent
        return None


# resolved once in the agent: the child between fork and exec must not load libraries
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int):
    """``preexec_fn`` of a spawned worker: SIGKILL when the agent dies, even by SIGKILL, as the fork
    server's workers do. The parent may die between fork and prctl: then nothing would ever send the
    signal, so the child checks and ends itself."""
    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # type: ignore[operator]
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


class SpawnStarter:
    """One fresh interpreter per worker; exits are seen through pidfds. Workers die with the agent
    (PR_SET_PDEATHSIG set between fork and exec)."""

    def __init__(self) -> None:
        self._pidfds: dict[int, WorkerProc] = {}
        # one fd for the agent to watch: an epoll fd is itself selectable
        self._sel = selectors.DefaultSelector()

    def start(self, cmd: WorkerCommand, workers: list[WorkerProc], cwd: str) -> None:
        for w in workers:
            if cmd.kind == "exec":
                argv = [cmd.target, *cmd.args]
            elif cmd.kind == "module":
                argv = [os.getenv("PYTHON_EXEC", sys.executable), "-u", "-m", cmd.target, *cmd.args]
            else:
                argv = [os.getenv("PYTHON_EXEC", sys.executable), "-u", cmd.target, *cmd.args]
            p = subprocess.Popen(
                argv, env=w.env, cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=w.stdout_fd, stderr=w.stderr_fd, process_group=0,
                # PDEATHSIG follows the thread that forked: Popen is called from the agent's main thread,
                # which lives as long as the agent
                preexec_fn=_die_with_parent(os.getpid()),
            )
            w.pid = p.pid
            w._popen = p
            pidfd = os.pidfd_open(p.pid)
            self._pidfds[pidfd] = w
            self._sel.register(pidfd, selectors.EVENT_READ)

    def fileno(self) -> int:
        return self._sel.fileno()  # type: ignore[attr-defined]

    def poll_exits(self) -> list[WorkerProc]:
        out = []
        for key, _ in self._sel.select(timeout=0):
            w = self._pidfds.pop(key.fd)
            self._sel.unregister(key.fd)
            os.close(key.fd)
            assert w._popen is not None
            w.exit_code = w._popen.wait(timeout=5)
            w.exit_wall = time.time()
            out.append(w)
        return out

    def close(self) -> None:
        for fd in list(self._pidfds):
            self._sel.unregister(fd)
            os.close(fd)
        self._pidfds.clear()
        self._sel.close()
