"""Start-up of a restarted worker that uses ``torch.compile``, with and without ``resilient.compile_cache``.

Attempt 1 compiles a small transformer training step and saves its compile caches into a run directory.
Attempt 2 is a fresh process with an *empty* local Inductor cache (a new process on a replacement node, or
a node whose /tmp was wiped); it starts either cold or after ``compile_cache.restore``. Measured from before
``import torch`` to the end of the first compiled step. Runs alternate between the two, several times.
Prints a table and writes bench/results/compile_cache.json.
Usage: python bench/compile_cache.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[3])
from resilient import compile_cache
t_import = time.perf_counter()
mode, cache = sys.argv[1], sys.argv[2]
restored = compile_cache.restore(cache) if mode == "warm" else None
t_restore = time.perf_counter()
torch.manual_seed(0)

class Block(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.att = torch.nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))

model = torch.nn.Sequential(Block(), Block())
opt = torch.optim.SGD(model.parameters(), lr=0.01)

@torch.compile
def step(x):
    loss = model(x).square().mean()
    loss.backward()
    return loss

step(torch.randn(4, 16, 64))
opt.step()
t_step = time.perf_counter()
if mode == "first":
    compile_cache.save(cache)
print(json.dumps({"import": t_import - t0, "restore": t_restore - t_import, "compile_first_step": t_step - t_restore,
                  "startup": t_step - t0, "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}))
"""


def child(mode: str, cache: Path, scratch: Path, i: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(scratch / f"inductor-{mode}-{i}"),
               TRITON_CACHE_DIR=str(scratch / f"triton-{mode}-{i}"), PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-c", CHILD, mode, str(cache), str(ROOT)], env=env, capture_output=True,
                         text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="compile-cache-bench-") as tmp:
        scratch = Path(tmp)
        cache = scratch / "run" / "compile_cache"
        first = child("first", cache, scratch, 0)
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for i in range(args.reps):
            for mode in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
                runs[mode].append(child(mode, cache, scratch, i))
                print(f"  {mode:<4} run {i}: {runs[mode][-1]['startup']:.2f} s", flush=True)
        blob = sum(f.stat().st_size for f in cache.iterdir())
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("import", "restore", "compile_first_step", "startup")}
           for m, rs in runs.items()}
    ratio = med["warm"]["startup"] / med["cold"]["startup"]
    print(f"\nattempt 2 start-up, median of {args.reps} (attempt 1 took {first['startup']:.2f} s; cache blob "
          f"{blob / 1024:.0f} KiB)")
    print(f"{'':<22}{'import':>8}{'restore':>9}{'compile+step':>14}{'total':>8}{'fx hits':>9}")
    for m, label in (("cold", "without cache"), ("warm", "with compile_cache")):
        d = med[m]
        hits = statistics.median(r["fxgraph_hit"] for r in runs[m])
        print(f"{label:<22}{d['import']:>8.2f}{d['restore']:>9.2f}{d['compile_first_step']:>14.2f}"
              f"{d['startup']:>8.2f}{hits:>9.0f}")
    print(f"with/without: {ratio:.2f}× the start-up time")
    out = ROOT / "bench" / "results" / "compile_cache.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"first_attempt": first, "runs": runs, "median": med, "warm_over_cold": ratio,
                               "blob_bytes": blob, "reps": args.reps, "torch": _torch_version()}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    t = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t:.0f} s)")
    sys.exit(rc)
