"""An agent in miniature, for the fork server forked from it: it imports torch, sets up our logging, installs a
signal handler and leaves bytes buffered in an open file, then starts one worker from a ForkServer(inherit=True) and
waits for it. argv: OUT_DIR WORKER_SCRIPT"""
import json
import os
import select
import signal
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # as the agent imports torch: numpy's BLAS pool would be a thread
import torch  # noqa: E402,F401 - the point: the server inherits it

from resilient.launcher.api import WorkerCommand
from resilient.launcher.starters import ForkServer, WorkerProc
from resilient.logs import setup_logging

out, script = sys.argv[1], sys.argv[2]
setup_logging("agent", run_dir=out, level="INFO")
signal.signal(signal.SIGHUP, lambda *_: None)
buffered = open(os.path.join(out, "agent.txt"), "w")
buffered.write("AGENT\n")  # not flushed before the fork: only this process may ever write it

fs = ForkServer(inherit=True)
fs.wait_ready(120)
w = WorkerProc(local_rank=0, rank=0, env=dict(os.environ, RANK="0"), stdout_fd=1, stderr_fd=2)
fs.start(WorkerCommand(script, (out,)), [w], os.getcwd())
deadline = time.monotonic() + 120
while w.exit_code is None and time.monotonic() < deadline:
    if not fs.buffered():
        select.select([fs.fileno()], [], [], 0.5)
    fs.poll_exits()
with open(os.path.join(out, "driver.json"), "w") as f:
    json.dump({"agent": os.getpid(), "server": fs.proc.pid, "kind": type(fs.proc).__name__, "worker_exit": w.exit_code}, f)
fs.close()
