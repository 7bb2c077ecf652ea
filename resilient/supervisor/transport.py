"""Agent ↔ supervisor messages over the job's rendezvous store, signed with the per-job secret.

Agents → supervisor: one store queue (``resilient/sv/q``) of signed messages — ``join``, ``hb`` (a periodic
summary: heartbeats themselves stay on the node), ``event`` (a fault or state change worth a decision),
``ack`` (an assignment carried out), ``done`` (this node's workers all finished). Supervisor → agents: one
write-once key per assignment round (``resilient/sv/plan/<round>``) plus ``resilient/sv/latest``; agents
check for the next round every ``--monitor-interval`` and jump to the latest.

Every message carries an HMAC-SHA256 of its body under the job secret: a message without a valid one
triggers nothing and is logged (rate-limited). Checkpoint data never passes through here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from resilient import env as renv
from resilient.logs import RateLimitedLog

logger = logging.getLogger(__name__)

PREFIX = "resilient/sv"
QUEUE = f"{PREFIX}/q"
LATEST = f"{PREFIX}/latest"
SECRET_KEY = f"{PREFIX}/secret"  # only when no secret was configured: store access is then the only guard


def plan_key(round_: int) -> str:
    return f"{PREFIX}/plan/{round_}"


def master_key(round_: int) -> str:
    return f"{PREFIX}/master/{round_}"


class MessageKind:
    JOIN = "join"
    HB = "hb"
    EVENT = "event"
    ACK = "ack"
    DONE = "done"
    LEAVE = "leave"


class BadMessage(ValueError):
    """A message that is not ours: unsigned, wrongly signed, or not JSON."""


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


@dataclass
class Signer:
    secret: bytes

    def seal(self, body: dict[str, Any]) -> bytes:
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
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise BadMessage("malformed control message body")
        return body


def connect_store(host: str, port: int, timeout: float, *, is_master: bool = False):
    """A TCPStore client (or server) with a bounded connect; every later call is bounded by ``timeout``."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout), use_libuv=True)


class AgentChannel:
    """The agent's end: sends signed messages, reads assignments. Every call is bounded by the store timeout;
    a store that went away raises (the agent keeps its workers and reconnects — fail static)."""

    def __init__(self, store: Any, signer: Signer, node: str):
        self.store, self.signer, self.node = store, signer, node
        self._bad = RateLimitedLog(logger)

    def send(self, kind: str, **body: Any) -> None:
        body.update(type=kind, node=self.node, t=time.time())
        self.store.queue_push(QUEUE, self.signer.seal(body))

    def latest_round(self) -> int:
        if not self.store.check([LATEST]):
            return -1
        return int(self.store.get(LATEST))

    def has_round(self, round_: int) -> bool:
        return bool(self.store.check([plan_key(round_)]))

    def plan(self, round_: int) -> dict[str, Any] | None:
        """The signed plan of a round; a forged one is refused (None) and logged."""
        try:
            return self.signer.open(self.store.get(plan_key(round_)))
        except BadMessage as e:
            self._bad.warning("refused the plan of round %d: %s", round_, e)
            return None


class SupervisorChannel:
    """The supervisor's end: drains the queue, publishes plans."""

    def __init__(self, store: Any, signer: Signer, *, max_batch: int = 100_000):
        self.store, self.signer, self.max_batch = store, signer, max_batch
        self.refused = 0
        self._bad = RateLimitedLog(logger)

    def drain(self) -> list[dict[str, Any]]:
        import torch.distributed as dist

        out: list[dict[str, Any]] = []
        for _ in range(self.max_batch):
            try:
                data = self.store.queue_pop(QUEUE, block=False)
            except dist.QueueEmptyError:
                break
            try:
                out.append(self.signer.open(data))
            except BadMessage as e:
                self.refused += 1
                self._bad.warning("refused a control message: %s", e)
        return out

    def publish(self, round_: int, plan: dict[str, Any]) -> None:
        self.store.set(plan_key(round_), self.signer.seal(plan))
        self.store.set(LATEST, str(round_))


PRESENCE = f"{PREFIX}/presence"  # addr:port of the supervisor's presence listener


class PresenceServer:
    """One TCP connection per agent, kept open for the job: when an agent dies, its kernel closes the
    connection and the supervisor knows at once, without waiting ``--node-timeout`` (which still covers a
    hung or partitioned host). The first line an agent sends is a signed hello naming its node, so a
    stranger's connection (or its closing) counts for nothing."""

    def __init__(self, signer: Signer, bind: str = "0.0.0.0", max_conns: int = 65536, hello_timeout: float = 10.0):
        self.signer, self.max_conns, self.hello_timeout = signer, max_conns, hello_timeout
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._pending: dict[Any, tuple[float, bytes]] = {}  # accepted, hello not yet read
        self._nodes: dict[Any, str] = {}
        self._bad = RateLimitedLog(logger)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)

    def poll(self) -> tuple[list[str], list[str]]:
        """Non-blocking: (nodes that said hello, nodes whose connection closed)."""
        hello: list[str] = []
        gone: list[str] = []
        for key, _ in self._sel.select(timeout=0):
            if key.data is None:
                self._accept()
                continue
            conn = key.fileobj
            try:
                data = conn.recv(4096)  # type: ignore[union-attr]
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
                continue  # nothing more is expected after the hello; ignore
            t0, buf = self._pending[conn]
            buf += data
            if b"\n" in buf:
                line = buf.split(b"\n", 1)[0]
                try:
                    node = str(self.signer.open(line)["node"])
                except (BadMessage, KeyError, ValueError) as e:
                    self._bad.warning("refused a presence connection: %s", e)
                    self._close(conn)
                    continue
                del self._pending[conn]
                self._nodes[conn] = node
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
        return self._nodes.pop(conn, None)

    def close(self) -> None:
        for conn in list(self._pending) + list(self._nodes):
            self._close(conn)
        self._sel.close()
        self.sock.close()


def presence_connect(addr: str, signer: Signer, node: str, timeout: float) -> Any:
    """The agent's end: a connection that lives as long as the agent (the kernel closes it when it dies)."""
    return presence_connect_clocked(addr, signer, node, timeout, clock_timeout=0.0)[0]


@dataclass(frozen=True)
class ClockSample:
    """The supervisor host's clock minus this host's, from one round trip (error at most ``rtt / 2``)."""

    offset: float
    rtt: float


def presence_connect_clocked(addr: str, signer: Signer, node: str, timeout: float, *,
                             clock_timeout: float = 2.0) -> tuple[Any, ClockSample | None]:
    """:func:`presence_connect`, and the clock offset from the supervisor's signed reply to the hello
    (None if it does not come within ``clock_timeout`` or does not verify: the offset is a refinement)."""
    host, port = addr.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=timeout)
    t0 = time.time()
    conn.sendall(signer.seal({"node": node, "t": t0}) + b"\n")
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
