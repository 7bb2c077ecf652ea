"""A job whose main backend is NCCL saves, is SIGKILLed after a committed checkpoint, restarts under
``resilient-run`` and restores bit-exact, with the checkpointer's traffic on its own gloo groups (host memory).

CUDA only: the same script and flow run on CPU in ``tests/checkpoint/test_backend_string.py`` (there with
``cpu:gloo`` and with a default group that cannot carry host tensors); here only the device and the backend differ.
NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the 2-rank case needs 2 GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "_backend_job.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (NCCL); the CPU half of this check is "
                                                   "tests/checkpoint/test_backend_string.py")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env | extra


def records(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend,nproc", [
    ("cuda:nccl,cpu:gloo", 1),
    ("nccl", 1),
    pytest.param("cuda:nccl,cpu:gloo", 2, marks=pytest.mark.skipif(
        GPUS < 2, reason="2 ranks need 2 GPUs: NCCL refuses two ranks on one device")),
])
def test_nccl_job_restarts_and_restores_bit_exact(tmp_path: Path, backend: str, nproc: int) -> None:
    """Local and persistent (file://) tiers, a save every 2 steps; the last rank SIGKILLed once step 3 is
    committed; the restart restores step 3 with the digest it was saved with and finishes. With 2 ranks the
    model is in DDP, so NCCL carries the gradients while our groups carry the checkpoint."""
    out, run = tmp_path / "out", tmp_path / "run"
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", "--run-dir", str(run), "--ckpt-local", str(tmp_path / "ckpt"),
           "--ckpt-persistent", f"file://{tmp_path}/bucket", "--ckpt-interval", "2", "--ckpt-persistent-every", "1",
           str(JOB), "--device", "cuda", "--backend", backend, "--steps", "8", "--out", str(out),
           *(["--ddp"] if nproc > 1 else [])]
    env = plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=nproc - 1, step=3, attempt=0))
    r = subprocess.run(cmd, cwd=REPO, env=child_env(env), capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert [e.details["fault"] for e in read_events(run) if e.kind == EventKind.FAULT_INJECTED] \
        == ["kill-after-save"]
    for rank in range(nproc):
        recs = records(out, rank)
        groups = {(g["default"], g["ours"], g["upload"]) for g in recs if g["event"] == "groups"}
        assert groups == {(backend, "gloo", "gloo")}, groups
        saved = {x["digest"] for x in recs if x["event"] == "save" and x["attempt"] == 0 and x["step"] == 3}
        restored = [x for x in recs if x["event"] == "restore"]
        assert [(x["attempt"], x["step"]) for x in restored] == [(1, 3)], recs
        assert len(saved) == 1 and restored[0]["digest"] in saved, (saved, restored)
        assert [(x["attempt"], x["start"]) for x in recs if x["event"] == "done"] == [(1, 4)], recs
