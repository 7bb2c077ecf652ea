"""MetricsServer scraped over HTTP while real processes append to the ledger."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from resilient.goodput.metrics import LedgerCollector, MetricsServer
from tests.goodput.conftest import finish, kill_group, launch
from tests._helpers.gcs import free_port as _free_port

pytestmark = pytest.mark.timeout(120)

WRITER = textwrap.dedent("""
    import os, sys, time
    from resilient.events import EventKind, Ledger
    led = Ledger(sys.argv[1], node="n0", attempt=0)
    led.emit(EventKind.RUN_START, run_id="t")
    led.emit(EventKind.ATTEMPT_START, attempt=0, world_size=1)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "step":
            t = time.perf_counter(); sum(range(20000))
            led.emit(EventKind.STEP, rank=0, step=int(cmd[1]), seconds=time.perf_counter() - t)
        elif cmd[0] == "save":
            led.emit(EventKind.CKPT_SAVE, rank=0, step=int(cmd[1]), blocking_seconds=0.01)
            led.emit(EventKind.CKPT_TIER_DONE, rank=0, step=int(cmd[1]), tier="local", seconds=0.02)
        elif cmd[0] == "fail":  # an upload refused: the step is on the local tier all the same
            led.emit(EventKind.CKPT_TIER_FAILED, rank=0, step=int(cmd[1]), tier="persistent", error="store down")
        elif cmd[0] == "half":  # a line cut in two writes, as a writer dying mid-line would leave it
            fd = os.open(os.path.join(sys.argv[1], "events.jsonl"), os.O_WRONLY | os.O_APPEND)
            os.write(fd, b'{"kind":"restart","node":"n0","attempt":1,"details":{"cause":"failed"},')
        elif cmd[0] == "rest":
            os.write(fd, b'"wall":%f,"mono":0}\\n' % time.time()); os.close(fd)
        elif cmd[0] == "end":
            led.emit(EventKind.RUN_END, exit_code=0)
        print("ok", flush=True)
""")


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(m: dict, name: str, **labels) -> float:
    for lab, v in m[name]:
        if all(lab.get(k) == val for k, val in labels.items()):
            return v
    raise KeyError((name, labels))


@pytest.fixture
def writer(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)

    def do(cmd: str) -> None:
        assert p.stdin and p.stdout
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"

    yield do
    p.kill()
    p.wait(timeout=10)


def test_scrape_follows_a_growing_ledger(tmp_path, writer):
    with MetricsServer(0, str(tmp_path)) as srv:
        assert srv.port
        m = scrape(srv.port)  # nothing written yet: still a valid page
        assert "resilient_goodput_ratio" not in m
        for i in range(5):
            writer(f"step {i}")
        writer("save 4")
        m = scrape(srv.port)
        assert value(m, "resilient_last_step") == 4
        assert 0 <= value(m, "resilient_goodput_ratio") <= 1
        assert value(m, "resilient_in_progress") == 1
        assert value(m, "resilient_checkpoint_step", tier="local") == 4
        assert value(m, "resilient_checkpoint_age_seconds", tier="local") >= 0
        assert value(m, "resilient_restarts_total") == 0 and value(m, "resilient_world_size") == 1
        cats = {lab["category"] for lab, _ in m["resilient_badput_seconds"]}
        assert {"checkpoint_save_stall", "wasted_progress", "checkpoint_interference", "step_slowdown"} <= cats
        assert value(m, "resilient_clean_step_seconds") >= 0
        assert "resilient_checkpoint_tier_failures_total" not in m  # none yet
        writer("fail 4")
        writer("fail 4")
        m = scrape(srv.port)
        assert value(m, "resilient_checkpoint_tier_failures_total", tier="persistent") == 2
        writer("half")
        m = scrape(srv.port)  # the half line is not an event yet
        assert value(m, "resilient_restarts_total") == 0
        writer("rest")
        writer("step 5")
        m = scrape(srv.port)  # ... and is not lost once complete
        assert value(m, "resilient_restarts_total") == 1 and value(m, "resilient_last_step") == 5
        assert value(m, "resilient_ledger_events_total", kind="step") == 6
        writer("end")
        m = scrape(srv.port)
        assert value(m, "resilient_in_progress") == 0
    with pytest.raises(OSError):
        scrape(srv.port)  # closed



def test_a_reused_report_never_hides_a_restart_or_the_runs_end(tmp_path, writer):
    """Under load a scrape reuses the last report (its cost is rationed); a restart, an attempt or the run's end
    must still show at the next scrape. Rationing forced here: every report costs more than the CPU share allows."""
    c = LedgerCollector(tmp_path, max_cpu_share=1e-9, free_report_seconds=0.0)

    def page() -> dict[str, float]:
        return {s.name: s.value for fam in c.collect() for s in fam.samples if not s.labels}

    for i in range(3):
        writer(f"step {i}")
    first = page()
    assert first["resilient_restarts_total"] == 0 and first["resilient_last_step"] == 2
    writer("step 3")
    m = page()  # rationed: the report is the last one, the live gauges are not
    assert m["resilient_wall_seconds"] == first["resilient_wall_seconds"] and m["resilient_last_step"] == 3
    writer("half")
    writer("rest")  # a restart line
    m = page()
    assert m["resilient_restarts_total"] == 1 and m["resilient_wall_seconds"] > first["resilient_wall_seconds"]
    writer("step 4")
    assert page()["resilient_in_progress"] == 1
    writer("end")
    assert page()["resilient_in_progress"] == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kw", [{"max_cpu_share": 0}, {"max_cpu_share": 1.5}, {"max_cpu_share": float("nan")},
                                {"free_report_seconds": -1}, {"free_report_seconds": float("inf")},
                                {"free_report_seconds": float("nan")}])
def test_bad_rations_are_refused_by_name(tmp_path, kw):
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=name):
        LedgerCollector(tmp_path, **kw)


def test_resilient_run_metrics_port(tmp_path):
    """Scrape ``resilient-run --metrics-port`` while its workers are paused mid-run, then let them finish."""
    run_dir = tmp_path / "run"
    ready, go = tmp_path / "ready", tmp_path / "go"
    port = _free_port()
    proc = launch(run_dir, steps=12, save_every=3, extra_args=("--metrics-port", str(port)),
                  extra_env={"TOY_WAIT_FILE": str(go), "TOY_READY_FILE": str(ready), "TOY_WAIT_AFTER": "7"})
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, finish(proc)
            assert time.monotonic() < deadline, "the job never reached step 7"
            time.sleep(0.05)
        m = scrape(port)
        assert value(m, "resilient_last_step") == 5  # step 6 is the one waiting: recorded when it ends
        # loopback only unless --metrics-addr says otherwise
        import psutil

        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [a.ip for a in listening] == ["127.0.0.1"], listening
        assert value(m, "resilient_in_progress") == 1 and value(m, "resilient_attempt") == 0
        assert value(m, "resilient_world_size") == 2
        assert value(m, "resilient_checkpoint_step", tier="local") == 5
        assert 0 < value(m, "resilient_goodput_ratio") < 1
        go.touch()
        out = finish(proc)
        assert proc.returncode == 0, out
    finally:
        kill_group(proc)


def test_metrics_addr_flag_and_loopback_default(tmp_path):
    from resilient.launcher.args import parse

    script = tmp_path / "s.py"
    script.write_text("")
    base = ["--standalone", "--run-dir", str(tmp_path / "run"), "--metrics-port", "0"]
    assert parse([*base, str(script)]).metrics_addr == "127.0.0.1"
    assert parse([*base, "--metrics-addr", "0.0.0.0", str(script)]).metrics_addr == "0.0.0.0"
    with MetricsServer(0, str(tmp_path)) as srv:
        assert srv._server.server_address[0] == "127.0.0.1"
    with MetricsServer(0, str(tmp_path), addr="0.0.0.0") as srv:
        assert srv._server.server_address[0] == "0.0.0.0"
        scrape(srv.port)
