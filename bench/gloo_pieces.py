"""What the data movement of a peer restore costs on its own, against a raw gloo transfer of the same bytes.

A peer or hot-swap restore of the GPT-shaped state reaches about half the speed of a raw transfer
(``bench/checkpoint.py --only peer,hotswap``). This bench takes the restore away and keeps only the way its
bytes move, one ingredient at a time, so that the gap can be placed: between two gloo ranks (2 processes),
252 MiB sent by rank 0 and received by rank 1, 16 messages in flight, as

* ``8 x 32 MiB``: the raw baseline of ``bench/checkpoint.py`` (one reused buffer each side);
* ``pieces``: the same bytes in tensor-sized pieces (512 KiB to 4 MiB, as a manifest cuts a GPT-shaped file);
* ``+ digest``: the receiver computes xxh3 of each piece after it lands (as every received block is checked);
* ``+ targets``: each piece lands in a tensor of its own instead of one buffer;
* ``+ file``: the sender sends from a read-only mapping of a file in the page cache (as ``send_pieces`` does);
* ``all``: pieces, digest, targets and file together.

Cases interleaved, the first round dropped; median wall time (rank 1's), and each rank's CPU.
``python bench/gloo_pieces.py [--reps 6] [--mb 252] [--out bench/results/gloo-pieces.json]``
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint import _run_pair, free_port  # noqa: E402  (bench/checkpoint.py: two ranks of a gloo pair)

CASES = {  # name: (tensor-sized pieces, digest on the receiver, a target per piece, send from a file mapping)
    "8 x 32 MiB": (False, False, False, False),
    "pieces": (True, False, False, False),
    "+ digest": (True, True, False, False),
    "+ targets": (True, False, True, False),
    "+ file": (True, False, False, True),
    "all": (True, True, True, True),
}
WINDOW = 16


def _pieces(total: int, tensor_sized: bool) -> list[int]:
    if not tensor_sized:
        k = 32 << 20
        return [min(k, total - a) for a in range(0, total, k)]
    rnd = random.Random(0)
    out, left = [], total
    while left > 0:
        n = min(left, rnd.choice([4 << 20, 2 << 20, 1 << 20, 1 << 20, 512 << 10]))
        out.append(n)
        left -= n
    return out


def worker(mb: int, reps: int, work: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import xxhash

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = mb << 20
    path = work / "sent.bin"
    if rank == 0:
        with open(path, "wb") as f:
            f.write(os.urandom(total))
    dist.barrier()
    buf = torch.ones(total, dtype=torch.uint8)
    f = open(path, "rb")
    mm = mmap.mmap(f.fileno(), total, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: torch warns that its tensor is not writable
        mapped = torch.frombuffer(mm, dtype=torch.uint8)
    targets = {tensor_sized: [torch.zeros(n, dtype=torch.uint8) for n in _pieces(total, tensor_sized)]
               for tensor_sized in (False, True)}
    rows: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for rep in range(reps + 1):
        for name, (tensor_sized, digest, own, from_file) in CASES.items():
            pieces = _pieces(total, tensor_sized)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            inflight: collections.deque[Any] = collections.deque()

            def finish() -> None:
                work_, t = inflight.popleft()
                work_.wait()
                if digest and rank == 1:
                    xxhash.xxh3_64_intdigest(memoryview(t.numpy()))

            off = 0
            for i, n in enumerate(pieces):
                while len(inflight) >= WINDOW:
                    finish()
                if rank == 0:
                    t = (mapped if from_file else buf)[off:off + n]
                    inflight.append((dist.isend(t, 1), t))
                else:
                    t = targets[tensor_sized][i] if own else buf[off:off + n]
                    inflight.append((dist.irecv(t, 0), t))
                off += n
            while inflight:
                finish()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            cpus: list[Any] = [None, None]
            dist.all_gather_object(cpus, cpu)
            if rep:
                rows[name].append((wall, cpus[0], cpus[1]))
    if rank == 1:
        def med(xs: list[float]) -> float:
            return statistics.median(xs)

        result = {name: {"wall_s": med([r[0] for r in v]), "wall_all_s": [r[0] for r in v],
                         "cpu_sender_s": med([r[1] for r in v]), "cpu_receiver_s": med([r[2] for r in v])}
                  for name, v in rows.items()}
        base = result["8 x 32 MiB"]["wall_s"]
        for v in result.values():
            v["raw_over_this"] = base / v["wall_s"]
        out.write_text(json.dumps({"mb": mb, "reps": reps, "window": WINDOW, "cpus": os.cpu_count(),
                                   "load_average": os.getloadavg(), "torch": torch.__version__, "cases": result},
                                  indent=1))
    del mapped
    mm.close()
    f.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6, help="measured rounds (one more warms up)")
    ap.add_argument("--mb", type=int, default=252, help="MiB sent (252: the GPT-shaped state)")
    ap.add_argument("--out", default=str(HERE / "results" / "gloo-pieces.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.mb, a.reps, Path(a.worker), Path(a.out))
        return
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gloo-pieces-") as work:
        _run_pair(free_port(), ["--worker", work, "--mb", str(a.mb), "--reps", str(a.reps), "--out", a.out],
                  "gloo pieces worker", script=__file__)
    res = json.loads(Path(a.out).read_text())
    print(f"{a.mb} MiB rank 0 -> rank 1 over gloo, {WINDOW} in flight, median of {a.reps}; load {load:.1f} before")
    print(f"{'case':12s} {'wall ms':>8s} {'raw / this':>10s} {'CPU sender ms':>14s} {'CPU receiver ms':>16s}")
    for name, v in res["cases"].items():
        print(f"{name:12s} {1e3 * v['wall_s']:8.1f} {v['raw_over_this']:10.2f} {1e3 * v['cpu_sender_s']:14.1f} "
              f"{1e3 * v['cpu_receiver_s']:16.1f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
