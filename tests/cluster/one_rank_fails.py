"""Every rank prints its rank and meets the others; then the last rank raises, naming itself, and the others end
cleanly (no collective left for them to fail in)."""
import os

import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world} on pid {os.getpid()}", flush=True)
dist.barrier()
if rank == world - 1:
    raise ValueError(f"rank {rank} fails on purpose")
