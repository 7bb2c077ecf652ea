"""Fork server: a process that has already imported torch and forks workers on request.

Importing torch costs about a second; a restart that pays it for every worker is slow. The agent
starts this process once, it imports torch and the user's preload modules, proves it is still single-threaded and
has no CUDA context, and then forks one child per worker on request. The agent forks it right after its own import
of torch, before it starts any thread (:func:`serve_inherited`: the server then lets go of everything of the
agent's), so a node imports torch once; it starts it by exec instead when forking is not safe there (a thread,
CUDA), with the fast exit off, and for a program of the standard library only (a server without torch). A child runs the user's script with ``runpy`` exactly as
``python -u script`` would (``sys.argv``, ``sys.path[0]``, ``__main__``).
A worker the spawn starter starts as a fresh interpreter runs its program through this module too
(``--run KIND TARGET ARGS``), so that it ends with the same fast exit as a forked one.

Protocol over a Unix stream socket (inherited as fd ``argv[1]``), one JSON object a line:
agent → zygote ``{"op": "spawn", "id": str, "argv": [...], "env": {...}, "cwd": str,
"kind": "script"|"module", "error_file": str|null, "stdout": n, "stderr": n}`` where ``stdout``/``stderr``
are ``-1`` (inherit), or the index of a file descriptor sent with the message (SCM_RIGHTS);
zygote → agent ``{"ev": "ready"|"spawned"|"exit"|"refused"|"modules"|"failed", ...}``.

Automatic preload: each worker reports the modules it loads (an audit hook on ``import`` writing names to a
pipe the zygote reads); the zygote passes new names on as ``{"ev": "modules", "names": [...]}``, and the agent
starts the next fork server with them (``+name`` in the preload list), so a restart does not import them
again. A learned module is imported only if it is installed (standard library or site-packages: never the
user's own code) and only if the process stays single-threaded without a CUDA context afterwards; the first
one that breaks this ends the zygote with ``{"ev": "failed", "bad": name}`` and the agent never tries it again.

Warming is cheap: ``{"op": "fork", "nfds": 1}`` with a socket sent along makes the zygote fork a copy of itself
that serves on that socket (it answers ``{"ev": "ready", "pid": n}`` at once: torch and everything else is
already imported), and ``{"op": "preload", "modules": [...], "seq": n}`` to that idle copy imports the learned
modules and answers ``{"ev": "warm", "seq": n}``. So only the learned imports cost time, in a process no worker
is using, and the serving zygote stays pristine whatever a learned module does to its copy. The copy stays the
child of the zygote it came from, which the agent keeps (idle) for as long as the copy serves.
The zygote dies with the agent (PR_SET_PDEATHSIG), a copy with the zygote it came from, and workers die with the
zygote that forked them.

CUDA: the fork server never touches it. A CUDA driver that was loaded and initialised before ``fork()`` is broken in
every child (workers fail with "CUDA error: initialization error"), and so is NVML state. So the server never asks
``torch.cuda.is_available()`` (that initialises the driver) and reads only torch's own flag, its own
``/proc/self/maps`` and, for a driver or NVML library found there (a CUDA build of torch maps libcuda at import,
which is harmless), one call that answers "not initialised" without initialising (:func:`cuda_touched`): after each module it preloads (a ``--preload`` module that touches CUDA
ends it with an error naming the module; a learned one is refused and never preloaded again), and again before
every fork (should it ever find CUDA, it refuses to fork and the agent starts workers as fresh interpreters). A
``!lib`` entry in the preload list names a library whose mere presence counts (tests use one that exists without a
GPU).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

# The CUDA driver and NVML, with a call that tells whether this process initialised them without initialising
# anything: before cuInit / nvmlInit both answer "not initialised" (CUDA_ERROR_NOT_INITIALIZED = 3,
# NVML_ERROR_UNINITIALIZED = 1). Merely loaded is harmless: a CUDA build of torch maps libcuda at import.
DRIVER_PROBES: dict[str, tuple[str, int]] = {"libcuda.so": ("cuCtxGetCurrent", 3),
                                             "libnvidia-ml.so": ("nvmlDeviceGetCount_v2", 1)}
# libraries whose mere presence in this process counts as touched (the ``!lib`` preload entries: a test's stand-in
# for a driver, on machines that have none)
GUARDED_LIBS: tuple[str, ...] = ()


def _mapped_path(mapped: bytes, lib: str) -> str | None:
    key = f"/{lib}".encode()
    for line in mapped.splitlines():
        i = line.find(b"/")
        if i >= 0 and key in line[i:]:
            return line[i:].decode(errors="replace")
    return None


def _initialised(path: str, probe: str, not_initialised: int) -> str | None:
    """Why the already-loaded library at ``path`` counts as initialised here, or None (RTLD_NOLOAD: never loads
    it, and the probe changes nothing)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        fn = getattr(lib, probe)
    except (OSError, AttributeError):  # unmapped since, or an unknown build: its mere presence decides
        return f"loaded {os.path.basename(path)} and it cannot be asked whether it was initialised"
    out = ctypes.c_void_p() if probe == "cuCtxGetCurrent" else ctypes.c_uint()
    rc = fn(ctypes.byref(out))
    return None if rc == not_initialised else f"initialised {os.path.basename(path)} ({probe} answered {rc})"


def cuda_touched(libs: tuple[str, ...] | None = None, maps: str = "/proc/self/maps") -> str | None:
    """Why this process must not fork workers that may use CUDA, or None. Cheap (a flag, one read of ``maps``
    and, where the driver or NVML is loaded, one call that initialises nothing); never asks
    ``torch.cuda.is_available()``, which would initialise the driver."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is not None:
        try:
            if cuda.is_initialized():
                return "initialised CUDA (torch.cuda.is_initialized())"
        except Exception:  # noqa: BLE001 - a broken torch is the worker's problem, not a reason to stop forking
            pass
    try:
        with open(maps, "rb") as f:
            mapped = f.read()
    except OSError:  # no procfs: the flag above is all we can read
        return None
    for lib in GUARDED_LIBS if libs is None else libs:
        if f"/{lib}".encode() in mapped:
            return f"loaded {lib} (the CUDA driver or NVML)"
    for lib, (probe, not_initialised) in DRIVER_PROBES.items():
        path = _mapped_path(mapped, lib)
        if path is not None:
            why = _initialised(path, probe, not_initialised)
            if why:
                return why
    return None


def fork_unsafe() -> str | None:
    """Why forking this process now would hand workers a broken state, or None."""
    if thread_count() != 1:
        return f"{thread_count()} threads in the fork server"
    why = cuda_touched()
    return f"the fork server {why}" if why else None


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: workers are still killed by the agent
        pass


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def write_error_file(path: str | None, exc: BaseException) -> None:
    """Same format as torch.distributed.elastic's ``@record`` so torchrun-style summaries read it."""
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    restore = getattr(exc, "details", None)  # a failed restore's steps, ranks, files and tiers (NoRestorableStepError)
    if isinstance(restore, dict):
        data["message"]["extraInfo"]["restore"] = restore
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


# The program's namespace (or the exception that ended it, whose traceback holds it), alive until the process ends,
# as ``python script`` keeps ``__main__``: runpy drops it on return, on the main thread with the GIL held, and a gloo
# process group freed there joins its run loop while that loop waits for the GIL to free a finished work (the worker
# never exits); the fast exit then ends the process without destroying it.
_PROGRAM_STATE: list[object] = []


def _bind_numa() -> None:
    """``resilient-run --numa-binding``: this worker's threads bound to the CPUs near its GPU by torch's own binding
    (what torchrun applies through numactl), before the program starts a thread. The worker's environment says
    "MODE:GPU"."""
    from resilient.env import NUMA_BINDING  # stdlib only: the fork server stays light

    spec = os.environ.get(NUMA_BINDING)
    if not spec:
        return
    mode, _, gpu = spec.partition(":")
    from torch.numa.binding import AffinityMode, NumaOptions, _maybe_apply_numa_binding_to_current_process

    try:
        _maybe_apply_numa_binding_to_current_process(gpu_index=int(gpu),
                                                     numa_options=NumaOptions(affinity_mode=AffinityMode(mode)))
    except Exception as e:  # noqa: BLE001 - the worker fails, naming the flag
        raise RuntimeError(f"resilient-run --numa-binding {mode}: binding this worker to the CPUs of GPU {gpu} "
                           f"failed: {type(e).__name__}: {e}") from e


def run_worker(job: dict[str, Any]) -> int:
    """Run the user's program in this (forked or fresh) process; returns the exit code."""
    import runpy

    argv = list(job["argv"])
    sys.argv = argv
    try:
        _bind_numa()
        if job["kind"] == "module":
            sys.path.insert(0, os.getcwd())
            _PROGRAM_STATE.append(runpy.run_module(argv[0], run_name="__main__", alter_sys=True))
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            _PROGRAM_STATE.append(runpy.run_path(argv[0], run_name="__main__"))
    except SystemExit as e:
        _PROGRAM_STATE.append(e)
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - the worker's own failure, reported like @record
        _PROGRAM_STATE.append(e)
        traceback.print_exc()
        write_error_file(job.get("error_file"), e)
        return 1
    return 0


_REPORT_FD: int | None = None  # a worker's end of the zygote's module pipe


def _report_import(event: str, args: tuple) -> None:
    # called for every audit event of the worker: return at once unless a module is being loaded
    if event != "import" or _REPORT_FD is None:
        return
    try:
        os.write(_REPORT_FD, f"{args[0]}\n".encode())
    except (BlockingIOError, BrokenPipeError, OSError):
        pass  # a busy or gone zygote only costs a faster restart


def _child_setup(job: dict[str, Any], fds: list[int], sock: socket.socket, mods: tuple[int, int] | None) -> None:
    global _REPORT_FD
    sock.close()
    if mods is not None:
        os.close(mods[0])
        _REPORT_FD = mods[1]
        sys.addaudithook(_report_import)
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    set_pdeathsig(signal.SIGKILL)
    if _WORKER_COMM:
        _set_comm(_WORKER_COMM)
    os.setpgid(0, 0)  # its own group: the agent signals the worker and its children together
    for target, key in ((1, "stdout"), (2, "stderr")):
        idx = job.get(key, -1)
        if idx is not None and idx >= 0:
            os.dup2(fds[idx], target)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    _own_thread_count(job["env"])
    _own_blas_threads(job["env"])
    os.chdir(job["cwd"])
    # ``python -u``: unbuffered stdout/stderr, as torchrun runs workers
    import io

    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True)


def _own_thread_count(env: dict[str, str]) -> None:
    """The worker's ``OMP_NUM_THREADS``, as a fresh interpreter would take it: the OpenMP runtime read the variable
    once, when the server loaded torch, so a worker whose value differs (``1`` for each of several ranks on a node
    whose server saw none) would otherwise run the server's count of intra-op threads, on cores its peers need."""
    torch = sys.modules.get("torch")
    value = env.get("OMP_NUM_THREADS", "").strip()
    if torch is None or not value.isdigit() or int(value) < 1:
        return
    if torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))


# OpenBLAS builds' thread-count setters: the plain library, and the prefixed ones numpy and scipy bundle
_BLAS_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                 "openblas_set_num_threads64_")


def _blas_threads_wanted(env: dict[str, str]) -> int:
    """The thread count OpenBLAS takes at load from ``env``: the first of ``OPENBLAS_NUM_THREADS``,
    ``GOTO_NUM_THREADS``, ``OMP_NUM_THREADS`` that reads as a number > 0 (as C's ``atoi`` reads it), else every CPU
    this process may run on; never more than those CPUs."""
    cpus = len(os.sched_getaffinity(0))
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        m = re.match(r"\s*\+?(\d+)", env.get(name, ""))
        if m and int(m.group(1)) > 0:
            return min(int(m.group(1)), cpus)
    return cpus


def _own_blas_threads(env: dict[str, str], maps: str = "/proc/self/maps") -> None:
    """numpy's OpenBLAS with the thread count the worker's environment asks for, as in a fresh interpreter: the
    server loaded it with one thread (its pool's threads would make the fork unsafe), and OpenBLAS grows its pool
    when asked. Best effort: a library it cannot set is left at one thread, as before."""
    try:
        with open(maps) as f:
            rows = [ln.split(None, 5) for ln in f if "openblas" in ln]
    except OSError:
        return
    paths = {r[5].strip() for r in rows if len(r) == 6}  # address, mode, offset, device, inode, path
    if not paths:
        return
    want = _blas_threads_wanted(env)
    for path in sorted(p for p in paths if os.path.basename(p).startswith("lib")):
        try:
            lib = ctypes.CDLL(path)  # loaded already: its handle, no load
        except OSError:
            continue
        for name in _BLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter(want)
                break


def _send_on(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        sock.sendall((json.dumps(msg) + "\n").encode())
    except OSError:
        pass


def _close_read(sock: socket.socket) -> None:
    """Close after reading what the agent sent already: closing with unread data resets the connection, and the
    agent would lose the reason just sent."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()


class Zygote:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.children: dict[int, str] = {}
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self.sig_r, self.sig_w = rfd, wfd
        signal.set_wakeup_fd(wfd)
        self.servers: set[int] = set()  # copies of this zygote serving the agent (see fork_server)
        # workers write the names of modules they load here (non-blocking: a worker never waits on us)
        self.mods = os.pipe()
        os.set_blocking(self.mods[0], False)
        os.set_blocking(self.mods[1], False)
        self._mods_buf = b""
        self._known: set[str] = set(sys.modules)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.servers:  # a copy that failed its imports or was told to quit: nothing to report
                self.servers.discard(pid)
                continue
            wid = self.children.pop(pid, None)
            if os.WIFSIGNALED(status):
                code = -os.WTERMSIG(status)
            else:
                code = os.WEXITSTATUS(status)
            self.send({"ev": "exit", "id": wid, "pid": pid, "code": code, "t": time.time()})

    def serve(self) -> dict[str, Any] | Zygote | None:
        """Serve until told to quit; in a forked child, return the job it must run (a worker) or the Zygote it
        now is (a copy made by ``fork``)."""
        import select

        while True:
            try:
                r, _, _ = select.select([self.sock, self.sig_r, self.mods[0]], [], [])
            except InterruptedError:
                continue
            if self.mods[0] in r:
                self.read_modules()
            if self.sig_r in r:
                try:
                    os.read(self.sig_r, 4096)
                except BlockingIOError:
                    pass
                self.reap()
            if self.sock in r:
                try:
                    data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 16)
                except OSError as e:
                    if e.errno == errno.EINTR:
                        continue
                    raise
                if not data:
                    return None  # agent gone
                self.buf += data
                pending = list(fds)
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if msg["op"] == "quit":
                        return None
                    if msg["op"] in ("spawn", "fork"):
                        n = msg.get("nfds", 0)
                        my_fds, pending = pending[:n], pending[n:]
                        job = self.spawn(msg, my_fds) if msg["op"] == "spawn" else self.fork_server(my_fds)
                        if job is not None:
                            for fd in pending:  # the parent's, sent with later messages
                                os.close(fd)
                            return job
                    elif msg["op"] == "preload":
                        if not self.preload_more(msg):
                            return None
                self.reap()

    def read_modules(self) -> None:
        try:
            data = os.read(self.mods[0], 1 << 16)
        except BlockingIOError:
            return
        self._mods_buf += data
        *lines, self._mods_buf = self._mods_buf.split(b"\n")
        new = []
        for ln in lines:
            name = ln.decode(errors="replace")
            if name and name not in self._known and not name.startswith("__"):
                self._known.add(name)
                new.append(name)
        if new:
            self.send({"ev": "modules", "names": new})

    def fork_server(self, fds: list[int]) -> Zygote | None:
        """A copy of this zygote serving on the socket passed in ``fds`` (in the child: that copy)."""
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        sock = socket.socket(fileno=fds[0])
        why = fork_unsafe()  # cannot happen after the checks at start; never fork a threaded or CUDA process
        if why:
            _send_on(sock, {"ev": "failed", "why": why})
            _close_read(sock)
            return None
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self.sock.close()
            for fd in (self.sig_r, self.sig_w, *self.mods):
                os.close(fd)
            set_pdeathsig(signal.SIGKILL)  # cleared by fork: dies with the zygote it came from, as that one does
            if os.getppid() != parent:
                os._exit(0)
            z = Zygote(sock)
            z.send({"ev": "ready", "pid": os.getpid()})
            return z
        sock.close()
        self.servers.add(pid)
        return None

    def preload_more(self, msg: dict[str, Any]) -> bool:
        """Import learned modules (only ever asked of an idle copy); False when this process must end."""
        try:
            preload_learned([str(m) for m in msg.get("modules", ())])
        except UnsafePreload as e:
            self.send({"ev": "failed", "why": str(e), "bad": e.module})
            return False
        self._known.update(sys.modules)
        self.send({"ev": "warm", "seq": msg.get("seq", 0), "t": time.time()})
        return True

    def spawn(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        why = fork_unsafe()
        if why:
            for fd in fds:
                os.close(fd)
            self.send({"ev": "refused", "id": msg["id"], "why": why})
            return None
        _freeze_for_fork()
        pid = os.fork()
        if pid == 0:
            _child_setup(msg, fds, self.sock, self.mods)
            return msg
        for fd in fds:
            os.close(fd)
        self.children[pid] = msg["id"]
        self.send({"ev": "spawned", "id": msg["id"], "pid": pid, "t": time.time()})
        return None


def _freeze_for_fork() -> None:
    """Move everything imported so far out of the collector's reach (``gc.freeze``): a worker's collections, and
    the walk over its objects at exit (exit_safety.finish), then never touch these objects, so neither pays for
    them nor copies the pages they share with this process."""
    import gc

    from resilient.worker import exit_safety

    if exit_safety.fast_exit_enabled():
        gc.freeze()


def _install_roots() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


def installed(name: str, roots: tuple[str, ...]) -> bool:
    """True for a module of the standard library or site-packages: never the user's own code (it may change
    between restarts, and importing it could run their training)."""
    import importlib.util

    top = name.split(".", 1)[0]
    if top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    where = spec.origin if spec.origin not in (None, "namespace", "built-in", "frozen") else None
    if where is None and spec.submodule_search_locations:
        where = next(iter(spec.submodule_search_locations), None)
    if spec.origin in ("built-in", "frozen"):
        return True
    return where is not None and os.path.realpath(where).startswith(roots)


class UnsafePreload(RuntimeError):
    def __init__(self, module: str, why: str, *, explicit: bool = False):
        super().__init__(f"--preload {module}: importing it {why}" if explicit else f"importing {module} {why}")
        self.module = module


def _unsafe() -> str | None:
    if thread_count() != 1:
        return f"started threads ({thread_count()} now)"
    return cuda_touched()


def preload_learned(names: list[str]) -> None:
    """Import what earlier workers imported, checking after each that forking stays safe."""
    import importlib

    import warnings

    roots = _install_roots()
    for name in names:
        if name in sys.modules or not installed(name, roots):
            continue
        try:
            # a worker that imports it shows its warnings; the fork server must not show them on the user's terminal
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a speed-up only: aliases, platform modules, odd packages
            pass
        why = _unsafe()
        if why:
            raise UnsafePreload(name, why)


def preload(modules: list[str]) -> None:
    import importlib
    import warnings

    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)

    if "~torch" not in modules:  # the agent read a program that imports only the standard library: nothing to warm
        import torch  # noqa: F401  - the point of this process
        import torch.distributed  # noqa: F401

    global GUARDED_LIBS
    GUARDED_LIBS += tuple(m[1:] for m in modules if m.startswith("!") and len(m) > 1)
    why = cuda_touched()
    if why:  # torch itself: nothing here can be forked safely
        raise UnsafePreload("torch", why)
    learned = [m[1:] for m in modules if m.startswith("+")]
    static = [m[1:] for m in modules if m.startswith("=")]
    for m in modules:
        if not m or m[0] in "+!=-#~":
            continue
        if m.startswith("?"):  # our own defaults: a speed-up, never a reason to fail
            try:
                importlib.import_module(m[1:])
            except Exception:  # noqa: BLE001
                pass
            why = cuda_touched()
            if why:
                raise UnsafePreload(m[1:], why)
        else:
            importlib.import_module(m)
            why = cuda_touched()
            if why:
                raise UnsafePreload(m, f"{why}: a fork server must never touch CUDA (every worker forked from it "
                                       f"would inherit a broken CUDA state); drop it from --preload", explicit=True)
    if static:
        preload_static(static)
    if learned:
        preload_learned(learned)


def preload_static(entries: list[str]) -> None:
    """Import what the entry script's imports name (``module`` or ``module:attribute``, read statically by the
    agent), installed ones only, checking after each that forking stays safe (UnsafePreload names the module)."""
    import importlib
    import warnings

    roots = _install_roots()
    for entry in entries:
        name, _, attr = entry.partition(":")
        if not attr and name in sys.modules:
            continue
        if not installed(name, roots):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
                # ``from module import attr`` as Python does it: the attribute (a lazy package such as transformers
                # loads the class's module on it), else a submodule of that name
                if attr and getattr(mod, attr, None) is None and hasattr(mod, "__path__"):
                    importlib.import_module(f"{name}.{attr}")
        except BaseException:  # noqa: BLE001 - a speed-up only: the worker meets the same error itself
            pass
        why = _unsafe()
        if why:
            raise UnsafePreload(name, why)


def _reexec_without(fd: int, spec: list[str], tag: str, bad: str, why: str) -> None:
    """Start this fork server again (same process, same socket) without the entry-script import ``bad``: a thread
    it started, or CUDA, cannot be undone in this process. ``-bad`` in the new list says what was left out."""
    keep = [m for m in spec if not (m.startswith("=") and m[1:].partition(":")[0].split(".")[0] == bad.split(".")[0])]
    keep.append(f"-{bad}")
    keep.append(f"#{why}".replace(",", ";").replace("\n", " "))
    os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "resilient.launcher.zygote", str(fd), ",".join(keep), tag])


# ``python -m resilient.launcher.zygote --run KIND TARGET ARGS...``: a worker started as a fresh interpreter (the
# spawn starter) runs its program here, as ``python -u TARGET ARGS`` would, so that it ends as forked workers do
RUN_FLAG = "--run"


def run_spawned(kind: str, argv: list[str]) -> None:
    """The program of a spawned worker, then :func:`exit_safety.finish` instead of the interpreter's finalisation
    (seconds in a process that imported torch, after everything it wrote is done)."""
    from resilient.worker import exit_safety

    code = run_worker({"kind": kind, "argv": argv, "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE")})
    exit_safety.finish(code)


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == RUN_FLAG:
        run_spawned(sys.argv[2], sys.argv[3:])
    fd = int(sys.argv[1])
    # argv[3], when given, only labels the process for people reading ps
    spec = sys.argv[2] if len(sys.argv) > 2 else ""
    if spec.startswith("@"):  # a long list (learned modules) comes in a file: one argument is capped at 128 KiB
        with open(spec[1:]) as f:
            spec = f.read().strip()
    _serve(fd, [m for m in spec.replace("\n", ",").split(",")], sys.argv[3] if len(sys.argv) > 3 else "")


def _serve(fd: int, preload_modules: list[str], tag: str) -> None:
    """The fork server on socket ``fd``: import, prove forking safe, serve; in a forked worker, run its program and
    end the process (it never returns there with the fast exit)."""
    set_pdeathsig(signal.SIGKILL)
    # the server shares the agent's process group: a Ctrl-C, or a scheduler's SIGTERM to every process of the job,
    # would end it and, through the workers' death signal, kill them before the agent could pass the signal on for
    # their last save; it is ended by the agent (its socket) or with it (the death signal) instead. Workers reset
    # both in _child_setup.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    try:
        preload(preload_modules)
    except UnsafePreload as e:
        if any(m.startswith("=") and m[1:].partition(":")[0].split(".")[0] == e.module.split(".")[0]
               for m in preload_modules):
            _reexec_without(fd, preload_modules, tag, e.module, str(e))
        sock.sendall((json.dumps({"ev": "failed", "why": str(e), "bad": e.module}) + "\n").encode())
        sys.exit(3)
    except BaseException as e:  # noqa: BLE001 - reported, then the agent falls back to spawn
        sock.sendall((json.dumps({"ev": "failed", "why": f"preload failed: {type(e).__name__}: {e}"}) + "\n").encode())
        sys.exit(3)
    why = None
    if thread_count() != 1:
        why = f"{thread_count()} threads after imports; forking would be unsafe"
    else:
        touched = cuda_touched()
        if touched:
            why = f"imports {touched}; forking would be unsafe"
    if why:
        sock.sendall((json.dumps({"ev": "failed", "why": why}) + "\n").encode())
        sys.exit(3)
    z = Zygote(sock)
    denied = [m[1:] for m in preload_modules if m.startswith("-") and len(m) > 1]
    why_denied = "; ".join(m[1:] for m in preload_modules if m.startswith("#"))
    z.send({"ev": "ready", "pid": os.getpid(), "t": time.time(),
            **({"denied": denied, "why": why_denied} if denied else {})})
    job = z.serve()
    while isinstance(job, Zygote):  # this process is now a copy serving on a socket of its own
        z = job
        job = z.serve()
    if job is None:
        # Agent asked us to quit or went away: take our children with us.
        for pid in list(z.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        # Nothing of ours needs finalising, and tearing down torch's modules takes seconds on a busy host.
        os._exit(0)
    code = run_worker(job)
    sys.stdout.flush()
    sys.stderr.flush()
    from resilient.worker import exit_safety

    if exit_safety.fast_exit_enabled():
        exit_safety.finish(code)  # never returns
    sys.exit(code)


# A fork server forked from the agent (after the agent imported torch, before it started any thread) instead of
# started by exec: it inherits torch, so a node imports torch once instead of twice (about 2 s of CPU a node start,
# on the cores the job's first step needs). It then lets go of what was the agent's, so that it and its workers
# hold what an exec'd server would: no descriptor, signal handler, log handler or warnings hook of the agent's (its
# Python objects stay, unreferenced by anything that runs).
_COMM = "resilient-fork"  # the name ps -e and top show for it (its command line is the agent's)


def serve_inherited(fd: int, preload_modules: list[str], tag: str) -> NoReturn:
    """Run the fork server in a child just forked from the agent; never returns into the agent's code."""
    code = 1
    try:
        global _WORKER_COMM
        _WORKER_COMM = os.path.basename(sys.executable)  # what a worker of an exec'd server shows
        _forget_agent(fd)
        _set_comm(_COMM)
        _serve(fd, preload_modules, tag)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - nothing may unwind into the agent's frames
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


def _forget_agent(keep_fd: int) -> None:
    # The exit hooks stay: those registered by then are the imports' (logging's flush, weakref finalizers such as a
    # TemporaryDirectory's, multiprocessing's and the DataLoader's clean-up), which an exec'd server's imports
    # register too and a worker's end must run; the agent registers none of its own before it forks the server
    # (its ledger and checkpoints are closed by Agent.run, not at exit).
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    logs = sys.modules.get("resilient.logs")
    if logs is not None:
        logs.forget_setup()
    # as ``python -m`` (the exec'd server) has it: the working directory first, not the agent's script directory
    if sys.path:
        sys.path[0] = os.getcwd()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # as ForkServer gives an exec'd server (see there)
    # Every descriptor but stdout, stderr and the server's socket becomes /dev/null instead of being closed: the
    # agent's Python objects (its log file, its sockets) may still close or flush theirs one day, and that must
    # never reach a descriptor a worker opened under the same number.
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:  # no procfs: the agent has opened little by now (its log file); the common range is enough
        fds = list(range(256))
    for fd in fds:
        if fd in (1, 2, keep_fd, devnull):
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue  # not open (the listing's own descriptor, gone already)
        os.dup2(devnull, fd, inheritable=fd == 0)
    os.close(devnull)


_WORKER_COMM: str | None = None  # the process name a worker gets back (a forked server renamed itself)


def is_server_process(pid: int) -> bool:
    """Whether ``pid`` is a fork server (or a copy of one): by its name when forked from the agent, by its command
    line when started by exec (for tools and benches that look for it)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == _COMM:
                return True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resilient.launcher.zygote" in f.read()
    except OSError:
        return False


def _set_comm(name: str) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
