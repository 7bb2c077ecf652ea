"""The worker client: plain range outside resilient-run, ledger records, on_scale, an absent agent, the
preemption agreement."""
import ast
import json
import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

import resilient
from resilient import env as renv
from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.worker import steps as client
from resilient.signals import protocol as P
from resilient.signals.api import ScaleEvent
from resilient.worker.scale import read_world, record_world
from tests.signals.harness import kinds

LIGHT = str(Path(__file__).with_name("light_worker.py"))


@pytest.fixture
def no_agent(monkeypatch):
    monkeypatch.delenv("RESILIENT_AGENT_SOCKET", raising=False)
    monkeypatch.setattr(client, "_client_obj", None)


def test_outside_resilient_run_steps_is_a_plain_range(no_agent):
    assert resilient.steps(3, 7) == range(3, 7)
    unbounded = resilient.steps(5)
    assert [next(unbounded) for _ in range(3)] == [5, 6, 7]
    with resilient.section("eval"):
        pass
    assert resilient.ScaleEvent is ScaleEvent


def test_bad_arguments_are_named(no_agent):
    with pytest.raises(TypeError, match="callable"):
        resilient.on_scale(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        with resilient.section("x", timeout=0):
            pass


def test_unreachable_agent_never_blocks_or_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("RESILIENT_AGENT_SOCKET", "@resilient-test-nobody-listens")
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(client, "_client_obj", None)
    assert list(resilient.steps(0, 5)) == [0, 1, 2, 3, 4]
    with resilient.section("ckpt"):
        pass
    c = client._client()
    assert c is not None and c.dropped > 0
    evs = list(read_events(tmp_path))
    assert [e.details["step"] for e in kinds(evs, EventKind.STEP)] == [0, 1, 2, 3, 4]
    assert [e.details["name"] for e in kinds(evs, EventKind.SECTION)] == ["ckpt"]
    c.ledger.close()
    monkeypatch.setattr(client, "_client_obj", None)


def test_packets_round_trip():
    hdr = P.header(P.STEP, 3, 11, 1234, 2)
    m = P.unpack(P.pack_step(hdr, 7, 0.5, 0.25))
    assert (m.type, m.local_rank, m.rank, m.pid, m.attempt, m.step, m.seconds, m.compute) == (P.STEP, 3, 11, 1234, 2, 7, 0.5, 0.25)
    m = P.unpack(P.pack_section_start(P.with_type(hdr, P.SECTION_START), "eval", None))
    assert m.name == "eval" and m.timeout is None
    m = P.unpack(P.pack_section_end(P.with_type(hdr, P.SECTION_END), "é" * 1000, 1.5))
    assert m.seconds == 1.5 and len(m.name.encode()) <= P.MAX_PACKET
    m = P.unpack(P.pack_hello(P.with_type(hdr, P.HELLO), 8, 4, 100))
    assert (m.world_size, m.local_world_size, m.step) == (8, 4, 100)
    assert P.unpack(b"\x02") is None and P.unpack(b"\x02\x09" + bytes(30)) is None  # short, wrong version
    assert P.unpack(P.pack_step(hdr, 1, math.nan, math.nan)).compute != 0
    assert P.socket_address("@x") == b"\0x" and P.socket_address("/tmp/s") == "/tmp/s"


@pytest.mark.timeout(60)
def test_one_step_event_per_step_and_section_events_from_rank_0(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=5.0)
    a.spawn(2, {"T_STEPS": "12", "T_SECTION": "eval", "T_SECTION_AT": "3", "T_SECTION_SLEEP": "0.01"}, script=LIGHT)
    a.pump(lambda ev: a.all_exited(), 30)
    a.pump_for(0.2)
    assert [p.returncode for p in a.procs] == [0, 0]
    evs = list(read_events(a.run_dir))
    steps = kinds(evs, EventKind.STEP)
    assert [e.details["step"] for e in steps] == list(range(12))
    assert {e.rank for e in steps} == {0} and all(e.attempt == 0 and e.details["seconds"] > 0 for e in steps)
    (sec,) = kinds(evs, EventKind.SECTION)
    assert sec.details["name"] == "eval" and sec.details["seconds"] >= 0.01 and sec.rank == 0
    assert len(kinds(evs, EventKind.WORKERS_READY)) == 1
    assert not kinds(evs, EventKind.HANG)  # finished ranks are not watched


@pytest.mark.timeout(60)
def test_on_scale_runs_before_training_when_the_world_changed(make_agent, tmp_path):
    a = make_agent(heartbeat_timeout=5.0)
    log = tmp_path / "scale.log"
    env = {"T_STEPS": "3", "T_SCALE_LOG": str(log)}
    a.spawn(2, env, script=LIGHT)
    a.pump(lambda ev: a.all_exited(), 30)
    assert read_world(a.run_dir).world_size == 2 and not log.exists()  # nothing to compare with yet
    a.stop()
    a.spawn(1, dict(env, **{renv.ROUND_REASON: "node b lost: scaling down"}), script=LIGHT)  # one rank lost
    a.pump(lambda ev: a.all_exited(), 30)
    assert log.read_text().split("\n")[0] == "0 2 1 2 1"
    a.stop()
    a.spawn(1, dict(env, T_DP="1"), script=LIGHT)  # same world again: no callback
    a.pump(lambda ev: a.all_exited(), 30)
    assert log.read_text().count("\n") == 1
    (sc,) = kinds(list(read_events(a.run_dir)), EventKind.SCALE)
    assert sc.details == {"old_world_size": 2, "new_world_size": 1, "old_dp": 2, "new_dp": 1, "old_dp_size": 2,
                          "new_dp_size": 1, "reason": "node b lost: scaling down"} and sc.attempt == 1


def test_record_world_is_atomic_and_validated(tmp_path):
    record_world(tmp_path, 8, 4, attempt=3)
    rec = read_world(tmp_path)
    assert (rec.world_size, rec.dp_size, rec.attempt) == (8, 4, 3)
    assert json.loads((tmp_path / "world.json").read_text())["dp_size"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["world.json"]
    with pytest.raises(ValueError, match="world_size"):
        record_world(tmp_path, 0)
    (tmp_path / "world.json").write_text("{not json")
    assert read_world(tmp_path) is None


def test_previous_world_is_recorded_for_a_node_that_sat_out_and_only_over_its_own_stale_record(tmp_path):
    import socket

    from resilient.launcher.workers import record_previous_world

    def rec(d):
        r = read_world(d)
        return None if r is None else (r.world_size, r.dp_size, r.attempt)

    fresh = tmp_path / "fresh"  # a hot spare: no record at all
    fresh.mkdir()
    record_previous_world(fresh, 4, 2, attempt=3, sat_out=True)
    assert rec(fresh) == (4, 2, 2) and read_world(fresh).host == socket.gethostname()
    own = tmp_path / "own"  # back after being lost: its own record from attempt 0, world 8
    own.mkdir()
    record_world(own, 8, attempt=0)
    record_previous_world(own, 4, attempt=3, sat_out=False)  # trained in the round before: its record stands
    assert rec(own) == (8, 8, 0)
    record_previous_world(own, 4, attempt=3, sat_out=True)
    assert rec(own) == (4, 4, 2)
    shared = tmp_path / "shared"  # a shared run directory: another machine wrote the job's record since
    shared.mkdir()
    (shared / "world.json").write_text(json.dumps({"world_size": 6, "dp_size": 6, "attempt": 1, "wall": 1.0,
                                                   "host": "another-machine"}))
    record_previous_world(shared, 4, attempt=3, sat_out=True)
    assert rec(shared) == (6, 6, 1)
    previous = tmp_path / "previous"  # a record of the round before is the job's, whoever wrote it
    previous.mkdir()
    record_world(previous, 6, attempt=2)
    record_previous_world(previous, 4, attempt=3, sat_out=True)
    assert rec(previous) == (6, 6, 2)


def test_config_errors_name_the_field():
    from resilient.signals.api import MonitorConfig

    with pytest.raises(ValueError, match="straggler_threshold"):
        MonitorConfig(socket_path="@x", straggler_threshold=1.5)
    with pytest.raises(ValueError, match="socket_path"):
        MonitorConfig(socket_path="@")
    with pytest.raises(ValueError, match="heartbeat timeout"):
        MonitorConfig(socket_path="@x", heartbeat_timeout=0)


def test_socket_in_use_is_a_clear_error(make_agent):
    from resilient.signals.api import MonitorConfig
    from resilient.signals.monitor import create_node_monitor

    a = make_agent()
    with pytest.raises(OSError, match="cannot listen on the agent socket"):
        create_node_monitor(MonitorConfig(socket_path=a.config.socket_path), None, 0)


def test_filesystem_socket_path(tmp_path, monkeypatch):
    from resilient.signals.api import MonitorConfig
    from resilient.signals.monitor import create_node_monitor

    path = str(tmp_path / "agent.sock")
    mon = create_node_monitor(MonitorConfig(socket_path=path, heartbeat_timeout=5.0), None, 0)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        mon.attempt_started(0, {0: 0}, {0: os.getpid()})
        monkeypatch.setenv("RESILIENT_AGENT_SOCKET", path)
        monkeypatch.delenv("RESILIENT_RUN_DIR", raising=False)
        monkeypatch.setattr(client, "_client_obj", None)
        gen = resilient.steps(0, 3)
        next(gen)
        deadline = time.monotonic() + 10
        while mon.summary(time.monotonic())["ranks"][0]["step"] != 0:
            assert time.monotonic() < deadline, "the monitor never saw the step"
            select.select([mon.fileno()], [], [], 0.1)
            mon.on_readable(time.monotonic())
        assert list(gen) == [1, 2]
    finally:
        mon.close()
        monkeypatch.setattr(client, "_client_obj", None)
    assert not os.path.exists(path)


def test_the_preemption_stop_key_has_one_writer():
    # what decides a preempted attempt's last step lives in one module; nothing else spells the store key
    pkg = Path(resilient.__file__).resolve().parent
    spelled = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "preempt_stop" in node.value:
                spelled.add(path.relative_to(pkg).as_posix())
    assert spelled == {"worker/preemption.py"}


AGREE = r'''
import json, os, sys
import torch.distributed as dist
from resilient.worker import preemption
dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
rank = dist.get_rank()
out = {}
if rank == 0:
    out["proposed_before"] = preemption.stop_proposed(3)
    out["agreed"] = preemption.agree_stop(3, 10)
dist.barrier()
if rank == 1:
    out["proposed"] = preemption.stop_proposed(3)
    out["other_attempt"] = preemption.stop_proposed(4)
    out["agreed"] = preemption.agree_stop(3, 12)  # later, with another proposal: the first word stands
dist.barrier()
print(json.dumps(out), flush=True)
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_ranks_agree_on_the_first_proposed_stop_step(tmp_path):
    from tests._helpers.gcs import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(resilient.__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", AGREE], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    r0, r1 = (json.loads(o[0].strip().splitlines()[-1]) for o in outs)
    assert r0 == {"proposed_before": False, "agreed": 10}
    assert r1 == {"proposed": True, "other_attempt": False, "agreed": 10}
