"""recipes/torchtitan: torchtitan's own trainer under the real ``resilient-run`` on GPUs, a worker SIGKILLed
after torchtitan's first checkpoint; the restarted attempt loads it and finishes.

torchtitan 0.3.0 needs CUDA (under torchrun too) and is never a dependency of ours: where it or CUDA is
missing, the GPU test is reported as skipped with the reason. Nothing here imports torchtitan: it runs in
the child processes only (``TORCHTITAN_PYTHON``, default this interpreter)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "torchtitan"
CONFIG_MODULE = "resilient_llama3"
STEPS, INTERVAL = 400, 10  # enough steps after the first checkpoint that the kill lands mid-run


def _registry_functions() -> set[str]:
    tree = ast.parse((RECIPE / f"{CONFIG_MODULE}.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def test_readme_commands_name_configs_the_registry_defines() -> None:
    text = (RECIPE / "README.md").read_text()
    used = set(re.findall(rf"--module {CONFIG_MODULE} --config (\w+)", text))
    assert used, "the README runs no config of this recipe"
    assert used <= _registry_functions(), (used, _registry_functions())
    assert "_cuda_setDevice" in text and "fsspec" in text and "--no-deps" in text


def _gpu_python() -> tuple[str, int]:
    """The Python to run torchtitan with and its GPU count; skips (with the reason) where it cannot run."""
    py = os.environ.get("TORCHTITAN_PYTHON")
    if py is None:
        if importlib.util.find_spec("torchtitan") is None:  # finds the package without importing it
            pytest.skip("torchtitan is not installed (it needs CUDA and is kept out of our dependencies: install "
                        "it in its own venv and set TORCHTITAN_PYTHON to that venv's python)")
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: torchtitan 0.3.0 stops at torch._C._cuda_setDevice without one")
        return sys.executable, torch.cuda.device_count()
    probe = subprocess.run([py, "-c", "import importlib.util, torch; print(importlib.util.find_spec('torchtitan') "
                            "is not None, torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"TORCHTITAN_PYTHON={py} cannot import torch: {probe.stderr.strip()[-300:]}")
    has_titan, gpus = probe.stdout.split()
    if has_titan != "True":
        pytest.skip(f"torchtitan is not installed for TORCHTITAN_PYTHON={py}")
    if int(gpus) == 0:
        pytest.skip("no CUDA device: torchtitan 0.3.0 stops at torch._C._cuda_setDevice without one")
    return py, int(gpus)


def _assets_root() -> Path:
    root = Path(os.environ.get("TORCHTITAN_ROOT", os.getcwd()))
    if not (root / "tests" / "assets" / "tokenizer").is_dir():
        pytest.skip("set TORCHTITAN_ROOT to a torchtitan v0.3.0 checkout: the debug model reads its tokenizer "
                    "and c4_test data from its tests/assets")
    return root


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


@pytest.mark.timeout(900)
def test_torchtitan_small_llama_restarts_from_its_checkpoint_on_gpus(tmp_path: Path) -> None:
    py, gpus = _gpu_python()
    root = _assets_root()
    nproc = min(gpus, 2)
    run_dir, dump = tmp_path / "run", tmp_path / "out"
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_")):
            del env[k]
    env["PYTHONPATH"] = os.pathsep.join([str(RECIPE), str(REPO), env.get("PYTHONPATH", "")])
    cmd = [py, "-m", "resilient.run", "--standalone", f"--nproc_per_node={nproc}", "--local-ranks-filter", "0",
           "--role", "rank", "--tee", "3", "--max-restarts", "2", "--run-dir", str(run_dir),
           "-m", "torchtitan.train", "--module", CONFIG_MODULE, "--config", "llama3_small",
           "--dump_folder", str(dump), "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL)]
    out, err = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=err, text=True)
    try:
        first = dump / "checkpoint" / f"step-{INTERVAL}" / ".metadata"  # DCP's commit marker, written last
        try:
            wait_for(first.exists, 600, f"torchtitan's first checkpoint ({first})", proc)
        except AssertionError as e:  # its output went to files: the failure shows their ends
            out.flush(), err.flush()
            tails = ((tmp_path / "stdout.txt").read_text()[-3000:], (tmp_path / "stderr.txt").read_text()[-6000:])
            raise AssertionError(f"{e}\n--- stdout ---\n{tails[0]}\n--- stderr ---\n{tails[1]}") from None
        starts = [e for e in _events(run_dir) if e["kind"] == "attempt_start" and e["attempt"] == 0]
        assert starts, "no attempt_start in the ledger"
        victim = int(starts[0]["details"]["pids"][str(nproc - 1)])
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        out.close(), err.close()
    log = (tmp_path / "stdout.txt").read_text() + (tmp_path / "stderr.txt").read_text()
    assert rc == 0, log[-6000:]
    events = _events(run_dir)
    assert any(e["kind"] == "worker_exit" and e["details"].get("pid") == victim for e in events), "kill not seen"
    assert any(e["kind"] == "attempt_start" and e["attempt"] == 1 for e in events), "no restarted attempt"
    assert re.search(r"Loading the checkpoint from .*step-\d+", log), "the restarted attempt did not load a checkpoint"
    assert (dump / "checkpoint" / f"step-{STEPS}" / ".metadata").exists(), "the last step was not saved"
