"""GPU health checks against a stand-in NVML (no GPU exists here): what is tested is the wiring — NVML answers
becoming one GPU_UNHEALTHY event per check that turns unhealthy, re-armed when healthy again, unsupported checks
skipped, a blocking call turned into "unresponsive", Xids sorted into critical and benign. The stand-in is
``tests/signals/fake_nvml/pynvml.py``, put in ``sys.modules`` as ``pynvml``; the real NVML is tested on a GPU by
``tests/gpu/test_nvml_health.py``."""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import sys
import threading
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.signals.gpu import GpuHealthConfig, select_devices
from resilient.signals.health import HealthConfig, HostChecks

FAKE = Path(__file__).resolve().parent / "fake_nvml" / "pynvml.py"
HEALTHY = {"init": "ok", "devices": [
    {"uuid": "GPU-aaaa-0000", "temperature": 45, "ecc": 0, "remapped": [0, 0, 0, 0], "clocks": 0,
     "recovery_action": 0, "xids": []},
    {"uuid": "GPU-bbbb-1111", "temperature": 47, "ecc": 0, "remapped": [0, 0, 0, 0], "clocks": 0,
     "recovery_action": 0, "xids": []},
]}


@pytest.fixture
def nvml(monkeypatch):
    """The stand-in as ``pynvml``, with a fresh healthy two-GPU state (``nvml.STATE``)."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.STATE = copy.deepcopy(HEALTHY)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    yield mod
    for d in mod.STATE["devices"]:  # release any call a test left blocked
        d["block"] = False
    mod.STATE["init"] = "ok"


def make_checks(**gpu) -> tuple[HostChecks, list]:
    made: list = []
    cfg = HealthConfig(memory_threshold=100.0, gpu=GpuHealthConfig(**{"throttle_rounds": 1, **gpu}))
    checks = HostChecks(cfg, lambda kind, **d: made.append((kind, d)) or (kind, d))
    return checks, made


def gpu_events(evs) -> list[dict]:
    return [d for k, d in evs if k == EventKind.GPU_UNHEALTHY]


SICK = [  # (device field, unhealthy value, healthy value, check, event value)
    ("temperature", 95, 45, "temperature", 95),
    ("ecc", 2, 0, "ecc_uncorrected", 2),
    ("remapped", [0, 1, 1, 0], [0, 1, 0, 0], "remapped_rows",
     {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}),
    ("remapped", [0, 0, 0, 1], [0, 0, 0, 0], "remapped_rows",
     {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": True}),
    ("clocks", 0x8, 0x0, "throttle", ["hw_slowdown"]),
    ("clocks", 0x40 | 0x1, 0x1, "throttle", ["gpu_idle", "hw_thermal_slowdown"]),
    ("clocks", 0x80, 0x4, "throttle", ["hw_power_brake_slowdown"]),
    ("recovery_action", 1, 0, "recovery_action", "gpu_reset"),
    ("recovery_action", 2, 0, "recovery_action", "node_reboot"),
    ("lost", True, False, "reachable", "GPU is lost"),
]


@pytest.mark.parametrize("field,bad,good,check,value", SICK,
                         ids=[f"{c}-{i}" for i, (_, _, _, c, _) in enumerate(SICK)])
def test_a_check_turns_unhealthy_once_and_is_rearmed(nvml, field, bad, good, check, value):
    checks, _ = make_checks()
    assert gpu_events(checks.run()) == []  # healthy
    nvml.STATE["devices"][1][field] = bad
    (e,) = gpu_events(checks.run())
    assert (e["index"], e["uuid"], e["check"], e["value"]) == (1, "GPU-bbbb-1111", check, value)
    assert gpu_events(checks.run()) == []  # still unhealthy: said once
    nvml.STATE["devices"][1][field] = good
    assert gpu_events(checks.run()) == [] and f"gpu1:{check}" not in checks._bad  # healthy again: re-armed
    nvml.STATE["devices"][1][field] = bad
    assert [d["check"] for d in gpu_events(checks.run())] == [check]


def test_a_gpu_lost_before_nvml_loaded_is_unreachable_not_skipped(nvml):
    nvml.STATE["devices"][1]["lost"] = True
    checks, _ = make_checks()
    assert [(d["index"], d["check"]) for d in gpu_events(checks.run())] == [(1, "reachable")]
    assert [g.index for g in checks.gpu.gpus] == [0, 1]
    nvml.STATE["devices"][1]["lost"] = False
    assert gpu_events(checks.run()) == [] and "gpu1:reachable" not in checks._bad
    nvml.STATE["devices"][1]["xids"] = [95]  # its Xid events are registered once it is back
    assert [(d["index"], d["check"], d["value"]) for d in gpu_events(checks.run())] == [(1, "xid", [95])]


def test_idle_power_cap_and_application_clocks_are_not_hardware_trouble(nvml):
    checks, _ = make_checks()
    nvml.STATE["devices"][0]["clocks"] = 0x1 | 0x2 | 0x4 | 0x20
    assert gpu_events(checks.run()) == [] and gpu_events(checks.run()) == []
    assert [r.value for r in checks.gpu.last if r.index == 0 and r.check.value == "throttle"] == \
        [["gpu_idle", "applications_clocks_setting", "sw_power_cap", "sw_thermal_slowdown"]]


def test_hardware_slowdown_counts_after_the_configured_rounds(nvml):
    checks, _ = make_checks(throttle_rounds=3)
    nvml.STATE["devices"][0]["clocks"] = 0x8
    assert gpu_events(checks.run()) == [] and gpu_events(checks.run()) == []
    (e,) = gpu_events(checks.run())
    assert e["check"] == "throttle" and e["rounds"] == 3
    nvml.STATE["devices"][0]["clocks"] = 0
    checks.run()
    nvml.STATE["devices"][0]["clocks"] = 0x8
    assert gpu_events(checks.run()) == []  # a flicker after recovering starts the count again


def test_critical_xid_is_unhealthy_benign_xid_is_only_reported(nvml):
    checks, made = make_checks()
    nvml.STATE["devices"][0]["xids"] = [31]  # before registration: never delivered
    checks.run()
    nvml.STATE["devices"][0]["xids"] += [13, 43]  # application faults
    evs = checks.run()
    assert gpu_events(evs) == []
    logs = [d for k, d in evs if k == EventKind.LOG]
    assert [(d["index"], d["xid"], d["xid_kind"], d["check"]) for d in logs] == \
        [(0, 13, "application", "xid"), (0, 43, "application", "xid")]
    nvml.STATE["devices"][0]["xids"] += [79, 154]
    evs = checks.run()
    (e,) = gpu_events(evs)
    assert (e["index"], e["check"], e["value"]) == (0, "xid", [79])
    assert [(d["xid"], d["xid_kind"]) for k, d in evs if k == EventKind.LOG] == [(154, "unknown")]
    assert gpu_events(checks.run()) == []  # no new Xid: healthy, re-armed
    nvml.STATE["devices"][0]["xids"] += [48]
    assert [(d["check"], d["value"]) for d in gpu_events(checks.run())] == [("xid", [48])]


def test_not_supported_is_skipped_quietly_and_said_once(nvml, caplog):
    caplog.set_level(logging.INFO, logger="resilient.signals.gpu")
    for d in nvml.STATE["devices"]:
        d["unsupported"] = ["remapped_rows", "recovery_action", "xid"]
    checks, _ = make_checks()
    for _ in range(3):
        assert gpu_events(checks.run()) == []
    assert nvml.CALLS["nvmlDeviceGetRemappedRows"] == 2  # once per GPU, never again
    assert nvml.CALLS["nvmlDeviceGetFieldValues"] == 2
    assert "nvmlEventSetWait_v2" not in nvml.CALLS
    said = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()
            or "not readable" in r.getMessage()]
    assert len(said) == 6, said  # three checks × two GPUs, once each
    assert {r.check.value for r in checks.gpu.last} == {"reachable", "responsive", "ecc_uncorrected", "temperature",
                                                       "throttle"}


@pytest.mark.timeout(30)
def test_a_call_that_blocks_is_unresponsive_within_the_bound(nvml):
    checks, _ = make_checks(call_timeout=0.3)
    checks.run()
    nvml.STATE["devices"][1]["block"] = True
    (e,) = gpu_events(checks.run())  # returns: the blocked call is abandoned, not waited for
    assert (e["index"], e["check"], e["timeout"]) == (1, "responsive", 0.3)
    assert [r.check.value for r in checks.gpu.last if r.index == 0 and r.bad] == []  # GPU 0 still read
    temps = nvml.CALLS["nvmlDeviceGetTemperature"]
    assert gpu_events(checks.run()) == []  # still hung: no second call started against it, no second event
    assert nvml.CALLS["nvmlDeviceGetTemperature"] == temps + 1  # only GPU 0's
    nvml.STATE["devices"][1]["block"] = False
    stuck = checks.gpu.gpus[1].caller
    done = threading.Event()
    for _ in range(500):  # the abandoned call returns once unblocked
        if stuck.abandoned() == 0:
            done.set()
            break
        done.wait(0.01)
    assert done.is_set()
    assert gpu_events(checks.run()) == [] and "gpu1:responsive" not in checks._bad  # answers again: re-armed


@pytest.mark.timeout(30)
def test_nvml_init_that_blocks_is_unresponsive_then_recovers(nvml):
    nvml.STATE["init"] = "block"
    checks, _ = make_checks(call_timeout=0.3)
    (e,) = gpu_events(checks.run())
    assert (e["index"], e["uuid"], e["check"]) == (None, None, "responsive")
    assert gpu_events(checks.run()) == []  # refused while the first nvmlInit still hangs
    nvml.STATE["init"] = "ok"
    stuck = checks.gpu._init_caller
    for _ in range(500):
        if stuck.abandoned() == 0:
            break
        threading.Event().wait(0.01)
    assert gpu_events(checks.run()) == [] and "gpu:responsive" not in checks._bad
    assert checks.gpu.state == "ready" and [g.index for g in checks.gpu.gpus] == [0, 1]


def test_no_driver_skips_gpu_checks_said_once(nvml, caplog):
    caplog.set_level(logging.INFO, logger="resilient.signals.gpu")
    nvml.STATE["init"] = "fail"
    checks, _ = make_checks()
    assert gpu_events(checks.run()) == [] and gpu_events(checks.run()) == []
    assert nvml.CALLS["nvmlInit"] == 1
    assert len([r for r in caplog.records if "GPU health checks skipped" in r.getMessage()]) == 1


def test_only_the_workers_gpus_are_watched(nvml):
    nvml.STATE["devices"][0]["temperature"] = 99  # a GPU of another job on this node
    checks, _ = make_checks(visible_devices="GPU-bbbb")
    assert gpu_events(checks.run()) == []
    assert [(g.index, g.uuid) for g in checks.gpu.gpus] == [(1, "GPU-bbbb-1111")]
    checks, _ = make_checks(visible_devices="0")
    assert [d["index"] for d in gpu_events(checks.run())] == [0]


def test_cuda_visible_devices_rules():
    uuids = ["GPU-aaaa-0000", "GPU-aaab-1111", "GPU-cccc-2222"]
    assert select_devices(None, uuids) == [0, 1, 2]
    assert select_devices("2,0", uuids) == [2, 0]
    assert select_devices("GPU-cccc,1", uuids) == [2, 1]
    assert select_devices("1,7,0", uuids) == [1]  # the list ends at the first entry naming no GPU
    assert select_devices("GPU-aaa,2", uuids) == []  # an ambiguous prefix names no GPU
    assert select_devices("", uuids) == [] and select_devices("-1", uuids) == []


def test_config_is_checked():
    with pytest.raises(ValueError, match="call timeout"):
        GpuHealthConfig(call_timeout=0)
    with pytest.raises(ValueError, match="throttle_rounds"):
        GpuHealthConfig(throttle_rounds=0)
    with pytest.raises(ValueError, match="two GPU temperature thresholds"):
        HealthConfig(gpu_temperature_threshold=80.0, gpu=GpuHealthConfig(temperature_threshold=85.0))
    assert HealthConfig(gpu_temperature_threshold=80.0).gpu.temperature_threshold == 80.0


def test_health_interval_flag_reaches_the_config(tmp_path):
    from resilient.launcher.api import LaunchError
    from resilient.launcher.args import parse
    from tests.launcher.conftest import SCRIPTS

    script = str(SCRIPTS / "dump_env.py")
    assert parse(["--run-dir", str(tmp_path / "r"), "--health-interval", "0.5", script]).health_interval == 0.5
    assert parse(["--run-dir", str(tmp_path / "r"), script]).health_interval == 5.0
    with pytest.raises(LaunchError, match=r"\-\-health\-interval"):
        parse(["--run-dir", str(tmp_path / "q"), "--health-interval", "0", script])


# --- through the real agent: a resilient-run job whose node b sees a failing GPU -------------------------------

from tests.cluster.conftest import REPO, cluster_factory, wait_for  # noqa: E402,F401 - the fixture is used by name
from tests.cluster.test_node_loss import _listening, node_name  # noqa: E402


@pytest.mark.timeout(300)
def test_an_xid_on_a_nodes_gpu_swaps_it_for_the_spare(cluster_factory, tmp_path):
    """Node b's agent loads the stand-in NVML (a ``PYTHONPATH`` entry) driven by a state file; when b's GPU reports
    Xid 79 (fallen off the bus) its health thread writes gpu_unhealthy into the run's ledger, the supervisor swaps b
    for the spare, and the job finishes there from the checkpoint. An application Xid before it is only logged."""
    state = tmp_path / "nvml-b.json"
    healthy = {"init": "ok", "devices": [{"uuid": "GPU-node-b-0", "temperature": 40, "xids": []}]}
    state.write_text(json.dumps(healthy))
    fake_env = {"PYTHONPATH": f"{FAKE.parent}{os.pathsep}{REPO}", "FAKE_NVML_STATE": str(state)}
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", "4", "--out", str(out), "--gate", str(gate), "--gate-step", "2"]
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "20",
                                    "--heartbeat-timeout", "300", "--health-interval", "0.1"])
    a = c.start("a", args)
    wait_for(lambda: _listening(c.port) or a.proc.poll() is not None, 60, "the first agent to host the store")
    b = c.start("b", args, env=fake_env)
    # b must be the member with the failing GPU: the spare starts once b holds its group rank (the first two agents
    # to join are the members, and a later start can join first)
    wait_for(lambda: any(e.kind == EventKind.RENDEZVOUS_DONE and e.node == node_name(b) for e in c.events()), 120,
             "b to join the job", a.proc)
    spare = c.start("spare", args)
    wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 120, "both ranks at the gate", a.proc)
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 60,
             "the spare to join", a.proc)
    assert not [e for e in c.events() if e.kind == EventKind.GPU_UNHEALTHY], "healthy until the Xid"
    sick = json.loads(json.dumps(healthy))
    sick["devices"][0]["xids"] = [13, 79]
    tmp = tmp_path / "nvml-b.tmp"
    tmp.write_text(json.dumps(sick))
    os.replace(tmp, state)

    def swaps() -> list[dict]:
        return [e.details for e in c.events() if e.kind == EventKind.ACTION and e.details.get("action") == "hot_swap"]

    wait_for(swaps, 60, "the supervisor to swap node b out", a.proc)
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and spare.proc.poll() is not None, 150, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert spare.proc.returncode == 0, spare.output()
    evs = c.events()
    (bad,) = [e for e in evs if e.kind == EventKind.GPU_UNHEALTHY]
    assert bad.node == node_name(b)
    assert (bad.details["index"], bad.details["uuid"], bad.details["check"], bad.details["value"]) == \
        (0, "GPU-node-b-0", "xid", [79])
    logged = [e.details for e in evs if e.kind == EventKind.LOG and e.details.get("check") == "xid"]
    assert [(d["xid"], d["xid_kind"]) for d in logged] == [(13, "application")]
    (swap,) = swaps()
    assert swap["cause"] == "gpu_unhealthy", swap
    assert (swap["action_args"]["node"], swap["action_args"]["spare"]) == (node_name(b), node_name(spare))
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(spare)]
    assert restores and restores[-1].details["step"] == 2, restores
    assert (out / "rank0.pt").exists() and (out / "rank1.pt").exists()
