"""Host health on a really full filesystem, memory pressure, NVML absence, and the preemption notice file."""
import json
import logging
import os
import subprocess
import time

import pytest

from resilient.events.api import EventKind
from resilient.signals.health import parse_deadline
from tests.signals.harness import kinds


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (we may be root); else a directory on the ordinary disk (fallback: see the test)."""
    d = tmp_path / "local"
    d.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)],
                             capture_output=True).returncode == 0
    yield d, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(path, nbytes):
    """Write until ``nbytes`` are written or the filesystem is full."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb") as f:
        written = 0
        try:
            while written < nbytes:
                written += f.write(chunk[: min(len(chunk), nbytes - written)])
                f.flush()
        except OSError:
            pass


@pytest.mark.timeout(30)
def test_full_local_tier_is_host_unhealthy(make_agent, small_fs):
    d, mounted = small_fs
    if mounted:
        a = make_agent(ckpt_local=str(d / "ckpt"), health_interval=0.05, disk_min_free_bytes=1 << 20)
        size = 64 << 20  # more than fits
    else:
        # no tmpfs: the threshold sits 8 MiB under the current free space and a real file crosses it
        free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
        a = make_agent(ckpt_local=str(d / "ckpt"), health_interval=0.05, disk_min_free_bytes=free - (8 << 20),
                       disk_min_free_fraction=0.999)
        size = 32 << 20
    a.pump_for(0.2)
    assert not [e for e in a.events if e.details.get("check") == "disk_free"]
    fill(d / "blob", size)
    evs = a.pump(lambda ev: [e for e in ev if e.details.get("check") == "disk_free"], 10)
    (e,) = [e for e in evs if e.details.get("check") == "disk_free"]
    assert e.kind == EventKind.HOST_UNHEALTHY and e.details["value"] < e.details["threshold"]
    assert e.details["path"] == str(d / "ckpt") and e.node == "node0"
    # reported once while it stays full; again after it recovered and filled up again
    (d / "blob").unlink()
    a.pump(lambda ev: not a.monitor._health.checks._bad & {"disk_free"}, 10)
    fill(d / "blob2", size)
    a.pump(lambda ev: [e for e in ev if e.details.get("check") == "disk_free"], 10)
    assert len([e for e in a.events if e.details.get("check") == "disk_free"]) == 2


@pytest.mark.timeout(30)
def test_memory_pressure_and_missing_nvml(make_agent, caplog):
    caplog.set_level(logging.INFO, logger="resilient.signals.health")
    caplog.set_level(logging.INFO, logger="resilient.signals.gpu")
    a = make_agent(health_interval=0.05, memory_threshold=0.01)  # any machine uses more than 0.01 % of its RAM
    evs = a.pump(lambda ev: kinds(ev, EventKind.HOST_UNHEALTHY), 10)
    (e,) = kinds(evs, EventKind.HOST_UNHEALTHY)
    assert e.details["check"] == "memory" and e.details["value"] > e.details["threshold"] == 0.01
    a.pump_for(0.3)
    assert len(kinds(a.events, EventKind.HOST_UNHEALTHY)) == 1
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("this machine has NVML: the skip path cannot be observed")
    except Exception:  # noqa: BLE001
        pass
    # no GPU here: skipped cleanly, said once, no GPU events
    assert len([r for r in caplog.records if "GPU health checks skipped" in r.getMessage()]) == 1
    assert not kinds(a.events, EventKind.GPU_UNHEALTHY)


@pytest.mark.timeout(30)
def test_preemption_notice_file(make_agent):
    a = make_agent(preempt_poll=0.02, preempt_grace=45.0)
    notice = a.run_dir / "preempt"
    deadline = time.time() + 120
    tmp = a.run_dir / ".preempt.tmp"
    tmp.write_text(json.dumps({"deadline": deadline, "reason": "maintenance"}))
    os.replace(tmp, notice)
    evs = a.pump(lambda ev: kinds(ev, EventKind.PREEMPTION_NOTICE), 5)
    (e,) = kinds(evs, EventKind.PREEMPTION_NOTICE)
    assert e.details["deadline"] == pytest.approx(deadline) and e.details["reason"] == "maintenance"
    assert e.details["source"] == f"file:{notice}"
    a.pump_for(0.2)
    assert len(kinds(a.events, EventKind.PREEMPTION_NOTICE)) == 1  # same file: one notice
    tmp.write_text("30")  # a new notice: 30 s from its mtime
    os.replace(tmp, notice)
    evs = a.pump(lambda ev: kinds(ev, EventKind.PREEMPTION_NOTICE), 5)
    (e,) = kinds(evs, EventKind.PREEMPTION_NOTICE)
    assert e.details["deadline"] == pytest.approx(notice.stat().st_mtime + 30)


@pytest.mark.timeout(30)
def test_a_notice_left_by_an_earlier_run_is_stale(tmp_path):
    """A rerun in the same run directory (a requeue after exit 75) finds the old notice: the workers ignore it,
    and so must the agent, or the supervisor would end the rerun as preempted at its first failure."""
    from resilient.events.api import Event
    from resilient.signals.health import NoticeFile

    notice = tmp_path / "preempt"
    notice.write_text("30")
    os.utime(notice, (time.time() - 60, time.time() - 60))
    made: list[Event] = []
    nf = NoticeFile(str(notice), 45.0, lambda kind, **d: made.append(kind) or kind)
    assert nf.poll() == [] and nf.poll() == []
    tmp = tmp_path / ".preempt.tmp"
    tmp.write_text("30")  # a new notice for this run
    os.replace(tmp, notice)
    assert nf.poll() == [EventKind.PREEMPTION_NOTICE]


def test_deadline_formats():
    assert parse_deadline("", 1000.0, 30) == (1030.0, None)
    assert parse_deadline("1800000000", 1000.0, 30) == (1800000000.0, None)
    assert parse_deadline("2026-11-22T05:00:00+00:00", 0, 30)[0] == pytest.approx(1795323600.0)
    assert parse_deadline('{"deadline": 12, "reason": "spot"}', 1000.0, 30) == (1012.0, "spot")
    assert parse_deadline("soon-ish", 1000.0, 30) == (1030.0, None)


@pytest.fixture
def metadata_server():
    """A real HTTP server standing in for a cloud metadata endpoint; the answer is settable."""
    import http.server
    import threading

    state = {"answer": "NONE", "headers": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 — http.server's naming
            state["headers"].append(self.headers.get("Metadata-Flavor"))
            body = state["answer"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/computeMetadata/v1/instance/maintenance-event", state
    srv.shutdown()
    srv.server_close()


@pytest.mark.timeout(30)
def test_preemption_notice_from_http_endpoint(make_agent, metadata_server):
    url, state = metadata_server
    a = make_agent(preempt_url=url, preempt_url_poll=0.05, preempt_grace=60.0)
    a.pump(lambda ev: len(state["headers"]) >= 3, 10)  # polled, quiet while it answers NONE
    assert not kinds(a.events, EventKind.PREEMPTION_NOTICE) and state["headers"][0] == "Google"
    state["answer"] = "TERMINATE_ON_HOST_MAINTENANCE"
    t0 = time.time()
    evs = a.pump(lambda ev: kinds(ev, EventKind.PREEMPTION_NOTICE), 10)
    (e,) = kinds(evs, EventKind.PREEMPTION_NOTICE)
    assert e.details["reason"] == "TERMINATE_ON_HOST_MAINTENANCE" and e.details["source"] == f"http:{url}"
    assert e.details["deadline"] >= t0 + 60.0 - 1
    n = len(state["headers"])
    a.pump(lambda ev: len(state["headers"]) >= n + 3, 10)
    assert len(kinds(a.events, EventKind.PREEMPTION_NOTICE)) == 1  # one notice while the answer stands


def test_unreachable_endpoint_is_quiet(make_agent, caplog):
    caplog.set_level(logging.INFO, logger="resilient.signals.health")
    a = make_agent(preempt_url="http://127.0.0.1:9/none", preempt_url_poll=0.05)
    a.pump(lambda ev: len([r for r in caplog.records if "unreachable" in r.getMessage()]) >= 1, 10)
    a.pump_for(0.3)
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
    assert not kinds(a.events, EventKind.PREEMPTION_NOTICE)
