"""The NeMo-Run ``torchrun`` shim picks an interpreter that can run the launcher.

The scenario users hit: NeMo-Run started by its interpreter's full path (no activated environment), the shim
first on PATH, a plain ``LocalExecutor(launcher="torchrun")`` (not our helper, so no RESILIENT_PYTHON), and
a ``python3`` first on PATH that cannot import torch. NeMo-Run itself is not needed to reproduce it: what the
shim sees is a Python parent process that runs ``torchrun ...`` from PATH, and that is what this test starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = REPO / "recipes" / "nemo"

JOB = '''
import os, sys
import torch
import resilient

for step in resilient.steps(0, 3):
    torch.ones(2).sum()
with open(os.path.join(sys.argv[1], "ran"), "w") as f:
    f.write(os.environ.get("RESILIENT_RUN_DIR", ""))
'''

# the experiment process: like NeMo-Run's local scheduler, it starts `torchrun` from PATH as its child
PARENT = "import subprocess, sys; sys.exit(subprocess.call(['torchrun', *sys.argv[1:]], timeout=150))"


def python_without_torch() -> str | None:
    """An interpreter of this machine, outside the test's virtual environment, that cannot import torch."""
    for c in (getattr(sys, "_base_executable", None), "/usr/bin/python3"):
        if c and os.path.isfile(c):
            r = subprocess.run([c, "-c", "import torch"], capture_output=True, timeout=60)
            if r.returncode != 0:
                return c
    return None


@pytest.mark.timeout(180)
def test_shim_runs_the_launcher_with_the_interpreter_that_started_it(tmp_path: Path) -> None:
    bare = python_without_torch()
    if bare is None:
        pytest.skip("every interpreter here imports torch: no Python without torch to put first on PATH")
    if not os.path.isabs(sys.executable):
        pytest.skip("the test's interpreter has no full path to start the parent process by")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(bare)  # the first python3 on PATH: no torch
    path = os.pathsep.join([str(SHIM_DIR), str(bin_dir), "/usr/bin", "/bin"])
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME")
           and not k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_"))}
    run_dir = tmp_path / "run"
    env.update(PATH=path, OMP_NUM_THREADS="1",
               RESILIENT_RUN_ARGS=f"--run-dir {run_dir} --node-timeout 60")
    # the preconditions that make this the failing case
    assert subprocess.run(["python3", "-c", "import torch"], env=env, capture_output=True, timeout=60).returncode != 0
    assert subprocess.run(["sh", "-c", "command -v resilient-run"], env=env, capture_output=True,
                          timeout=30).returncode != 0
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "out"
    out.mkdir()
    # started by its full path, as `/path/to/venv/bin/python experiment.py` is
    r = subprocess.run([sys.executable, "-c", PARENT, "--standalone", "--nproc-per-node", "1", str(job), str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert (out / "ran").read_text() == str(run_dir)  # the worker ran under resilient-run
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    assert kinds[0] == "run_start" and "run_end" in kinds
