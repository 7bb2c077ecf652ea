"""Loading a policy file (``--policy FILE``, ``resilient policy check FILE``).

A policy file is plain Python. The loader looks, in this order, for:

1. a module-level ``policy`` object with a ``decide`` method (``policy = MyPolicy(k=5)``): used as is;
2. a module-level function ``decide(event, view)``: used as is;
3. exactly one class defined in the file with a ``decide`` method: instantiated without arguments
   (``__init__`` may take none, or only arguments with defaults); it may keep state between calls.

Policy files import what they need from :mod:`resilient.supervisor.api` (actions, ``JobView``,
``NodeState``) and :mod:`resilient.events.api` (``EventKind``); to extend the default behaviour, subclass
:class:`resilient.supervisor.default_policy.DefaultPolicy`. A file that cannot be compiled or run, or
that offers no ``decide``, raises :class:`PolicyError` naming the file and line.

Where a policy file runs: every ``--policy`` file runs in a process of its own
(:class:`IsolatedPolicy`, :mod:`resilient.supervisor.policy_host`), spawned once per job and fed each event
and the read-only view over a socket, so that a policy keeps its state between calls but a crash, an
``os._exit``, an endless loop, a huge allocation or a fork cannot take the supervisor (and the agent hosting
it) down. The shipped files under ``policies/`` are treated the same way: they are starting points users
copy and edit, so a path says nothing about whether the code is ours. Only the built-in default policy (no
``--policy``, and the fallback whenever a policy fails) runs in-process: it is the package's own code, and
the supervisor cannot do without it.
"""

from __future__ import annotations

import enum
import errno
import importlib.util
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from resilient.events.api import Event
from resilient.supervisor.api import ACTIONS, Action, JobView, Policy, PolicyError
from resilient.supervisor.config import PolicyLimits
from resilient.supervisor.default_policy import DefaultPolicy

logger = logging.getLogger(__name__)


class _FunctionPolicy:
    def __init__(self, fn: Any, name: str) -> None:
        self._fn = fn
        self.name = name

    def decide(self, event: Any, view: Any) -> Any:
        return self._fn(event, view)

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def default_policy() -> Policy:
    return DefaultPolicy()


def _where(path: Path, exc: BaseException) -> str:
    """``file:line`` of the innermost frame inside the policy file (or of the syntax error)."""
    if isinstance(exc, SyntaxError):
        return f"{path}:{exc.lineno}"
    line = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(fr.filename) == os.path.abspath(path):
            line = fr.lineno
    return f"{path}:{line}" if line is not None else str(path)


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is the address-space limit: a ``MemoryError``, or ENOMEM from a mapping (``mmap``, a
    thread's stack) that the limit refused."""
    return isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM)


def load_policy(path: str | os.PathLike[str], *, isolated: bool = True,
                limits: "PolicyLimits | None" = None) -> Policy:
    """The policy in ``path``: by default an :class:`IsolatedPolicy` (its own process, loaded there under
    ``limits``); ``isolated=False`` loads it into this process (the policy host itself, offline tools and
    tests that look inside a policy object)."""
    if isolated:
        return IsolatedPolicy(path, limits or PolicyLimits())
    p = Path(path)
    if not p.is_file():
        raise PolicyError(f"policy file {p} does not exist (pass a Python file defining decide(event, view))")
    try:
        source = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"policy file {p} cannot be read: {e}") from None
    try:
        code = compile(source, str(p), "exec")
    except SyntaxError as e:
        raise PolicyError(f"{_where(p, e)}: syntax error in the policy: {e.msg}") from None
    name = f"resilient_policy_{p.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(p))
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = str(p)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    try:
        exec(code, mod.__dict__)
    except Exception as e:  # noqa: BLE001 - whatever a policy's import does wrong, refuse it clearly
        sys.modules.pop(name, None)
        kind = "MemoryError" if out_of_memory(e) else type(e).__name__  # the isolated loader reads the name
        raise PolicyError(f"{_where(p, e)}: the policy failed while loading: {kind}: {e}") from None
    obj = mod.__dict__.get("policy")
    if obj is not None and callable(getattr(obj, "decide", None)) and not inspect.isclass(obj):
        return obj
    fn = mod.__dict__.get("decide")
    if callable(fn) and not inspect.isclass(fn):
        return _FunctionPolicy(fn, p.name)
    classes = [v for v in mod.__dict__.values() if inspect.isclass(v) and v.__module__ == name
               and callable(getattr(v, "decide", None))]
    if len(classes) == 1:
        try:
            return classes[0]()
        except Exception as e:  # noqa: BLE001
            where = _where(p, e)
            code = getattr(classes[0].__init__, "__code__", None)
            if where == str(p) and code is not None and os.path.abspath(code.co_filename) == os.path.abspath(p):
                where = f"{p}:{code.co_firstlineno}"  # the signature is what is wrong
            raise PolicyError(f"{where}: the policy class {classes[0].__name__} cannot be created "
                              f"without arguments ({type(e).__name__}: {e}); or set policy = "
                              f"{classes[0].__name__}(...)") from None
    if len(classes) > 1:
        raise PolicyError(f"{p}: several policy classes ({', '.join(c.__name__ for c in classes)}); say which "
                          "with a module-level `policy = TheClass()`")
    raise PolicyError(f"{p}:1: no decide(event, view) in the policy: define a function decide, a class with a "
                      "decide method, or `policy = ...`")


class UnloadablePolicy:
    """Stands for a policy file that a supervisor started during the job could not load (a node taking the job over
    after its host was lost, the file edited or removed since the start-up check): every decision is the default
    policy's, and each ``action`` event's ``fallback`` says why. Ending a running job over it would cost more than
    the policy is worth; a file that does not load when the job starts is refused then, while nothing runs."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        self.path, self.why = Path(path), why
        self.name = self.path.name

    def __repr__(self) -> str:
        return f"<unloadable policy {self.name}>"

    def decide_within(self, event: Event, view: JobView, timeout: float) -> Action:
        raise PolicyFailure(PolicyFailureKind.DISABLED, f"the policy could not be loaded when this supervisor started "
                                                        f"({self.why}); the default policy decides in its place")

    def decide(self, event: Event, view: JobView) -> Action:
        return self.decide_within(event, view, 0.0)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- isolation
MAX_ANSWER = 1 << 20  # bytes: an action is a few names and a reason


class PolicyFailureKind(str, enum.Enum):
    RAISED = "raised"  # decide raised: the process lives on, with its state
    NONSENSE = "nonsense"  # decide returned something that is not an action
    DIED = "died"  # the process ended (os._exit, a signal, the CPU-time limit, a crash)
    OVERRAN = "overran"  # no answer within --policy-timeout: the process is killed
    MEMORY = "memory"  # the address-space limit was hit (MemoryError)
    FORKED = "forked"  # the policy called fork
    DISABLED = "disabled"  # failed too often in a row: not asked again


# failures after which the process is killed and started afresh (the policy's state is lost with it)
HARD_FAILURES = frozenset({PolicyFailureKind.DIED, PolicyFailureKind.OVERRAN, PolicyFailureKind.MEMORY,
                           PolicyFailureKind.FORKED})


class PolicyFailure(PolicyError):
    """One call of an isolated policy gave no action; the message says why, for the ledger's ``action``
    event (the default policy decides instead)."""

    def __init__(self, kind: PolicyFailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def view_to_json(view: JobView) -> dict[str, Any]:
    nodes = {n: {"name": v.name, "state": v.state.value, "group_rank": v.group_rank, "nproc": v.nproc,
                 "healthy": v.healthy, "failures": v.failures, "stragglers": v.stragglers, "last_seen": v.last_seen}
             for n, v in view.nodes.items()}
    return {"nodes": nodes, "min_nodes": view.min_nodes, "max_nodes": view.max_nodes,
            "nproc_per_node": view.nproc_per_node, "restarts_left": view.restarts_left, "attempt": view.attempt,
            "ckpt_steps": dict(view.ckpt_steps), "recent": [e.to_json() for e in view.recent],
            "failure_window": view.failure_window, "now": view.now, "pending_scale_up": list(view.pending_scale_up),
            "joining": list(view.joining), "nodes_per_replica": view.nodes_per_replica,
            "replacement_wait_left": view.replacement_wait_left}


_ACTION_KINDS = {cls.kind: cls for cls in ACTIONS}


def action_from_json(d: Any) -> Action | None:
    cls = _ACTION_KINDS.get(d.get("action")) if isinstance(d, dict) else None
    if cls is None:
        return None
    try:
        return cls(**{k: v for k, v in d.items() if k != "action"})
    except TypeError:
        return None


def _how_it_ended(rc: int | None, limits: PolicyLimits) -> str:
    if rc is None:
        return "stopped answering"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        if -rc == signal.SIGXCPU:
            return f"was killed by {name} (its CPU-time limit of {limits.cpu_seconds} s, --policy-cpu-seconds)"
        return f"was killed by {name}"
    return f"exited with code {rc}"


class _Handle:
    """The process and its socket, apart from the policy object so that a finalizer can end them."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.pidfd: int | None = None
        self.spawned = 0.0
        self.ready = False

    def kill(self) -> int | None:
        """End the process and everything it left in its session; its exit status, if known."""
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the policy's and nothing else
            except (ProcessLookupError, PermissionError):
                pass
            try:
                rc = proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                logger.warning("policy process %d did not end within 10 s of SIGKILL", proc.pid)
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.ready = False
        return rc


class IsolatedPolicy:
    """A policy file running in a process of its own (see the module's docstring); ``decide`` has the
    :class:`~resilient.supervisor.api.Policy` signature and raises :class:`PolicyFailure` when there is no
    action. Calls never overlap: a call that overruns ends with its process, before the next one starts."""

    def __init__(self, path: str | os.PathLike[str], limits: PolicyLimits | None = None) -> None:
        self.path = Path(path)
        self.limits = limits or PolicyLimits()
        if not self.path.is_file():
            raise PolicyError(f"policy file {self.path} does not exist (pass a Python file defining "
                              "decide(event, view))")
        self.name = self.path.name
        self.failures: list[PolicyFailure] = []  # the hard ones, oldest first (resilient policy check reads them)
        self._h = _Handle()
        self._lock = threading.Lock()
        self._seq = 0
        self._in_a_row = 0
        self._disabled: str | None = None
        self._finalizer = weakref.finalize(self, _Handle.kill, self._h)
        self._spawn()
        try:
            self._loaded(self.limits.load_timeout)
        except PolicyFailure as e:
            self.close()
            raise PolicyError(f"{self.path}: {e}") from None

    def __repr__(self) -> str:
        return f"<isolated policy {self.name}>"

    # ------------------------------------------------------------------------------------------ process
    def _spawn(self) -> None:
        a, b = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # this package, whichever way it was found here
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "resilient.supervisor.policy_host", str(b.fileno()), str(self.path),
                 str(self.limits.memory_mb << 20), str(self.limits.cpu_seconds)],
                pass_fds=(b.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        except OSError as e:
            a.close()
            b.close()
            raise PolicyFailure(PolicyFailureKind.DIED, f"the policy process could not be started: {e}") from None
        b.close()
        h = self._h
        h.proc, h.conn, h.spawned, h.ready = proc, Connection(a.detach()), time.monotonic(), False
        try:
            h.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            h.pidfd = None  # the socket's end of file says the same, unless a grandchild holds it

    def _wait(self, timeout: float) -> dict[str, Any] | str:
        """The next message, or "dead" / "timeout"."""
        h = self._h
        assert h.conn is not None and h.proc is not None
        end = time.monotonic() + timeout
        while True:
            if h.conn.poll(0):
                try:
                    return json.loads(h.conn.recv_bytes(MAX_ANSWER))
                except (EOFError, ConnectionError):
                    return "dead"
                except (OSError, ValueError):  # over the size limit, or not JSON: not something a policy said
                    return "dead"
            if h.proc.poll() is not None:
                return "dead"
            left = end - time.monotonic()
            if left <= 0:
                return "timeout"
            wait([h.conn] + ([h.pidfd] if h.pidfd is not None else []), timeout=left if h.pidfd is not None
                 else min(left, 0.5))

    def _loaded(self, timeout: float) -> None:
        """Wait for the process to say it loaded the file; raise :class:`PolicyFailure` if it did not."""
        msg = self._wait(timeout)
        lim = self.limits
        if msg == "timeout":
            self._h.kill()
            raise PolicyFailure(PolicyFailureKind.OVERRAN, f"the policy did not load within {lim.load_timeout:g} s "
                                                           "(an endless loop or a blocking call at import?)")
        if msg == "dead" or not isinstance(msg, dict):
            rc = self._h.kill()
            raise PolicyFailure(PolicyFailureKind.DIED, f"the policy process {_how_it_ended(rc, lim)} while "
                                                        "loading the file (os._exit, a signal or a crash at import)")
        state = msg.get("load")
        if state == "ok":
            self._h.ready = True
            return
        self._h.kill()
        if state == "memory" or (state == "error" and "MemoryError" in str(msg.get("error"))):
            raise PolicyFailure(PolicyFailureKind.MEMORY, "the policy ran out of memory while loading (its process "
                                                          f"may use {lim.memory_mb} MiB of address space: "
                                                          "--policy-memory-mb)")
        if state == "forked":
            raise PolicyFailure(PolicyFailureKind.FORKED, "the policy forked while loading (a policy must not "
                                                          "start processes)")
        text = str(msg.get("error", msg))
        prefix = f"{self.path}: "
        raise PolicyFailure(PolicyFailureKind.RAISED, text[len(prefix):] if text.startswith(prefix) else text)

    def _fail(self, kind: PolicyFailureKind, text: str) -> PolicyFailure:
        """A hard failure: end the process, start a fresh one (or give up after too many in a row)."""
        self._h.kill()
        self._in_a_row += 1
        if self._in_a_row >= self.limits.max_failures:
            self._disabled = (f"the policy failed {self._in_a_row} times in a row (last: {kind.value}); it is not "
                              "asked again in this job")
            text = f"{text}; {self._disabled}"
        else:
            text = f"{text}; a fresh policy process is started (the policy's state is lost)"
            try:
                self._spawn()
            except PolicyFailure as e:
                self._disabled = str(e)
        f = PolicyFailure(kind, text)
        self.failures.append(f)
        logger.debug("policy %s: %s", self.name, text)  # the core logs the fallback, with this text
        return f

    # ------------------------------------------------------------------------------------------ deciding
    def decide(self, event: Event, view: JobView) -> Action:
        return self.decide_within(event, view, self.limits.timeout)

    def decide_within(self, event: Event, view: JobView, timeout: float) -> Action:
        with self._lock:
            if self._disabled is not None:
                raise PolicyFailure(PolicyFailureKind.DISABLED, self._disabled)
            h = self._h
            if not h.ready:  # restarted after a failure: give it what is left of its load time
                left = max(0.0, h.spawned + self.limits.load_timeout - time.monotonic())
                try:
                    self._loaded(left)
                except PolicyFailure as e:
                    raise self._fail(e.kind, f"the restarted policy process failed: {e}") from None
            self._seq += 1
            on = f"{event.kind.value} from {event.node}"
            try:
                assert h.conn is not None
                h.conn.send_bytes(json.dumps({"id": self._seq, "event": event.to_json(), "view": view_to_json(view)},
                                             default=str).encode())
            except OSError:
                rc = h.proc.wait(timeout=10.0) if h.proc is not None else None
                raise self._fail(PolicyFailureKind.DIED, f"the policy process {_how_it_ended(rc, self.limits)} "
                                                         f"before deciding on {on}") from None
            msg = self._wait(timeout)
            if msg == "timeout":
                raise self._fail(PolicyFailureKind.OVERRAN, f"the policy did not decide within {timeout:g} s "
                                                            f"(--policy-timeout) on {on}: its process was killed")
            if msg == "dead" or not isinstance(msg, dict) or msg.get("id") != self._seq:
                rc = h.proc.poll() if h.proc is not None else None
                if rc is None:  # alive but talking nonsense on the socket: end it all the same
                    rc = self._h.kill()
                raise self._fail(PolicyFailureKind.DIED, f"the policy process {_how_it_ended(rc, self.limits)} "
                                                         f"while deciding on {on}")
            if "memory" in msg:
                raise self._fail(PolicyFailureKind.MEMORY, f"the policy ran out of memory deciding on {on} (its "
                                                           f"process may use {self.limits.memory_mb} MiB of address "
                                                           f"space: --policy-memory-mb)")
            if "forked" in msg:
                raise self._fail(PolicyFailureKind.FORKED, f"the policy forked deciding on {on} (a policy must not "
                                                           "start processes; the child was ended at once)")
            self._in_a_row = 0
            if "raised" in msg:
                raise PolicyFailure(PolicyFailureKind.RAISED, f"the policy raised:\n{msg['raised']}")
            action = action_from_json(msg.get("action"))
            if action is None:
                shown = msg.get("nonsense", msg.get("action"))
                raise PolicyFailure(PolicyFailureKind.NONSENSE,
                                    f"the policy returned {shown!s:.200}, not an action (Restart, HotSwap, ScaleDown, "
                                    "ScaleUp, Cordon, Ignore or Stop)")
            return action

    def close(self) -> None:
        """End the policy's process (also done when the object is collected, and at exit)."""
        self._finalizer()

    def __enter__(self) -> "IsolatedPolicy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
