"""The wait clock behind straggler scores, on a real scheduler: a training thread kept waiting for a CPU has that
delay subtracted from its own work once, never twice when the delay fell inside a wait that was already timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests._helpers.load import cpu_burners

# Runs pinned to one CPU shared with two busy processes. Each case times a stretch of waiting (a collective, or
# DDP's span from the last gradient to the end of backward) followed by a little own work, and reports what the
# clock charged as "not own work" against what the kernel says of the same stretch.
_PROBE = textwrap.dedent(
    """
    import json, time
    from resilient.worker import collectives as c

    def spin_wall(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def spin_cpu(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def run_queue():
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9

    clock = c._WaitClock()
    c._clock = clock
    c._bw_queued = True  # no autograd here: the end-of-backward callback is called by hand below
    out = {}
    for case in ("collective", "ddp"):
        clock.take()
        t0, cpu0, q0 = time.perf_counter(), time.thread_time(), run_queue()
        if case == "collective":
            c._charged(lambda args, kwargs: spin_wall(0.4), (), {})
        else:
            c._ddp_grad_ready(None)
            spin_wall(0.4)
            c._ddp_backward_done()
        cpu_in_wait = time.thread_time() - cpu0
        q_wait = run_queue() - q0
        spin_cpu(0.05)  # own work, with the CPU it gets on a crowded core
        charged = clock.take()
        out[case] = {"charged": charged, "wall": time.perf_counter() - t0,
                     "own_cpu": time.thread_time() - cpu0 - cpu_in_wait, "queued_in_wait": q_wait,
                     "queued": run_queue() - q0}
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel reports no run-queue delay")
@pytest.mark.timeout(60)
def test_run_queue_delay_inside_a_wait_is_not_subtracted_twice():
    cpu = sorted(os.sched_getaffinity(0))[0]
    with cpu_burners(2, max_seconds=60) as burners:
        for b in burners:
            os.sched_setaffinity(b.pid, {cpu})
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=50,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
    assert probe.returncode == 0, probe.stderr
    for case, m in json.loads(probe.stdout).items():
        # the contention was real: the thread spent a good part of the wait, and of its own work, queued
        assert m["queued_in_wait"] > 0.1, (case, m)
        assert m["queued"] - m["queued_in_wait"] > 0.02, (case, m)
        # what is not own work can never exceed the wall time less the CPU the thread spent on its own work;
        # counting the wait's queueing twice would (by the wait's queueing, here over 0.1 s)
        assert m["charged"] <= m["wall"] - m["own_cpu"] + 0.02, (case, m)
        # and the queueing outside the wait is subtracted: the wait plus most of that delay
        assert m["charged"] >= 0.4 + 0.5 * (m["queued"] - m["queued_in_wait"]), (case, m)
