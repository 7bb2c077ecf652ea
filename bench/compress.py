"""Checkpoint compression on the state of a really trained model.

    python bench/compress.py                 # a few minutes on 2 busy cores
    python bench/compress.py --steps 50 --reps 2   # quicker

Trains the recipe's byte-level GPT (recipes/pytorch/model.py: 4 blocks of width 256, 3.2 M parameters)
with AdamW on the shipped corpus for ``--steps`` steps, then measures, on its weights and AdamW moments
(``exp_avg``, ``exp_avg_sq``) in fp32 and cast to bf16:

* the compression ratio per dtype and per part, for bgzstd (byte planes + zstd, ours), zstd (DCP's own
  ``ZStandard``, plain-readable), and where installed blosc2 (shuffle + zstd) and zipnn;
* the codec's throughput per core (one thread), encoding and decoding;
* the end-to-end upload of the whole state (``CheckpointManager``, local tier then the bundled
  fake-gcs-server) with ``--ckpt-compress none`` against ``bgzstd``, interleaved per repetition in the
  same run; the time is the manager's own (``ckpt_tier_done`` of the persistent tier: decide, code, send,
  commit). The compressed path codes and sends at once, in part objects of one request each; the plain
  path sends each file as one request, or a larger one as parts two at a time joined by GCS compose (the
  same transport; README figures taken before plain uploads moved to it used a resumable ``put_file``);
* the same data files sent over the same transport (parts of one request, two at a time) plain and coded,
  so that the gain of compression itself is told apart from that of the transport;
* the load average before and after each repetition (2 shared cores: the emulator, gcsfs and the codec
  compete for them).

Writes bench/results/compress.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes" / "pytorch"))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch  # noqa: E402

from model import GPT, GPTConfig, load_corpus  # noqa: E402
from resilient.checkpoint.format import codec as coding  # noqa: E402
from resilient.checkpoint.storage import parts as store_parts  # noqa: E402
from resilient.checkpoint.upload import chooser  # noqa: E402
from resilient.checkpoint.upload import transcode  # noqa: E402


def train(steps: int, seed: int = 0) -> tuple[GPT, torch.optim.Optimizer, float]:
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=64)
    m = GPT(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    data = load_corpus()
    g = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        ix = torch.randint(0, data.numel() - cfg.seq_len - 1, (8,), generator=g)
        x = torch.stack([data[i:i + cfg.seq_len] for i in ix])
        y = torch.stack([data[i + 1:i + cfg.seq_len + 1] for i in ix])
        loss = m.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return m, opt, loss.item()


def parts(m: GPT, opt: torch.optim.Optimizer, dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    params = list(m.parameters())
    return {"weights": [p.detach().to(dtype) for p in params],
            "exp_avg": [opt.state[p]["exp_avg"].to(dtype) for p in params],
            "exp_avg_sq": [opt.state[p]["exp_avg_sq"].to(dtype) for p in params]}


def _raw(ts: list[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in ts]


def codecs() -> dict[str, Any]:
    import zstandard

    out: dict[str, Any] = {
        "bgzstd": lambda b, es: len(coding.encode(b, es)),
        "zstd (DCP)": lambda b, es: len(zstandard.ZstdCompressor(level=1).compress(b)),
    }
    try:
        import blosc2

        out["blosc2 shuffle+zstd"] = lambda b, es: len(blosc2.compress2(
            b, typesize=es, codec=blosc2.Codec.ZSTD, clevel=1, filters=[blosc2.Filter.SHUFFLE], nthreads=1))
    except ImportError:
        pass
    try:
        from zipnn import ZipNN  # type: ignore[import-not-found]

        zn: dict[int, Any] = {}

        def zipnn_len(b: bytes, es: int) -> int:
            z = zn.setdefault(es, ZipNN(input_format="byte", bytearray_dtype={4: "float32", 2: "bfloat16"}[es],
                                        threads=1))
            return len(z.compress(b))

        out["zipnn"] = zipnn_len
    except ImportError:
        pass
    return out


def ratios(state: dict[str, dict[str, list[torch.Tensor]]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for dname, ps in state.items():
        for part, ts in ps.items():
            blobs, es = _raw(ts), ts[0].element_size()
            raw = sum(len(b) for b in blobs)
            row: dict[str, Any] = {"bytes": raw}
            for cname, f in codecs().items():
                t0 = time.perf_counter()
                n = sum(f(b, es) for b in blobs)
                row[cname] = {"ratio": round(raw / n, 3), "MBps_per_core": round(raw / (time.perf_counter() - t0) / 1e6)}
            # decode throughput of ours
            coded = [coding.encode(b, es) for b in blobs]
            t0 = time.perf_counter()
            for c in coded:
                coding.decode(c)
            row["bgzstd"]["decode_MBps_per_core"] = round(raw / (time.perf_counter() - t0) / 1e6)
            res[f"{dname}/{part}"] = row
    return res


def upload(state: dict[str, Any], mode: str, root: Path, url: str, run_dir: Path) -> float:
    """Seconds of the persistent upload of one step (the manager's own figure, from the ledger)."""
    from resilient.checkpoint.save.manager import CheckpointManager
    from resilient.events.ledger import read_events

    os.environ[chooser.ENV_MODE] = mode
    os.environ["RESILIENT_RUN_DIR"] = str(run_dir)
    ck = CheckpointManager(local=root, persistent=url, interval=1, persistent_every=1, keep_persistent=1)
    ck.save(1, state)
    assert ck.wait(600), "upload did not finish"
    ck.close()
    secs = [e.details["seconds"] for e in read_events(run_dir)
            if e.kind.value == "ckpt_tier_done" and e.details.get("tier") == "persistent"]
    return float(secs[-1])


def same_transport(step_dir: Path, url: str, step: int, coded_first: bool) -> tuple[float, float, float]:
    """(plain seconds, coded seconds, ratio): this rank's data files sent as parts of one request each, two
    at a time, as they are (cut at part boundaries) and coded by the pipeline."""
    from concurrent.futures import ThreadPoolExecutor

    from resilient.checkpoint.format.safe import load_metadata
    from resilient.checkpoint.storage.tiers import BoundedTier, make_tier

    tier = BoundedTier(make_tier(url, "persistent"), 60.0)
    names = sorted(p.name for p in step_dir.glob("*.distcp"))

    def plain() -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(store_parts.SENDERS) as ex:
            futs = []
            for n in names:
                data = (step_dir / n).read_bytes()
                ps = store_parts.part_size(len(data))
                futs += [ex.submit(tier.write_bytes, step, f"{n}.plain{i}", data[o:o + ps])
                         for i, o in enumerate(range(0, len(data), ps))]
            for f in futs:
                f.result()
        return time.perf_counter() - t0

    def coded() -> tuple[float, float]:
        md = load_metadata((step_dir / ".metadata").read_bytes(), what=".metadata")
        t0 = time.perf_counter()
        part = transcode.stream_files(step_dir, names, md, coding.Codec.BGZSTD, store_parts.TierDest(tier, step + 1))
        return time.perf_counter() - t0, part.ratio

    if coded_first:
        c, ratio = coded()
        p = plain()
    else:
        p = plain()
        c, ratio = coded()
    return p, c, ratio


def _spread(xs: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(xs), 3), "range": [round(min(xs), 3), round(max(xs), 3)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results" / "compress.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    m, opt, loss = train(args.steps)
    train_s = time.perf_counter() - t0
    print(f"trained {args.steps} steps in {train_s:.0f} s, loss {loss:.3f}", flush=True)
    state = {"fp32": parts(m, opt, torch.float32), "bf16": parts(m, opt, torch.bfloat16)}
    r = ratios(state)

    from tests._helpers.gcs import LocalGCS

    up: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-compress-") as tmp:
        gcs = LocalGCS(Path(tmp) / "gcs")
        gcs.start()
        try:
            for k, v in gcs.env().items():
                os.environ[k] = v
            gcs.make_bucket("bench")
            loads: list[list[float]] = []
            for dname, ps in state.items():
                flat = {f"{part}.{i}": t for part, ts in ps.items() for i, t in enumerate(ts)}
                times: dict[str, list[float]] = {"none": [], "bgzstd": []}
                tr: dict[str, list[float]] = {"plain": [], "coded": []}
                for rep in range(args.reps):  # interleaved: the baseline then ours, back to back
                    load0 = os.getloadavg()[0]
                    for mode in ("none", "bgzstd"):
                        d = Path(tmp) / f"{dname}-{mode}-{rep}"
                        times[mode].append(upload(flat, mode, d / "local", f"gs://bench/{d.name}", d / "run"))
                    d = Path(tmp) / f"{dname}-none-{rep}"
                    p, c, _ = same_transport(d / "local" / "step_00000001", f"gs://bench/{d.name}-tr", 10, rep % 2 == 1)
                    tr["plain"].append(p)
                    tr["coded"].append(c)
                    loads.append([round(load0, 2), round(os.getloadavg()[0], 2)])
                ratio = [a / b for a, b in zip(times["none"], times["bgzstd"])]
                tratio = [a / b for a, b in zip(tr["plain"], tr["coded"])]
                up[dname] = {"state_MB": round(sum(t.numel() * t.element_size() for t in flat.values()) / 1e6, 1),
                             "none_s": [round(x, 3) for x in times["none"]],
                             "bgzstd_s": [round(x, 3) for x in times["bgzstd"]],
                             "speedup_median": round(statistics.median(ratio), 3),
                             "speedup_range": [round(min(ratio), 3), round(max(ratio), 3)],
                             "same_transport": {"plain_parts_s": [round(x, 3) for x in tr["plain"]],
                                                "coded_parts_s": [round(x, 3) for x in tr["coded"]],
                                                "speedup": _spread(tratio)},
                             "load_avg_1min_before_after": loads[-args.reps:]}
                print(f"upload {dname}: {up[dname]}", flush=True)
        finally:
            gcs.stop()
    result = {"model": "GPT 4x256 (recipes/pytorch), AdamW", "steps": args.steps, "loss": round(loss, 3),
              "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "ratios": r, "upload": up,
              "part_MB": store_parts.part_size(0) / 2**20, "chunk_MB": transcode.CHUNK / 2**20, "senders": store_parts.SENDERS,
              "goals": {"bf16 weights >= 1.3x": r["bf16/weights"]["bgzstd"]["ratio"],
                        "fp32 weights >= 1.15x": r["fp32/weights"]["bgzstd"]["ratio"],
                        "bf16 upload >= 1.25x faster": up["bf16"]["speedup_median"],
                        "bf16 upload, same transport": up["bf16"]["same_transport"]["speedup"]["median"]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    names = list(codecs())
    print(f"\n{'part':22s}{'MB':>7s}" + "".join(f"{n:>22s}" for n in names) + f"{'bgzstd decode':>15s}")
    for k, row in r.items():
        print(f"{k:22s}{row['bytes'] / 1e6:7.1f}" + "".join(
            f"{row[n]['ratio']:>10.3f}x {row[n]['MBps_per_core']:>5d} MB/s" for n in names)
            + f"{row['bgzstd']['decode_MBps_per_core']:>10d} MB/s")
    for dname, u in up.items():
        st = u["same_transport"]
        print(f"upload {dname} ({u['state_MB']} MB) to the emulator: none {statistics.median(u['none_s']):.2f} s, "
              f"bgzstd {statistics.median(u['bgzstd_s']):.2f} s, speedup {u['speedup_median']}x "
              f"[{u['speedup_range'][0]}-{u['speedup_range'][1]}]; same transport (parts): plain "
              f"{statistics.median(st['plain_parts_s']):.2f} s, coded {statistics.median(st['coded_parts_s']):.2f} s, "
              f"{st['speedup']['median']}x [{st['speedup']['range'][0]}-{st['speedup']['range'][1]}]; "
              f"load {u['load_avg_1min_before_after']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
