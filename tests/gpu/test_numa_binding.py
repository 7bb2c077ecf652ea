"""``resilient-run --numa-binding``: each worker's threads bound to the CPUs near its GPU, the set torch's own binding
(``torch.numa.binding``, what torchrun applies) computes for that GPU. CUDA only (the CPU half, the flag refused on a
CPU build of torch and carried to each worker as its own GPU, is in tests/launcher/test_args.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NUMA binding follows "
                                                                     "each GPU's node)")

SCRIPT = r'''
import json, os, sys, threading
seen = {}
t = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))  # inherits the binding
t.start()
t.join()
with open(sys.argv[1], "w") as f:
    json.dump({"main": sorted(os.sched_getaffinity(0)), **seen}, f)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["node", "socket"])
def test_each_worker_is_bound_to_the_cpus_torch_binds_its_gpu_to(tmp_path: Path, mode: str) -> None:
    from torch.numa.binding import AffinityMode, NumaOptions, _get_validated_logical_cpus_to_bind_to

    want = sorted(_get_validated_logical_cpus_to_bind_to(gpu_index=0,
                                                         numa_options=NumaOptions(affinity_mode=AffinityMode(mode))))
    script = tmp_path / "aff.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--numa-binding", mode, "--run-dir", str(tmp_path / "run"), str(script),
                        str(tmp_path / "out.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["main"] == want and got["thread"] == want, (got, want)
