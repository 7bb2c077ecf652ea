"""The checkpointer's traffic stays on gloo groups of its own whatever the job's default group is: the CPU half of
the NCCL job check (``tests/gpu/test_nccl_job.py`` runs the same script, ``tests/gpu/_backend_job.py``, on a GPU
with ``cuda:nccl,cpu:gloo``).

Two default groups stand for a GPU job's here: ``cpu:gloo`` (a backend string, as ``cuda:nccl,cpu:gloo`` is) and
``cuda:gloo``, a default group with no backend for host tensors, as a plain ``init_process_group("nccl")`` has
none: a collective of ours on it would fail ("No backend type associated with device type cpu"), so a job that
saves, replicates to its peer, uploads, restores and restarts on it shows that none of ours went there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from resilient.checkpoint.storage.collective import Ranks
from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import REPO, Workers, _child_env, ok

JOB = REPO / "tests" / "gpu" / "_backend_job.py"


def records(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


def saved_digest(recs: list[dict], step: int) -> str:
    got = {r["digest"] for r in recs if r["event"] == "save" and r["step"] == step}
    assert len(got) == 1, f"step {step} saved with digests {got}"
    return got.pop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["cpu:gloo", "cuda:gloo"])
def test_job_killed_after_a_save_restarts_and_restores_bit_exact(tmp_path: Path, backend: str) -> None:
    """Under ``resilient-run`` (2 ranks, local and persistent tiers), rank 1 SIGKILLed once step 3 is committed:
    the restart restores step 3 on both ranks with the digest it was saved with, and the job finishes."""
    out, run = tmp_path / "out", tmp_path / "run"
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--run-dir", str(run), "--ckpt-local", str(tmp_path / "ckpt"),
           "--ckpt-persistent", f"file://{tmp_path}/bucket", "--ckpt-interval", "2", "--ckpt-persistent-every", "1",
           str(JOB), "--device", "cpu", "--backend", backend, "--steps", "8", "--out", str(out)]
    env = plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=1, step=3, attempt=0))
    r = subprocess.run(cmd, cwd=REPO, env=_child_env(env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert [e.details["fault"] for e in read_events(run) if e.kind == EventKind.FAULT_INJECTED] \
        == ["kill-after-save"]
    for rank in (0, 1):
        recs = records(out, rank)
        groups = [x for x in recs if x["event"] == "groups"]
        assert {(g["default"], g["ours"], g["upload"]) for g in groups} == {(backend, "gloo", "gloo")}, groups
        restored = [x for x in recs if x["event"] == "restore"]
        assert [(x["attempt"], x["step"]) for x in restored] == [(1, 3)], recs
        assert restored[0]["digest"] == saved_digest([x for x in recs if x["attempt"] == 0], 3)
        assert [(x["attempt"], x["start"]) for x in recs if x["event"] == "done"] == [(1, 4)], recs


@pytest.mark.timeout(150)
def test_peer_copy_travels_on_our_group_when_the_default_cannot_carry_host_tensors(
        tmp_path: Path, workers: Workers) -> None:
    """Two "nodes" (LOCAL_WORLD_SIZE=1) on a ``cuda:gloo`` default group: each node's files replicate to its
    partner; with node 1's disk gone, rank 1 restores its files from node 0's peer copy, sent to it over the
    network, bit-exact."""
    common = ["--device", "cpu", "--backend", "cuda:gloo", "--local", str(tmp_path / "node{node}"),
              "--interval", "1", "--out", str(tmp_path / "out")]
    ok(workers.run(JOB, [*common, "--steps", "3"], 2, local_world_size=1, timeout=120))
    assert (tmp_path / "node0" / "peer" / "step_00000002" / "COMMITTED").exists()
    shutil.rmtree(tmp_path / "node1")
    ok(workers.run(JOB, [*common, "--steps", "4"], 2, local_world_size=1, timeout=120))
    for rank in (0, 1):
        recs = records(tmp_path / "out", rank)
        assert {x["ours"] for x in recs if x["event"] == "groups"} == {"gloo"}
        restored = [x for x in recs if x["event"] == "restore"]
        assert [x["step"] for x in restored] == [2], recs
        assert restored[0]["digest"] == saved_digest(recs, 2)
    assert [x["tier"] for x in records(tmp_path / "out", 1) if x["event"] == "restore"] == ["peer"]


def test_our_collectives_refuse_the_default_group() -> None:
    """The one helper all of the checkpointer's object collectives go through refuses the job's default group
    (``None`` means it to torch) and takes a gloo group of our own."""
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for group in (None, dist.group.WORLD):
            with pytest.raises(ValueError, match="never on the job's default group"):
                Ranks(group, 0, 1, distributed=True)
        ours = dist.new_group(backend="gloo")
        assert dist.get_backend(ours) == "gloo"
        assert Ranks(ours, 0, 1, distributed=True).gather({"step": 3}) == [{"step": 3}]
        assert Ranks(None, 0, 1, distributed=False).gather(1) == [1]  # no process group: one process
    finally:
        dist.destroy_process_group()
