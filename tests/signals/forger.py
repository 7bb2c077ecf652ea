"""An outside process of the same user that attacks the agent socket (never a descendant of a worker).

    forger.py forge AGENT_PID WORKER_PID FROZEN_RANK OTHER_RANK ATTEMPT READY_FILE
        finds the agent socket in /proc/net/unix, then, until killed: sends DONE twice
        and STEP packets in the frozen rank's name (its pid in the header) to hide a hang, and slow STEP
        packets in the other rank's name to make it look like a straggler; reconnects whenever the agent
        closes the connection. Writes READY_FILE after its first batch.
    forger.py hold AGENT_PID COUNT READY_FILE
        opens up to COUNT connections and keeps them open until killed; writes the number it holds to
        READY_FILE.
"""
import os
import resource
import socket
import sys
import time

from resilient.signals import protocol as P


def agent_address(agent_pid: int) -> bytes | str:
    """Abstract socket names are listed in /proc/net/unix for anyone to read: no secret to steal."""
    prefix = f"@resilient-{agent_pid}-"
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith(prefix):
            return P.socket_address(parts[7])
    sys.exit(f"no agent socket {prefix}* in /proc/net/unix")


def connect(addr) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(False)
    try:
        s.connect(addr)
    except OSError:
        s.close()
        return None
    return s


def forge(agent_pid: int, worker_pid: int, frozen: int, other: int, attempt: int, ready: str) -> None:
    addr = agent_address(agent_pid)
    frozen_hdr = lambda t: P.header(t, frozen, frozen, worker_pid, attempt)  # noqa: E731
    other_hdr = lambda t: P.header(t, other, other, 0, attempt)  # noqa: E731
    step = 10_000
    sent = 0
    started = ready + ".started" if ready else ""
    s = None
    while True:
        if s is None:
            s = connect(addr)
        batch = [P.pack_done(frozen_hdr(P.DONE), step), P.pack_done(frozen_hdr(P.DONE), step)]
        for _ in range(20):
            step += 1
            batch.append(P.pack_step(frozen_hdr(P.STEP), step, 0.01, 0.001))
            batch.append(P.pack_step(other_hdr(P.STEP), step, 1.0, 1.0))  # 1000× slower than the frozen rank
        for pkt in batch:
            if s is None:
                break
            try:
                s.send(pkt)
                sent += 1
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                s = None
        if started and sent:
            open(started, "w").close()  # sending: the test may now freeze the rank (our start-up can outlast its timeout)
            started = ""
        if ready and sent >= 400:
            with open(ready + ".tmp", "w") as f:
                f.write(str(sent))
            os.replace(ready + ".tmp", ready)
            ready = ""
        time.sleep(0.05)


def hold(agent_pid: int, count: int, ready: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
    addr = agent_address(agent_pid)
    held = []
    failures = 0
    while len(held) < count and failures < 2000:
        s = connect(addr)
        if s is None:
            failures += 1  # backlog full for a moment: the agent is draining it
            time.sleep(0.001)
            continue
        held.append(s)
    with open(ready + ".tmp", "w") as f:
        f.write(str(len(held)))
    os.replace(ready + ".tmp", ready)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "forge":
        forge(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
    elif mode == "hold":
        hold(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(f"unknown mode {mode!r}")
