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
