"""Framing of the presence connection: newline-terminated signed lines, both ways.

After its hello, an agent writes its summaries and acknowledgements (``hb``, ``ack``: all but a few of the
messages, one per node per second and per plan) on the presence connection it already keeps open, instead of one
store round trip each: the supervisor reads whatever arrived with one ``recv`` per readable socket. The store
queue stays the path of what needs a decision or ends something (``join``, ``arriving``, ``event``, ``done``,
``leave``: each push is answered, so an agent whose supervisor is gone keeps the report, and the door's promise
rests on that answer) and the fallback for an agent without a working connection.

An agent's line is ``MAC BODY`` (:meth:`Signer.seal_line <resilient.supervisor.transport.Signer.seal_line>`: one
JSON parse to open, not the queue's two). A line sealed for this path names it (``via``), so a line taken off the wire and pushed into the store queue, or
the other way round, is refused: each path keeps its own replay guard per node, and the two never meet. The
supervisor writes one kind of line back after the clock reply: a signed notice of each new plan's round, so agents
that wait for it need not poll the store.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

#: the ``via`` of a body sealed for the presence connection
VIA_PRESENCE = "presence"
#: the ``type`` of the supervisor's notice of a new plan
PLAN_NOTICE = "plan"
#: a line longer than this is not one of ours: it is dropped up to its end
MAX_LINE = 1 << 20
#: bytes taken from one socket in one read: a pass never loops on one busy connection
RECV_BYTES = 1 << 16


class LineBuffer:
    """Bytes in, complete lines out; an over-long line is dropped whole (counted), the next one is read normally."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._buf = b""
        self._skipping = False
        self.dropped = 0

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        if self._skipping and lines:
            lines.pop(0)  # the end of the over-long line
            self._skipping = False
        if len(self._buf) > self.max_line:
            self._buf, self._skipping = b"", True
            self.dropped += 1
        return [ln for ln in lines if ln]


def send_line(conn: socket.socket, data: bytes, timeout: float) -> None:
    """Write ``data`` and a newline within ``timeout`` seconds, or raise ``TimeoutError``/``OSError``. A line cut by
    the timeout leaves the stream unusable for lines: the caller stops writing on it."""
    out = memoryview(data + b"\n")
    p = select.poll()
    p.register(conn, select.POLLOUT)
    left_ms = max(1, int(timeout * 1000))
    deadline = time.monotonic() + timeout
    while out:
        # poll first: a socket with a timeout would wait in send() up to its own (longer) timeout
        if not p.poll(left_ms):
            raise TimeoutError(f"the presence connection took no data for {timeout:g} s")
        try:
            n = conn.send(out, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            n = 0
        out = out[n:]
        left_ms = int((deadline - time.monotonic()) * 1000)
        if out and left_ms <= 0:
            raise TimeoutError(f"the presence connection took no data for {timeout:g} s")


def send_now(conn: Any, data: bytes) -> bool:
    """The supervisor's side: never waits. False when the line did not go whole (the agent then polls as before:
    a notice is a shortcut, not the plan)."""
    try:
        return conn.send(data + b"\n", socket.MSG_DONTWAIT) == len(data) + 1
    except OSError:
        return False
