"""Hostile input on the agent socket, through the real launcher: an outside process of the same user forges
heartbeats for a frozen rank, or holds thousands of connections while the job runs and a worker crashes."""
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from tests._helpers.wait import wait_for
from tests.signals.harness import REPO

LIGHT = str(Path(__file__).with_name("light_worker.py"))
FORGER = str(Path(__file__).with_name("forger.py"))


def launch(tmp_path, args, env, nofile=None):
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    e.update({"PYTHONPATH": REPO, **env})

    def limit():  # many systems default to 1024 descriptors per process
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    return subprocess.Popen([sys.executable, "-m", "resilient.run", "--standalone", *args], cwd=tmp_path, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def of(evs, kind):
    return [e for e in evs if e.kind == kind]


def worker_pids(run):
    starts = [e for e in read_events(run) if e.kind == EventKind.ATTEMPT_START] if (run / "events.jsonl").exists() else []
    return {int(r): pid for r, pid in starts[-1].details["pids"].items()} if starts else {}


def agent_log(run):
    path = run / "logs" / "agent.jsonl"
    return path, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(120)
def test_forged_heartbeats_neither_hide_a_frozen_rank_nor_make_a_straggler(tmp_path, procs):
    mark, run = tmp_path / "mark", tmp_path / "run"
    mark.mkdir()
    timeout = 3.0
    p = launch(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "0", "--heartbeat-timeout", str(timeout),
                          "--run-dir", str(run), LIGHT],
               {"T_STEPS": "100000", "T_STEP_SLEEP": "0.01", "T_MARK_STEP": "20", "T_MARK_DIR": str(mark)})
    procs.append(p)
    wait_for(lambda: all((mark / f"rank{r}.step").exists() for r in (0, 1)), 90, "both ranks at step 20", p)
    pids = worker_pids(run)
    # forged packets in rank 1's name (its real pid in the header): DONE twice, then STEPs; rank 0 "slow"
    ready = tmp_path / "forger.ready"
    forger = subprocess.Popen([sys.executable, FORGER, "forge", str(p.pid), str(pids[1]), "1", "0", "0", str(ready)],
                              env=dict(os.environ, PYTHONPATH=REPO))
    procs.append(forger)
    # freeze only once the forger sends: under load its start-up alone can outlast the 3 s hang timeout, and
    # the job (no restarts left) would end before a single forged packet
    wait_for(Path(f"{ready}.started").exists, 60, "the forger sending", forger)
    os.kill(pids[1], signal.SIGSTOP)
    t_stop = time.time()
    (mark / "go").touch()
    wait_for(ready.exists, 30, "400 forged packets sent", forger)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err  # hung, no restarts left
    evs = list(read_events(run))
    hangs = of(evs, EventKind.HANG)
    assert hangs and hangs[0].rank == 1 and hangs[0].details["suspect"] is True, err
    assert hangs[0].details["process_state"] == "T"
    detected = hangs[0].wall - t_stop
    print(f"hang reported {detected:.2f} s after the freeze under forged packets (timeout {timeout} s)")
    assert detected <= timeout + 3.0, f"hang reported {detected:.1f} s after the freeze (timeout {timeout} s)"
    assert not of(evs, EventKind.STRAGGLER), of(evs, EventKind.STRAGGLER)
    path, lines = agent_log(run)
    refused = [rec for rec in lines if "refused a connection on the agent socket" in rec["message"]]
    assert refused and "not a worker of this attempt" in refused[0]["message"]
    assert len(refused) <= 3, [r["message"] for r in refused]  # one line per interval, with a count


@pytest.mark.timeout(180)
def test_thousands_of_held_connections_leave_the_job_unharmed(tmp_path, procs):
    mark, run = tmp_path / "mark", tmp_path / "run"
    mark.mkdir()
    p = launch(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "20",
                          "--run-dir", str(run), LIGHT],
               {"T_STEPS": "40", "T_STEP_SLEEP": "0.005", "T_MARK_STEP": "5", "T_MARK_DIR": str(mark)}, nofile=1024)
    procs.append(p)
    wait_for(lambda: all((mark / f"rank{r}.step").exists() for r in (0, 1)), 90, "both ranks at step 5", p)
    pids = worker_pids(run)
    ready = tmp_path / "holder.ready"
    n = 3000  # three times the agent's descriptor limit
    holder = subprocess.Popen([sys.executable, FORGER, "hold", str(p.pid), str(n), str(ready)],
                              env=dict(os.environ, PYTHONPATH=REPO))
    procs.append(holder)
    wait_for(ready.exists, 60, "connections held", holder)
    held = int(ready.read_text())
    agent_fds = len(os.listdir(f"/proc/{p.pid}/fd"))
    assert held >= n // 2, held
    assert agent_fds < 200, f"the agent holds {agent_fds} descriptors while an outsider holds {held} connections"
    # a worker crashes while the connections are held: the job restarts and finishes
    os.kill(pids[1], signal.SIGKILL)
    (mark / "go").touch()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    evs = list(read_events(run))
    assert [e.details.get("cause") for e in of(evs, EventKind.RESTART)] == ["failed"]
    assert [e.details["step"] for e in of(evs, EventKind.STEP) if e.attempt == 1] == list(range(40))
    path, lines = agent_log(run)
    print(f"outsider held {held} connections; agent descriptors {agent_fds}; agent.jsonl {path.stat().st_size} bytes")
    assert path.stat().st_size < 100_000, path.stat().st_size
    assert any("refused a connection on the agent socket" in rec["message"] for rec in lines)
    assert not any("uv loop" in rec["message"] or "Errno 24" in rec["message"] for rec in lines)


@pytest.mark.timeout(60)
def test_a_wrapper_s_python_child_is_the_worker_and_others_are_refused(make_agent, tmp_path):
    """--no-python: the agent knows the wrapper's pid, the client runs in its child: still that rank."""
    import socket

    from resilient.signals import protocol as P
    from tests.signals.harness import kinds

    a = make_agent(heartbeat_timeout=5.0, initial_timeout=30.0)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               TORCHELASTIC_RESTART_COUNT="0", RESILIENT_AGENT_SOCKET=a.config.socket_path, PYTHONPATH=REPO,
               RESILIENT_RUN_DIR=str(a.run_dir), T_STEPS="20", T_STEP_SLEEP="0.005", T_OUT=str(tmp_path))
    a.attempt = 0
    # "; exit" keeps the shell alive as the python process's parent (no exec of the last command)
    wrapper = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" "{LIGHT}"; exit $?'], env=env)
    a.procs = [wrapper]
    a.monitor.attempt_started(0, {0: 0}, {0: wrapper.pid})
    # an outsider claims to be rank 0 (with the wrapper's pid in the header): refused, whatever it says
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(P.socket_address(a.config.socket_path))
    s.send(P.pack_done(P.header(P.DONE, 0, 0, wrapper.pid, 0), 10**6))
    evs = a.pump(lambda ev: kinds(ev, EventKind.WORKERS_READY), 30)
    assert kinds(evs, EventKind.WORKERS_READY)
    assert a.monitor.refused == 1
    a.pump(lambda ev: a.all_exited(), 30)
    assert wrapper.returncode == 0 and (tmp_path / "rank0.done").exists()
    summary = a.monitor.summary(time.monotonic())
    assert summary["ranks"][0]["step"] in (19, 20)  # the real worker's last step, not the forged 10**6
    s.close()


@pytest.mark.parametrize("flag,value", [("--heartbeat-timeout", "nan"), ("--heartbeat-timeout", "inf"),
                                        ("--heartbeat-timeout", "0"), ("--term-timeout", "nan"),
                                        ("--term-timeout", "-1"), ("--monitor-interval", "inf"),
                                        ("--monitor-interval", "0"), ("--metrics-addr", "")])
def test_non_finite_or_non_positive_seconds_are_refused(tmp_path, flag, value):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--run-dir", str(tmp_path / "run"),
                        flag, value, str(script)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "ran" not in r.stdout, r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was created


@pytest.mark.timeout(30)
def test_malformed_packets_from_a_worker_are_ignored(make_agent):
    """Garbage on a worker's own connection is no message: no event, no state; the connection stays, and
    what the worker sends after it still counts."""
    import socket

    from resilient.signals import protocol as P
    from tests.signals.harness import kinds

    a = make_agent(heartbeat_timeout=5.0, initial_timeout=30.0)
    a.attempt = 0
    a.monitor.attempt_started(0, {0: 0}, {0: os.getpid()})  # this process is rank 0's worker
    hdr = lambda t: P.header(t, 0, 0, os.getpid(), 0)  # noqa: E731
    other_version = bytes([P.STEP, P.PROTOCOL_VERSION + 1]) + hdr(P.STEP)[2:]
    garbage = [b"garbage that is not a packet", b"\x02", hdr(P.STEP)[:-1], hdr(P.STEP) + bytes(3),
               hdr(P.DONE) + bytes(5), P.with_type(hdr(P.STEP), 99) + bytes(24),
               P.pack_step(other_version, 10**6, 0.01, 0.01)]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(P.socket_address(a.config.socket_path))
        # one connection keeps packet order: the monitor reads each piece of garbage before what follows it
        for pkt in garbage:
            s.send(pkt)
        s.send(P.pack_step(hdr(P.STEP), 7, 0.01, 0.01))
        for pkt in garbage:
            s.send(pkt)
        s.send(P.pack_done(hdr(P.DONE), 7))
        evs = a.pump(lambda ev: a.monitor.summary(time.monotonic())["ranks"][0]["done"], 10)
    finally:
        s.close()
    r = a.monitor.summary(time.monotonic())["ranks"][0]
    assert r["step"] == 7, r  # not the other protocol version's 10**6
    assert [e.kind for e in evs] == [EventKind.WORKERS_READY] and evs[0].details["step"] == 7
    assert a.monitor.refused == 0
    assert not kinds(a.events, EventKind.HANG)
