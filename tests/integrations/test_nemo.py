"""NeMo / NeMo-Run under the real ``resilient-run``: the torchrun shim (with and without ``resilient-run`` on
PATH), the Slurm template, and NeMo-Run itself running a 2-rank job whose killed rank is restarted."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.integrations import nemo as rnemo

from tests.recipes.test_nemo_shim import python_without_torch

from .conftest import HERE, REPO, child_env

SHIM = REPO / "recipes" / "nemo" / "torchrun"
WORKER = HERE / "nemo_worker.py"
# the argv NeMo-Run's torchrun launcher gives (with Megatron-Bridge's underscore spelling)
NEMO_ARGV = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "7", "--nnodes", "1",
             "--nproc_per_node", "2", "--node-rank", "0", "--tee", "3"]


def _restarted(out: Path, run_dir: Path) -> None:
    got = sorted(p.name for p in out.iterdir())
    assert got == ["a0_r0_w2", "a0_r1_w2", "a1_r0_w2", "a1_r1_w2"], got  # both ranks ran again, together
    assert any(e.kind == EventKind.RUN_START for e in read_events(run_dir))


@pytest.mark.timeout(120)
def test_recipe_shim_finds_resilient_run_without_it_on_path(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = child_env({"PATH": "/usr/bin:/bin", "RESILIENT_PYTHON": sys.executable,
                     "RESILIENT_RUN_ARGS": f"--run-dir {tmp_path / 'run'} --max-restarts 2"})
    r = subprocess.run([str(SHIM), *NEMO_ARGV, str(WORKER), str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    _restarted(out, tmp_path / "run")


def test_recipe_shim_says_what_to_do_when_nothing_is_found(tmp_path: Path) -> None:
    shim = tmp_path / "torchrun"  # away from the source tree, with an empty PATH: nothing to find
    shutil.copy(SHIM, shim)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": str(empty), "HOME": str(tmp_path)}
    # the shim tries the Python that started it: here one that cannot run the launcher (no torch)
    bare = python_without_torch()
    if bare is None:
        pytest.skip("every interpreter here imports torch: no parent Python that cannot run the launcher")
    parent = [bare, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:], timeout=25))"]
    r = subprocess.run([*parent, shutil.which("sh") or "/bin/sh", str(shim), "--nproc-per-node", "2", "x.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 127
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "resilient-run not found" in lines[0] and "RESILIENT_RUN=" in lines[0], r.stderr


def test_written_shim_runs_this_installation(tmp_path: Path) -> None:
    env = rnemo.shim_env("--max-restarts 1", shim_dir=tmp_path / "bin", path="/usr/bin:/bin")
    assert env["PATH"].split(os.pathsep)[0] == str(tmp_path / "bin")
    r = subprocess.run(["torchrun", "--help"], env=child_env(env), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--ckpt-local" in r.stdout  # resilient-run's help, not torchrun's


def test_slurm_template_renders_resilient_run_around_the_command(tmp_path: Path) -> None:
    cmd = "python -m nemo_run.core.runners.fdl_runner -n job cfg.yaml"
    text = rnemo.render_slurm(cmd, nproc_per_node=8, resilient_args="--max-restarts 3 --ckpt-local /mnt/ssd/c")
    srun = " ".join(text.replace("\\\n", " ").split())
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=0 resilient-run --nnodes $SLURM_JOB_NUM_NODES " \
           "--nproc-per-node 8" in srun
    assert srun.endswith(f"--max-restarts 3 --ckpt-local /mnt/ssd/c --no-python {cmd}")
    script = tmp_path / "job.sh"
    script.write_text(text)
    bash = shutil.which("bash")
    if bash:
        assert subprocess.run([bash, "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    with pytest.raises(rnemo.NemoIntegrationError, match="nproc_per_node"):
        rnemo.render_slurm(cmd, nproc_per_node=0)
    with pytest.raises(rnemo.NemoIntegrationError, match="ntasks_per_node"):
        rnemo.local_executor(ntasks_per_node=0)


def test_llm_recipe_without_nemo_says_so(tmp_path: Path) -> None:
    try:
        import nemo.collections.llm  # noqa: F401
        pytest.skip("NeMo's LLM collection is installed here")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, str(REPO / "recipes" / "nemo" / "llm_pretrain.py"), "--dry-run"],
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "nemo.collections.llm" in r.stderr, r.stderr


# NeMo-Run lives in a directory of its own (see the Makefile): its dependencies conflict with the Hugging Face hub's
NEMO_RUN_DIR = REPO / ".venv" / "nemo-run"


def _nemo_run_path() -> str:
    """What to put on PYTHONPATH so that a job process imports NeMo-Run; skips where it is not installed."""
    try:
        import nemo_run  # noqa: F401

        return ""
    except ImportError:
        pass
    if (NEMO_RUN_DIR / "nemo_run").is_dir():
        return str(NEMO_RUN_DIR)
    pytest.skip("NeMo-Run is not installed (make venv puts it in .venv/nemo-run)")


@pytest.mark.timeout(240)
def test_nemo_run_local_and_inline_forms_restart_a_killed_rank(tmp_path: Path) -> None:
    extra = _nemo_run_path()

    def job(form: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        d = tmp_path / form
        (d / "out").mkdir(parents=True)
        env = child_env({"NEMORUN_HOME": str(d / "home")})
        if extra:  # first: the job process imports NeMo-Run's pins, the launched workers do not need them
            env["PYTHONPATH"] = extra + os.pathsep + env["PYTHONPATH"]
        r = subprocess.run([sys.executable, str(HERE / "nemo_job.py"), form, str(d / "out"), str(d / "run")],
                           cwd=d, env=env, capture_output=True, text=True, timeout=200)
        return form, r

    with cf.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(job, ["local", "inline"]))
    for form, r in results:
        assert r.returncode == 0 and "[nemo] finished" in r.stdout, (form, r.stdout[-3000:], r.stderr[-3000:])
        assert "SUCCEEDED" in r.stdout, (form, r.stdout[-3000:])
        assert "[nemo] slurm template matches" in r.stdout, (form, r.stdout[-3000:])
        _restarted(tmp_path / form / "out", tmp_path / form / "run")
