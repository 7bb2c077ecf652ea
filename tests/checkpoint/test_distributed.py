"""Several ranks on real gloo groups, killed with SIGKILL and resumed: bit-exact with an uninterrupted run.

The training script is examples/ckpt_train.py: DDP on gloo (collectives on the user's default group
run while the manager saves in the background on its own groups), a per-rank RNG and data position.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from resilient.drill.spec import FaultHow, WorkerFault, plan_env

from .conftest import TRAIN, Workers, ok

STEPS = 16
ARGS = ["--steps", str(STEPS), "--interval", "4"]


def final(out: Path, nproc: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def assert_bit_exact(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b):
        for k in ra["model"]:
            assert torch.equal(ra["model"][k], rb["model"][k]), k
        for i, st in ra["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, rb["optim"]["state"][i][k]), (i, k)
        assert torch.equal(ra["rng"], rb["rng"]), "per-rank RNG state did not come back per rank"
        assert ra["pos"] == rb["pos"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The uninterrupted 2-rank run: its directory (its local tier in ``ckpt``) and its ranks' final states."""
    base = tmp_path_factory.mktemp("ref")
    w = Workers()
    try:
        ok(w.run(TRAIN, [*ARGS, "--local", str(base / "ckpt"), "--out", str(base / "out")], 2))
    finally:
        w.close()
    res = final(base / "out", 2)
    assert torch.equal(res[0]["model"]["0.weight"], res[1]["model"]["0.weight"])  # all-reduce kept replicas equal
    assert not torch.equal(res[0]["model"]["1.running_mean"], res[1]["model"]["1.running_mean"])  # per-rank BN
    assert not torch.equal(res[0]["rng"], res[1]["rng"])  # per-rank state really differs
    return base, res


@pytest.fixture(scope="module")
def reference(reference_run: tuple[Path, list[dict]]) -> list[dict]:
    return reference_run[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,at,expect_steps", [(FaultHow.KILL_AFTER_SAVE, 7, {7}),
                                                  (FaultHow.KILL_MID_WRITE, 11, {3, 7})])
def test_sigkill_and_resume_is_bit_exact(tmp_path: Path, workers: Workers, reference: list[dict],
                                         how: FaultHow, at: int, expect_steps: set[int]) -> None:
    """Killed between saves (step 7 complete) or in the middle of writing step 11 (step 7 may still be
    committing then: either 7 or 3 is the newest complete step)."""
    args = [*ARGS, "--local", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    first = workers.run(TRAIN, args, 2, env=plan_env(WorkerFault(how, rank=0, step=at)))
    assert first[0].returncode == -9, first[0].output[-3000:]  # the planned SIGKILL, nothing else
    ok(workers.run(TRAIN, args, 2))
    res = final(tmp_path / "out", 2)
    for r in res:
        assert r["restore"]["step"] in expect_steps and r["start"] == r["restore"]["step"] + 1
        assert r["restore"]["tier"] == "local"
    assert_bit_exact(reference, res)


@pytest.mark.timeout(120)
def test_peer_tier_restores_a_node_that_lost_its_disk(tmp_path: Path, workers: Workers, reference: list[dict]
                                                     ) -> None:
    """Two "nodes" (LOCAL_WORLD_SIZE=1, one local dir each); node 1's disk is wiped after a kill: its files
    come back from node 0's replica over the manager's gloo group."""
    args = [*ARGS, "--local", str(tmp_path / "node{node}"), "--out", str(tmp_path / "out")]
    workers.run(TRAIN, args, 2, local_world_size=1,
                env=plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=0, step=7)))
    assert (tmp_path / "node0" / "peer" / "step_00000007" / "__1_0.distcp").exists()  # node 1's files on node 0
    assert (tmp_path / "node1" / "peer" / "step_00000007" / "COMMITTED").exists()
    shutil.rmtree(tmp_path / "node1")
    ok(workers.run(TRAIN, args, 2, local_world_size=1))
    res = final(tmp_path / "out", 2)
    assert res[1]["restore"]["step"] == 7 and res[1]["restore"]["tier"] == "peer"
    assert set(res[1]["restore"]["sources"].values()) == {"peer"}
    assert res[0]["restore"]["sources"]["__0_0.distcp"] == "local"
    assert_bit_exact(reference, res)


@pytest.mark.timeout(150)
def test_three_nodes_one_wiped_bit_exact(tmp_path: Path, workers: Workers) -> None:
    """Any group size: 3 ranks as 3 nodes, rank 2 killed, node 1 wiped; equal to an uninterrupted run."""
    ref = tmp_path / "ref"
    ok(workers.run(TRAIN, [*ARGS, "--local", str(ref / "ckpt"), "--out", str(ref / "out")], 3))
    args = [*ARGS, "--local", str(tmp_path / "node{node}"), "--out", str(tmp_path / "out")]
    workers.run(TRAIN, args, 3, local_world_size=1,
                env=plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=2, step=7)))
    shutil.rmtree(tmp_path / "node1")
    ok(workers.run(TRAIN, args, 3, local_world_size=1))
    res = final(tmp_path / "out", 3)
    assert [r["restore"]["step"] for r in res] == [7, 7, 7]
    assert_bit_exact(final(ref / "out", 3), res)


@pytest.mark.timeout(150)
def test_restore_onto_other_world_sizes(tmp_path: Path, workers: Workers, reference_run: tuple[Path, list[dict]]
                                       ) -> None:
    """A 2-rank checkpoint (the module's uninterrupted run, from a copy of its local tier) restores into one
    process without a process group, and into 3 ranks (DCP reshards replicated tensors; a per-rank value missing
    for the new rank 2 falls back to the shared one)."""
    from resilient.checkpoint.save.manager import CheckpointManager

    base, two = reference_run
    shutil.copytree(base / "ckpt", tmp_path / "ckpt")
    args = ["--steps", str(STEPS), "--interval", "4", "--local", str(tmp_path / "ckpt")]

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = CheckpointManager(local=tmp_path / "ckpt", interval=4)
    assert ck.restore({"model": model, "optim": optim}) == STEPS
    ck.close()
    for k, v in model.state_dict().items():
        assert torch.equal(v, two[0]["model"][k]), k  # rank 0's view, per-rank BN statistics included

    ok(workers.run(TRAIN, [*args[:1], str(STEPS + 1), *args[2:], "--out", str(tmp_path / "three")], 3))
    three = final(tmp_path / "three", 3)
    assert [r["restore"]["step"] for r in three] == [STEPS - 1] * 3
    assert all(r["start"] == STEPS for r in three)


NARROW = '''
import json, os, sys, torch, torch.distributed as dist
from resilient.checkpoint.manager import CheckpointManager
dist.init_process_group("gloo")
r = dist.get_rank()
state = {"mine": torch.full((1000,), float(r))}  # differs per rank: stored per rank
persistent = sys.argv[4] if len(sys.argv) > 4 else None
ck = CheckpointManager(local=sys.argv[1], persistent=persistent, interval=1, persistent_every=1)
if sys.argv[2] == "save":
    ck.save(0, state)
else:
    state["mine"].zero_()
    ck.restore(state)
    assert torch.equal(state["mine"], torch.full((1000,), float(r)))
    json.dump(ck.last_restore.sources, open(os.path.join(sys.argv[3], f"src{r}.json"), "w"))
ck.close()
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_each_rank_fetches_only_the_files_it_loads(tmp_path: Path, workers: Workers) -> None:
    script = tmp_path / "narrow.py"
    script.write_text(NARROW)
    local = str(tmp_path / "node{node}")
    ok(workers.run(script, [local, "save"], 2, local_world_size=1))
    shutil.rmtree(tmp_path / "node1")
    ok(workers.run(script, [local, "restore", str(tmp_path)], 2, local_world_size=1))
    import json

    s0 = json.loads((tmp_path / "src0.json").read_text())
    s1 = json.loads((tmp_path / "src1.json").read_text())
    assert "__1_0.distcp" not in s0 and s0["__0_0.distcp"] == "local"
    assert "__0_0.distcp" not in s1 and s1["__1_0.distcp"] == "peer"


@pytest.mark.timeout(120)
def test_corrupt_peer_replica_falls_back_to_persistent(tmp_path: Path, workers: Workers) -> None:
    """Node 1 lost its disk and its replica on node 0 has a flipped byte: the receiver detects the
    mismatch and takes that file from the persistent tier instead."""
    import json

    script = tmp_path / "narrow.py"
    script.write_text(NARROW)
    local, url = str(tmp_path / "node{node}"), f"file://{tmp_path}/bucket"
    ok(workers.run(script, [local, "save", str(tmp_path), url], 2, local_world_size=1))
    shutil.rmtree(tmp_path / "node1")
    replica = tmp_path / "node0" / "peer" / "step_00000000" / "__1_0.distcp"
    data = bytearray(replica.read_bytes())
    data[len(data) // 2] ^= 0x04
    replica.write_bytes(bytes(data))
    results = ok(workers.run(script, [local, "restore", str(tmp_path), url], 2, local_world_size=1))
    s1 = json.loads((tmp_path / "src1.json").read_text())
    assert s1["__1_0.distcp"] == "persistent"
    assert "falling back to the persistent tier" in results[1].output


RESHARD = '''
import json, os, sys, torch, torch.distributed as dist
from resilient.checkpoint.api import CheckpointReshardError
from resilient.checkpoint.manager import CheckpointManager
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
local, mode, kind, out = sys.argv[1:5]
model = torch.full((64,), 1.0)  # replicated: reshards to any world size
if kind == "object":  # a per-rank data position: differs per rank, a plain int
    state = {"model": model, "cursor": {"pos": 100 + r}}
else:  # a per-rank shard whose size follows the world size
    state = {"model": model, "shard": torch.full((12 // w,), float(r))}
ck = CheckpointManager(local=local, interval=1, peer=False)
if mode == "save":
    model.fill_(7.0)
    ck.save(0, state)
    res = {}
else:
    try:
        res = {"start": ck.restore(state)}
    except CheckpointReshardError as e:
        res = {"error": str(e), "keys": sorted(e.problems), "saved": e.saved_world_size, "now": e.world_size}
    # nothing moved into the state when it was refused; everything when it was not
    res["model"] = model.tolist()[:2]
    res["cursor"] = state["cursor"]["pos"] if kind == "object" else None
    res["shard"] = state["shard"].tolist() if kind != "object" else None
    res["last_restore"] = ck.last_restore.step if ck.last_restore else None
json.dump(res, open(os.path.join(out, f"reshard{r}.json"), "w"))
ck.close()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def saved_by_3_ranks(tmp_path_factory: pytest.TempPathFactory):
    """``kind`` -> the local tier of a save of that kind of state by 3 ranks: one save per kind for the module,
    each case restoring a copy of it."""
    saved: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in saved:
            base = tmp_path_factory.mktemp(f"saved-{kind}")
            script = base / "reshard.py"
            script.write_text(RESHARD)
            w = Workers()
            try:
                ok(w.run(script, [str(base / "ckpt"), "save", kind, str(base)], 3))
            finally:
                w.close()
            saved[kind] = base / "ckpt"
        return saved[kind]

    return get


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,world,refused", [
    ("object", 3, None),  # the same world size: every rank gets its own position back
    ("object", 2, "cursor.pos"),  # rank 2's position would be dropped
    ("object", 4, "cursor.pos"),  # rank 3 would have no position of its own
    ("shard", 2, "shard"),  # saved as 4 elements per rank, 6 asked for
])
def test_restore_at_a_world_size_the_state_cannot_be_resharded_to(
        tmp_path: Path, workers: Workers, saved_by_3_ranks, kind: str, world: int, refused: str | None) -> None:
    """Saved by 3 ranks (once per kind for the module: the saves are the same); restored by ``world`` ranks on
    real gloo groups, each case from its own copy of the save. A state that cannot follow the world size is
    refused on every rank, during planning (no data file is fetched, nothing lands in the state), by an error
    that names the keys and both world sizes and says what to do."""
    import json

    script = tmp_path / "reshard.py"
    script.write_text(RESHARD)
    shutil.copytree(saved_by_3_ranks(kind), tmp_path / "ckpt")
    ok(workers.run(script, [str(tmp_path / "ckpt"), "restore", kind, str(tmp_path)], world))
    res = [json.loads((tmp_path / f"reshard{r}.json").read_text()) for r in range(world)]
    if refused is None:
        assert all(x["start"] == 1 and x["model"] == [7.0, 7.0] for x in res), res
        assert [x["cursor"] for x in res] == [100, 101, 102]
        return
    for x in res:
        assert x["keys"] == [refused] and (x["saved"], x["now"]) == (3, world), x
        assert x["error"] == res[0]["error"]  # one verdict, the same on every rank
        assert f"saved by 3 ranks and cannot be restored onto {world}" in x["error"]
        assert refused in x["error"] and "Restart with 3 ranks" in x["error"], x["error"]
        assert "\n" not in x["error"]
        assert x["model"] == [1.0, 1.0] and x["last_restore"] is None  # not a byte loaded
    if kind == "object":
        assert [x["cursor"] for x in res] == [100 + r for r in range(world)]
    else:
        assert all(x["shard"] == [float(r)] * (12 // world) for r, x in enumerate(res))
