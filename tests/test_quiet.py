"""No warning reaches the user from the environment itself: not from ``import torch`` (every worker and every
bench does it), not from a short job under ``resilient-run``.

Run in the environment's own interpreter with Python's default warning filters (no ``PYTHONWARNINGS``), so a
package whose import warns, such as the deprecated ``pynvml`` package's import hook, is seen as a user sees it.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# how Python prints a warning: "<file>:<line>: FutureWarning: <message>"
WARNING = re.compile(r"\b\w*Warning: ")


def quiet_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")  # this checkout, whatever the venv installed
    return env


@pytest.mark.timeout(120)
def test_import_torch_prints_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import torch"], cwd=tmp_path, env=quiet_env(),
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == "", r.stderr


@pytest.mark.timeout(180)
def test_a_short_job_prints_no_warning(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch\nimport resilient\n\n"
                      "for step in resilient.steps(0, 3):\n    torch.ones(2).sum()\nprint('job done')\n")
    run = Path(sys.executable).with_name("resilient-run")
    assert run.exists(), f"the console script is not installed beside {sys.executable}"
    r = subprocess.run([str(run), "--standalone", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                        str(script)], cwd=tmp_path, env=quiet_env(), capture_output=True, text=True, timeout=150)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("job done") == 2, out  # both workers ran to the end: their output was seen
    assert not WARNING.search(out), out
