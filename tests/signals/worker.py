"""A training worker for the signal tests: gloo group, resilient.steps, explicit all_reduce or DDP.

Configured by environment (the tests set it; under resilient-run the launcher sets the torch part):
  T_STEPS        number of steps (default 30)
  T_MODE         "allreduce" (hand-written loop) or "ddp" (unmodified DDP training step)
  T_WORK         seconds of CPU work per step on every rank (CPU time, not wall time; default 0.02)
  T_SLOW_RANK    global rank that sleeps T_SLOW_EXTRA more seconds per step (from step T_SLOW_FROM)
  T_MARK_STEP    at this step each rank writes its pid to T_MARK_DIR/rank<R>.step and waits for T_MARK_DIR/go
                 (lets a test freeze a rank at a known point without sleeping); only in attempt
                 T_MARK_ATTEMPT (default 0, from TORCHELASTIC_RESTART_COUNT)
  T_SECTION      if set, wrap every 5th step's extra work in resilient.section(T_SECTION)
  RESILIENT_FAULTS  faults (resilient.drill), carried out by resilient.steps; e.g. hang-collective:
                 a rank waits in dist.recv for a message no peer sends while the others wait in their
                 all_reduce (a deadlock inside communication)
  T_OUT          directory for rank<R>.done (written after the loop)
"""
import os
import time

import torch
import torch.distributed as dist

import resilient
from tests._helpers.wait import wait_for


def busy(seconds: float) -> None:
    """``seconds`` of this thread's CPU time: a fixed amount of work, as a real step's is, so that waiting for a
    core on a busy machine lengthens it (and is not the rank's own work) instead of eating into it."""
    end = time.thread_time() + seconds
    x = torch.ones(64, 64)
    while time.thread_time() < end:
        x = (x @ x).clamp_(-1, 1)


def wait_for_file(path: str, timeout: float = 60.0) -> None:
    wait_for(lambda: os.path.exists(path), timeout, path, interval=0.005)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = int(os.environ.get("T_STEPS", "30"))
    mode = os.environ.get("T_MODE", "allreduce")
    work = float(os.environ.get("T_WORK", "0.02"))
    slow_rank = int(os.environ.get("T_SLOW_RANK", "-1"))
    slow_extra = float(os.environ.get("T_SLOW_EXTRA", "0"))
    slow_from = int(os.environ.get("T_SLOW_FROM", "0"))
    mark = int(os.environ.get("T_MARK_STEP", "-1"))
    mark_dir = os.environ.get("T_MARK_DIR", "")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != os.environ.get("T_MARK_ATTEMPT", "0"):
        mark = -1
    sect = os.environ.get("T_SECTION")
    scale_log = os.environ.get("T_SCALE_LOG")
    if scale_log:
        resilient.on_scale(lambda ev: open(f"{scale_log}.{rank}", "a").write(f"{ev.old_world_size} {ev.new_world_size} {ev.old_dp_size} {ev.new_dp_size}\n"))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grad = torch.zeros(1)
    for step in resilient.steps(0, n):
        if step == mark and mark_dir:
            with open(os.path.join(mark_dir, f".rank{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(mark_dir, f".rank{rank}.tmp"), os.path.join(mark_dir, f"rank{rank}.step"))
            wait_for_file(os.path.join(mark_dir, "go"))
        busy(work)
        if rank == slow_rank and step >= slow_from:
            time.sleep(slow_extra)
        if sect and step % 5 == 4:
            with resilient.section(sect):
                busy(work)
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if mode == "allreduce":
            grad.fill_(float(loss.detach()))
            dist.all_reduce(grad)
        opt.step()
    out = os.environ.get("T_OUT")
    if out:
        open(os.path.join(out, f"rank{rank}.done"), "w").close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
