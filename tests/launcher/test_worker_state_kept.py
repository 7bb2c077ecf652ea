"""A worker's program state lives until the process ends, as under ``python script``: the fork server's runner must
not tear the script's namespace down when the script returns, before the fast exit.

The hang this guards against: a 2-rank gloo DDP script ends; the runner dropped the script's globals on the main
thread, with the GIL held; the DDP reducer's last reference went, and ``~ProcessGroupGloo`` joined gloo's run loop,
which was waiting for that GIL to free a finished work's Python state. The worker never exited, and the agent
waited for it until it was killed. That interleaving depends on timing; here a destructor that never returns
stands in for it deterministically (a builtin callback on an object held only by the script's namespace, so no
reference cycle delays it to a later collection). The fork server and its workers are real processes.
"""
import select
import time

import pytest

from resilient.launcher.api import WorkerCommand
from resilient.launcher.starters import ForkServer, WorkerProc

SCRIPT = r'''
import sys, threading, time, weakref

held = threading.Event()
# destroying the script's state would block this worker's exit for an hour (only that: not an exit hook itself)
weakref.finalize(held, time.sleep, 3600).atexit = False
print("script done", flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)
'''


@pytest.mark.timeout(150)
def test_a_forked_worker_exits_without_destroying_its_script_state(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    fs = ForkServer(tag="state-kept-test")
    try:
        fs.wait_ready(90)
        # one script falls off its end, the other ends by sys.exit: both paths out of the runner
        workers = [WorkerProc(local_rank=i, rank=i, env={"RESILIENT_FAST_EXIT": "1"}) for i in range(2)]
        ends = {0: "end", 1: "exit"}
        for w in workers:
            fs.start(WorkerCommand(str(script), (ends[w.local_rank],)), [w], str(tmp_path))
        deadline = time.monotonic() + 30
        while any(w.exit_code is None for w in workers) and (left := deadline - time.monotonic()) > 0:
            if not fs.buffered():
                select.select([fs.fileno()], [], [], left)
            fs.poll_exits()
        assert [(ends[w.local_rank], w.exit_code) for w in workers] == [("end", 0), ("exit", 0)]
    finally:
        fs.close()
