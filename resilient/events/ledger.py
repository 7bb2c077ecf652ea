"""Append-only JSON-lines ledger: one file per writing process, so no two writers ever share a file.

``O_APPEND`` makes each line one atomic append on a local filesystem, but not across the clients of a shared
volume (NFS, a Kubernetes ``ReadWriteMany`` claim that every pod's run directory points at), where two nodes
appending to one file can overwrite each other's lines. So each process claims a file of its own, created with
``O_EXCL`` (exclusive on NFSv3 and later too, so a name two writers could both pick — the same host name and pid
in two containers — still goes to one of them only):

* the run's first writer takes ``RUN_DIR/events.jsonl`` (the name users and older tools know; on a single node
  that is the agent, whose file also holds its supervisor's decisions);
* every other takes ``RUN_DIR/events.<host>-<pid>.jsonl`` (``-<n>`` added when that name is taken: a pid reused,
  a host name shared by containers).

Several :class:`Ledger` objects in one process (a worker's step loop, its checkpointer, a drill) share the
process's file; a process forked with a ledger open writes to a file of its own from its first event. The run
is read as one time line by :func:`resilient.events.follow.read_events`, which merges every writer's file on wall
time; a crash can at worst leave a file's final line truncated, which the reader skips in that file alone.

**A ledger that lost events says so.** A write the filesystem refuses or cuts short (a full run directory, a
quota) never stops training, but it is not silent either: the writer says it once on stderr, in one line,
and leaves a marker beside its file, ``<its file>.incomplete`` (one JSON line: when its first loss happened,
which event, the error). Creating an empty file needs no data block, so the marker exists even on a full
filesystem where its line does not fit. Readers (:func:`resilient.events.follow.ledger_incomplete`,
``resilient goodput``, the launcher's final lines) report the ledger as incomplete whenever any marker exists:
its last events may be missing, so a run that looks "in progress" may have ended.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path

from resilient import env as renv
from resilient.events.api import Event, EventKind
# read_events is re-exported: the reading side lives in follow.py, but callers find it beside the writer
from resilient.events.follow import incomplete_path, ledger_path, read_events, writer_path  # noqa: F401

logger = logging.getLogger(__name__)

# (pid, run directory) -> the file that process claimed there: one file per process, whatever the Ledger objects
_claimed: dict[tuple[int, str], Path] = {}
_claim_lock = threading.Lock()
_MAX_SUFFIX = 1000  # names tried after events.<host>-<pid>.jsonl is taken


def writer_host() -> str:
    """This host's part of its writers' names (``[A-Za-z0-9_-]`` only): every file a process of this host claims,
    other than ``events.jsonl``, starts with ``events.<writer_host()>-``."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]) or "host"


def writer_name() -> str:
    """This process's name among a run's writers: host name and pid (``[A-Za-z0-9_-]`` only)."""
    return f"{writer_host()}-{os.getpid()}"


def _create(path: Path) -> int | None:
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None


def claim(run_dir: str | os.PathLike[str]) -> tuple[Path, int]:
    """This process's ledger file in ``run_dir`` and an ``O_APPEND`` descriptor on it: the one it claimed
    before, else ``events.jsonl`` if no writer has it yet, else ``events.<host>-<pid>[-<n>].jsonl``, each
    created exclusively (a name another writer took is never opened)."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    key = (os.getpid(), str(d.resolve()))
    with _claim_lock:
        mine = _claimed.pop(key, None)
        if mine is not None:
            try:
                fd = os.open(mine, os.O_WRONLY | os.O_APPEND)
                _claimed[key] = mine
                return mine, fd
            except FileNotFoundError:
                pass  # deleted since: claim afresh, the name may be someone else's by now
        base = writer_name()
        candidates = [ledger_path(d), writer_path(d, base)]
        for path in candidates + [writer_path(d, f"{base}-{n}") for n in range(2, _MAX_SUFFIX)]:
            fd = _create(path)
            if fd is not None:
                _claimed[key] = path
                return path, fd
    raise FileExistsError(f"no free ledger file name in {d} for {base}")


class Ledger:
    """Writer of this process's ledger file in ``run_dir`` (see the module's docstring). Never raises on write:
    a ledger problem must not stop training."""

    def __init__(self, run_dir: str | os.PathLike[str], *, node: str | None = None, attempt: int | None = None):
        self.run_dir = Path(run_dir)
        self.path, self._fd = claim(self.run_dir)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.node = node
        self.attempt = attempt
        self._warned = False
        self.lost = 0  # events this writer could not write (whole or in part)

    @classmethod
    def from_env(cls) -> "Ledger | None":
        run_dir = os.environ.get(renv.RUN_DIR)
        if not run_dir:
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        try:
            return cls(run_dir, attempt=int(attempt) if attempt is not None else None)
        except OSError as e:
            logger.warning("cannot open the ledger in %s: %s; events will not be recorded", run_dir, e)
            return None

    def emit(self, kind: EventKind | Event, *, rank: int | None = None, attempt: int | None = None,
             **details: object) -> Event:
        if isinstance(kind, Event):
            ev = kind
        else:
            kw: dict[str, object] = {}
            if self.node is not None:
                kw["node"] = self.node
            ev = Event(kind=kind, rank=rank, attempt=self.attempt if attempt is None else attempt,
                       details=dict(details), **kw)  # type: ignore[arg-type]
        self.write(ev)
        return ev

    def write(self, ev: Event) -> None:
        line = (json.dumps(ev.to_json(), separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            self._append(line, ev.kind.value)

    def write_line(self, line: bytes) -> bool:
        """Append one pre-formatted event line (``Event.to_json`` as JSON, ending in a newline) with one
        ``os.write``: the hot path of per-step records. False when the write failed (the caller stops)."""
        return self._append(line, None)

    def _append(self, line: bytes, kind: str | None) -> bool:
        try:
            if os.getpid() != self._pid:
                self._reclaim()
            n = os.write(self._fd, line)
        except OSError as e:
            self._lost(e.strerror or str(e), kind, line)
            return False
        if n != len(line):
            # a full disk can take part of a line: the rest is lost, and the cut line is unreadable
            self._lost(f"only {n} of {len(line)} bytes written", kind, line)
            return False
        return True

    def _reclaim(self) -> None:
        """In a process forked with this ledger open: a file of its own, never the parent's."""
        old = self._fd
        self.path, self._fd = claim(self.run_dir)
        self._pid = os.getpid()
        try:
            os.close(old)
        except OSError:
            pass

    def _lost(self, error: str, kind: str | None, line: bytes) -> None:
        self.lost += 1
        if self._warned:
            return
        self._warned = True
        if kind is None:
            try:
                kind = str(json.loads(line).get("kind", "?"))
            except (ValueError, AttributeError):
                kind = "?"
        who = f"{self.node or os.environ.get(renv.NODE) or 'node'} pid {os.getpid()}"
        rank = os.environ.get("RANK")
        if rank is not None:
            who += f" rank {rank}"
        note = (json.dumps({"wall": time.time(), "who": who, "kind": kind, "error": error}) + "\n").encode()
        marker = incomplete_path(self.path)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, note)
            except OSError:
                pass  # no room for the line: the empty marker still says events were lost
            finally:
                os.close(fd)
        except OSError as e:
            logger.debug("cannot write %s: %s", marker, e)
        # once per process, one line: every lost event after this one would only repeat it
        logger.error("cannot write the ledger %s (%s; first lost: %s): the run's record is incomplete from "
                     "here on; training goes on; free space in the run directory", self.path, error, kind)

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

