"""The node monitor: everything workers report over the agent socket, plus host/GPU/notice detectors.

The agent owns the loop (see :mod:`resilient.signals.api`); this object never blocks it: the socket is
non-blocking, health checks run in a thread, and ``next_deadline`` tells the agent exactly when the next
hang deadline falls, so a missed heartbeat is reported at the deadline, not a polling period later.

Hang rule, per local rank:

* before ``steps()`` (its hello), outside sections: ``attempt start + initial_timeout`` (or ``learn_factor`` × the
  longest start-up seen, if longer) — armed only once the job is known to use the worker client (some rank of this
  node has said hello in this or an earlier attempt), so a script that never imports ``resilient`` is never called
  hung. Once an earlier attempt's ranks restored through the checkpointer (a marked restore, ``RESTORE_SECTION``),
  the start-up is held to what it was then instead: ``learn_factor`` × the longest such start-up with its restore
  left out, at least ``min_learned_startup``, the clock stopped while the rank is inside a section;
* inside a marked restore: its start + ``max(initial_timeout, learn_factor`` × the longest restore seen``)``, never
  learned shorter (a restore from a slower tier can take ten times the last one);
* inside a ``section``: section start + its timeout (given, else learned for that section name once
  ``learn_after`` of them were seen, else ``initial_timeout``);
* during the rank's first ``warmup_steps`` steps of the attempt: last message + ``initial_timeout`` (or
  ``learn_factor`` × the longest warm-up step seen, if longer), unless a heartbeat timeout is given;
* otherwise: last message + the heartbeat timeout (given, else learned: ``learn_factor`` × the longest
  step seen, at least ``min_learned_timeout``, ``initial_timeout`` until ``learn_after`` steps were seen;
  doubled after every hang declared on a learned timeout unless a stalled rank's process was stopped, which
  is a hang for certain, not a long step);
* the step right after a section: the above plus the timeout the section had (a peer may still be inside
  it, and this rank waits for it in the next collective);
* after ``steps()`` finished: not watched (outside sections).

A step sample is the time between two step heartbeats with nothing else between them, after the warm-up:
warm-up steps, steps holding a section and the steps' start-up are never learned from. What is learned
(step and section lengths, the back-off) lives as long as the agent, so it carries over restarts: the job's
steps are the same program after a restart; what differs, the warm-up, is under the initial timeout again.

Who may speak: the kernel's word only. Each connection is bound at accept to the worker whose pid
``SO_PEERCRED`` reports (or whose descendant it is: a ``--no-python`` wrapper's python child), and every
message on it counts for that worker's rank, whatever pid, rank or attempt its header claims. A connection
from any other process, of any user, is closed at once, before the agent keeps its descriptor; so is one
beyond ``_CONNS_PER_WORKER`` per worker. Refusals are logged at most once per ``_REFUSED_LOG_INTERVAL``
with a count, so no outside process can flood the agent's log or exhaust its descriptors.

Hangs are reported once per attempt, when the first deadline passes, with one HANG per rank that is
silent for at least half its timeout; ``suspect`` marks the likely culprit (a stopped process, else the
ranks furthest behind). Nothing more is reported until the next attempt.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient import env as renv
from resilient.events.api import Event, EventKind
from resilient.events.ledger import Ledger
from resilient.logs import RateLimitedLog
from resilient.signals import protocol as P
from resilient.signals.api import RESTORE_SECTION, MonitorConfig, NodeMonitor
from resilient.signals.health import HealthConfig, HealthThread, HostChecks, NoticeFile, NoticeURL
from resilient.signals.straggler import StragglerConfig, StragglerScorer

logger = logging.getLogger(__name__)

PREEMPT_FILE = "preempt"
PREEMPT_URL_ENV = renv.PREEMPT_URL  # read by the agent's monitor: an HTTP notice endpoint
_MAX_PER_CONN = 4096  # packets read from one connection per on_readable: no worker can starve the others
_PEERCRED = struct.Struct("3i")
# A worker holds one connection; a reconnect briefly holds two; a wrapper and its python child one each.
_CONNS_PER_WORKER = 4
_ACCEPTS_PER_CALL = 256  # then back to the agent loop: a connect flood cannot starve exit and hang watching
_REFUSED_LOG_INTERVAL = 10.0
# A gap longer than this between two calls of the agent is the agent's own stall (its process stopped, its host
# frozen), not its workers' silence: the ranks' clocks move on by the gap. The agent calls at least every
# --monitor-interval while workers run, and its other calls in a pass are bounded to about a second or two.
_PAUSE_AFTER = 2.0
_ANCESTRY_DEPTH = 8  # parent links followed from a sender to a worker (wrapper → python is 1)
_ANCESTRY_CACHE = 4096


def create_node_monitor(config: MonitorConfig, ledger: Ledger | None, node_rank: int) -> NodeMonitor:
    """The agent's entry point. ``ledger`` is used for the run directory and node name only: the agent
    itself writes the events this monitor returns."""
    return SocketNodeMonitor(config, ledger, node_rank)


@dataclass
class _Rank:
    local_rank: int
    rank: int
    pid: int | None
    hello: bool = False
    stepped: bool = False
    done: bool = False
    last_seen: float | None = None
    step: int = -1
    sections: list[tuple[str, float, float | None]] = field(default_factory=list)  # name, start, timeout
    steps_seen: int = 0  # STEP messages in this attempt
    last_type: int | None = None  # of the last message
    after_section: tuple[str, float] | None = None  # (name, timeout) of the section just left, until the next STEP
    pre_sections: float = 0.0  # seconds inside sections before the hello: not start-up work (a restore)
    restored: bool = False  # a marked restore ended before the hello: this start-up is a sample for later attempts


@dataclass
class _Conn:
    sock: socket.socket
    pid: int  # the sender, as the kernel reported it at connect time
    local_rank: int  # the worker it is bound to
    attempt: int | None


class SocketNodeMonitor:
    def __init__(self, config: MonitorConfig, ledger: Ledger | None, node_rank: int) -> None:
        self.config = config
        self.node_rank = node_rank
        self.node = ledger.node if ledger is not None and ledger.node else None
        self.run_dir = ledger.path.parent if ledger is not None else None
        self._path: str | None = None
        addr = P.socket_address(config.socket_path)
        self._listen = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._wake_r, self._wake_w = socket.socketpair()
        self._ep = select.epoll()
        try:
            if isinstance(addr, str):
                self._path = addr
                try:
                    os.unlink(addr)  # a stale file from a dead agent
                except FileNotFoundError:
                    pass
            self._listen.bind(addr)
            if self._path is not None:
                os.chmod(self._path, 0o600)
            self._listen.listen(1024)
            self._listen.setblocking(False)
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._ep.register(self._listen.fileno(), select.EPOLLIN)
            self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
        except OSError as e:
            for obj in (self._listen, self._wake_r, self._wake_w, self._ep):
                obj.close()
            raise OSError(e.errno, f"cannot listen on the agent socket {config.socket_path!r}: {e.strerror}; "
                          "pick another socket_path (an '@name' is per network namespace)") from e
        self._conns: dict[int, _Conn] = {}
        self._uid = os.getuid()
        self._me = os.getpid()
        self._per_rank: dict[int, int] = {}  # local rank → connections held
        self._ancestry: dict[tuple[int, int], int | None] = {}  # (pid, start time) → worker pid it descends from
        self._refused = RateLimitedLog(logger, _REFUSED_LOG_INTERVAL)
        self.refused = 0  # connections refused since start (tests, summary)
        # one descriptor kept in reserve: when the process is out of descriptors, it is freed to accept and
        # close the pending connection, so a full backlog cannot keep the socket readable forever
        self._reserve: int | None = _open_reserve()

        self.attempt: int | None = None
        self._active = False
        self._attempt_t0 = 0.0
        self._last_call: float | None = None  # the agent's last call with a time: a long gap is its own stall
        self.pauses: list[float] = []  # the agent's stalls while workers ran, oldest first (tests, summary)
        self._ranks: dict[int, _Rank] = {}  # local rank →
        self._by_global: dict[int, _Rank] = {}
        self._by_pid: dict[int, _Rank] = {}
        self._hung = False
        self._ready_sent = False
        self._client_seen = False  # some rank ever said hello: the script uses the worker client
        self._max_gap = 0.0
        self._gaps = 0
        self._section_max: dict[str, float] = {}
        self._section_seen: dict[tuple[str, int], int] = {}  # (section, global rank) → times ended
        self._max_warmup = 0.0  # longest warm-up step seen: a compile longer than the initial timeout stays safe
        self._backoff = 1.0  # ×2 per hang declared on a learned timeout
        self._max_startup = 0.0  # longest spawn → first message seen: a slow start must not trip later attempts
        # longest start-up (spawn → hello, sections left out) of an earlier attempt whose ranks restored through
        # the checkpointer, and how many such start-ups were seen; this attempt's, folded in when the next starts
        # (never learned within an attempt: one rank's own work before the loop, a tracker's login on rank 0, may
        # outlast the others' by far, every attempt alike)
        self._startup_learned = 0.0
        self._startup_samples = 0
        self._startup_now: list[float] = []
        self._startup_off = False  # a start-up held to the learned bound ran past it without being stopped

        self._straggler = StragglerScorer(StragglerConfig(
            threshold=config.straggler_threshold, history_threshold=config.straggler_history_threshold,
            window=config.straggler_window, confirm=config.straggler_confirm, min_gap=config.straggler_min_gap))
        self._health = HealthThread(
            HostChecks(HealthConfig(interval=config.health_interval, memory_threshold=config.memory_threshold,
                                    ckpt_local=config.ckpt_local, disk_min_free_bytes=config.disk_min_free_bytes,
                                    disk_min_free_fraction=config.disk_min_free_fraction,
                                    gpu_temperature_threshold=config.gpu_temperature_threshold),
                       self._event),
            config.health_interval, self._wake)
        notice = config.preempt_file or (str(self.run_dir / PREEMPT_FILE) if self.run_dir is not None else None)
        self._notice = NoticeFile(notice, config.preempt_grace, self._event) if notice else None
        self._next_notice = 0.0
        url = config.preempt_url or os.environ.get(PREEMPT_URL_ENV) or None
        self._notice_url = (HealthThread(NoticeURL(url, config.preempt_grace, self._event), config.preempt_url_poll,
                                         self._wake, name="notice-url") if url else None)

    # --- NodeMonitor -------------------------------------------------------------------------------

    def fileno(self) -> int:
        return self._ep.fileno()

    def attempt_started(self, attempt: int, ranks: dict[int, int], pids: dict[int, int],
                        ranks_per_replica: int | None = None) -> None:
        """``ranks``: local → global rank; ``ranks_per_replica`` (None: every rank a replica) tells the
        straggler scores which ranks are data-parallel peers."""
        if self._startup_now:
            self._startup_learned = max(self._startup_learned, *self._startup_now)
            self._startup_samples += len(self._startup_now)
            self._startup_now = []
        self.attempt = attempt
        self._active = True
        self._attempt_t0 = self._last_call = time.monotonic()
        self._hung = False
        self._ready_sent = False
        self._ranks = {lr: _Rank(local_rank=lr, rank=gr, pid=pids.get(lr)) for lr, gr in ranks.items()}
        self._by_global = {r.rank: r for r in self._ranks.values()}
        self._by_pid = {r.pid: r for r in self._ranks.values() if r.pid is not None}
        self._ancestry.clear()
        self._straggler.reset(set(self._by_global), ranks_per_replica)
        self._close_conns()  # anything still open belongs to the previous attempt's processes

    def attempt_stopped(self) -> None:
        self._active = False
        self._ranks, self._by_global, self._by_pid = {}, {}, {}
        self._close_conns()

    def _clock(self, now: float) -> None:
        """Before anything is judged at ``now``: a gap since the agent's last call longer than ``_PAUSE_AFTER`` was
        the agent's stall, during which no heartbeat could be read. Every watched clock moves on by the gap (never
        past ``now``), so a rank silent before the stall stays as late as it was, and none is late for it."""
        last, self._last_call = self._last_call, now if self._last_call is None else max(now, self._last_call)
        if last is None or not self._active or now - last <= _PAUSE_AFTER:
            return
        gap = now - last
        self.pauses.append(gap)
        self._attempt_t0 = min(now, self._attempt_t0 + gap)
        for r in self._ranks.values():
            if r.last_seen is not None:
                r.last_seen = min(now, r.last_seen + gap)
            r.sections = [(name, min(now, start + gap), given) for name, start, given in r.sections]
        logger.warning("the agent did not run for %.1f s (its own stall): its ranks' heartbeat clocks move on by "
                       "as much", gap)

    def on_readable(self, now: float) -> list[Event]:
        self._clock(now)
        out: list[Event] = []
        try:
            ready = self._ep.poll(0)
        except InterruptedError:
            ready = []
        for fd, mask in ready:
            if fd == self._listen.fileno():
                self._accept()
            elif fd == self._wake_r.fileno():
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
            else:
                out += self._read(fd, mask, now)
        out += self._drain_threads()
        return out

    def _drain_threads(self) -> list[Event]:
        out = self._health.drain()
        if self._notice_url is not None:
            out += self._notice_url.drain()
        return out

    def tick(self, now: float) -> list[Event]:
        self._clock(now)
        self._refused.flush()
        out = self._drain_threads()
        if self._notice is not None and now >= self._next_notice:
            self._next_notice = now + self.config.preempt_poll
            out += self._notice.poll()
        if self._active and not self._hung:
            out += self._check_hangs(now)
        return out

    def next_deadline(self) -> float | None:
        times = []
        if self._notice is not None:
            times.append(self._next_notice)
        if self._active and not self._hung:
            for r in self._ranks.values():
                d = self._deadline(r)
                if d is not None:
                    times.append(d[0])
        return min(times) if times else None

    def close(self) -> None:
        self._health.close()
        if self._notice_url is not None:
            self._notice_url.close()
        self._refused.flush(force=True)
        self._close_conns()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        self._ep.close()
        self._listen.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    # --- introspection (tests, logs) ---------------------------------------------------------------

    def heartbeat_timeout(self) -> tuple[float, str]:
        """The out-of-section heartbeat timeout in force and where it comes from."""
        if self.config.heartbeat_timeout is not None:
            return self.config.heartbeat_timeout, "configured"
        if self._gaps >= self.config.learn_after:
            return self._learned(self._max_gap), "learned"
        return self.config.initial_timeout, "initial"

    def startup_timeout(self) -> tuple[float, str]:
        """The start-up bound (spawn → ``steps()``, outside sections) in force and where it comes from."""
        cfg = self.config
        if self._startup_samples and not self._startup_off:
            return max(min(cfg.min_learned_startup, cfg.initial_timeout),
                       cfg.learn_factor * self._startup_learned), "startup:learned"
        return max(cfg.initial_timeout, cfg.learn_factor * self._max_startup), "initial"

    def _learned(self, longest: float) -> float:
        return self._backoff * max(self.config.min_learned_timeout, self.config.learn_factor * longest)

    def _section_timeout(self, name: str, given: float | None, rank: int | None = None) -> tuple[float, str]:
        """The timeout of section ``name`` for global rank ``rank`` (None: any rank of the node). Learned once
        that rank has ended it ``learn_after`` times: counted per rank, since a node of N workers sees each save N
        times. A configured ``--heartbeat-timeout`` is a floor: a section is never watched more tightly than a
        step."""
        if given is not None:
            return given, f"section:{name}"
        if name == RESTORE_SECTION:
            t, source = max(self.config.initial_timeout,
                            self.config.learn_factor * self._section_max.get(name, 0.0)), f"section:{name}:startup"
            floor = self.config.heartbeat_timeout
            return (floor, f"section:{name}:configured") if floor is not None and floor > t else (t, source)
        seen = (max((n for (s, _), n in self._section_seen.items() if s == name), default=0) if rank is None
                else self._section_seen.get((name, rank), 0))
        if seen < self.config.learn_after:
            t, source = self.config.initial_timeout, f"section:{name}:initial"
        else:
            t, source = self._learned(self._section_max[name]), f"section:{name}:learned"
        floor = self.config.heartbeat_timeout
        if floor is not None and floor > t:
            return floor, f"section:{name}:configured"
        return t, source

    def straggler_scores(self) -> dict[int, tuple[float, float]]:
        """global rank → (peers score, history score) over the current windows."""
        return self._straggler.scores()

    def summary(self, now: float) -> dict[str, Any]:
        """A compact view of this node for a periodic report to the supervisor (which compares nodes:
        this monitor only sees its own ranks): per global rank its step, heartbeat age, median own-work
        seconds and scores, plus the heartbeat timeout in force."""
        scores = self._straggler.scores()
        medians = self._straggler.medians()
        timeout, source = self.heartbeat_timeout()
        ranks = {}
        for r in self._ranks.values():
            peers, hist = scores.get(r.rank, (None, None))
            ranks[r.rank] = {"local_rank": r.local_rank, "step": r.step, "done": r.done,
                             "heartbeat_age": None if r.last_seen is None else now - r.last_seen,
                             "median_compute": medians.get(r.rank), "peers_score": peers, "history_score": hist}
        return {"attempt": self.attempt, "active": self._active, "hung": self._hung,
                "heartbeat_timeout": timeout, "timeout_source": source, "ranks": ranks}

    # --- internals ---------------------------------------------------------------------------------

    def _event(self, kind: EventKind, rank: int | None = None, **details: Any) -> Event:
        kw: dict[str, Any] = {"node": self.node} if self.node else {}
        return Event(kind=kind, rank=rank, attempt=self.attempt, details=details, **kw)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass  # already pending, or closing

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_CALL):
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._shed_one():
                    self._refused.warning("agent socket: out of file descriptors (%s); refused a pending connection",
                                          e, key="emfile")
                    continue
                self._refused.warning("agent socket accept failed: %s", e, key="accept")
                return
            try:
                pid, uid, _gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError as e:
                sock.close()
                self._refused.warning("agent socket: no peer credentials (%s); connection refused", e, key="cred")
                continue
            r = self._worker_for(pid) if uid == self._uid and self._active else None
            if r is None:
                sock.close()
                self.refused += 1
                why = ("another user" if uid != self._uid else "no attempt running" if not self._active
                       else "not a worker of this attempt")
                self._refused.warning("refused a connection on the agent socket from pid %d (uid %d): %s",
                                      pid, uid, why, key="refused")
                continue
            if self._per_rank.get(r.local_rank, 0) >= _CONNS_PER_WORKER:
                sock.close()
                self.refused += 1
                self._refused.warning("refused a connection on the agent socket from pid %d: local rank %d "
                                      "already holds %d", pid, r.local_rank, _CONNS_PER_WORKER, key="per-rank")
                continue
            sock.setblocking(False)
            self._conns[sock.fileno()] = _Conn(sock, pid, r.local_rank, self.attempt)
            self._per_rank[r.local_rank] = self._per_rank.get(r.local_rank, 0) + 1
            self._ep.register(sock.fileno(), select.EPOLLIN)

    def _shed_one(self) -> bool:
        """Out of descriptors: accept the pending connection on the reserve descriptor and close it."""
        if self._reserve is None:
            return False
        os.close(self._reserve)
        self._reserve = None
        try:
            sock, _ = self._listen.accept()
            sock.close()
            self.refused += 1
        except OSError:
            pass
        self._reserve = _open_reserve()
        return self._reserve is not None

    def _worker_for(self, pid: int) -> _Rank | None:
        """The rank of this attempt that ``pid`` is, or descends from; None for any other process."""
        r = self._by_pid.get(pid)
        if r is not None:
            return r
        st = _stat(pid)
        if st is None:
            return None
        key = (pid, st[1])
        if key in self._ancestry:
            found = self._ancestry[key]
            return self._by_pid.get(found) if found is not None else None
        found: int | None = None
        ppid = st[0]
        for _ in range(_ANCESTRY_DEPTH):
            if ppid <= 1 or ppid == self._me:
                break
            if ppid in self._by_pid:
                found = ppid
                break
            up = _stat(ppid)
            if up is None:
                break
            ppid = up[0]
        if len(self._ancestry) >= _ANCESTRY_CACHE:
            self._ancestry.clear()
        self._ancestry[key] = found
        return self._by_pid.get(found) if found is not None else None

    def _drop(self, fd: int) -> None:
        c = self._conns.pop(fd, None)
        if c is not None:
            self._ep.unregister(fd)
            c.sock.close()
            n = self._per_rank.get(c.local_rank, 0) - 1
            if n > 0:
                self._per_rank[c.local_rank] = n
            else:
                self._per_rank.pop(c.local_rank, None)

    def _close_conns(self) -> None:
        for fd in list(self._conns):
            self._drop(fd)
        self._per_rank.clear()

    def _read(self, fd: int, mask: int, now: float) -> list[Event]:
        c = self._conns.get(fd)
        if c is None:
            return []
        out: list[Event] = []
        for _ in range(_MAX_PER_CONN):
            try:
                data = c.sock.recv(P.MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # the worker closed its end (exited): WORKER_EXIT is the agent's to report
                self._drop(fd)
                break
            msg = P.unpack(data)
            if msg is not None:
                out += self._handle(c, msg, now)
        return out

    def _rank_for(self, c: _Conn, msg: P.Message) -> _Rank | None:
        # the connection's binding, never the header: any process can write any pid, rank or attempt there
        if not self._active or c.attempt != self.attempt:
            return None
        return self._ranks.get(c.local_rank)

    def _handle(self, c: _Conn, msg: P.Message, now: float) -> list[Event]:
        r = self._rank_for(c, msg)
        if r is None:
            return []
        out: list[Event] = []
        t = msg.type
        if r.last_seen is None:
            self._max_startup = max(self._max_startup, now - self._attempt_t0)
        elif t == P.STEP and r.last_type == P.STEP and not r.sections and not r.done:
            gap = now - r.last_seen  # the step that ended now, with nothing else inside it
            if r.steps_seen > self.config.warmup_steps:
                self._gaps += 1
                if gap > self._max_gap:
                    self._max_gap = gap
            elif gap > self._max_warmup:
                self._max_warmup = gap
        r.last_seen = now
        r.last_type = t
        if t == P.HELLO:
            if not r.hello and r.restored:
                self._startup_now.append(now - self._attempt_t0 - r.pre_sections)
            r.hello, r.done, r.step = True, False, msg.step
            if not self._client_seen:
                self._client_seen = True
        elif t == P.STEP:
            r.step = msg.step
            r.stepped = True
            r.steps_seen += 1
            r.after_section = None
            if not math.isnan(msg.compute):
                for f in self._straggler.add(r.rank, msg.step - 1, msg.compute):
                    lr = self._by_global[f.rank].local_rank
                    logger.warning("straggler: rank %d (local %d) %s score %.2f < %.2f", f.rank, lr,
                                   f.reference, f.score, f.threshold)
                    out.append(self._event(
                        EventKind.STRAGGLER, rank=f.rank, score=round(f.score, 4), threshold=f.threshold,
                        reference=f.reference, local_rank=lr, median_seconds=f.median_seconds,
                        reference_seconds=f.reference_seconds, peers_score=round(f.peers_score, 4),
                        history_score=round(f.history_score, 4), step=f.step,
                        window=self.config.straggler_window))
            if not self._ready_sent and all(x.stepped for x in self._ranks.values()):
                self._ready_sent = True
                out.append(self._event(EventKind.WORKERS_READY, step=msg.step,
                                       seconds=now - self._attempt_t0))
        elif t == P.SECTION_START:
            r.sections.append((msg.name, now, msg.timeout))
        elif t == P.SECTION_END:
            for i in range(len(r.sections) - 1, -1, -1):
                if r.sections[i][0] == msg.name:
                    if i == 0:
                        name, start, given = r.sections[0]
                        r.after_section = (name, self._section_timeout(name, given, r.rank)[0])
                        if not r.hello:
                            r.pre_sections += now - start
                            r.restored = r.restored or name == RESTORE_SECTION
                    del r.sections[i:]
                    break
            if msg.seconds == msg.seconds:
                self._section_max[msg.name] = max(self._section_max.get(msg.name, 0.0), msg.seconds)
                key = (msg.name, r.rank)
                self._section_seen[key] = self._section_seen.get(key, 0) + 1
        elif t == P.DONE:
            r.done = True
            r.step = max(r.step, msg.step)
        return out

    def _deadline(self, r: _Rank) -> tuple[float, float, str] | None:
        """(deadline, timeout, source) of a rank, or None when it is not watched."""
        cfg = self.config
        if not r.hello and not self._client_seen:
            return None  # a script that never entered steps() on this node: not known to use the client
        if r.last_seen is None:
            t, source = self.startup_timeout()
            return self._attempt_t0 + t, t, source
        if r.sections:
            name, start, given = r.sections[-1]
            t, source = self._section_timeout(name, given, r.rank)
            return start + t, t, source
        if r.done:
            return None
        if not r.hello:  # between sections before steps() (after a restore): still the start-up, its clock stopped
            t, source = self.startup_timeout()                 # while the rank was inside them
            return self._attempt_t0 + r.pre_sections + t, t, source
        timeout, source = self.heartbeat_timeout()
        if source != "configured" and r.steps_seen <= cfg.warmup_steps:
            timeout, source = max(cfg.initial_timeout, cfg.learn_factor * self._max_warmup), "warmup"
        if r.after_section is not None:
            timeout += r.after_section[1]
            source = f"{source}+after:{r.after_section[0]}"
        return r.last_seen + timeout, timeout, source

    def _check_hangs(self, now: float) -> list[Event]:
        watched = [(r, self._deadline(r)) for r in self._ranks.values()]
        if not any(d is not None and now >= d[0] for _, d in watched):
            return []
        self._hung = True
        # Peers of a frozen rank stall in their next collective, so every rank of a synchronous job goes
        # silent within about one step: report all that are well on their way (half their timeout), and
        # mark as suspect a stopped process or, failing that, the ranks furthest behind.
        stalled = []
        for r, d in watched:
            if d is None:
                continue
            deadline, timeout, source = d
            since = r.last_seen if r.last_seen is not None else self._attempt_t0
            if now >= deadline or now - since >= 0.5 * timeout:
                stalled.append((r, since, deadline, timeout, source, _process_state(r.pid)))
        stopped = [x for x in stalled if x[5] in ("T", "t")]
        if stopped:
            suspects = {x[0].local_rank for x in stopped}
        else:
            low = min(x[0].step for x in stalled)
            suspects = {x[0].local_rank for x in stalled if x[0].step == low}
        if not stopped and any(x[4] == "startup:learned" for x in stalled) and not self._startup_off:
            # maybe work before the loop that only a resumed attempt does (batches skipped by hand): the bound is
            # not learned again, so such a job loses one attempt at most, not one per doubling up to the timeout
            self._startup_off = True
            logger.warning("hang declared on a learned start-up bound: later attempts' start-ups are held to the "
                           "start-up timeout (%g s) again; mark work before steps() that only a resumed attempt does "
                           "with resilient.section()", self.config.initial_timeout)
        if not stopped and any(_is_learned(x[4]) for x in stalled):
            # maybe a long step rather than a hang: if so, the next attempt must not trip on it again. A stopped
            # process is a hang for certain, and backing off then would only slow the next detection.
            self._backoff *= 2
            logger.warning("hang declared on a learned timeout: learned timeouts doubled (×%g) from now on",
                           self._backoff)
        # suspects first: an agent may act on the first HANG and not read the rest
        stalled.sort(key=lambda x: (x[0].local_rank not in suspects, x[0].local_rank))
        out = []
        for r, since, deadline, timeout, source, state in stalled:
            details: dict[str, Any] = {
                "last_heartbeat_age": now - since, "timeout": timeout, "local_rank": r.local_rank,
                "timeout_source": source, "step": r.step, "pid": r.pid, "process_state": state,
                "late_seconds": now - deadline, "suspect": r.local_rank in suspects,
            }
            if r.sections:
                details["section"] = r.sections[-1][0]
            if source.startswith("startup:learned"):
                details["longest_startup_seconds"] = self._startup_learned  # what the learned bound came from
            elif _is_learned(source):
                details["longest_step_seconds"] = self._max_gap  # what the learned step timeout came from
            # the start-up bound is the one a user may find too long or too short for the job: say what sets it
            base = source.split("+after:", 1)[0]
            hint = ("; resilient-run --startup-timeout sets it" if base in ("initial", "warmup", "section:restore:startup")
                    else f"; {self.config.learn_factor:g} x the longest start-up of an earlier attempt "
                         f"({self._startup_learned:.2f} s, its restore left out)" if base == "startup:learned" else "")
            logger.error("hang: rank %d (local %d, pid %s, state %s%s) silent for %.2f s (timeout %.2f s, %s%s)",
                         r.rank, r.local_rank, r.pid, state, ", suspect" if details["suspect"] else "",
                         now - since, timeout, source, hint)
            out.append(self._event(EventKind.HANG, rank=r.rank, **details))
        return out


def _is_learned(source: str) -> bool:
    """Whether a deadline's source (``learned``, ``section:NAME:learned``, ``…+after:NAME``) was learned."""
    base = source.split("+after:", 1)[0]
    return base == "learned" or (base.startswith("section:") and base.endswith(":learned"))


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process; the start time tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _process_state(pid: int | None) -> str | None:
    """The kernel's one-letter state (T: stopped, D: uninterruptible I/O, S: sleeping, R: running)."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return None
