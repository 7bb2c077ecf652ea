"""Integration tests run the real trainer under the real ``resilient-run`` (2 ranks, gloo, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from resilient.events.api import EventKind
from resilient.events.ledger import read_events

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("RESILIENT_", "TORCHELASTIC_", "PET_")):
            del env[k]
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               DISABLE_MLFLOW_INTEGRATION="TRUE", WANDB_DISABLED="true")
    env.update(extra or {})
    return env


def resilient_run(tmp: Path, script: Path, script_args: list[str], flags: list[str] = (),
                  env: dict[str, str] | None = None, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    # --node-timeout: on a 2-core machine shared with other jobs the agent of a standalone run was once starved
    # past the default 10 s and taken for a lost node (the run stopped); these tests are about the trainers
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--node-timeout", "60",
           "--run-dir", str(tmp / "run"), "--ckpt-local", str(tmp / "ckpt"), *flags, str(script), *script_args]
    return subprocess.run(cmd, cwd=tmp, env=child_env(env), capture_output=True, text=True, timeout=timeout)


def restores(run_dir: Path) -> list[dict]:
    return [e.details | {"rank": e.rank, "attempt": e.attempt}
            for e in read_events(run_dir) if e.kind == EventKind.CKPT_RESTORE]


def assert_long_eval_was_no_hang(r: subprocess.CompletedProcess[str], run_dir: Path) -> None:
    """The run finished, nothing was declared hung, and its "eval" section lasted long enough (over the 1 s floor
    of the learned step timeout) that it would have been taken for a hang outside a section."""
    evs = list(read_events(run_dir))
    hangs = [e.details for e in evs if e.kind == EventKind.HANG]
    assert not hangs, hangs
    assert r.returncode == 0, r.stderr[-4000:]
    evals = [e.details for e in evs if e.kind == EventKind.SECTION and e.details.get("name") == "eval"]
    assert evals and evals[0]["seconds"] > 1.0, evals


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert wa.keys() == wb.keys()
    diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not diff, f"weights differ from the uninterrupted run: {diff[:5]}"
