"""Snapshot benchmark: what a snapshot in node memory costs the training thread, and how fast a restart restores it.

    python bench/snapshot.py                  # the three states of bench/checkpoint.py, 5 repetitions (~2 minutes)
    python bench/snapshot.py --quick          # the GPT recipe's state and a 32 MB one, 2 repetitions

States: the GPT recipe's own model with AdamW moments (what ``bench/goodput.py`` trains: 129 tensors, 1.4 MiB a rank),
and ``bench/checkpoint.py``'s *large* (512 MB in 16 MiB tensors), *gpt* (252 MiB, 168 tensors) and *gpt_x10* (the same
bytes in 1,680 tensors). Every figure is a ratio against a baseline measured in the same run, interleaved, each
repetition baseline then ours, reported as median [min-max]:

* blocking per snapshot ÷ a plain memory copy of the same tensors into buffers kept between copies (``copy_`` per
  tensor), the floor of any copy to host memory; ``save()`` of the disk tiers' default mode beside it (its own
  staging copy) for scale.
* the digest and commit on the snapshot's own thread (not on the training thread), in milliseconds.
* restore from the snapshot in a freshly started process ÷ restore of the same step from the local tier in a
  freshly started process (both read from memory here: the local tier's files are in the page cache).

Writes bench/results/snapshot.json.
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

import torch  # noqa: E402

from checkpoint import flat_tensors, make_any, paired, spread  # noqa: E402  (bench/checkpoint.py)

RESULTS = HERE / "results" / "snapshot.json"


def recipe_state() -> dict[str, Any]:
    """The GPT recipe's model and AdamW state after one step, as bench/goodput.py trains it (one rank's share)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe_train", REPO / "recipes" / "pytorch" / "train.py")
    tr = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(tr)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = tr.GPT(tr.GPTConfig())
    opt = torch.optim.AdamW(model.parameters())
    out = model(torch.randint(0, 200, (2, 32)))
    (out if torch.is_tensor(out) else out[0]).float().sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def state_of(kind: str, mb: int) -> dict[str, Any]:
    return recipe_state() if kind == "recipe" else make_any(kind, mb)


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    if "model" in state and isinstance(state["model"], torch.nn.Module):
        from resilient.checkpoint.format.state import flatten, plain_state

        return [v for _, v in flatten(plain_state(state)).values() if isinstance(v, torch.Tensor)]
    return list(flat_tensors(state).values())


def bench_blocking(kind: str, mb: int, reps: int, work: Path) -> dict[str, Any]:
    from resilient.checkpoint import CheckpointManager
    from resilient.checkpoint.snapshot.ring import SnapshotRing

    state = state_of(kind, mb)
    srcs = tensors_of(state)
    bufs = [torch.empty_like(t) for t in srcs]
    shm = Path(tempfile.mkdtemp(prefix="snap-bench-", dir="/dev/shm"))
    ring = SnapshotRing(shm, rank=0, world_size=1, every=1)
    copy_s, snap_s, commit_s, save_s = [], [], [], []
    try:
        with CheckpointManager(local=work / f"ckpt-{kind}", interval=1, peer=False, snapshot=0) as ck:
            for i in range(reps + 2):  # two warm-ups: a slot's first snapshot maps its memory
                t0 = time.perf_counter()
                with torch.no_grad():
                    for b, s in zip(bufs, srcs):
                        b.copy_(s)
                c = time.perf_counter() - t0
                t0 = time.perf_counter()
                ring.take(i, state)
                s = time.perf_counter() - t0
                ring.flush(120)
                d = ring._digest_s
                t0 = time.perf_counter()
                ck.save(i, state, force=True)
                v = time.perf_counter() - t0
                ck.wait(300)
                if i >= 2:
                    copy_s.append(c)
                    snap_s.append(s)
                    commit_s.append(d)
                    save_s.append(v)
    finally:
        ring.close()
        shutil.rmtree(shm, ignore_errors=True)
    return {"state": kind, "bytes": sum(t.numel() * t.element_size() for t in srcs), "tensors": len(srcs),
            "copy_s": spread(copy_s), "snapshot_s": spread(snap_s), "save_s": spread(save_s),
            "commit_thread_s": spread(commit_s), "snapshot_over_copy": paired(snap_s, copy_s),
            "save_over_copy": paired(save_s, copy_s)}


def restore_worker(kind: str, mb: int, work: Path, shm: Path, tier: str) -> None:
    """A fresh process restoring step 3 from the snapshot or from the local tier; prints seconds and the tier."""
    from resilient.checkpoint import CheckpointManager

    state = state_of(kind, mb)
    with torch.no_grad():
        for t in tensors_of(state):
            t.zero_()
    t0 = time.perf_counter()
    with CheckpointManager(local=work / f"restore-{kind}", interval=100, peer=False,
                           snapshot=1 if tier == "snapshot" else 0, snapshot_dir=shm) as ck:
        ck.restore(state)
        print(json.dumps({"seconds": time.perf_counter() - t0, "tier": ck.last_restore.tier,
                          "restore_seconds": ck.last_restore.seconds}))


def prepare_restore(kind: str, mb: int, work: Path, shm: Path) -> None:
    from resilient.checkpoint import CheckpointManager

    state = state_of(kind, mb)
    with CheckpointManager(local=work / f"restore-{kind}", interval=100, peer=False, snapshot=1,
                           snapshot_dir=shm) as ck:
        ck.restore(state)
        for step in range(4):
            ck.save(step, state, force=step == 3)
        ck.wait(300)
        ck.snapshot.flush(120)


def bench_restore(kind: str, mb: int, reps: int, work: Path) -> dict[str, Any]:
    shm = Path(tempfile.mkdtemp(prefix="snap-bench-", dir="/dev/shm"))
    me = [sys.executable, str(Path(__file__).resolve())]
    try:
        subprocess.run([*me, "--_prepare", kind, str(mb), str(work), str(shm)], check=True, timeout=600)
        disk, snap, tiers = [], [], set()
        for _ in range(reps):
            for tier, acc in (("local", disk), ("snapshot", snap)):
                p = subprocess.run([*me, "--_restore", kind, str(mb), str(work), str(shm), tier], check=True,
                                   capture_output=True, text=True, timeout=600)
                r = json.loads(p.stdout.strip().splitlines()[-1])
                acc.append(r["restore_seconds"])
                tiers.add((tier, r["tier"]))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {"state": kind, "local_restore_s": spread(disk), "snapshot_restore_s": spread(snap),
            "local_over_snapshot": paired(disk, snap), "tiers": sorted(tiers)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_restore":
        restore_worker(argv[1], int(argv[2]), Path(argv[3]), Path(argv[4]), argv[5])
        return 0
    if argv and argv[0] == "--_prepare":
        prepare_restore(argv[1], int(argv[2]), Path(argv[3]), Path(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--mb", type=int, default=None, help="size of the large state (default 512; --quick 32)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if not os.path.isdir("/dev/shm"):
        raise SystemExit("bench/snapshot.py: no /dev/shm on this host")
    reps = args.reps or (2 if args.quick else 5)
    mb = args.mb or (32 if args.quick else 512)
    kinds = ["recipe", "large"] if args.quick else ["recipe", "large", "gpt", "gpt_x10"]
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="snapshot-bench-"))
    load0 = os.getloadavg()
    blocking, restores = [], []
    try:
        for kind in kinds:
            blocking.append(bench_blocking(kind, mb, reps, work))
            restores.append(bench_restore(kind, mb, reps, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"reps": reps, "mb": mb, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
           "blocking": blocking, "restore": restores}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    m = statistics.median
    print(f"{'state':8s} {'MiB':>7s} {'tensors':>7s} {'copy ms':>8s} {'snapshot ms':>11s} {'÷ copy':>7s} "
          f"{'save() ms':>9s} {'commit ms':>9s} {'restore: local ms':>17s} {'snapshot ms':>11s} {'local ÷ snap':>12s}")
    for b, r in zip(blocking, restores):
        print(f"{b['state']:8s} {b['bytes'] / 2**20:7.1f} {b['tensors']:7d} {1e3 * b['copy_s']['median']:8.2f} "
              f"{1e3 * b['snapshot_s']['median']:11.2f} {b['snapshot_over_copy']['median']:7.2f} "
              f"{1e3 * b['save_s']['median']:9.2f} {1e3 * b['commit_thread_s']['median']:9.2f} "
              f"{1e3 * m(r['local_restore_s']['all']):17.1f} {1e3 * m(r['snapshot_restore_s']['all']):11.1f} "
              f"{r['local_over_snapshot']['median']:12.2f}")
    print(f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
