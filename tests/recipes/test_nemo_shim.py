"""The NeMo-Run ``torchrun`` shim picks an interpreter that can run the launcher.

The scenario users hit: NeMo-Run started by its interpreter's full path (no activated environment), the shim
first on PATH, a plain ``LocalExecutor(launcher="torchrun")`` (not our helper, so no RESILIENT_PYTHON), and
a ``python3`` first on PATH that cannot import torch. NeMo-Run itself is not needed to reproduce it: what the
shim sees is a Python parent process that runs ``torchrun ...`` from PATH with its own environment (as
torchx's local scheduler does, under NeMo-Run's LocalExecutor), and that is what these tests start.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = REPO / "recipes" / "nemo"
SHIM = SHIM_DIR / "torchrun"

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

# a torch that is installed but cannot be imported, as a CUDA build is on a machine without CUDA's libraries
BROKEN_TORCH = 'raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")\n'


def python_without_torch() -> str | None:
    """An interpreter of this machine, outside the test's virtual environment, that cannot import torch."""
    for c in (getattr(sys, "_base_executable", None), "/usr/bin/python3"):
        if c and os.path.isfile(c):
            r = subprocess.run([c, "-c", "import torch"], capture_output=True, timeout=60)
            if r.returncode != 0:
                return c
    return None


def venv_without_torch(where: Path) -> Path | None:
    """A virtual environment made without site packages (so without torch); its python, or None."""
    base = python_without_torch() or getattr(sys, "_base_executable", None) or sys.executable
    r = subprocess.run([base, "-m", "venv", "--without-pip", str(where)], capture_output=True, timeout=120)
    py = where / "bin" / "python"
    if r.returncode != 0 or not py.exists():
        return None
    if subprocess.run([str(py), "-c", "import torch"], capture_output=True, timeout=60).returncode == 0:
        return None
    return py


def clean_env(path: str, **extra: str) -> dict[str, str]:
    """This environment with no activated virtual environment and nothing of resilient-run's in it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME")
           and not k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_"))}
    env.update(PATH=path, OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.timeout(240)
def test_shim_runs_the_launcher_with_the_interpreter_that_started_it(tmp_path: Path) -> None:
    if not os.path.isabs(sys.executable):
        pytest.skip("the test's interpreter has no full path to start the parent process by")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bare = python_without_torch()
    if bare is not None:
        (bin_dir / "python3").symlink_to(bare)  # the first python3 on PATH: no torch
    else:
        venv_py = venv_without_torch(tmp_path / "bare-venv")
        if venv_py is None:
            pytest.skip("no Python without torch here: every interpreter imports it and no venv can be made")
        (bin_dir / "python3").symlink_to(venv_py)
    run_dir = tmp_path / "run"
    env = clean_env(os.pathsep.join([str(SHIM_DIR), str(bin_dir), "/usr/bin", "/bin"]),
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
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert (out / "ran").read_text() == str(run_dir)  # the worker ran under resilient-run
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    assert kinds[0] == "run_start" and "run_end" in kinds


@pytest.mark.timeout(240)
def test_shim_refuses_a_parent_whose_torch_does_not_import_and_uses_its_own_venv(tmp_path: Path) -> None:
    own = REPO / ".venv" / "bin" / "python"
    if not own.exists():
        pytest.skip("this checkout has no .venv (make venv) for the shim to fall back on")
    venv_py = venv_without_torch(tmp_path / "venv")
    if venv_py is None:
        pytest.skip("no virtual environment without site packages can be made here")
    # the parent's environment has a torch that is found but fails to import, and resilient (via the source
    # checkout the shim puts on PYTHONPATH): finding torch is not enough, importing it is the test
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(BROKEN_TORCH)
    env = clean_env(os.pathsep.join([str(SHIM_DIR), "/usr/bin", "/bin"]))
    r = subprocess.run([str(venv_py), "-c", PARENT, "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "--ckpt-local" in r.stdout  # resilient-run's help: the launcher ran, with the checkout's own venv


@pytest.mark.timeout(120)
def test_shim_names_every_interpreter_it_tried_in_one_line(tmp_path: Path) -> None:
    venv_py = venv_without_torch(tmp_path / "venv")
    if venv_py is None:
        pytest.skip("no virtual environment without site packages can be made here")
    shim = tmp_path / "bin" / "torchrun"  # away from the source tree: no checkout, no venv of its own
    shim.parent.mkdir()
    shutil.copy(SHIM, shim)
    env = {"PATH": os.pathsep.join([str(shim.parent), "/usr/bin", "/bin"]), "HOME": str(tmp_path)}
    sh = shutil.which("sh") or "/bin/sh"
    r = subprocess.run([str(venv_py), "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))",
                        sh, str(shim), "--nproc-per-node", "2", "x.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 127, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"{venv_py} (torch: ModuleNotFoundError)" in lines[0], lines[0]
    assert "RESILIENT_RUN=" in lines[0]
