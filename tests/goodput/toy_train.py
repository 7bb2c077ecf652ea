"""A tiny real training job for goodput tests: gloo all-reduce steps, a checkpoint file, ledger events.

Runs under ``resilient-run`` or with the launcher's environment set by a test. Settings (environment):
TOY_STEPS total steps; TOY_SAVE_EVERY save interval; faults come from RESILIENT_FAULTS
(resilient.drill: carried out by resilient.steps, or here with TOY_OWN_STEPS=1); TOY_WAIT_FILE: after TOY_WAIT_AFTER steps rank 0 waits (at most 60 s) for this file to exist,
so a test can look at the run while it is alive; TOY_READY_FILE is created then.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import resilient
from resilient.events import EventKind, Ledger
from resilient.drill.worker import maybe_fail


def main() -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_dir = Path(os.environ["RESILIENT_RUN_DIR"])
    steps = int(os.environ.get("TOY_STEPS", "30"))
    save_every = int(os.environ.get("TOY_SAVE_EVERY", "5"))
    wait_file = os.environ.get("TOY_WAIT_FILE")
    wait_after = int(os.environ.get("TOY_WAIT_AFTER", "5"))
    ledger = Ledger.from_env() if rank == 0 else None
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    ckpt = run_dir / "toy_ckpt.pt"
    w = torch.zeros(64)
    start = 0
    if ckpt.exists():
        t = time.perf_counter()
        state = torch.load(ckpt)
        w, start = state["w"], state["step"] + 1
        if ledger:
            ledger.emit(EventKind.CKPT_RESTORE, rank=rank, step=state["step"], tier="local",
                        seconds=time.perf_counter() - t, bytes=ckpt.stat().st_size)
    a = torch.randn(128, 128)
    # resilient.steps writes rank 0's STEP events (the real producer); TOY_OWN_STEPS=1 writes them here
    own_steps = os.environ.get("TOY_OWN_STEPS") == "1"
    loop = range(start, steps) if own_steps else resilient.steps(start, steps)
    for step in loop:
        t = time.perf_counter()
        if own_steps:
            maybe_fail(step)  # under resilient.steps the loop itself does it
        for _ in range(20):
            a = torch.tanh(a @ a.T / 128)
        g = torch.ones(64) * (step + 1)
        dist.all_reduce(g)
        w += g
        if (step + 1) % save_every == 0 and rank == 0:
            ts = time.perf_counter()
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"w": w, "step": step}, tmp)
            os.replace(tmp, ckpt)
            blocking = time.perf_counter() - ts
            assert ledger is not None
            ledger.emit(EventKind.CKPT_SAVE, rank=rank, step=step, blocking_seconds=blocking, mode="sync")
            ledger.emit(EventKind.CKPT_TIER_DONE, rank=rank, step=step, tier="local", seconds=blocking,
                        bytes=ckpt.stat().st_size)
        dist.barrier()
        if ledger and own_steps:
            ledger.emit(EventKind.STEP, rank=rank, step=step, seconds=time.perf_counter() - t)
        if wait_file and step + 1 == wait_after and attempt == 0:
            if rank == 0:
                Path(os.environ["TOY_READY_FILE"]).touch()
                deadline = time.monotonic() + 60
                while not os.path.exists(wait_file) and time.monotonic() < deadline:
                    time.sleep(0.05)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
