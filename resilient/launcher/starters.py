"""The two ways to start one node's worker processes, behind one interface (:class:`WorkerStarter`).

:class:`ForkServer` forks from a long-lived process that already imported torch (restarts in milliseconds),
:class:`SpawnStarter` runs a fresh interpreter per worker exactly as torchrun does (the fallback, and the only way
for ``--no-python``). Both report exits through a file descriptor the agent selects on, so exits are seen the
moment they happen. :class:`~resilient.launcher.workers.WorkerGroup` uses them through the protocol only.
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
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from resilient.launcher.api import WorkerCommand
from resilient.launcher.zygote import RUN_FLAG

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

    def buffered(self) -> bool:
        """Exits already read along with other answers: the caller polls them without waiting for ``fileno()``."""

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until workers can be started (raises ForkServerError when they cannot be, this way)."""

    def take_learned(self) -> list[str]:
        """Modules the workers reported loading since the last call (automatic preload)."""

    def ready_copy(self) -> ForkServer | None:
        """A copy of this starter that already imported what it did (None when it cannot make one now)."""

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


class _ForkedProc:
    """The part of ``subprocess.Popen`` the agent uses, for a fork server forked by another one (not the agent's
    child: its exit is seen through a pidfd, and the zygote it came from reaps it)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._pidfd: int | None = None
        self.returncode: int | None = None

    def attach(self, pid: int) -> None:
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            self.returncode = -1

    def poll(self) -> int | None:
        if self.returncode is None and self._pidfd is not None:
            import select

            if select.select([self._pidfd], [], [], 0)[0]:
                self.returncode = -1  # not our child: its status is its parent's
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode if self.pid is not None else None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.pid is not None and self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired("fork server", timeout)
            import select

            select.select([self._pidfd], [], [], min(left, 1.0))
        return self.returncode if self.returncode is not None else -1

    def kill(self) -> None:
        if self.pid is not None and self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """Client of :mod:`resilient.launcher.zygote`."""

    def __init__(self, preload: tuple[str, ...] = (), *, tag: str = "", preload_file: str | None = None,
                 inherit: bool = False, _copy_of: ForkServer | None = None):
        """``preload_file``: where to write the list when it is long (learned modules), passed as ``@FILE``.
        ``inherit``: fork the server from this process when that is safe (see :func:`_fork_here`) instead of
        starting it by exec. ``_copy_of``: see :meth:`fork`."""
        self._buf = b""
        self._by_id: dict[str, WorkerProc] = {}
        self._events: list[dict] = []
        self.preload = tuple(preload)
        self.learned: list[str] = []  # modules the workers loaded, in order, as the zygote reported them
        self.copy = _copy_of is not None
        self.origin = _copy_of  # the fork server a copy was forked from
        self.parent: ForkServer | None = None  # see adopt()
        self._warm_sent = 0  # batches of learned modules sent (preload_more), and imported
        self._warm_done = 0
        self.warm_at: float | None = None  # wall time the last batch was imported
        self._out = b""  # preload requests not yet taken by the server
        self._ready = False
        # entry-script imports this server left out because importing them made forking unsafe (it restarted
        # without them before saying it was ready), and why
        self.static_denied: tuple[str, ...] = ()
        self.static_denied_why = ""
        if _copy_of is not None:
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock = parent
            self.proc: subprocess.Popen[bytes] | _ForkedProc | _ChildProc = _ForkedProc()
            _copy_of.sock.setblocking(True)
            try:
                socket.send_fds(_copy_of.sock, [b'{"op": "fork", "nfds": 1}\n'], [child.fileno()])
            finally:
                _copy_of.sock.setblocking(False)
                child.close()
            return
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = parent
        forked = _fork_here(child, self.preload, tag) if inherit else None
        if forked is not None:
            self.proc = forked
            child.close()
            return
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

    def fork(self) -> ForkServer:
        """A copy of this (ready, idle or not) fork server, serving on a socket of its own: it has imported all
        this one has, at no cost; :meth:`preload_more` then imports the learned modules in it, not in this one."""
        if not self._ready:
            raise ForkServerError("fork server not ready")
        return ForkServer(self.preload, _copy_of=self)

    def adopt(self, origin: ForkServer) -> None:
        """This copy takes over from the fork server it was forked from, which must live (idle) as long as it does:
        a copy dies with it. Closing this one closes it too."""
        self.parent = origin

    def preload_more(self, modules: list[str] | tuple[str, ...]) -> None:
        """Ask this (idle: no worker started from it yet) fork server to import learned modules; it is warm again
        once it has (:meth:`poll_ready`). A module that makes forking unsafe ends it (ForkServerError.bad_module)."""
        self._warm_sent += 1
        self._out += (json.dumps({"op": "preload", "modules": list(modules), "seq": self._warm_sent}) + "\n").encode()
        self._flush()

    def _flush(self) -> None:
        # never blocks: the server reads only between imports, and the agent must not wait on it meanwhile
        while self._out:
            try:
                n = self.sock.send(self._out, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise ForkServerError(f"fork server gone ({e})") from e
            self._out = self._out[n:]

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
        if isinstance(self.proc, _ForkedProc) and self.proc.pid is None:
            self.proc.attach(int(msg["pid"]))
        self.static_denied = tuple(str(m) for m in msg.get("denied", ()))
        self.static_denied_why = str(msg.get("why", ""))
        self.sock.setblocking(False)
        self._ready = True
        if not self.copy:
            # the start-up bench splits the launch by this line (the server's own clock: when it was ready)
            logger.info("fork server ready at %.6f (pid %s)", float(msg.get("t", time.time())), msg.get("pid"))

    def poll_ready(self) -> bool:
        """Without blocking: has it finished its imports, and every batch of :meth:`preload_more`? Raises
        ForkServerError when it failed (``bad_module``: the learned module that made forking unsafe)."""
        if self._ready and self._warm_done >= self._warm_sent:
            return True
        if self.sock.fileno() < 0:
            raise ForkServerError("fork server closed")
        self._flush()
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    if b"\n" in self._buf:
                        break  # its last words (why it failed) come first
                    raise ForkServerError(f"fork server exited (code {self.proc.poll()})")
                self._buf += data
        finally:
            if not self._ready:
                self.sock.setblocking(True)
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if not self._ready:
                self._first(msg)
            elif msg.get("ev") == "warm":
                self._warm_done = max(self._warm_done, int(msg.get("seq", 0)))
                self.warm_at = msg.get("t")
            elif msg.get("ev") == "failed":
                self.close()
                raise ForkServerError(msg.get("why", "failed"), msg.get("bad"))
            else:
                self._events.append(msg)  # worker events: poll_exits handles them
        return self._ready and self._warm_done >= self._warm_sent

    def take_learned(self) -> list[str]:
        out, self.learned = self.learned, []
        return out

    def ready_copy(self) -> ForkServer | None:
        return self.fork() if self.alive() and self.poll_ready() else None

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

    def buffered(self) -> bool:
        """Events already read from the socket (along with the answers :meth:`start` waited for): the socket will
        not become readable for them, so the caller must call :meth:`poll_exits` without waiting for it."""
        return bool(self._events) or b"\n" in self._buf

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
        """Tell the server to end and return without waiting for it: a process that imported torch takes a
        fifth of a second or more to tear down, on the exit's and a restart's critical path. Its workers are
        stopped before it is closed; it kills any that are not, and is reaped in the background
        (:func:`_reap_in_background`), or SIGKILLed by the kernel when the agent ends first (PR_SET_PDEATHSIG)."""
        if self.sock.fileno() < 0:
            return
        try:
            self.sock.settimeout(_QUIT_SEND_TIMEOUT)
            self.sock.sendall(b'{"op": "quit"}\n')
        except OSError:
            pass  # gone, or not reading: the socket's close below is its end too (it quits on EOF)
        self.sock.close()
        if isinstance(self.proc, (subprocess.Popen, _ChildProc)):
            _reap_in_background(self.proc)
        # a copy is not our child: the fork server it came from reaps it, and it dies with that one
        if self.parent is not None:
            self.parent.close()


# the quit is one short line into an empty socket buffer: a server that does not take it within this is stuck, and
# the closed socket ends it all the same
_QUIT_SEND_TIMEOUT = 1.0
# a server told to quit ends within milliseconds once scheduled; one that has not after this is SIGKILLed
_REAP_GRACE = 10.0


def _fork_here(child: socket.socket, preload: tuple[str, ...], tag: str) -> _ChildProc | None:
    """The fork server as a child forked from this process, which has imported torch already (the agent, for its
    store): it then imports only the rest of its list, and a node imports torch once. None when forking is not
    safe here (a thread, or CUDA), when torch is not imported (nothing to gain), or with the fast exit turned off
    (a forked worker cannot then end through this interpreter's finalisation): the caller starts it by exec."""
    from resilient.launcher import zygote
    from resilient.worker import exit_safety

    if "torch" not in sys.modules or not exit_safety.fast_exit_enabled():
        return None
    why = zygote.fork_unsafe()
    if why:
        logger.debug("fork server started by exec: forking the agent is unsafe (%s)", why)
        return None
    for stream in (sys.stdout, sys.stderr):  # else what they hold would be written twice
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid == 0:
        zygote.serve_inherited(child.fileno(), list(preload), tag)  # never returns
    return _ChildProc(pid)


class _ChildProc:
    """The part of ``subprocess.Popen`` the agent uses, for a fork server forked from the agent (its child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # the background reaper and the agent's loop may both ask

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    self.returncode = -1
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import select

        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            pidfd: int | None = os.pidfd_open(self.pid)
        except OSError:  # reaped already, or no pidfd: polled
            pidfd = None
        try:
            while self.poll() is None:
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if left <= 0:
                    raise subprocess.TimeoutExpired("fork server", timeout or 0)
                if pidfd is not None:
                    select.select([pidfd], [], [], left)
                else:
                    time.sleep(min(left, 0.05))
        finally:
            if pidfd is not None:
                os.close(pidfd)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _reap_in_background(proc: subprocess.Popen[bytes] | _ChildProc) -> threading.Thread:
    """Wait for a fork server that was told to quit, bounded: SIGKILL after ``_REAP_GRACE``, so that a live agent
    never leaves it running or a zombie. A daemon thread: an agent that ends first takes the server with it
    (PR_SET_PDEATHSIG) and its parent's parent reaps it."""

    def reap() -> None:
        try:
            proc.wait(timeout=_REAP_GRACE)
            return
        except subprocess.TimeoutExpired:
            logger.warning("fork server %d still running %.0fs after it was told to quit; killing it", proc.pid,
                           _REAP_GRACE)
        proc.kill()
        try:
            proc.wait(timeout=_REAP_GRACE)
        except subprocess.TimeoutExpired:
            logger.error("fork server %d survived SIGKILL for %.0fs", proc.pid, _REAP_GRACE)

    t = threading.Thread(target=reap, name=f"reap-fork-server-{proc.pid}", daemon=True)
    t.start()
    return t


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
            elif self._fast_exit(w.env, cwd):
                argv = [sys.executable, "-u", "-m", "resilient.launcher.zygote", RUN_FLAG, cmd.kind, cmd.target,
                        *cmd.args]
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

    @staticmethod
    def _fast_exit(env: dict[str, str], cwd: str) -> bool:
        """Whether a Python worker runs through the fork server's runner (``zygote --run``), which ends it with
        the fast exit as forked workers end: not when the fast exit is off, not under another interpreter
        (``PYTHON_EXEC``), and only where the worker can import this package (its ``sys.path`` is the agent's,
        its own working directory first instead of the agent's)."""
        from resilient.worker.exit_safety import fast_exit_enabled

        if not fast_exit_enabled(env) or os.getenv("PYTHON_EXEC", sys.executable) != sys.executable:
            return False
        if env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
            return False  # another path than the agent's: whether it finds this package is not known here
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return root in {os.path.abspath(p) for p in sys.path[1:] if p} | {os.path.abspath(cwd)}

    def fileno(self) -> int:
        return self._sel.fileno()  # type: ignore[attr-defined]

    def buffered(self) -> bool:
        return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        return None

    def take_learned(self) -> list[str]:
        return []

    def ready_copy(self) -> ForkServer | None:
        return None

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
