"""The presence connection also measures each agent's clock offset to the supervisor's host.

Real sockets, a real PresenceServer polled in a thread as the supervisor loop does; the offset of two
processes on one host must come out near zero, and a stranger (wrong secret) gets no clock at all.
"""
from __future__ import annotations

import threading

import pytest

from resilient.supervisor import transport as T
from tests._helpers.wait import wait_for


@pytest.fixture
def server():
    signer = T.Signer(b"s" * 32)
    srv = T.PresenceServer(signer, bind="127.0.0.1")
    seen: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            hello, _gone = srv.poll()
            seen.extend(hello)
            stop.wait(0.005)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv, signer, seen
    stop.set()
    t.join(timeout=5)
    srv.close()


@pytest.mark.timeout(30)
def test_agent_learns_its_clock_offset_on_connect(server):
    srv, signer, seen = server
    conn, sample = T.presence_connect_clocked(f"127.0.0.1:{srv.port}", signer, "node-a", timeout=5,
                                              clock_timeout=5)
    try:
        assert sample is not None
        assert 0 <= sample.rtt < 5
        assert abs(sample.offset) <= sample.rtt / 2 + 0.01  # one host, one clock: zero within the error
        # the clock reply leaves inside poll(), before the loop records the hello: wait for the record
        wait_for(lambda: seen == ["node-a"], 10, f"the server to record the hello (seen: {seen})")
    finally:
        conn.close()


@pytest.mark.timeout(30)
def test_wrong_secret_gets_no_clock_and_is_refused(server):
    srv, _signer, seen = server
    conn, sample = T.presence_connect_clocked(f"127.0.0.1:{srv.port}", T.Signer(b"x" * 32), "intruder",
                                              timeout=5, clock_timeout=1)
    try:
        assert sample is None
        assert seen == []
    finally:
        conn.close()
