"""Rank 1 SIGKILLs itself after init_process_group on the first attempt; the job must still finish."""
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(out, f"a{attempt}_r{rank}.json"), "w") as f:
    json.dump({"sum": t.item(), "t": time.time()}, f)
if rank == 1 and attempt == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
