"""A later attempt's start-up is held to what an earlier one took, its restore left out.

Real worker processes that restore through the real ``CheckpointManager`` (whose restore is reported to the agent as
the ``restore`` section) under the test agent, which drives a real ``NodeMonitor``; real SIGSTOP.
"""
from __future__ import annotations

import textwrap

import pytest

from resilient.events.api import EventKind
from tests.signals.harness import kinds

# T_MODE: what attempt 1 does after (or in) its restore; T_DIR: the checkpoint and the marks
RESTORING = textwrap.dedent('''
    import os, signal, time
    import torch
    import resilient
    from resilient.checkpoint.save.manager import CheckpointManager

    mode, d = os.environ["T_MODE"], os.environ["T_DIR"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ck = CheckpointManager(local=os.path.join(d, "ckpt"), interval=1)
    state = {"w": torch.zeros(8)}
    if mode == "slow-restore" and attempt == 1:
        inner = ck._restorer.restore

        def slow(s):  # a restore from a slower tier: far longer than attempt 0's start-up
            time.sleep(float(os.environ["T_SLEEP"]))
            return inner(s)

        ck._restorer.restore = slow
    start = ck.restore(state)
    if attempt == 1 and mode in ("stop", "slow-start"):
        # stuck after its restore, before the loop (a rendezvous, a model build, a download that never ends)
        with open(os.path.join(d, "stuck"), "w") as f:
            f.write(repr(time.monotonic()))
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(float(os.environ.get("T_SLEEP", "0")))
    for step in resilient.steps(start, start + 3):
        state["w"] += 1
        ck.save(step, state)
    ck.close()
''')


def _first_attempt(a, tmp_path, mode: str):
    """Attempt 0: restores (nothing yet), trains 3 steps; returns the script. Its start-up is no bound yet."""
    script = tmp_path / "restoring.py"
    script.write_text(RESTORING)
    a.spawn(1, {"T_MODE": mode, "T_DIR": str(tmp_path)}, script=str(script))
    a.pump(lambda ev: a.all_exited(), 60)
    assert [p.returncode for p in a.procs] == [0]
    # learned from an earlier attempt only: within one, a rank's own work before the loop may outlast another's
    assert a.monitor.startup_timeout()[1] == "initial"
    (sample,) = a.monitor._startup_now
    a.stop()
    return script, sample


@pytest.mark.timeout(120)
def test_a_rank_stuck_before_its_loop_is_acted_on_within_the_learned_start_up(make_agent, tmp_path):
    a = make_agent(initial_timeout=60.0, min_learned_startup=2.0)
    script, sample = _first_attempt(a, tmp_path, "stop")
    a.spawn(1, {"T_MODE": "stop", "T_DIR": str(tmp_path)}, script=str(script))
    timeout, source = a.monitor.startup_timeout()
    assert source == "startup:learned" and timeout == pytest.approx(max(2.0, 3 * sample)) and timeout < 60.0
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 60)
    (h,) = kinds(evs, EventKind.HANG)
    d = h.details
    assert d["timeout_source"] == "startup:learned" and d["process_state"] == "T" and d["step"] == -1
    assert d["timeout"] == pytest.approx(timeout) and d["longest_startup_seconds"] == pytest.approx(sample)
    # its restore (a section of its own) came first; the bound counts from the spawn with the restore left out, so
    # the hang is declared within the bound of the rank's getting stuck, never before the bound since the spawn
    stuck = float((tmp_path / "stuck").read_text())
    assert h.mono - stuck <= timeout + 10.0
    # a stopped process is a hang for certain: the bound is not backed off
    assert a.monitor.startup_timeout() == (timeout, "startup:learned")


@pytest.mark.timeout(120)
def test_a_restore_longer_than_the_learned_start_up_is_no_hang(make_agent, tmp_path):
    # a floor of 5 s: the rest of the start-up (the compile cache's set-up in steps()) must not be what trips it on a
    # loaded machine; the restore alone takes longer
    a = make_agent(initial_timeout=60.0, min_learned_startup=5.0)
    script, sample = _first_attempt(a, tmp_path, "slow-restore")
    bound = max(5.0, 3 * sample)
    a.spawn(1, {"T_MODE": "slow-restore", "T_DIR": str(tmp_path), "T_SLEEP": str(bound + 3.0)}, script=str(script))
    assert a.monitor.startup_timeout() == (pytest.approx(bound), "startup:learned")
    a.pump(lambda ev: a.all_exited(), 60)
    a.pump_for(0.3)
    assert [p.returncode for p in a.procs] == [0]
    assert not kinds(a.events, EventKind.HANG), [e.details for e in kinds(a.events, EventKind.HANG)]
    # what it leaves to learn from: the start-up without its restore
    (late,) = a.monitor._startup_now
    assert late < bound + 3.0, late


@pytest.mark.timeout(120)
def test_a_start_up_only_longer_than_the_learned_bound_ends_the_learning(make_agent, tmp_path):
    a = make_agent(initial_timeout=60.0, min_learned_startup=1.0)
    script, sample = _first_attempt(a, tmp_path, "slow-start")
    # not stopped, only slow: maybe work before the loop that only a resumed attempt does (batches skipped by hand),
    # so later attempts are held to the start-up timeout again, not to a bound doubled after each lost attempt
    a.spawn(1, {"T_MODE": "slow-start", "T_DIR": str(tmp_path), "T_SLEEP": "600"}, script=str(script))
    evs = a.pump(lambda ev: kinds(ev, EventKind.HANG), 60)
    (h,) = kinds(evs, EventKind.HANG)
    assert h.details["timeout_source"] == "startup:learned" and h.details["process_state"] != "T"
    assert h.details["timeout"] == pytest.approx(max(1.0, 3 * sample))
    assert a.monitor.startup_timeout() == (60.0, "initial")
    assert a.monitor.heartbeat_timeout()[1] == "initial"  # a step's learned timeout is not backed off by it
    assert a.monitor._backoff == 1.0


@pytest.mark.timeout(60)
def test_no_learned_start_up_for_a_script_whose_restore_is_not_marked(make_agent, tmp_path):
    # a script of its own (its own dcp.load, say) before the loop: a restart's start-up may hold a restore the first
    # attempt never had, so it stays under the start-up timeout
    a = make_agent(initial_timeout=60.0, min_learned_startup=1.0)
    script = tmp_path / "plain.py"
    script.write_text("import resilient\nfor s in resilient.steps(0, 3):\n    pass\n")
    for _ in range(2):
        a.spawn(1, {}, script=str(script))
        a.pump(lambda ev: a.all_exited(), 30)
        a.stop()
    assert a.monitor.startup_timeout()[1] == "initial" and not a.monitor._startup_samples
    assert a.monitor.startup_timeout()[0] >= 60.0
