"""The failure classifier: a table of cases, each the facts an event carries and the class they give."""

from __future__ import annotations

import pytest

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import JobView
from resilient.supervisor.classify import FailureClass, classify

W = EventKind.WORKER_EXIT
CASES = [
    # (kind, details, class)
    (W, {"exit_code": 1, "exc_type": "NoRestorableStepError", "message": "committed steps [89, 79] exist"},
     FailureClass.STATE_UNRECOVERABLE),
    (W, {"exit_code": 1, "exc_type": "resilient.checkpoint.api.StateUndefinedError", "message": "undefined"},
     FailureClass.STATE_UNRECOVERABLE),
    (EventKind.CKPT_TIER_FAILED, {"tier": "all", "state_undefined": True}, FailureClass.STATE_UNRECOVERABLE),
    (W, {"exit_code": -9, "signal": "SIGKILL", "oom_kill": True}, FailureClass.RESOURCE),
    (W, {"exit_code": -9, "signal": "SIGKILL", "oom_kill": False}, FailureClass.TRANSIENT),
    (W, {"exit_code": -9, "signal": "SIGKILL"}, FailureClass.TRANSIENT),
    (W, {"exit_code": -15, "signal": "SIGTERM"}, FailureClass.TRANSIENT),
    (W, {"exit_code": -11, "signal": "SIGSEGV"}, FailureClass.UNKNOWN),
    (W, {"exit_code": 1, "exc_type": "torch.OutOfMemoryError", "message": "CUDA out of memory. Tried to"},
     FailureClass.RESOURCE),
    (W, {"exit_code": 1, "exc_type": "MemoryError", "message": ""}, FailureClass.RESOURCE),
    (W, {"exit_code": 1, "exc_type": "RuntimeError", "message": "[gloo] Connection closed by peer [127.0.0.1]:1"},
     FailureClass.TRANSIENT),
    (W, {"exit_code": 1, "exc_type": "torch.distributed.DistNetworkError", "message": "failed to recv"},
     FailureClass.TRANSIENT),
    (W, {"exit_code": 1, "exc_type": "RuntimeError", "message": "x", "consequence": True}, FailureClass.TRANSIENT),
    (W, {"exit_code": 1, "exc_type": "RuntimeError", "message": "CUDA error: uncorrectable ECC error encountered"},
     FailureClass.HARDWARE),
    (W, {"exit_code": 1, "exc_type": "ValueError", "message": "step 5 is bad", "frame": "t.py:3 in f"},
     FailureClass.SOFTWARE),
    (W, {"exit_code": 3}, FailureClass.UNKNOWN),  # sys.exit(3): no error file, no cause known
    (W, {"exit_code": 1, "failure_class": "hardware"}, FailureClass.HARDWARE),  # the agent's own class wins
    (W, {"exit_code": 1, "failure_class": "no-such-class", "exc_type": "KeyError"}, FailureClass.SOFTWARE),
    (W, {"exit_code": 1, "preempted": True}, FailureClass.PREEMPTION),
    (EventKind.GPU_UNHEALTHY, {"index": 0, "check": "ecc", "value": 2}, FailureClass.HARDWARE),
    (EventKind.HOST_UNHEALTHY, {"check": "memory", "value": 0.99}, FailureClass.RESOURCE),
    (EventKind.PREEMPTION_NOTICE, {"source": "SIGTERM"}, FailureClass.PREEMPTION),
    (EventKind.HANG, {"last_heartbeat_age": 5.0}, FailureClass.UNKNOWN),
    (EventKind.AGENT_LOST, {"reason": "timeout"}, FailureClass.UNKNOWN),
    ("no_such_kind", {}, FailureClass.UNKNOWN),
    (W, None, FailureClass.UNKNOWN),
]


@pytest.mark.parametrize("kind,details,expected", CASES)
def test_classify_table(kind, details, expected) -> None:
    assert classify(kind, details) is expected


def test_classes_are_stable_strings() -> None:
    # ledger readers and policies compare these strings: they are a contract
    assert [c.value for c in FailureClass] == ["transient", "software", "state_unrecoverable", "resource",
                                               "hardware", "preemption", "unknown"]


def test_job_view_exposes_the_class() -> None:
    ev = Event(EventKind.WORKER_EXIT, node="a", rank=0, attempt=0,
               details={"exit_code": 1, "exc_type": "NoRestorableStepError", "message": "none"})
    view = JobView(nodes={}, min_nodes=1, max_nodes=1, nproc_per_node=1, restarts_left=3)
    assert view.failure_class(ev) is FailureClass.STATE_UNRECOVERABLE


def test_a_lost_spare_is_recorded() -> None:
    from resilient.supervisor.config import SupervisorConfig
    from resilient.supervisor.core import SupervisorCore

    core = SupervisorCore(SupervisorConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=3))
    for n in ("a", "s"):
        core.join(n, 1, 0.0)
    core.form(0.0)
    core.seen("s", 4.0)
    ds = core.handle(Event(EventKind.AGENT_LOST, node="s", details={"reason": "disconnected"}), 5.0)
    assert ds == []  # nothing to decide: the job runs on
    notes = core.take_notes()
    assert [(e.kind, e.node, e.details) for e in notes] == [
        (EventKind.SPARE_LOST, "s", {"cause": "disconnected", "last_seen_age": 1.0})]
    assert core.take_notes() == []  # each once
    core.handle(Event(EventKind.AGENT_LOST, node="a", details={"reason": "disconnected"}), 6.0)
    assert core.take_notes() == []  # a member's loss is the decision's cause, not a note


def test_spare_wait_flag_and_variable(monkeypatch) -> None:
    from resilient import env
    from resilient.launcher.args import parse

    script = "tests/cluster/train.py"
    assert parse(["--standalone", script]).supervisor.spare_wait == 60.0
    assert parse(["--standalone", "--spare-wait", "15", script]).supervisor.spare_wait == 15.0
    monkeypatch.setenv(env.SPARE_WAIT, "7")
    assert parse(["--standalone", script]).supervisor.spare_wait == 7.0


def test_scale_up_and_preempt_waits_are_flags_of_both_commands() -> None:
    from resilient.launcher.api import LaunchError
    from resilient.launcher.args import parse
    from resilient.supervisor import standalone

    script = "tests/cluster/train.py"
    sup = parse(["--standalone", script]).supervisor
    assert (sup.scale_up_wait, sup.preempt_wait) == (60.0, 120.0)
    sup = parse(["--standalone", "--scale-up-wait", "5", "--preempt-wait", "30", script]).supervisor
    assert (sup.scale_up_wait, sup.preempt_wait) == (5.0, 30.0)
    base = ["--rdzv-endpoint", "127.0.0.1:29400", "--nnodes", "2", "--run-dir", "/tmp/never-made"]
    sup = standalone.parse([*base, "--scale-up-wait", "7", "--preempt_wait", "9"]).supervisor
    assert (sup.scale_up_wait, sup.preempt_wait) == (7.0, 9.0)
    for flag, bad in (("--scale-up-wait", "0"), ("--preempt-wait", "-1"), ("--scale-up-wait", "inf"),
                      ("--preempt-wait", "nan")):
        with pytest.raises(LaunchError, match=f"{flag} must be a positive, finite number of seconds"):
            parse(["--standalone", flag, bad, script])
        with pytest.raises(standalone._BadInput, match=f"{flag} must be a positive, finite number of seconds"):
            standalone.parse([*base, flag, bad])
