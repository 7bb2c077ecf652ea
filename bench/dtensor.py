"""DTensor states (FSDP2, tensor parallelism): what each tensor costs a save and a restore.

    python bench/dtensor.py                 # GPT-shaped states, 168 and 1,680 tensors, plain and DTensor
    python bench/dtensor.py --reps 3 --out bench/results/dtensor.json

An FSDP2 or TP job's state is all DTensors: every parameter and both AdamW moments. The same bytes are saved and
restored here as plain tensors and as DTensors (``Shard(0)`` on a one-rank mesh of a real gloo group: the local
shard is the whole tensor, so the bytes and the files match and only the per-tensor handling differs), each
against synchronous ``dcp.save`` / ``dcp.load`` of the same state in the same process:

* ``save blocked``: what ``CheckpointManager.save()`` holds the training thread for (median of the saves after the
  first, which plans), ÷ synchronous ``dcp.save``;
* ``save to committed``: from the call until the step is committed on the local tier, ÷ ``dcp.save``;
* ``restore``: a cold local restore (parsed metadata forgotten, as in a fresh process) ÷ ``dcp.load``;
* ``DTensor ÷ plain``: the same measure for the DTensor state over the plain one (1.0: a DTensor costs what a
  tensor does).

Baseline and measurement alternate in every repetition; medians (min-max) are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from checkpoint import cold, make_gpt_state  # noqa: E402


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def as_dtensor(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: ({n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in v.items()} if isinstance(v, dict) else v)
            for k, v in state.items()}


def zeros(state: dict[str, Any], mesh: Any, dtensor: bool) -> dict[str, Any]:
    out = {k: ({n: torch.zeros_like(t) for n, t in v.items()} if isinstance(v, dict) else -1)
           for k, v in state.items()}
    return as_dtensor(out, mesh) if dtensor else out


def leaves(state: dict[str, Any]) -> list[torch.Tensor]:
    return [t for v in state.values() if isinstance(v, dict) for t in v.values()]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x.full_tensor() if hasattr(x, "full_tensor") else x,
                           y.full_tensor() if hasattr(y, "full_tensor") else y)
               for x, y in zip(leaves(a), leaves(b)))


def measure(state: dict[str, Any], target: dict[str, Any], work: Path, saves: int) -> dict[str, Any]:
    """One repetition: synchronous dcp.save and dcp.load (the baseline), then ``saves`` saves and a cold restore
    by a manager, alternating baseline and ours."""
    from resilient.checkpoint.save.manager import CheckpointManager

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(work / "dcp"))
    dcp_save = time.perf_counter() - t0
    ck = CheckpointManager(local=work / "ours", interval=1, peer=False)
    blocked, committed = [], []
    try:
        for step in range(saves):
            t0 = time.perf_counter()
            assert ck.save(step, state, force=True)
            blocked.append(time.perf_counter() - t0)
            assert ck.wait(120), f"save of step {step} did not commit"
            committed.append(time.perf_counter() - t0)
    finally:
        ck.close(120)
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(work / "dcp"))
    dcp_load = time.perf_counter() - t0
    assert same(state, target), "dcp.load is not bit-exact"
    for t in leaves(target):
        (t.to_local() if hasattr(t, "to_local") else t).zero_()
    ck = CheckpointManager(local=work / "ours", interval=1, peer=False)
    try:
        cold()
        t0 = time.perf_counter()
        ck.restore(target)
        restore = time.perf_counter() - t0
    finally:
        ck.close(120)
    assert same(state, target), "restore is not bit-exact"
    return {"dcp_save_s": dcp_save, "blocked_s": statistics.median(blocked[1:]),
            "committed_s": statistics.median(committed[1:]), "dcp_load_s": dcp_load, "restore_s": restore}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--saves", type=int, default=4, help="saves per repetition (the first plans; default 4)")
    ap.add_argument("--out", default=str(HERE / "results" / "dtensor.json"))
    ap.add_argument("--work", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.saves < 2:
        ap.error("--reps must be >= 1 and --saves >= 2 (the first save plans, the rest are measured)")
    torch.set_num_threads(2)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-dtensor-"))
    load_before = os.getloadavg()
    cases = {}
    for split in (1, 10):
        plain = make_gpt_state(split)
        name = "gpt" if split == 1 else "gpt_x10"
        cases[name] = (plain, False)
        cases[f"{name}_dtensor"] = (as_dtensor(plain, mesh), True)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in cases}
    try:
        for _ in range(args.reps):
            for name, (state, is_dt) in cases.items():
                runs[name].append(measure(state, zeros(state, mesh, is_dt), work / name, args.saves))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    results: dict[str, Any] = {"reps": args.reps, "saves": args.saves, "cpus": os.cpu_count(),
                               "torch": torch.__version__, "load_average_before": list(load_before),
                               "load_average_after": list(os.getloadavg()), "cases": {}}
    for name, rs in runs.items():
        state = cases[name][0]
        c: dict[str, Any] = {"tensors": len(leaves(state)),
                             "bytes": sum(t.numel() * t.element_size() for t in leaves(state))}
        for k in ("dcp_save_s", "blocked_s", "committed_s", "dcp_load_s", "restore_s"):
            c[k] = spread([r[k] for r in rs])
        c["blocked_over_dcp_save"] = spread([r["blocked_s"] / r["dcp_save_s"] for r in rs])
        c["committed_over_dcp_save"] = spread([r["committed_s"] / r["dcp_save_s"] for r in rs])
        c["restore_over_dcp_load"] = spread([r["restore_s"] / r["dcp_load_s"] for r in rs])
        results["cases"][name] = c
    for name in ("gpt", "gpt_x10"):
        p, d = runs[name], runs[f"{name}_dtensor"]
        results["cases"][f"{name}_dtensor"]["over_plain"] = {
            k: spread([b[k] / a[k] for a, b in zip(p, d)]) for k in ("blocked_s", "committed_s", "restore_s")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"DTensor states: {os.cpu_count()} CPUs, load {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"median (min-max) of {args.reps} interleaved repetitions")
    def rng(x: dict[str, Any], scale: float = 1.0, f: str = ".2f") -> str:
        return f"{x['median'] * scale:{f}} [{x['min'] * scale:{f}}-{x['max'] * scale:{f}}]"

    fmt = "{:<16} {:>7} {:>34} {:>34} {:>34}"
    print(fmt.format("state", "tensors", "save blocked: ms, x dcp.save", "save to committed: ms, x dcp.save",
                     "restore: ms, x dcp.load"))
    for name, c in results["cases"].items():
        def cell(k: str, r: str) -> str:
            return f"{rng(c[k], 1000, '.0f')}, {rng(c[r])}"
        print(fmt.format(name, c["tensors"], cell("blocked_s", "blocked_over_dcp_save"),
                         cell("committed_s", "committed_over_dcp_save"), cell("restore_s", "restore_over_dcp_load")))
    for name, c in results["cases"].items():
        op = c.get("over_plain")
        if op:
            print(f"{name} / plain: blocked {rng(op['blocked_s'])}, committed {rng(op['committed_s'])}, "
                  f"restore {rng(op['restore_s'])}")
    print("ratios: save ÷ synchronous dcp.save, restore ÷ dcp.load (same state, same process)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    code = main()
    # ends as resilient-run's workers do: no finalisation, so no gloo exit abort (README, Known limits)
    from resilient.worker import exit_safety

    exit_safety.finish(code)
