"""A 2-rank gloo job: rank 1 SIGKILLs itself in the first attempt; every attempt leaves a file per rank."""

import os
import signal
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(out, f"a{attempt}_r{rank}_w{int(t.item())}"), "w") as f:
    f.write(os.environ.get("RESILIENT_RUN_DIR", ""))
if rank == 1 and attempt == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
