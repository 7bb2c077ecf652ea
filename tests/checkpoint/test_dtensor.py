"""DTensor state (FSDP2, tensor parallelism, 2-D FSDP2 x TP, HSDP) on every tier: real ranks on real gloo groups.

The job is ``_dtensor_train.py``: small blocks whose LayerNorm weights and Linear biases are tensors of a few
bytes (every real model has such: before the mend, every save of a DTensor state under 1 MiB failed on
``.numpy()``), all parameters and the optimizer's moments DTensors. Checks: a save then a restore into a fresh
model is bit-exact for each layout; a 2-rank dp=1 x tp=2 FSDP2 job under ``resilient-run``, saving every step,
with a rank SIGKILLed at step 40, resumes from step 40 and ends equal to an uninterrupted run; a rank's shard
read from the peer tier and from the compressed persistent tier, a flipped byte in a shard block fetched again
from the next copy; and plain ``dcp.load`` of a saved step in processes that never import ``resilient``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.api import Manifest
from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.drill.spec import FaultHow, WorkerFault, plan_env

from .conftest import GCS, REPO, Workers, _child_env, ok

SCRIPT = Path(__file__).resolve().parent / "_dtensor_train.py"


def dump(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def assert_equal_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"model {k} differs"
    assert a["optim"].keys() == b["optim"].keys()
    for i, st in a["optim"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optim"][i][k]), f"optimizer state {i}.{k} differs"


def tier_failures(run_dir: Path) -> list[dict]:
    return [e.details for e in read_events(run_dir) if e.kind == EventKind.CKPT_TIER_FAILED]


def flip_byte_in_shard(step_dir: Path, rank: int) -> str:
    """Flip one byte inside a tensor's data (not a header) of ``rank``'s file of the step; returns the file."""
    m = Manifest.from_json(__import__("json").loads((step_dir / f"manifest-rank{rank}.json").read_text()))
    name, entry = next((n, e) for n, e in sorted(m.files.items()) if e.items)
    _, data_off, nbytes = max(entry.items, key=lambda it: it[2])  # the largest tensor record of the file
    p = step_dir / name
    raw = bytearray(p.read_bytes())
    raw[data_off + nbytes // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    return name


# ------------------------------------------------------------------ save, restore, bit-exact, each layout
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """``(layout, nproc)`` -> (its directory, its ranks' results) of 3 steps saved every step, then the last step
    restored in the same processes into a fresh model and optimizer (``--check-restore``): one run per layout
    for the module. The dumps in ``out`` are the trained state (taken before the check's restore), and the check
    writes to no tier: a later restore from a copy of ``ckpt`` sees what a plain training run leaves."""
    runs: dict[tuple[str, int], tuple[Path, list]] = {}

    def get(layout: str, nproc: int) -> tuple[Path, list]:
        if (layout, nproc) not in runs:
            base = tmp_path_factory.mktemp(f"trained-{layout}")
            w = Workers()
            try:
                res = ok(w.run(SCRIPT, ["--layout", layout, "--steps", "3", "--interval", "1", "--check-restore",
                                        "--local", str(base / "ckpt"), "--out", str(base / "out")],
                               nproc, timeout=200))
            finally:
                w.close()
            runs[layout, nproc] = (base, res)
        return runs[layout, nproc]

    return get


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,nproc", [("fsdp", 2), ("tp", 2), ("fsdp_tp", 4), ("hsdp", 4)])
def test_save_and_restore_is_bit_exact(trained, layout: str, nproc: int) -> None:
    base, res = trained(layout, nproc)
    assert all("restore bit-exact" in r.output for r in res), res[0].output[-3000:]
    # each rank restored the shards it saved: planned from its own entries where its manifest keeps them (not where
    # they would be most of .metadata: tp's replicated norms on 2 ranks), not the whole .metadata
    step = base / "ckpt" / "step_00000002"
    kept = ["index" in json.loads((step / f"manifest-rank{r}.json").read_text()) for r in range(nproc)]
    assert all(kept) or layout == "tp", kept
    for r, k in zip(res, kept):
        assert ("planned from its rank index" if k else "planned from .metadata") in r.output, r.output[-600:]
    # every rank wrote its own shards (no DTensor taken for a per-rank value, stored twice)
    m = Manifest.from_json(__import__("json").loads(
        (base / "ckpt" / "step_00000002" / "manifest-rank0.json").read_text()))
    assert m.per_rank_keys == ()


@pytest.mark.timeout(240)
def test_restore_onto_another_world_size_reshards(tmp_path: Path, workers: Workers, trained) -> None:
    """FSDP2 state saved by 2 ranks (the fsdp run of test_save_and_restore_is_bit_exact, shared), restored by 1
    from a copy of its local tier (its shards resharded by DCP's planner: no chunk of the checkpoint is the new
    local shard), into a fresh optimizer whose state is then placed like its parameters: equal to what was
    saved."""
    base, _ = trained("fsdp", 2)
    shutil.copytree(base / "ckpt", tmp_path / "ckpt")
    common = ["--layout", "fsdp", "--steps", "3", "--interval", "1", "--local", str(tmp_path / "ckpt")]
    ok(workers.run(SCRIPT, [*common, "--out", str(tmp_path / "b")], 1, timeout=200))
    b = dump(tmp_path / "b")
    assert b["start"] == 3 and b["restore"]["step"] == 2
    # another world size: the rank index (rank 0's of 2) does not hold the new shard; .metadata plans it
    assert "metadata" in b["restore"]["phases"] and "index" not in b["restore"]["phases"], b["restore"]["phases"]
    assert_equal_state(dump(base / "out"), b)


@pytest.mark.timeout(240)
def test_restore_onto_another_layout_at_the_same_world_size_plans_from_metadata(tmp_path: Path, workers: Workers,
                                                                               trained) -> None:
    """State saved by 2 ranks as FSDP2, restored by 2 ranks as TP (same world size, other shards): each rank's index
    (kept: FSDP2's shards are most of its share) holds chunks that are not its new shards, so it does not fit and the
    whole .metadata plans the reshard; the state equals what was saved."""
    base, _ = trained("fsdp", 2)
    step = base / "ckpt" / "step_00000002"
    assert all("index" in json.loads((step / f"manifest-rank{r}.json").read_text()) for r in (0, 1))
    shutil.copytree(base / "ckpt", tmp_path / "ckpt")
    common = ["--layout", "tp", "--steps", "3", "--interval", "1", "--local", str(tmp_path / "ckpt")]
    ok(workers.run(SCRIPT, [*common, "--out", str(tmp_path / "b")], 2, timeout=200))
    for rank in (0, 1):
        b = dump(tmp_path / "b", rank)
        assert b["start"] == 3 and b["restore"]["step"] == 2
        assert "metadata" in b["restore"]["phases"] and "index" not in b["restore"]["phases"], b["restore"]["phases"]
        assert_equal_state(dump(base / "out", rank), b)


# ------------------------------------------------------------------ the check, under resilient-run
def resilient_run(run: Path, flags: list[str], args: list[str], env: dict[str, str],
                  timeout: float = 240, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run),
           *flags, str(script), *args]
    return subprocess.run(cmd, cwd=REPO, env=_child_env(env), capture_output=True, text=True, timeout=timeout)


FSDP_TP_ARGS = ["--layout", "fsdp_tp", "--tp", "2", "--steps", "44"]


def _fsdp_tp_run(base: Path, env: dict[str, str], flags: list[str], args: tuple[str, ...] = ()) -> Path:
    r = resilient_run(base / "run", ["--max-restarts", "2", "--ckpt-local", str(base / "ckpt"), *flags],
                      [*FSDP_TP_ARGS, "--out", str(base / "out"), *args], env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return base


@pytest.fixture(scope="module")
def fsdp_tp_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted dp=1 x tp=2 job both kill tests compare with (its saves do not change its arithmetic)."""
    return _fsdp_tp_run(tmp_path_factory.mktemp("fsdp-tp-ref"), {}, ["--ckpt-interval", "5"])


@pytest.mark.timeout(420)
def test_fsdp_tp_job_killed_at_step_40_resumes_from_40_bit_exact(tmp_path: Path, fsdp_tp_ref: Path) -> None:
    """dp=1 x tp=2 FSDP2 with biases, a save every step (local and persistent tiers), rank 1 SIGKILLed once
    step 39 is saved (at step 40): every save succeeds, the restart resumes from step 40, and the final
    weights equal an uninterrupted run's bit for bit."""
    ref = fsdp_tp_ref
    hit = _fsdp_tp_run(tmp_path / "kill", plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=1, step=39, attempt=0)),
                       ["--ckpt-persistent", f"file://{tmp_path}/kill/bucket", "--ckpt-interval", "1",
                        "--ckpt-persistent-every", "10"])
    assert [e.details["fault"] for e in read_events(hit / "run") if e.kind == EventKind.FAULT_INJECTED] \
        == ["kill-after-save"]
    for base in (ref, hit):
        assert not tier_failures(base / "run"), tier_failures(base / "run")[:3]
    restores = [e for e in read_events(hit / "run") if e.kind == EventKind.CKPT_RESTORE]
    assert restores and {e.details["step"] for e in restores} == {39}, restores
    assert dump(hit / "out")["start"] == 40 and dump(hit / "out", 1)["start"] == 40
    assert dump(ref / "out")["start"] == 0
    for rank in (0, 1):
        assert_equal_state(dump(ref / "out", rank), dump(hit / "out", rank))


@pytest.mark.timeout(420)
def test_fsdp_tp_job_killed_between_saves_resumes_from_its_snapshot_bit_exact(tmp_path: Path,
                                                                            fsdp_tp_ref: Path) -> None:
    """The snapshot tier with DTensor state (every parameter and moment a DTensor on a 2-D mesh): disk saves every
    5 steps (after step 34 the newest), a snapshot every step, rank 1 SIGKILLed right after step 37. Both ranks
    restore from their snapshots in node memory (the same step, newer than the disk's), placements and mesh checked,
    and the final weights equal an uninterrupted run's bit for bit. Rank 1 settles before step 37 (step 34's disk
    save committed): on a loaded machine that background save can outlast three short steps, and a kill inside
    it fails it for real on rank 0 (recorded, but not the between-saves fault this test is about)."""
    hit = _fsdp_tp_run(tmp_path, plan_env(WorkerFault(FaultHow.KILL, rank=1, step=37, attempt=0)),
                       ["--ckpt-interval", "5", "--ckpt-snapshot", "1"], ("--settle-before", "37"))
    assert not tier_failures(hit / "run"), tier_failures(hit / "run")[:3]
    restores = [e for e in read_events(hit / "run") if e.kind == EventKind.CKPT_RESTORE]
    assert [e.details["tier"] for e in restores] == ["snapshot", "snapshot"], [e.details for e in restores]
    steps = {e.details["step"] for e in restores}
    # newer than step 34 on disk; the newest one or two may not have been committed when the kill came (under load)
    assert len(steps) == 1 and steps <= {35, 36, 37}, steps
    assert dump(hit / "out")["start"] == dump(hit / "out", 1)["start"] == steps.pop() + 1
    for rank in (0, 1):
        assert_equal_state(dump(fsdp_tp_ref / "out", rank), dump(hit / "out", rank))


@pytest.mark.timeout(300)
def test_recipe_with_fsdp_and_tp_saves_and_resumes(tmp_path: Path) -> None:
    """The shipped recipe as the issue ran it (``--fsdp``; here with ``--tp 2`` too: every parameter a DTensor,
    the MLPs' 2-D): the saves succeed and a second run resumes from the last one."""
    recipe = REPO / "recipes" / "pytorch" / "train.py"
    flags = ["--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-interval", "5"]
    r = resilient_run(tmp_path / "run", flags, ["--fsdp", "--tp", "2", "--steps", "12"], {}, script=recipe)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "FSDP2 x TP (dp 1, tp 2)" in r.stdout + r.stderr
    assert not tier_failures(tmp_path / "run"), tier_failures(tmp_path / "run")[:3]
    assert (tmp_path / "ckpt" / "step_00000009" / "COMMITTED").exists()
    r = resilient_run(tmp_path / "run", flags, ["--fsdp", "--tp", "2", "--steps", "14"], {}, script=recipe)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "starting at step 10" in r.stdout + r.stderr, r.stdout[-3000:]
    assert not tier_failures(tmp_path / "run"), tier_failures(tmp_path / "run")[:3]


# ------------------------------------------------------------------ peer and persistent tiers
def train_then_restore(workers: Workers, tmp_path: Path, flags: list[str], damage: "callable",
                       env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Two nodes of one rank each (so the peer ring runs): train 4 steps saving every step, damage the tiers,
    then restore in fresh processes. Returns (trained, restored) rank 0 and 1 dumps."""
    common = ["--layout", "fsdp", "--steps", "4", "--interval", "1", *flags]
    run = tmp_path / "run"
    run.mkdir()
    env = {"RESILIENT_RUN_DIR": str(run), **(env or {})}
    ok(workers.run(SCRIPT, [*common, "--out", str(tmp_path / "a")], 2, env=env, local_world_size=1, timeout=200))
    damage()
    ok(workers.run(SCRIPT, [*common, "--out", str(tmp_path / "b")], 2, env=env, local_world_size=1, timeout=200))
    for rank in (0, 1):
        assert dump(tmp_path / "b", rank)["start"] == 4
        assert_equal_state(dump(tmp_path / "a", rank), dump(tmp_path / "b", rank))
    return dump(tmp_path / "b", 0), dump(tmp_path / "b", 1)


@pytest.mark.timeout(300)
def test_shard_from_the_peer_tier_and_a_bad_block_fetched_again(tmp_path: Path, workers: Workers) -> None:
    local = tmp_path / "ckpt" / "node{node}"
    step = "step_00000003"
    flipped: list[str] = []

    def damage() -> None:
        node0, node1 = tmp_path / "ckpt" / "node0", tmp_path / "ckpt" / "node1"
        assert (node0 / "peer" / step / "__1_0.distcp").exists(), "node 1's shards were not replicated to node 0"
        shutil.rmtree(node1 / step)  # rank 1's local copy gone: its shard comes from node 0's peer copy
        flipped.append(flip_byte_in_shard(node0 / step, 0))  # rank 0's own copy has a bad block

    r0, r1 = train_then_restore(workers, tmp_path, ["--local", str(local)], damage)
    assert r1["restore"]["sources"]["__1_0.distcp"] == "peer"
    # node 1 holds no copy of rank 1's manifest (as a hot-swapped node): rank 0, whose node holds it in peer/,
    # hands rank 1 its index, so neither rank parses the whole .metadata
    for r in (r0, r1):
        assert "index" in r["restore"]["phases"] and "metadata" not in r["restore"]["phases"], r["restore"]["phases"]
    fails = tier_failures(tmp_path / "run")
    assert any(f"{flipped[0]} block" in f.get("error", "") and f["tier"] == "local" for f in fails), fails


@pytest.mark.timeout(300)
def test_shard_from_the_compressed_persistent_tier(tmp_path: Path, workers: Workers, gcs: GCS) -> None:
    """Uploads compressed (bgzstd), coded and sent by each rank's upload process: its files are not blocks of the
    local copies, so a step whose bytes must come from there in part (rank 1's copies only there; a bad block of
    rank 0's local copy, no peer copy) is read from the persistent tier's own copy, whole and consistent. One
    training for both damages: each is done to a fresh copy of the trained local tiers and ledger (a restore writes
    to no tier, the bucket included)."""
    gcs.make_bucket("dt")
    step = "step_00000003"
    common = ["--layout", "fsdp", "--steps", "4", "--interval", "1", "--persistent", "gs://dt/run",
              "--persistent-every", "1"]
    # the shards are coded and sent by each rank's upload process (whatever the machine's cores)
    env = {"RESILIENT_CKPT_COMPRESS": "bgzstd", "RESILIENT_CKPT_UPLOAD_PROCESS": "on", **gcs.env()}
    trained = tmp_path / "trained"
    ok(workers.run(SCRIPT, [*common, "--local", str(trained / "ckpt" / "node{node}"), "--out", str(tmp_path / "a")],
                   2, env={"RESILIENT_RUN_DIR": str(trained / "run"), **env}, local_world_size=1, timeout=200))
    events = list(read_events(trained / "run"))
    compressed = [e for e in events if e.kind == EventKind.CKPT_COMPRESS and e.details.get("step") == 3]
    assert compressed and compressed[0].details["codec"] == "bgzstd", compressed
    for rank in (0, 1):
        up = dump(tmp_path / "a", rank)["upload_process"]
        assert up is not None and up["pid"] is not None and up["deaths"] == 0, (rank, up)
    assert not [e.details for e in events if e.kind == EventKind.CKPT_UPLOAD_PROCESS]
    for damage_of in ("rank 1 only there", "bad block of rank 0"):
        case = tmp_path / damage_of.replace(" ", "-")
        shutil.copytree(trained, case)
        for node in (0, 1):
            shutil.rmtree(case / "ckpt" / f"node{node}" / "peer")
        flipped = None
        if damage_of == "rank 1 only there":
            shutil.rmtree(case / "ckpt" / "node1" / step)
        else:
            flipped = flip_byte_in_shard(case / "ckpt" / "node0" / step, 0)
        out = case / "b"
        ok(workers.run(SCRIPT, [*common, "--local", str(case / "ckpt" / "node{node}"), "--out", str(out)], 2,
                       env={"RESILIENT_RUN_DIR": str(case / "run"), **env}, local_world_size=1, timeout=200))
        for rank in (0, 1):
            assert dump(out, rank)["start"] == 4, damage_of
            assert_equal_state(dump(tmp_path / "a", rank), dump(out, rank))
        r0, r1 = dump(out, 0), dump(out, 1)
        assert r1["restore"]["sources"]["__1_0.distcp"] == "persistent", damage_of
        assert r0["restore"]["sources"]["__0_0.distcp"] == "persistent", damage_of
        if flipped:
            fails = tier_failures(case / "run")
            assert any(f"{flipped} block" in f.get("error", "") and f["tier"] == "local" for f in fails), fails


# ------------------------------------------------------------------ plain dcp.load, without resilient
@pytest.mark.timeout(240)
def test_plain_dcp_load_of_a_saved_step_without_resilient(tmp_path: Path, workers: Workers) -> None:
    ok(workers.run(SCRIPT, ["--layout", "fsdp_tp", "--steps", "3", "--interval", "1", "--local",
                            str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")], 2, timeout=200))
    res = ok(workers.run(SCRIPT, ["--layout", "fsdp_tp", "--dcp-load", str(tmp_path / "ckpt" / "step_00000002"),
                                  "--out", str(tmp_path / "b")], 2, timeout=200, fresh=True))
    assert all("resilient imported: False" in r.output for r in res), res[0].output[-2000:]
    trained, loaded = dump(tmp_path / "a"), torch.load(tmp_path / "b" / "loaded.pt", weights_only=False)
    assert loaded["model"].keys() == trained["model"].keys()
    for k, v in trained["model"].items():
        assert torch.equal(v, loaded["model"][k]), k
