"""Agent ↔ supervisor messages over the job's rendezvous store, signed with the per-job secret.

Agents → supervisor: signed messages — ``join``, ``hb`` (a periodic summary: heartbeats themselves stay on the
node), ``event`` (a fault or state change worth a decision), ``ack`` (an assignment carried out), ``done`` (this
node's workers all finished). Summaries and acknowledgements (:data:`PRESENCE_KINDS`) go over the agent's presence
connection once it has one (:mod:`.wire`: one ``recv`` per readable socket for the supervisor, not one store round
trip per message); the rest, and everything of an agent without a working connection, through one store queue
(``resilient/sv/<job>/q``). Supervisor → agents: one
write-once key per assignment round (``resilient/sv/<job>/plan/<round>``) plus ``resilient/sv/<job>/latest``;
each new round is announced as a signed line on every presence connection (:class:`PresenceReader`), and an agent
reads the store for it then, or every ``launcher.control.PLAN_LOOK_S`` without a notice, and jumps to the latest.

The job id (``--rdzv-id``, torchrun's meaning: the id names the job) is in every key, so two jobs never read
each other's; the endpoint's store says which job it serves (``resilient/job``), and an agent of another id is
refused there (it says so in ``resilient/refused`` for the serving side to log) and exits.

Every message carries an HMAC-SHA256 of its body under the job secret, and the body is bound to the job id,
the supervisor's term (a new one each time a supervisor starts) and a sequence number that only grows per
sender: a message without a valid signature, of another job, of another term, or not newer than the last one
taken from its sender (a replay) triggers nothing and is logged (rate-limited). Plans are bound the same way
and to their round: a plan read under another round's key, or of an older term, is refused. Checkpoint data
never passes through here.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from resilient import env as renv
from resilient.logs import RateLimitedLog
from resilient.supervisor import wire

logger = logging.getLogger(__name__)

PREFIX = "resilient/sv"
JOB_KEY = "resilient/job"  # the id of the job this endpoint's store serves (outside every job's prefix)
REFUSED_QUEUE = "resilient/refused"  # agents of another id say here that they were refused, for the log
ANY_JOB = "*"  # JOB_KEY's value while a supervisor started without --rdzv-id waits to adopt the first agent's
DEFAULT_JOB = "none"  # torchrun's default --rdzv-id


@dataclass(frozen=True)
class Keys:
    """The store keys of one job: every one carries the job id, so two jobs sharing a store never meet."""

    job: str = DEFAULT_JOB

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job or len(self.job) > 256 or "\n" in self.job:
            raise ValueError(f"a job id (--rdzv-id) must be 1 to 256 characters without a newline, got {self.job!r}")

    @property
    def prefix(self) -> str:
        return f"{PREFIX}/{self.job}"

    @property
    def queue(self) -> str:
        return f"{self.prefix}/q"

    @property
    def latest(self) -> str:
        return f"{self.prefix}/latest"

    @property
    def secret(self) -> str:
        """Only when no secret was configured: store access is then the only guard."""
        return f"{self.prefix}/secret"

    @property
    def presence(self) -> str:
        """addr:port of the supervisor's presence listener."""
        return f"{self.prefix}/presence"

    @property
    def term(self) -> str:
        """The current supervisor's term, signed: agents bind their messages to it."""
        return f"{self.prefix}/term"

    @property
    def preload(self) -> str:
        """Signed list of the modules the workers import, for the spares."""
        return f"{self.prefix}/preload"

    def plan(self, round_: int) -> str:
        return f"{self.prefix}/plan/{round_}"

    @property
    def succession(self) -> str:
        """Signed: who takes over if the agent hosting the supervisor is lost (default set-up only), kept current
        between plans (a spare that joins changes it without a new round)."""
        return f"{self.prefix}/succession"

    def door(self, term: int) -> str:
        """A counter a supervisor of ``term`` closes (adds :data:`DOOR_CLOSED` × outcome) once every agent read its
        final plan, right before its store may go away; see :meth:`AgentChannel.door`."""
        return f"{self.prefix}/door/{term}"


# The door's value once closed: DOOR_CLOSED × (1 + the outcome's index). Agents only ever add 0 (a read that
# creates the key): one atomic operation tells a joining agent whether the job's end already went past it.
DOOR_CLOSED = 1 << 40
DOOR_OUTCOMES = ("succeeded", "stopped", "preempted")


class MessageKind:
    JOIN = "join"
    ARRIVING = "arriving"  # connected, still warming up (importing torch, the fork server): a joining spare
    HB = "hb"
    EVENT = "event"
    ACK = "ack"
    DONE = "done"
    LEAVE = "leave"


# What goes over the presence connection once attached: the volume (a summary a second per node, an acknowledgement
# per node and plan), whose loss costs nothing (a later one says the same). What needs a decision or ends something
# (join, event, done, leave) stays on the store queue: each push is answered, so an agent whose supervisor is gone
# finds out and keeps the report for the next one, where a socket's send only says its own kernel took the bytes
# (a host lost without a FIN would swallow them).
PRESENCE_KINDS = frozenset({MessageKind.HB, MessageKind.ACK})


class BadMessage(ValueError):
    """A message that is not ours: unsigned, wrongly signed, not JSON, of another job, or a replay."""


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The job secret: ``--job-secret-file`` (e.g. a mounted Kubernetes Secret) or ``RESILIENT_JOB_SECRET``."""
    if secret_file:
        try:
            data = open(secret_file, "rb").read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the job secret file {secret_file!r}: {e.strerror or e}") from None
        if len(data) < 16:
            raise ValueError(f"the job secret in {secret_file!r} is shorter than 16 bytes; generate one with "
                             "`python -c 'import secrets; print(secrets.token_hex(32))'`")
        return data
    env = os.environ.get(renv.JOB_SECRET)
    if env:
        if len(env) < 16:
            raise ValueError(f"{renv.JOB_SECRET} is shorter than 16 characters")
        return env.encode()
    return None


def new_secret() -> bytes:
    return secrets.token_hex(32).encode()


# One counter per process, started at the wall clock in ns: a sender's sequence numbers only grow, also across a
# restart of the process under the same node name; several senders in one process each still see theirs grow.
_seq = itertools.count(time.time_ns())
_seq_lock = threading.Lock()


def next_seq() -> int:
    with _seq_lock:
        return next(_seq)


@dataclass
class Signer:
    """Signs and checks bodies under the job secret; every body it seals names the job and a fresh sequence
    number, and a body of another job does not open."""

    secret: bytes
    job: str = DEFAULT_JOB

    def seal(self, body: dict[str, Any]) -> bytes:
        body = {**body, "job": self.job, "seq": next_seq()}
        raw = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str)
        mac = hmac.new(self.secret, raw.encode(), hashlib.sha256).hexdigest()
        return json.dumps({"b": raw, "m": mac}, separators=(",", ":")).encode()

    def open(self, data: bytes) -> dict[str, Any]:
        try:
            outer = json.loads(data)
            raw, mac = outer["b"], outer["m"]
        except (ValueError, KeyError, TypeError):
            raise BadMessage("not a resilient control message") from None
        if not isinstance(raw, str) or not isinstance(mac, str):
            raise BadMessage("malformed control message")
        want = hmac.new(self.secret, raw.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            raise BadMessage("bad signature (wrong or missing job secret)")
        return self._checked(json.loads(raw))

    def seal_line(self, body: dict[str, Any]) -> bytes:
        """:meth:`seal` for the presence connection: ``MAC RAW`` on one line (the MAC's 64 hex digits, a space, the
        body's JSON), which opens with one JSON parse instead of two."""
        body = {**body, "job": self.job, "seq": next_seq()}
        raw = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str).encode()
        return hmac.new(self.secret, raw, hashlib.sha256).hexdigest().encode() + b" " + raw

    def open_line(self, line: bytes) -> dict[str, Any]:
        mac, sep, raw = line.partition(b" ")
        if not sep or len(mac) != 64:
            raise BadMessage("not a resilient control line")
        if not hmac.compare_digest(hmac.new(self.secret, raw, hashlib.sha256).hexdigest().encode(), mac):
            raise BadMessage("bad signature (wrong or missing job secret)")
        try:
            return self._checked(json.loads(raw))
        except ValueError:
            raise BadMessage("a signed line that is not JSON") from None

    def _checked(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadMessage("malformed control message body")
        if body.get("job") != self.job:
            # the same secret, another job (a shared secret, or a message carried over from another job's store)
            raise BadMessage(f"a message of job {body.get('job')!r}, this is job {self.job!r}")
        if not isinstance(body.get("seq"), int):
            raise BadMessage("no sequence number")
        return body


class ReplayGuard:
    """The newest sequence number taken from each sender: one not newer is a replay (or a duplicate)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, sender: str, seq: int) -> None:
        """Accept ``seq`` from ``sender`` or raise :class:`BadMessage`."""
        with self._lock:
            last = self._last.get(sender)
            if last is not None and seq <= last:
                raise BadMessage(f"a replayed message from {sender} (sequence number {seq}, newest taken {last})")
            self._last[sender] = seq


def claim_job(store: Any, job: str, *, hosting: bool, timeout: float) -> str:
    """Which job the endpoint's store serves. The host of a fresh store claims it for its job; a client waits
    (bounded) for the host's claim, and adopts a store whose supervisor waits for its first agent's id."""
    if hosting:
        return store.compare_set(JOB_KEY, "", job).decode(errors="replace")
    store.wait([JOB_KEY], timedelta(seconds=timeout))
    return store.compare_set(JOB_KEY, ANY_JOB, job).decode(errors="replace")


def refused_line(served: str, job: str, node: str, endpoint: str) -> str:
    """The one line both sides print when an agent of another job is refused."""
    return (f"refused node {node} of job {job!r}: {endpoint} serves job {served!r} "
            f"(--rdzv-id names the job: give each job its own --rdzv-endpoint, or the same --rdzv-id to join it)")


def knock(store: Any, job: str, node: str) -> None:
    """A refused agent tells the serving side who it was (best effort, unsigned: it has no business here)."""
    try:
        store.queue_push(REFUSED_QUEUE, json.dumps({"job": job, "node": node}).encode())
    except Exception as e:  # noqa: BLE001 - the refusal stands either way
        logger.debug("could not report the refusal to the serving side: %s", e)


def connect_store(host: str, port: int, timeout: float, *, is_master: bool = False):
    """A TCPStore client (or server) with a bounded connect; every later call is bounded by ``timeout``."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout), use_libuv=True)


def connect_store_waiting(host: str, port: int, timeout: float, *, say_every: float = 15.0):
    """A TCPStore client for an agent that may start before the node hosting the store (nodes of one job start in
    any order). Until something listens at ``host:port`` it knocks with plain TCP connects, saying every
    ``say_every`` seconds that it still waits (torch's own connect retries in silence, then prints a C++ trace per
    try); then it connects the store, every later call bounded by ``timeout``. Raises as :func:`connect_store`
    once nothing answered within ``timeout``."""
    from resilient.supervisor.quorum import Reach, reach

    t0 = time.monotonic()
    deadline, say_at = t0 + timeout, t0 + say_every
    while reach(f"{host}:{port}", min(1.0, max(0.01, deadline - time.monotonic()))) is not Reach.ACCEPTS:
        now = time.monotonic()
        if now >= deadline:
            break  # the store's own connect below says what failed, as it always did
        if now >= say_at:
            say_at = now + say_every
            logger.warning("no job's store answers at %s:%d after %.0f s (its host may not have started yet); "
                           "still trying for up to %.0f s (--rendezvous-timeout)", host, port, now - t0,
                           deadline - now)
        time.sleep(min(0.2, max(0.0, deadline - now)))
    if time.monotonic() >= deadline:
        return connect_store(host, port, 1.0)  # nothing listened within the timeout: torch's error says so, briefly
    return connect_store(host, port, timeout)


class AgentChannel:
    """The agent's end: sends signed messages, reads assignments. Every call is bounded by the store timeout;
    a store that went away raises (the agent keeps its workers and reconnects — fail static).

    Messages are bound to the supervisor's term, read from the store (:meth:`sync_term`, done by the first
    send if not before); plans are taken only under their own round's key and never of an older term."""

    #: bound on writing one message on the presence connection (a few hundred bytes into a kernel buffer: only a
    #: supervisor that stopped reading for long fills it)
    PRESENCE_SEND_TIMEOUT = 2.0

    def __init__(self, store: Any, signer: Signer, node: str):
        self.store, self.signer, self.node = store, signer, node
        self.keys = Keys(signer.job)
        self.term: int | None = None
        self._bad = RateLimitedLog(logger)
        self._lock = threading.Lock()  # a sequence number is pushed in the order it was drawn
        self.presence: Any = None  # the presence connection messages go over, None: the store queue

    def attach(self, conn: Any) -> None:
        """Send from now on over ``conn`` (this agent's presence connection, hello sent), not the store queue."""
        with self._lock:
            self.presence = conn

    def sync_term(self, timeout: float | None = None) -> int:
        """The current supervisor's term (waits up to ``timeout`` for it, else the store's own timeout)."""
        if timeout is not None:
            self.store.wait([self.keys.term], timedelta(seconds=timeout))
        term = int(self.signer.open(self.store.get(self.keys.term))["term"])
        self.term = term if self.term is None else max(self.term, term)
        return self.term

    def send(self, kind: str, **body: Any) -> None:
        if self.term is None:
            self.sync_term()
        body.update(type=kind, node=self.node, t=time.time(), term=self.term)
        with self._lock:
            conn = self.presence
            if conn is not None and kind in PRESENCE_KINDS:
                try:
                    wire.send_line(conn, self.signer.seal_line({**body, "via": wire.VIA_PRESENCE}),
                                   self.PRESENCE_SEND_TIMEOUT)
                    return
                except OSError as e:  # TimeoutError included: a cut line leaves the stream unusable for lines
                    logger.info("the presence connection took no message (%s): the store queue carries them", e)
                    self.presence = None
            self.store.queue_push(self.keys.queue, self.signer.seal(body))

    def hello(self) -> dict[str, Any]:
        """The body of the presence hello (bound to the term like every message)."""
        if self.term is None:
            self.sync_term()
        return {"node": self.node, "term": self.term}

    def door(self) -> str | None:
        """None while the job goes on; once its supervisor closed the door, how the job ended (one of
        :data:`DOOR_OUTCOMES`). Read after sending a message: when still open, the supervisor reads that message
        before it closes (it drains once more after closing) and waits for this agent's acknowledgement; when
        closed, the job ended and its store may go away at any moment, so this agent must not wait on it."""
        if self.term is None:
            self.sync_term()
        v = int(self.store.add(self.keys.door(self.term), 0))
        if v < DOOR_CLOSED:
            return None
        return DOOR_OUTCOMES[min(v // DOOR_CLOSED - 1, len(DOOR_OUTCOMES) - 1)]

    def latest_round(self) -> int:
        if not self.store.check([self.keys.latest]):
            return -1
        return int(self.store.get(self.keys.latest))

    def has_round(self, round_: int) -> bool:
        return bool(self.store.check([self.keys.plan(round_)]))

    def plan(self, round_: int) -> dict[str, Any] | None:
        """The signed plan of a round; a forged or replayed one is refused (None) and logged."""
        try:
            plan = self.signer.open(self.store.get(self.keys.plan(round_)))
            if plan.get("round") != round_:
                raise BadMessage(f"it is the plan of round {plan.get('round')!r} (a replay)")
            term = plan.get("term")
            if not isinstance(term, int):
                raise BadMessage("it names no term")
            if self.term is not None and term < self.term:
                raise BadMessage(f"it is of term {term}, older than the current {self.term} (a replay)")
        except BadMessage as e:
            self._bad.warning("refused the plan of round %d: %s", round_, e)
            return None
        self.term = term  # a newer term: the supervisor was started again
        return plan


class SupervisorChannel:
    """The supervisor's end: drains the queue, publishes plans."""

    def __init__(self, store: Any, signer: Signer, *, term: int, max_batch: int = 100_000):
        self.store, self.signer, self.term, self.max_batch = store, signer, term, max_batch
        self.keys = Keys(signer.job)
        self.refused = 0
        self.guard = ReplayGuard()
        self._bad = RateLimitedLog(logger)
        self._knocks = RateLimitedLog(logger)

    def announce(self) -> None:
        """Publish this supervisor's term: agents bind what they send to it."""
        self.store.set(self.keys.term, self.signer.seal({"term": self.term}))

    def check(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        """``body`` (opened: signed, of this job) is of this term and newer than its sender's last, or raise."""
        if body.get("term") != self.term:
            raise BadMessage(f"a {what} of term {body.get('term')!r}, this supervisor's is {self.term} (a replay, "
                             "or an agent that has not seen this supervisor's start yet)")
        if "via" in body:
            raise BadMessage(f"a {what} sealed for the presence connection, found in the store queue (a replay)")
        self.guard.take(str(body.get("node")), int(body["seq"]))
        return body

    def drain(self) -> list[dict[str, Any]]:
        import torch.distributed as dist

        out: list[dict[str, Any]] = []
        for _ in range(self.max_batch):
            try:
                data = self.store.queue_pop(self.keys.queue, block=False)
            except dist.QueueEmptyError:
                break
            try:
                out.append(self.check(self.signer.open(data), "message"))
            except BadMessage as e:
                self.refused += 1
                self._bad.warning("refused a control message: %s", e)
        return out

    def refusals(self, limit: int = 1000) -> list[dict[str, str]]:
        """Agents of another job that were refused at this endpoint (unsigned, so only ever logged)."""
        import torch.distributed as dist

        out: list[dict[str, str]] = []
        for _ in range(limit):
            try:
                data = self.store.queue_pop(REFUSED_QUEUE, block=False)
            except dist.QueueEmptyError:
                break
            try:
                d = json.loads(data)
                out.append({"job": str(d["job"])[:256], "node": str(d["node"])[:256]})
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def publish(self, round_: int, plan: dict[str, Any]) -> None:
        self.store.set(self.keys.plan(round_), self.signer.seal({**plan, "round": round_, "term": self.term}))
        self.store.set(self.keys.latest, str(round_))

    def close_door(self, outcome: str) -> None:
        """The job ended as ``outcome`` and every agent known to this supervisor read its final plan: agents
        joining from now on learn it from :meth:`AgentChannel.door` instead of waiting on this store."""
        self.store.add(self.keys.door(self.term), DOOR_CLOSED * (1 + DOOR_OUTCOMES.index(outcome)))


class PresenceServer:
    """One TCP connection per agent, kept open for the job: when an agent dies, its kernel closes the
    connection and the supervisor knows at once, without waiting ``--node-timeout`` (which still covers a
    hung or partitioned host). The first line an agent sends is a signed hello naming its node, so a
    stranger's connection (or its closing) counts for nothing; a hello of another job or term, or one not newer
    than the last from its node (a replayed hello, whose closing would mark a live node lost), is refused.

    After the hello, the agent's messages come as signed lines on the same connection (:mod:`.wire`); each poll
    reads at most :data:`wire.RECV_BYTES` per readable socket, and :meth:`messages` hands out those that are
    signed for this path, of this job and term, from the connection's own node, and newer than the last taken
    from that node over this path."""

    def __init__(self, signer: Signer, bind: str = "0.0.0.0", max_conns: int = 65536, hello_timeout: float = 10.0,
                 *, term: int | None = None):
        self.signer, self.max_conns, self.hello_timeout, self.term = signer, max_conns, hello_timeout, term
        self._guard = ReplayGuard()
        self._msg_guard = ReplayGuard()  # the messages' own: a node's hello and messages share one counter
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._pending: dict[Any, tuple[float, bytes]] = {}  # accepted, hello not yet read
        self._nodes: dict[Any, str] = {}
        self._lines: dict[Any, wire.LineBuffer] = {}  # per connection past its hello
        self._inbox: list[tuple[str, bytes]] = []  # (the connection's node, a line), oldest first
        self.refused = 0  # message lines refused
        self._bad = RateLimitedLog(logger)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)

    def poll(self) -> tuple[list[str], list[str]]:
        """Non-blocking: (nodes that said hello, nodes whose connection closed). The lines read on the way wait
        for :meth:`messages`."""
        hello: list[str] = []
        gone: list[str] = []
        for key, _ in self._sel.select(timeout=0):
            if key.data is None:
                self._accept()
                continue
            conn = key.fileobj
            try:
                data = conn.recv(wire.RECV_BYTES)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                logger.info("presence: fd %d closed (%s)", conn.fileno(), self._nodes.get(conn, "no hello yet"))
                node = self._close(conn)
                if node is not None:
                    gone.append(node)
                continue
            if conn in self._nodes:
                node = self._nodes[conn]
                self._inbox.extend((node, ln) for ln in self._lines[conn].feed(data))
                continue
            t0, buf = self._pending[conn]
            buf += data
            if b"\n" in buf:
                line, rest = buf.split(b"\n", 1)
                try:
                    body = self.signer.open(line)
                    node = str(body["node"])
                    if self.term is not None and body.get("term") != self.term:
                        raise BadMessage(f"a hello from {node} of term {body.get('term')!r}, this supervisor's is "
                                         f"{self.term}")
                    if "via" in body:
                        raise BadMessage(f"a message from {node} where its hello belongs")
                    self._guard.take(node, int(body["seq"]))
                except (BadMessage, KeyError, ValueError, TypeError) as e:
                    self._bad.warning("refused a presence connection: %s", e)
                    self._close(conn)
                    continue
                del self._pending[conn]
                for old, n in list(self._nodes.items()):
                    if n == node:
                        # the agent connected again (a newer hello, checked above): the end of its older
                        # connection is not its death
                        self._close(old)
                self._nodes[conn] = node
                self._lines[conn] = wire.LineBuffer()
                self._inbox.extend((node, ln) for ln in self._lines[conn].feed(rest))
                logger.info("presence: %s connected (fd %d)", node, conn.fileno())
                try:
                    # this host's clock, for the agent to measure its offset (the job's reports use one clock)
                    conn.send(self.signer.seal({"node": node, "t": time.time()}) + b"\n")  # type: ignore[union-attr]
                except OSError:
                    pass  # a small line on a fresh connection; if it cannot go, the agent just lacks an offset
                hello.append(node)
            elif len(buf) > 4096:
                self._close(conn)
            else:
                self._pending[conn] = (t0, buf)
        now = time.monotonic()
        for conn, (t0, _) in list(self._pending.items()):
            if now - t0 > self.hello_timeout:
                self._close(conn)
        return hello, gone

    def messages(self) -> list[dict[str, Any]]:
        """The messages read since the last call, checked; the rest refused (counted, logged rate-limited)."""
        inbox, self._inbox = self._inbox, []
        out: list[dict[str, Any]] = []
        for node, line in inbox:
            try:
                body = self.signer.open_line(line)
                if body.get("via") != wire.VIA_PRESENCE:
                    raise BadMessage(f"a message on {node}'s presence connection not sealed for it (a replay)")
                if body.get("node") != node:
                    raise BadMessage(f"a message naming {body.get('node')!r} on {node}'s presence connection")
                if self.term is not None and body.get("term") != self.term:
                    raise BadMessage(f"a message from {node} of term {body.get('term')!r}, this supervisor's is "
                                     f"{self.term}")
                self._msg_guard.take(node, int(body["seq"]))
            except (BadMessage, KeyError, ValueError, TypeError) as e:
                self.refused += 1
                self._bad.warning("refused a message on a presence connection: %s", e)
                continue
            out.append(body)
        return out

    def announce(self, round_: int) -> int:
        """Tell every connected agent that round ``round_``'s plan is readable (one signed line, the same bytes to
        all; never waits). How many connections took it whole."""
        line = self.signer.seal({"type": wire.PLAN_NOTICE, "round": round_, "term": self.term})
        return sum(wire.send_now(conn, line) for conn in list(self._nodes))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: refuse quietly, keep serving
                self._bad.warning("presence accept failed: %s", e)
                return
            if len(self._pending) + len(self._nodes) >= self.max_conns:
                conn.close()
                continue
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic(), b"")
            self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _close(self, conn: Any) -> str | None:
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self._pending.pop(conn, None)
        self._lines.pop(conn, None)
        return self._nodes.pop(conn, None)

    def close(self) -> None:
        for conn in list(self._pending) + list(self._nodes):
            self._close(conn)
        self._sel.close()
        self.sock.close()


def presence_connect(addr: str, signer: Signer, node: str, timeout: float, *, term: int | None = None) -> Any:
    """The agent's end: a connection that lives as long as the agent (the kernel closes it when it dies)."""
    return presence_connect_clocked(addr, signer, node, timeout, clock_timeout=0.0, term=term)[0]


class PresenceReader:
    """The agent's end of its presence connection, read without waiting: whether the supervisor's end closed (it
    stopped, or died: a supervisor started again has a new term that this agent must learn, whether or not its store
    client noticed), and the newest round the supervisor's notices announced (signed by the job's secret, of the term
    this node follows), so that the agent reads the store for a plan when one is there instead of at every pass."""

    def __init__(self, conn: Any, signer: "Signer", term: int | None) -> None:
        self.conn, self.signer, self.term = conn, signer, term
        self.newest = -1  # the newest round announced on this connection
        self._lines = wire.LineBuffer()

    def closed(self) -> bool:
        """Take what arrived (a bounded number of reads) and say whether the supervisor's end closed."""
        for _ in range(16):
            try:
                # a socket with a timeout waits in recv() even with MSG_DONTWAIT: ask whether it is readable first
                # (poll, not select: an agent's descriptors may be numbered past select's limit)
                p = select.poll()
                p.register(self.conn, select.POLLIN)
                if not p.poll(0):
                    return False
                data = self.conn.recv(wire.RECV_BYTES)
                if not data:
                    return True
            except (BlockingIOError, InterruptedError):
                return False
            except (OSError, ValueError):
                return True
            for line in self._lines.feed(data):
                self._take(line)
        return False

    def _take(self, line: bytes) -> None:
        try:
            body = self.signer.open(line)
        except BadMessage:
            return  # the clock reply's other fields, or a line cut by a full buffer: the store is read anyway
        rnd = body.get("round")
        if body.get("type") == wire.PLAN_NOTICE and isinstance(rnd, int) and body.get("term") == self.term:
            self.newest = max(self.newest, rnd)


@dataclass(frozen=True)
class ClockSample:
    """The supervisor host's clock minus this host's, from one round trip (error at most ``rtt / 2``)."""

    offset: float
    rtt: float


def presence_connect_clocked(addr: str, signer: Signer, node: str, timeout: float, *,
                             clock_timeout: float = 2.0, term: int | None = None) -> tuple[Any, ClockSample | None]:
    """:func:`presence_connect`, and the clock offset from the supervisor's signed reply to the hello
    (None if it does not come within ``clock_timeout`` or does not verify: the offset is a refinement)."""
    host, port = addr.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=timeout)
    t0 = time.time()
    conn.sendall(signer.seal({"node": node, "t": t0, "term": term}) + b"\n")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if clock_timeout <= 0:
        return conn, None
    sample = None
    buf = b""
    deadline = time.monotonic() + clock_timeout
    try:
        while b"\n" not in buf and len(buf) < 4096:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            data = conn.recv(4096)
            if not data:
                break
            buf += data
        if b"\n" in buf:
            t1 = time.time()
            reply = signer.open(buf.split(b"\n", 1)[0])
            if reply.get("node") == node:
                sample = ClockSample(offset=float(reply["t"]) - (t0 + t1) / 2, rtt=t1 - t0)
    except (OSError, BadMessage, KeyError, TypeError, ValueError) as e:
        logger.debug("no clock sample from the supervisor: %s", e)
    finally:
        conn.settimeout(timeout)
    return conn, sample
