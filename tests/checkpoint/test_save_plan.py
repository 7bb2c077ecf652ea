"""The save plan cached between saves (``checkpoint/save/plan.py``), on two real gloo ranks.

Every step a manager saves must load bit-exact with stock ``dcp.load``, also when the state's structure changes
between saves (AdamW's state appears after the first step, one rank gains a tensor, a tensor changes shape); and a
coordinator that lost its cached plan while a rank kept its own must fail that one save visibly, never write
metadata without that rank's tensors, and save the next step whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Workers, ok
from .test_reliability import tiny_disk  # noqa: F401 - the fixture of a real full disk

SCRIPT = r'''
import json, os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner
from resilient.checkpoint import CheckpointManager

dist.init_process_group("gloo")
rank = dist.get_rank()
root = sys.argv[1]
ck = CheckpointManager(local=root, interval=1, peer=False, keep_local=100)
g = torch.Generator().manual_seed(rank)
shapes = {"w": (4, 3), "b": (3,)}
states, outcome = {}, {}


def state(step):
    if step == 3 and rank == 1:
        shapes["only_r1"] = (2,)  # one rank's plan changes, rank 0's does not
    if step == 4:
        shapes["b"] = (5,)  # a tensor changes shape on every rank
    same = torch.Generator().manual_seed(step)  # replicated values, as DDP keeps them
    s = {k: torch.randn(*v, generator=g if k == "only_r1" else same) for k, v in shapes.items()}
    if step >= 2:  # the optimizer's state appears after the first step
        s["exp_avg"] = torch.randn(6, generator=same)
    s["noise"] = torch.randn(3, generator=g)  # a per-rank tensor (an RNG state, running statistics)
    s["pos"] = step * 10 + rank  # a per-rank object
    return s


for step in range(1, 7):
    if step == 5 and rank == 0:
        ck._planners["local"].forget()  # the coordinator loses its cache; rank 1 keeps its own
    s = state(step)
    states[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
    assert ck.save(step, s, force=True)
    outcome[step] = ck.wait(60)
ck.close(60)
key = ck._planners["local"]._cached_plans_key
cached = key in SavePlanner._cached_all_plans or key in SavePlanner._cached_save_plan
dist.barrier()
loaded = {}
for step, saved in states.items():
    d = os.path.join(root, f"step_{step:08d}")
    if not os.path.exists(os.path.join(d, "COMMITTED")):
        loaded[step] = "missing"
        continue
    # stock dcp.load: per-rank values under their per-rank keys, the rest under their own
    key = {k: (f"__rank{rank}__.{k}" if k == "noise" else k) for k in saved if k != "pos"}
    into = {key[k]: torch.empty_like(saved[k]) for k in key}
    dcp.load(into, checkpoint_id=d)
    bad = [k for k in key if not torch.equal(into[key[k]], saved[k])]
    loaded[step] = not bad or bad
with open(os.path.join(root, f"out{rank}.json"), "w") as f:
    json.dump({"outcome": outcome, "loaded": loaded, "cached_after_close": cached}, f)
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_plan_cache_saves_every_structure_and_fails_visibly_when_out_of_step(tmp_path: Path,
                                                                             workers: Workers) -> None:
    script = tmp_path / "plan_cache.py"
    script.write_text(SCRIPT)
    root = tmp_path / "ckpt"
    res = ok(workers.run(script, [str(root)], 2))
    import json

    outs = [json.loads((root / f"out{r}.json").read_text()) for r in range(2)]
    for r, out in enumerate(outs):
        # the save the coordinator could not plan failed (on every rank), the rest reached the local tier
        assert out["outcome"] == {"1": True, "2": True, "3": True, "4": True, "5": False, "6": True}, (r, out)
        # every committed step is bit-exact through stock dcp.load, whatever changed between saves; step 5
        # never committed (its metadata would have lacked rank 1's tensors)
        assert out["loaded"] == {"1": True, "2": True, "3": True, "4": True, "5": "missing", "6": True}, (r, out)
        assert not out["cached_after_close"], "close() left the planner's cache in DCP's class-level dicts"
    errors = "".join(r.output for r in res)
    assert "sent a cached save plan the coordinator does not hold" in errors, errors[-3000:]


@pytest.mark.timeout(60)
def test_a_tensor_reshaped_or_retyped_in_place_is_planned_again(tmp_path: Path) -> None:
    """The plan is reused only for the same layout: a view of the same storage (same address) with another shape
    or dtype must get a plan of its own, or the metadata would describe the old one."""
    import torch
    import torch.distributed.checkpoint as dcp

    from resilient.checkpoint.save import plan

    planner = plan.CachedSavePlanner("test")
    buf = torch.arange(6, dtype=torch.float32)
    states = [{"a": buf.view(2, 3), "n": 1}, {"a": buf.view(2, 3), "n": 2}, {"a": buf.view(3, 2), "n": 3},
              {"a": buf.view(torch.int32).view(3, 2), "n": 4}]
    try:
        for i, s in enumerate(states):
            plan.save(s, dcp.FileSystemWriter(str(tmp_path / str(i))), planner, None, no_dist=True)
    finally:
        planner.forget()
    for i, s in enumerate(states):
        into = {"a": torch.empty_like(s["a"]), "n": 0}
        dcp.load(into, checkpoint_id=str(tmp_path / str(i)))
        assert into["a"].shape == s["a"].shape and into["a"].dtype == s["a"].dtype, (i, into["a"])
        assert torch.equal(into["a"], s["a"]) and into["n"] == s["n"], (i, into)


@pytest.mark.timeout(60)
def test_a_state_with_a_container_never_takes_the_short_path(tmp_path: Path) -> None:
    """The short path trusts one look at the state's layout, compared with the layout of the planner's flattened
    copy; a container's tensors come out under dotted keys there, so a state holding one is planned by DCP at every
    save (here: the same, a tensor of another shape, a list, its order swapped), each save bit-exact. A flat state
    of the same tensors takes the short path from its second save (the control)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from resilient.checkpoint.save import plan
    from resilient.checkpoint.save.writer import RecordWriter

    a, w4, w6 = torch.zeros(8), torch.zeros(4), torch.zeros(6)
    nested = [{"a": a, "m": {"w": w4}}, {"a": a, "m": {"w": w4}}, {"a": a, "m": {"w": w6}},
              {"a": a, "m": [w6, w4]}, {"a": a, "m": [w4, w6]}]
    flat = [{"a": a, "m.w": w4} for _ in range(3)]
    for name, states in (("nested", nested), ("flat", flat)):
        planner = plan.CachedSavePlanner(name)
        try:
            for i, s in enumerate(states):
                for t in (a, w4, w6):
                    t.fill_(float(i + 1))
                writer = RecordWriter(tmp_path / name / str(i), sync_files=False)
                plan.save(s, writer, planner, None, no_dist=True)
                into = {"a": torch.empty(8), "m": {k: torch.empty_like(v) for k, v in s["m"].items()}
                        if isinstance(s["m"], dict) else [torch.empty_like(v) for v in s["m"]]} \
                    if name == "nested" else {"a": torch.empty(8), "m.w": torch.empty(4)}
                dcp.load(into, checkpoint_id=str(tmp_path / name / str(i)))
                got = [into["a"], *(into["m"].values() if isinstance(into.get("m"), dict) else into.get("m", [])),
                       *([into["m.w"]] if "m.w" in into else [])]
                assert all(torch.equal(t, torch.full_like(t, float(i + 1))) for t in got), (name, i, into)
            assert planner.short_saves == (0 if name == "nested" else len(states) - 1), (name, planner.short_saves)
        finally:
            planner.forget()


SHORT = r'''
import json, os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from resilient.checkpoint import CheckpointManager
from resilient.checkpoint.format.safe import load_metadata

dist.init_process_group("gloo")
rank = dist.get_rank()
root, full_at = sys.argv[1], int(sys.argv[2])
node = rank // int(os.environ["LOCAL_WORLD_SIZE"])
mine = os.path.join(root, f"local{node}")  # one worker a node: rank 1's maybe a tiny disk; two: both in local0
ck = CheckpointManager(local=os.path.join(root, "local{node}"), interval=1, peer=False, keep_local=100,
                       max_failed_saves=0)
planner = lambda: ck._planners["local"]
states, outcome, short, memo, patched = {}, {}, {}, {}, {}
for step in range(1, 8):
    g = torch.Generator().manual_seed(step)  # new values every step, the same layout
    s = {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(1024, generator=g),
         "h": torch.randn(33, generator=g).to(torch.bfloat16), "noise": torch.randn(3) + rank, "pos": step * 10 + rank}
    if step == full_at and rank == 1:  # a real full disk under rank 1's save of this step
        with open(os.path.join(mine, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20)); f.flush()
            except OSError:
                pass
    states[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
    assert ck.save(step, s, force=True)
    outcome[step] = ck.wait(60)
    short[step] = planner().short_saves
    memo[step] = planner().records.hits
    patched[step] = planner().records.patched
    if step == full_at and rank == 1:
        os.unlink(os.path.join(mine, "filler"))
    dist.barrier()
ck.close(60)
import shutil
loaded, same_metadata = {}, None
for step, saved in states.items():
    d = os.path.join(mine, f"step_{step:08d}")
    committed = [None, None]
    dist.all_gather_object(committed, os.path.exists(os.path.join(d, "COMMITTED")))
    if not all(committed):
        loaded[step] = "missing"
        continue
    # each node's directory holds its own rank's file: stock dcp.load reads both, as a restore gathers them
    both = os.path.join(root, "both", f"step_{step:08d}")
    os.makedirs(both, exist_ok=True)
    for n in os.listdir(d):  # two workers of a node share their directory: its rank 0 copies it
        if (n.endswith(".distcp") and (node == rank or rank == 0)) or (rank == 0 and n == ".metadata"):
            shutil.copy(os.path.join(d, n), both)
    dist.barrier()
    d = both
    key = {k: (f"__rank{rank}__.{k}" if k == "noise" else k) for k in saved if k != "pos"}
    into = {key[k]: torch.empty_like(saved[k]) for k in key}
    dcp.load(into, checkpoint_id=d)
    bad = [k for k in key if not torch.equal(into[key[k]], saved[k])]
    loaded[step] = not bad or bad
import pickle
raw = {s: open(os.path.join(mine, f"step_{s:08d}", ".metadata"), "rb").read() for s in (1, 3, 4)}
md = {s: load_metadata(raw[s], what="m") for s in raw}
# step 4's .metadata came from step 3's bytes with its own ids: it must be exactly what pickling it gives
same_metadata = (md[1].state_dict_metadata == md[3].state_dict_metadata and md[1].storage_data == md[3].storage_data
                 and md[3].storage_meta is not None and str(md[3].storage_meta.checkpoint_id).endswith("step_00000003")
                 and str(md[4].storage_meta.checkpoint_id).endswith("step_00000004")
                 and md[4].storage_meta.save_id != md[3].storage_meta.save_id
                 and pickle.dumps(md[4]) == raw[4] and md[4].storage_data == md[1].storage_data)
with open(os.path.join(root, f"out{rank}.json"), "w") as f:
    json.dump({"outcome": outcome, "loaded": loaded, "short": short, "memo": memo, "patched": patched, "same_metadata": same_metadata}, f)
dist.destroy_process_group()
'''


def _short_run(tmp_path: Path, workers: Workers, full_at: int, rank1_dir: Path | None = None,
               per_node: int = 1) -> list[dict]:
    import json

    script = tmp_path / "short.py"
    script.write_text(SHORT)
    root = tmp_path / "ckpt"
    root.mkdir()
    if rank1_dir is not None:
        (root / "local1").symlink_to(rank1_dir)
    ok(workers.run(script, [str(root), str(full_at)], 2, local_world_size=per_node))
    return [json.loads((root / f"out{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_node", [1, 2])
def test_a_save_laid_out_as_the_last_agrees_its_metadata_without_dcps_gathers(tmp_path: Path, workers: Workers,
                                                                              per_node: int) -> None:
    # the first save is planned through DCP; every later one reuses the plan and the metadata (its write results
    # the same on both ranks), and each step loads bit-exact through stock dcp.load, per-rank values included;
    # with one worker a node (each its own directory) and with two workers of one node sharing theirs
    for r, out in enumerate(_short_run(tmp_path, workers, full_at=0, per_node=per_node)):
        assert all(out["outcome"].values()), (r, out)
        assert all(v is True for v in out["loaded"].values()), (r, out)
        assert out["short"] == {str(s): s - 1 for s in range(1, 8)}, (r, out["short"])
        # every save after the first wrote its records from the last one's (the staging buffers are the same
        # tensors from save to save) and still wrote each step's own values
        assert out["memo"] == {str(s): s - 1 for s in range(1, 8)}, (r, out["memo"])
        # rank 0 writes .metadata: from the first short save on, from the last file's bytes with this save's ids
        assert out["patched"] == ({str(s): s - 1 for s in range(1, 8)} if r == 0 else {str(s): 0 for s in range(1, 8)}), \
            (r, out["patched"])
        # the short path's .metadata is DCP's for this step: same tensors and byte ranges, this step's own id
        assert out["same_metadata"] is True, (r, out)


@pytest.mark.timeout(120)
def test_a_full_disk_under_a_short_save_fails_it_on_every_rank_and_the_next_plans_afresh(
        tmp_path: Path, workers: Workers, tiny_disk: Path) -> None:  # noqa: F811
    outs = _short_run(tmp_path, workers, full_at=5, rank1_dir=tiny_disk)
    for r, out in enumerate(outs):
        # step 5's write failed on rank 1 only: both ranks learn it, neither commits it
        assert out["outcome"] == {"1": True, "2": True, "3": True, "4": True, "5": False, "6": True, "7": True}, \
            (r, out)
        assert out["loaded"]["5"] == "missing" and all(out["loaded"][str(s)] is True for s in (1, 2, 3, 4, 6, 7)), \
            (r, out)
        # saves 2-4 short; 5 failed (every rank forgot its plan); 6 planned through DCP again; 7 short again
        assert out["short"] == {"1": 0, "2": 1, "3": 2, "4": 3, "5": 3, "6": 3, "7": 4}, (r, out["short"])
        # the failed save forgot the records with the plan: save 6 wrote from the state again, 7 from its records
        assert out["memo"]["7"] == out["memo"]["6"] + 1 and out["memo"]["6"] == out["memo"]["5"], (r, out["memo"])


DTENSOR = r'''
import json, os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from resilient.checkpoint import CheckpointManager

dist.init_process_group("gloo")
rank = dist.get_rank()
root = sys.argv[1]
ck = CheckpointManager(local=root, interval=1, peer=False, keep_local=100)
planner = lambda: ck._planners["local"]
forward = DeviceMesh("cpu", [0, 1])
backward = DeviceMesh("cpu", [1, 0])  # the same ranks in the other order: each holds the other half
layouts = {1: (forward, [Shard(0)]), 2: (forward, [Shard(0)]), 3: (forward, [Shard(0)]),
           4: (backward, [Shard(0)]), 5: (backward, [Shard(0)]), 6: (forward, [Replicate()]),
           7: (forward, [Replicate()])}
saved, short, memo = {}, {}, {}
for step, (mesh, placements) in layouts.items():
    g = torch.Generator().manual_seed(step)  # new values every step; the state's tensors are new DTensors too
    full = {"w": torch.randn(8, 6, generator=g), "ln": torch.randn(6, generator=g),
            "m": torch.randn(8, 6, generator=g).to(torch.bfloat16)}
    saved[step] = full
    s = {k: distribute_tensor(v, mesh, placements) for k, v in full.items()}
    s["pos"] = step * 10 + rank
    assert ck.save(step, s, force=True)
    assert ck.wait(60), step
    short[step] = planner().short_saves
    memo[step] = planner().records.hits
ck.close(60)
loaded = {}
for step, (mesh, placements) in layouts.items():
    into = {k: distribute_tensor(torch.zeros_like(v), mesh, placements) for k, v in saved[step].items()}
    dcp.load(into, checkpoint_id=os.path.join(root, f"step_{step:08d}"))
    bad = [k for k, v in into.items() if not torch.equal(v.full_tensor(), saved[step][k])]
    loaded[step] = not bad or bad
# our restore in the same processes, of a step of each mesh (each step alone under a root of its own): the same
# global shapes and placements on two meshes, so the same local shapes at other offsets
import shutil
restored = {}
for step in (3, 5):
    only = os.path.join(root, f"only{step}")
    if rank == 0:
        shutil.copytree(os.path.join(root, f"step_{step:08d}"), os.path.join(only, f"step_{step:08d}"))
    dist.barrier()
    mesh, placements = layouts[step]
    into = {k: distribute_tensor(torch.zeros_like(v), mesh, placements) for k, v in saved[step].items()}
    into["pos"] = -1
    r = CheckpointManager(local=only, interval=1, peer=False)
    got = r.restore(into)  # the step to run next
    r.close(60)
    bad = [k for k in saved[step] if not torch.equal(into[k].full_tensor(), saved[step][k])]
    restored[step] = (got, into["pos"], bad)
with open(os.path.join(root, f"out{rank}.json"), "w") as f:
    json.dump({"loaded": loaded, "short": short, "memo": memo, "restored": restored}, f)
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_a_dtensor_state_takes_the_short_path_and_a_new_placement_is_planned_again(tmp_path: Path,
                                                                                   workers: Workers) -> None:
    """FSDP2 and TP states are DTensors: from the second save of one layout on, the plan, the metadata and the
    records are the last save's (as for plain tensors); a mesh that puts each rank on the other half (the same
    local shapes, the same staging buffers, other offsets) or another placement is planned afresh. Every step
    loads bit-exact through stock ``dcp.load`` into DTensors placed as saved, and through a restore in the same
    processes onto each mesh (a shard's offsets are computed once per mesh, shape and placement: not mixed up)."""
    import json

    script = tmp_path / "dtensor_plan.py"
    script.write_text(DTENSOR)
    root = tmp_path / "ckpt"
    ok(workers.run(script, [str(root)], 2))
    for r in range(2):
        out = json.loads((root / f"out{r}.json").read_text())
        assert all(v is True for v in out["loaded"].values()), (r, out)
        # planned through DCP at steps 1, 4 (other mesh) and 6 (other placement); short at the rest
        assert out["short"] == {"1": 0, "2": 1, "3": 2, "4": 2, "5": 3, "6": 3, "7": 4}, (r, out["short"])
        assert out["memo"] == out["short"], (r, out["memo"])
        assert out["restored"] == {"3": [4, 30 + r, []], "5": [6, 50 + r, []]}, (r, out["restored"])  # the next steps
