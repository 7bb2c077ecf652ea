"""Writes what a worker holds of the process it was forked from (before it opens anything itself)."""
import json
import logging
import logging.handlers
import os
import signal
import sys
import tempfile
import warnings

import torch  # noqa: F401 - a program that imports only the standard library gets a server without torch, by exec


def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").split("\0")[:-1]


def comm(pid):
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


fds = {int(n): target(n) for n in os.listdir("/proc/self/fd")}
server = os.getppid()
state = {
    "fds": {str(k): v for k, v in fds.items() if k > 2 and v is not None and not v.startswith("/proc/")},
    "root_handlers": [type(h).__name__ for h in logging.getLogger().handlers],
    "root_level": logging.getLogger().level,
    "showwarning": warnings.showwarning.__module__,
    "signals": {s.name: {signal.SIG_DFL: "default", signal.SIG_IGN: "ignore"}.get(signal.getsignal(s), repr(signal.getsignal(s)))
                for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD)},
    "wakeup_fd": signal.set_wakeup_fd(-1),
    "path0": sys.path[0],
    "env": dict(os.environ),
    "comm": comm(os.getpid()),
    "server": {"pid": server, "comm": comm(server), "cmdline": cmdline(server), "parent": ppid(server)},
}
# left to the exit hooks the imports registered (weakref.finalize's: a TemporaryDirectory is removed at exit), and
# logging's flush at exit (a MemoryHandler holds its records until then)
_kept = tempfile.TemporaryDirectory(dir=sys.argv[1], prefix=f"tmp_{os.environ.get('RANK', '0')}_")
state["tempdir"] = _kept.name
_log = logging.getLogger("worker")
_log.propagate = False
_log.addHandler(logging.handlers.MemoryHandler(
    1000, flushLevel=logging.CRITICAL,
    target=logging.FileHandler(os.path.join(sys.argv[1], f"worker_{os.environ.get('RANK', '0')}.log"))))
_log.warning("flushed at exit")
with open(os.path.join(sys.argv[1], f"state_{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(state, f)
