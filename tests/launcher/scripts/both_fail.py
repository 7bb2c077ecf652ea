"""Both ranks fail at once: rank 0 signals rank 1 and then itself, back to back (two different signals,
neither the SIGKILL the agent uses on survivors)."""
import os
import signal

import torch.distributed as dist

dist.init_process_group("gloo")
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
if dist.get_rank() == 0:
    os.kill(pids[1], signal.SIGUSR1)
    os.kill(pids[0], signal.SIGUSR2)
signal.pause()  # rank 1 waits for its signal
