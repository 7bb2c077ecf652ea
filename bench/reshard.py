"""Restore at another data-parallel size: time against a raw read of the same bytes.

    python bench/reshard.py                 # 2 -> 1 and 4 -> 2 ranks, 256 MiB of DTensors, 5 repetitions
    python bench/reshard.py --quick         # 32 MiB, 256 KiB verification blocks, 2 repetitions (< 30 s idle)

A state of FSDP2-style DTensors (``Shard(0)`` over a 1-D ("dp",) mesh) is saved by N ranks, one per "node"
(each node its own local tier; replicas of N/2 nodes, so the peer copies of the dropped half are on the half
that stays), the second half of the nodes is lost (local tiers deleted), and N/2 ranks in fresh processes
restore it: each new shard is two old ones, read from its own files, the peer copies on its node and the
other survivor's files over gloo, by the verification blocks it touches.

Per repetition, interleaved in the same processes (the order alternating): a raw read of exactly the bytes
the restore read (the same block ranges of the same files, from a copy on this machine, into one reused,
already touched buffer), then a cold restore (a new manager, no parsed metadata kept). A job's time is its
slowest rank's. Reported: restore seconds, raw seconds, their ratio per repetition as median [min-max], and
what the restore read against the new shard. Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))


def _state(n_tensors: int, mib: int, seed: int, mesh: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = (mib << 20) // (4 * 1024)
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
                      for i in range(n_tensors)}}


def _raw_read(root: Path, step: int, ranges: dict[str, list[tuple[int, int]]], buf: bytearray) -> float:
    """The same byte ranges of the same files, from whichever copy on this machine holds them."""
    t0 = time.perf_counter()
    for name, spans in ranges.items():
        path = next(p for p in sorted(root.glob(f"node*/**/step_{step:08d}/{name}")))
        with open(path, "rb", buffering=0) as f:
            for a, b in spans:
                view = memoryview(buf)[:b - a]
                got = 0
                while got < len(view):
                    got += os.preadv(f.fileno(), [view[got:]], a + got) or len(view)
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import resilient
    from resilient.checkpoint.restore import restore as restoring

    if args.block_kib:
        import resilient.checkpoint.save.manager as saving

        saving.BLOCK = args.block_kib << 10
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    root = Path(args.root)
    local = str(root / "node{node}")
    if args.phase == "save":
        state = _state(args.tensors, args.mib, 0, mesh)
        ck = resilient.CheckpointManager.from_env(local=local, interval="1")
        ck.save(0, state)
        if not ck.wait(timeout=300):
            raise SystemExit("save did not finish")
        ck.close()
        dist.destroy_process_group()
        return 0
    expect = _state(args.tensors, args.mib, 0, mesh)
    buf = bytearray(64 << 20)
    rows: list[dict[str, Any]] = []
    ranges: dict[str, list[tuple[int, int]]] = {}
    for rep in range(args.reps + 1):  # the first, a warm-up, also learns the ranges the restore reads
        order = ("ours", "raw") if rep % 2 else ("raw", "ours")
        got: dict[str, float] = {}
        stats = None
        for what in order:
            if what == "raw" and not ranges:
                continue
            dist.barrier()
            if what == "raw":
                need = max((b - a for s in ranges.values() for a, b in s), default=0)
                if len(buf) < need:
                    buf = bytearray(need)
                got["raw"] = _raw_read(root, 0, ranges, buf)
            else:
                restoring.clear_caches()
                state = _state(args.tensors, args.mib, 1, mesh)
                ck = resilient.CheckpointManager.from_env(local=local, interval="1")
                t0 = time.perf_counter()
                start = ck.restore(state)
                got["ours"] = time.perf_counter() - t0
                ranges = ck._restorer.ranges_read
                stats = ck._restorer.resharded
                ck.close()
                if start != 1 or not all(torch.equal(state["model"][k].to_local(), v.to_local())
                                         for k, v in expect["model"].items()):
                    raise SystemExit(f"rank {rank}: the restore differs from the saved state")
        slowest = [None] * world
        dist.all_gather_object(slowest, (got, stats))
        if rep and rank == 0:
            rows.append({"ours_s": max(g["ours"] for g, _ in slowest), "raw_s": max(g["raw"] for g, _ in slowest),
                         "ranks": [s for _, s in slowest]})
    if rank == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(n: int, argv: list[str], env_extra: dict[str, str], timeout: float) -> None:
    port = _free_port()
    procs = []
    for r in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
        env.update(env_extra, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    bad = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    if bad:
        r, rc, out = bad[0]
        raise SystemExit(f"rank {r} of {n} exited {rc}:\n{out[-3000:]}")


def scenario(old: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    root = work / f"{old}to{old // 2}"
    shutil.rmtree(root, ignore_errors=True)
    common = ["--root", str(root), "--tensors", str(args.tensors), "--mib", str(args.mib),
              "--block-kib", str(args.block_kib or 0)]
    env = {"RESILIENT_NODES_PER_REPLICA": str(old // 2)}  # the peer copies of the dropped half stay
    _launch(old, ["--phase", "save", *common], env, args.timeout)
    for node in range(old // 2, old):
        shutil.rmtree(root / f"node{node}")
    result = root / "result.json"
    _launch(old // 2, ["--phase", "restore", "--reps", str(args.reps), "--result", str(result), *common], env,
            args.timeout)
    rows = json.loads(result.read_text())
    ratio = [r["ours_s"] / r["raw_s"] for r in rows]
    stats = rows[-1]["ranks"]
    return {"old_ranks": old, "new_ranks": old // 2,
            "state_bytes": args.tensors * (args.mib << 20),
            "restore_s": _spread([r["ours_s"] for r in rows]), "raw_s": _spread([r["raw_s"] for r in rows]),
            "restore_over_raw": _spread(ratio),
            "per_rank": stats}


def _spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 256 KiB blocks, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "reshard.json"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="save", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tensors", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--block-kib", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.tensors, args.mib, args.block_kib = 4, 8, 256
    args.reps = args.reps or (2 if args.quick else 5)
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    try:
        results = [scenario(old, args, work) for old in (2, 4)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"mode": "quick" if args.quick else "full", "reps": args.reps, "block_kib": args.block_kib or 4096,
           "scenarios": results}
    print(f"{'change':<10} {'state':>8} {'restore s':>22} {'raw read s':>22} {'restore / raw':>22} "
          f"{'read / shard':>13} {'held / shard':>13}")
    for s in results:
        ranks = [r for r in s["per_rank"] if r]
        read = max(r["read"] / r["shard"] for r in ranks) if ranks else float("nan")
        held = max(r["held"] / r["shard"] for r in ranks) if ranks else float("nan")
        print(f"{s['old_ranks']} -> {s['new_ranks']:<5} {s['state_bytes'] / 2**20:>6.0f} MiB "
              f"{_fmt(s['restore_s']):>22} {_fmt(s['raw_s']):>22} {_fmt(s['restore_over_raw']):>22} "
              f"{read:>13.2f} {held:>13.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


def _fmt(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


if __name__ == "__main__":
    code = main()
    if "--worker" in sys.argv:
        # a rank ends as resilient-run's workers do: no finalisation, so no gloo exit abort (README, Known limits)
        from resilient.worker import exit_safety

        exit_safety.finish(code)
    sys.exit(code)
