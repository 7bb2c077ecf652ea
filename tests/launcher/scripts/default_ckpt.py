"""Uses CheckpointManager.from_env() with no --ckpt-* flag: the launcher's default local tier must take it.
Never calls resilient.steps(), so its ledger has no step records. Writes what it saw to argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist

import resilient

dist.init_process_group("gloo")
ckpt = resilient.CheckpointManager.from_env(interval=1)
state = {"w": torch.arange(4.0)}
for step in range(4):
    state["w"] += 1
    ckpt.save(step, state)
ckpt.wait()
ckpt.close()
with open(os.path.join(sys.argv[1], "seen.json"), "w") as f:
    json.dump({"MASTER_ADDR": os.environ["MASTER_ADDR"], "local": os.environ.get("RESILIENT_CKPT_LOCAL")}, f)
dist.destroy_process_group()
