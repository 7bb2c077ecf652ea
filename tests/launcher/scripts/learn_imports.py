"""Automatic preload learned from the workers: attempt 0 imports two installed modules (``calm``, and ``thready``
which starts a thread at import) by name, out of a static read's sight; rank 1 dies once the agent says its warmed
fork server is ready. Attempt 1 records which of them it found already imported when it started (inherited from
the fork server)."""
import json
import os
import signal
import sys
import time

found = {m: m in sys.modules for m in ("calm", "thready")}

import torch.distributed as dist  # noqa: E402

# by name at run time: what a static read of this script cannot see, so only the workers' reports teach the agent
# (``__import__``: the import statement's own path, which raises the audit event the reports come from)
for name in ("calm", "thready"):
    __import__(name)

out = sys.argv[1]
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(out, f"a{attempt}_r{rank}.json"), "w") as f:
    json.dump(found, f)
if attempt == 0 and rank == 1:
    log = os.path.join(os.environ["RESILIENT_RUN_DIR"], "logs", "agent.jsonl")
    deadline = time.monotonic() + 120  # the agent's log says when its warmed copy of the fork server is ready
    while time.monotonic() < deadline:
        if os.path.exists(log) and "automatic preload: fork server ready" in open(log).read():
            break
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
