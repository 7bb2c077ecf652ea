"""Runs the DDP (or backward + all_reduce, ``T_MODE=allreduce``) + ``resilient.steps()`` path many times and reports how every worker exited.

The driver imports torch, DDP and resilient once, then for each round forks WORLD workers (as the fork
server does) that form a gloo group, train a few DDP steps under ``resilient.steps()`` and end with a
normal interpreter exit — the moment a communication thread still running Python would abort the
process. Prints one JSON line: {"rounds": N, "codes": [[...], ...]}.

Usage: ddp_exit_driver.py ROUNDS WORLD STEPS RUN_DIR

Set RESILIENT_AGENT_SOCKET (any name: no agent needs to listen) or ``resilient.steps()`` is a plain range and
the run measures torch alone; ``T_PLAIN=1`` does that on purpose.
"""
import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401 - DDP's constructor imports it; imported before forking, as the fork server does
import torch.nn.parallel  # noqa: F401

import resilient

ROUND_TIMEOUT = 60.0
SWITCH_INTERVAL = float(os.environ.get("T_SWITCH_INTERVAL", "0.5"))
NICE_HELPERS = os.environ.get("T_NICE_HELPERS", "1") == "1"
MODE = os.environ.get("T_MODE", "ddp")  # "ddp", or "allreduce": backward then dist.all_reduce, no DDP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # A long switch interval keeps the GIL with the training thread while it runs Python: a communication
    # thread that needs the GIL after the last backward then finds the interpreter finalising (the race).
    sys.setswitchinterval(SWITCH_INTERVAL)
    faulthandler.enable(all_threads=True)  # an abort shows every thread's Python stack
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 1))
    if MODE == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)  # several buckets racing the exit
    else:
        model = net  # a hand-written loop: backward, then an explicit all_reduce
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if NICE_HELPERS:
        # Lower every helper thread (gloo's workers among them) below the training thread, so that under
        # CPU contention they run late: the exit race is then likely instead of rare.
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != threading.get_native_id():
                try:
                    os.setpriority(os.PRIO_PROCESS, int(tid), 19)
                except OSError:
                    pass
    loop = resilient.steps(0, steps) if os.environ.get("T_PLAIN") != "1" else range(steps)  # T_PLAIN=1: bare DDP
    for _ in loop:
        loss = model(torch.randn(8, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if MODE == "allreduce":
            g = torch.zeros(1)
            g.fill_(float(loss.detach()))
            dist.all_reduce(g)
        opt.step()
    # no destroy_process_group and nothing after the last backward: exit as fast as a script can


def main() -> None:
    rounds, world, steps, run_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ["RESILIENT_RUN_DIR"] = run_dir
    # what is imported so far out of the collector's reach, as the fork server does: a worker's finalisation
    # otherwise walks torch's and dynamo's objects (about 5 s of CPU per worker here) before it exits. The race
    # is unchanged: without steps()' hold (T_PLAIN=1, all-reduce) 3 rounds in 16 still aborted under contention
    gc.freeze()
    codes = []
    for r in range(rounds):
        port = free_port()
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                try:
                    worker(rank, world, port, steps)
                except BaseException:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                    os._exit(1)
                sys.exit(0)  # a normal exit: interpreter finalisation runs
            pids.append(pid)
        round_codes = []
        deadline = time.monotonic() + ROUND_TIMEOUT
        for pid in pids:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    round_codes.append(os.waitstatus_to_exitcode(status))
                    break
                if time.monotonic() > deadline:  # report a hang as such rather than blocking the test
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    round_codes.append("hung")
                    break
                time.sleep(0.05)
        codes.append(round_codes)
        print(r, round_codes, file=sys.stderr, flush=True)
    print(json.dumps({"rounds": rounds, "codes": codes}), flush=True)


if __name__ == "__main__":
    main()
