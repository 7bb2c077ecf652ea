"""How much background checkpoint work slows the GPT recipe's training steps, per tier and per lever.

Two ranks (gloo, one per "node", so peer replication runs) train the recipe's GPT (``recipes/pytorch/model.py``,
DDP, or FSDP2 with ``--fsdp``; AdamW, the shipped corpus) one micro-batch a step. Each case trains a window of
steps, timed as wall time on the training thread, with:

* ``none``: no checkpointing (the baseline; every repetition has its own);
* ``local``: a ``CheckpointManager`` with the local tier only;
* ``peer``: local + replication to the partner node;
* ``persistent``: local + peer + uploads of every save to a store (``--store``: a ``file://`` directory, or ``gcs``,
  the bundled fake-gcs-server on this machine through gcsfs, as a ``gs://`` job uploads);

each saved every step (``--intervals 1``) and every N steps (a save at the first step of each period of N, so each
save's background work falls inside the window), and each with every lever value of ``--levers``
(``CheckpointConfig.background_nice``: 0 leaves the threads at the process's priority; 1-19 a nice value per
thread; ``idle`` SCHED_IDLE), of ``--switch-intervals`` (the interpreter's GIL switch interval, ``sys.setswitchinterval``,
while the window runs: how long a thread that wants the GIL waits before asking its holder to let go; Python's default
is 5 ms) and of ``--writers`` (the local tier's writer: ``record``, ours, which writes each
tensor's record from a template and hashes as it writes; ``stock``, DCP's ``FileSystemWriter`` with the manifest
read back, as before it), and for the persistent tier of ``--upload-process`` (``on``: uploads' bytes sent from the
upload process, the default; ``off``: from the upload thread in the training process, ``CheckpointConfig.upload_process``). ``--profile PREFIX`` runs rank 0's save worker under cProfile. Cases run interleaved:
each repetition runs every case once, in an order of its own. A case's overhead is its window's wall over the baseline's of the same repetition, minus one; the table
gives the median over repetitions and the spread (min-max).

At the auto interval: ``--ckpt-interval auto`` saves so rarely on a real job (Young/Daly with the 6 h prior) that a
window would hold no save; the figure is derived from the measured cost of one save (the wall it added, blocking
included, at the sparsest measured interval) and the interval the real ``IntervalTuner`` picks for that cost and
the clean step: overhead = cost / (interval x clean step).

On a CPU machine training and the checkpoint threads compete for the same cores (``--threads`` intra-op threads
per rank, 1 by default, so two ranks fill two cores). ``--device cuda`` puts the model and its optimizer state on
the GPU (rank r on GPU r modulo the GPUs there; each step ends with a device synchronisation, so the wall is the
GPU's), and the checkpoint's staging becomes a device-to-host copy. The ranks still talk over gloo (it reduces CUDA
tensors through host memory): on a machine of one GPU, NCCL refuses two ranks on one device. ``--world 1`` runs one
rank (no DDP traffic, no peer tier): the step is the GPU's alone.

``--step launch`` stands in for a GPU job's training thread on a CPU machine: each step is ``--launch-ops`` pairs of
tiny tensor operations, dispatch-bound as kernel launches are (each gives up the GIL and takes it back), while the
state saved is still the model's and AdamW's. ``--pin`` (Linux) puts rank r's training thread on CPU r and every
other thread of the rank (the checkpoint's among them) on the CPUs past the ranks', so that no save takes a core
from training.

Where a save's cost goes, from the training thread's own accounting (``/proc/self/task/<tid>/schedstat``) against
the baseline of the same repetition, per save: ``staging`` (CPU inside ``save()``: the copy to host memory),
``waiting`` (off the CPU inside ``save()``: the previous save still writing), ``slower`` (the training thread's own
CPU time beyond the baseline's, staging excluded: the same instructions running slower beside the save, its bytes
through the shared caches), ``no core`` (runnable, waiting for a CPU) and ``off CPU`` (blocked outside ``save()``:
the GIL held by the save's Python, locks; on a GPU also waits for the device beyond the baseline's).

    python bench/interference.py [--reps 5] [--steps 30] [--intervals 1,10] [--levers 0,19,idle]
        [--writers stock,record] [--switch-intervals 0.005,0.0005] [--n-layer 4 --d-model 256] [--tiers local,peer,persistent]
        [--store file|gcs] [--upload-process on,off] [--profile PREFIX]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes" / "pytorch"))

TIERS = ("local", "peer", "persistent")
DEFAULT_SWITCH_S = 0.005  # CPython's own


def _cases(args: argparse.Namespace) -> list[dict]:
    out = [{"name": "none", "tier": "none", "nice": 0, "interval": 1, "writer": "record", "switch": DEFAULT_SWITCH_S}]
    for interval in args.intervals:
        for tier in args.tiers:
            for nice in args.levers:
                for writer in args.writers:
                    for sw in args.switch_intervals:
                        for up in (args.upload_process if tier == "persistent" else ["on"]):
                            name = f"{tier}/every{interval}/nice={nice}/{writer}" + (
                                f"/switch={sw * 1e3:g}ms" if sw != DEFAULT_SWITCH_S else "") + (
                                "/upload=thread" if up == "off" else "")
                            out.append({"name": name, "tier": tier, "nice": nice, "interval": interval,
                                        "writer": writer, "switch": sw, "upload_process": up == "on"})
    return out


class _StockWriter:
    """The ``--writers stock`` lever: DCP's own ``FileSystemWriter`` for the local tier, as before the record
    writer (no entries computed while writing, so the manifest reads each file back)."""

    def __new__(cls, path, sync_files=True):  # noqa: ANN001, ANN204 - the writer's constructor, as the manager calls it
        from torch.distributed.checkpoint import FileSystemWriter

        w = FileSystemWriter(path, sync_files=sync_files, thread_count=1, overwrite=True)
        w.entries = {}
        return w


def _use_writer(name: str) -> None:
    import resilient.checkpoint.save.manager as m
    from resilient.checkpoint.save.writer import RecordWriter

    m.RecordWriter = _StockWriter if name == "stock" else RecordWriter


def _profiled_save_loop(out: str):  # noqa: ANN202
    """The save worker's loop under cProfile (``--profile``), its stats and the thread's CPU time dumped when the
    manager closes. The profiler's clock is the thread's CPU time: CPU is what a save takes from training on a
    busy machine, and a wall clock would rank the waits in collectives first."""
    import cProfile

    from resilient.checkpoint.save.manager import CheckpointManager

    orig = CheckpointManager._save_loop

    def loop(self):  # noqa: ANN001, ANN202
        prof = cProfile.Profile(time.thread_time)
        cpu0 = time.thread_time()
        prof.enable()
        try:
            orig(self)
        finally:
            prof.disable()
            prof.dump_stats(f"{out}.{id(self)}.prof")
            Path(f"{out}.{id(self)}.cpu").write_text(str(time.thread_time() - cpu0))
    CheckpointManager._save_loop = loop


def _lever(text: str) -> int | str:
    t = text.strip().lower()
    return "idle" if t == "idle" else int(t)


def _thread_sched() -> tuple[float, float]:
    """The calling thread's seconds on a CPU and seconds runnable but waiting for one (Linux; zeros elsewhere)."""
    try:
        on, wait, _ = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()
        return int(on) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _rank_main(rank: int, world: int, init: str, root: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    for k in [k for k in os.environ if k.startswith("RESILIENT_")]:
        del os.environ[k]  # no ledger, no agent: the manager alone
    from resilient import env as renv

    os.environ[renv.CKPT_COMPRESS] = args.compress
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from model import GPT, CorpusWindows, GPTConfig, load_corpus

    from resilient.checkpoint.save.manager import CheckpointManager

    if args.profile and rank == 0:
        _profiled_save_loop(args.profile)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model)
    model = GPT(cfg).to(device)
    if args.fsdp:  # as the recipe's --fsdp: every block, then the root, sharded over the ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CorpusWindows(load_corpus(), cfg.seq_len)
    g = torch.Generator().manual_seed(rank)
    state = {"model": model, "optim": optim}
    loss_sum = torch.zeros((), device=device)

    def train_step() -> None:
        idx = torch.randint(len(data), (args.batch,), generator=g).tolist()
        x = torch.stack([data[j][0] for j in idx]).to(device)
        y = torch.stack([data[j][1] for j in idx]).to(device)
        optim.zero_grad(set_to_none=True)
        logits = ddp(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optim.step()
        loss_sum.copy_(loss.detach())
        dist.all_reduce(loss_sum)  # as the recipe does: the step's mean loss on every rank
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's wall is the GPU's, not its launch's

    tiny = torch.ones(4)

    def launch_step() -> None:
        t = tiny
        for _ in range(args.launch_ops):
            t = t * 1.0 + 0.0  # each operation releases the GIL and takes it back, as a kernel launch does
        dist.all_reduce(loss_sum)  # the ranks in step, as DDP keeps them

    train_step()  # the optimizer's state exists before any save, whatever the step
    if args.step == "launch":
        train_step = launch_step  # noqa: F811 - the stand-in replaces the model's step from here on
    if args.pin:
        others = set(range(world, os.cpu_count() or world + 1))
        os.sched_setaffinity(0, others)  # threads made from here on (the checkpoint's) inherit it

    for _ in range(args.warmup):
        train_step()
    from resilient.checkpoint.format.state import leaf_nbytes  # a DTensor's local shard: what this rank saves

    nbytes = sum(leaf_nbytes(t) for t in model.state_dict().values()) + \
        sum(leaf_nbytes(v) for s in optim.state.values() for v in s.values())
    cases = _cases(args)
    rows = []
    step_no = 0
    for rep in range(args.reps):
        order = list(range(len(cases)))
        random.Random(1000 + rep).shuffle(order)  # the same order on both ranks
        for ci in order:
            case = cases[ci]
            ck = None
            d = Path(root) / f"r{rep}c{ci}"
            if case["tier"] != "none":
                _use_writer(case["writer"])
                if args.pin:
                    os.sched_setaffinity(0, others)  # the manager's threads off the training thread's CPU
                ck = CheckpointManager(
                    local=str(d / "local{node}"), peer=case["tier"] != "local" and world > 1,
                    persistent=(None if case["tier"] != "persistent" else f"gs://bench/{d.name}" if args.store == "gcs"
                                else f"file://{d / 'store'}"),
                    upload_process=case.get("upload_process", True),
                    interval=1, persistent_every=1, keep_local=2, keep_peer=2, keep_persistent=2,
                    background_nice=case["nice"], upload_grace_s=120, collective_timeout_s=300)
                for _ in range(2):  # the first save allocates the staging buffers: outside the window
                    train_step()
                    ck.save(step_no, state)
                    step_no += 1
                ck.wait(timeout=300, upload_timeout=300)
            else:
                for _ in range(2):
                    train_step()
            if args.pin:
                os.sched_setaffinity(0, {rank})
            dist.barrier()
            times, blocking, blocking_cpu, saves = [], 0.0, 0.0, 0
            sys.setswitchinterval(case["switch"])
            t_start, cpu_start, sched_start = time.perf_counter(), time.process_time(), _thread_sched()
            for i in range(args.steps):
                t0 = time.perf_counter()
                train_step()
                if ck is not None and i % case["interval"] == 0:
                    t1, c1 = time.perf_counter(), time.thread_time()
                    ck.save(step_no, state)
                    blocking += time.perf_counter() - t1
                    blocking_cpu += time.thread_time() - c1
                    saves += 1
                step_no += 1
                times.append(time.perf_counter() - t0)
            wall = time.perf_counter() - t_start
            sched = _thread_sched()
            sys.setswitchinterval(DEFAULT_SWITCH_S)
            if ck is not None:
                ck.wait(timeout=300, upload_timeout=300)
            # CPU time of the whole process (training, checkpoint and gloo threads), the window's saves finished:
            # what the saves cost whatever else the machine runs
            cpu = time.process_time() - cpu_start
            if ck is not None:
                ck.close(timeout=300)
            mine = {"rep": rep, "case": case["name"], "wall": wall, "median_step": statistics.median(times),
                    "blocking": blocking, "saves": saves, "cpu": cpu, "blocking_cpu": blocking_cpu,
                    "train_on_cpu": sched[0] - sched_start[0], "train_no_core": sched[1] - sched_start[1]}
            everyone: list = [None] * world
            dist.all_gather_object(everyone, mine)
            if rank == 0:
                # the job runs at its slowest rank's pace (DDP waits for it every step)
                slow = max(everyone, key=lambda r: r["wall"])
                rows.append({**slow, "walls": [r["wall"] for r in everyone]})
                print(f"rep {rep} {case['name']:<34} wall {slow['wall']:.3f} s  median step "
                      f"{slow['median_step'] * 1e3:.1f} ms  blocking {slow['blocking'] * 1e3:.0f} ms", flush=True)
            dist.barrier()
            shutil.rmtree(d, ignore_errors=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "state_bytes_per_rank": nbytes,
                                         "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                                         else "cpu"}))
    dist.barrier()
    dist.destroy_process_group()
    # a rank ends as resilient-run's workers do: no finalisation, so no gloo exit abort (README, Known limits)
    from resilient.worker import exit_safety

    exit_safety.finish(0)


def _auto(cost_s: float, blocking_s: float, clean_step_s: float) -> tuple[int, float]:
    """The interval the real tuner picks for a save costing ``cost_s`` of wall (``blocking_s`` of it blocking),
    with its default prior; and the share of wall the saves then take."""
    from resilient.checkpoint.save.interval import IntervalTuner

    tuner = IntervalTuner()
    for _ in range(64):
        tuner.observe_step(clean_step_s)
        tuner.observe_save(blocking_s)
        tuner.observe_interference(max(0.0, cost_s - blocking_s))
    steps = max(1, int(tuner.interval_steps()))
    return steps, max(0.0, cost_s) / (steps * clean_step_s)


def summarise(rows: list[dict], args: argparse.Namespace) -> dict:
    base = {r["rep"]: r for r in rows if r["case"] == "none"}
    cases: dict[str, dict] = {}
    for r in rows:
        if r["case"] == "none":
            continue
        b = base[r["rep"]]
        c = cases.setdefault(r["case"], {"overhead": [], "cost_per_save_s": [], "blocking_per_save_s": [],
                                         "median_step_s": [], "cpu_per_save_s": []})
        if "cpu" in r:
            c["cpu_per_save_s"].append((r["cpu"] - b["cpu"]) / max(1, r["saves"]))
        c["overhead"].append(r["wall"] / b["wall"] - 1.0)
        c["cost_per_save_s"].append((r["wall"] - b["wall"]) / max(1, r["saves"]))
        c["blocking_per_save_s"].append(r["blocking"] / max(1, r["saves"]))
        c["median_step_s"].append(r["median_step"])
        if "train_on_cpu" in r and "train_on_cpu" in b:
            n = max(1, r["saves"])
            d_wall, d_on = r["wall"] - b["wall"], r["train_on_cpu"] - b["train_on_cpu"]
            d_wait, waiting = r["train_no_core"] - b["train_no_core"], r["blocking"] - r["blocking_cpu"]
            for k, v in (("staging", r["blocking_cpu"]), ("waiting", waiting), ("slower", d_on - r["blocking_cpu"]),
                         ("no_core", d_wait), ("off_cpu", d_wall - d_on - d_wait - waiting)):
                c.setdefault(f"split_{k}_s", []).append(v / n)
    clean = statistics.median(b["wall"] / args.steps for b in base.values())
    cpu_step = statistics.median(b["cpu"] / args.steps for b in base.values()) if all("cpu" in b for b in base.values()) \
        else None
    out = {}
    for name, c in cases.items():
        tier, every, nice, *rest = name.split("/")
        writer = next((x for x in rest if not x.startswith(("switch=", "upload="))), "stock")
        upload = next((x.split("=", 1)[1] for x in rest if x.startswith("upload=")), "process")
        switch = next((x.split("=", 1)[1] for x in rest if x.startswith("switch=")), f"{DEFAULT_SWITCH_S * 1e3:g}ms")
        s = {"tier": tier, "interval": int(every[len("every"):]), "background_nice": nice.split("=", 1)[1],
             "writer": writer, "switch_interval": switch, "upload": upload,
             "overhead_median": statistics.median(c["overhead"]), "overhead_min": min(c["overhead"]),
             "overhead_max": max(c["overhead"]), "cost_per_save_s": statistics.median(c["cost_per_save_s"]),
             "blocking_per_save_s": statistics.median(c["blocking_per_save_s"]),
             "median_step_s": statistics.median(c["median_step_s"]), "overheads": c["overhead"],
             "cpu_per_save_s": statistics.median(c["cpu_per_save_s"]) if c["cpu_per_save_s"] else None}
        if "split_staging_s" in c:  # where a save's cost went, per save (see the module's docstring)
            s["split_per_save_s"] = {k[len("split_"):-2]: statistics.median(v) for k, v in c.items()
                                     if k.startswith("split_")}
        out[name] = s
    sparsest = max(args.intervals)
    for name, s in out.items():
        if s["interval"] == sparsest:
            # the wall a sparse save adds is within the load's noise on a busy machine; its CPU is not: charge the
            # save its blocking time plus all the CPU its background work took (on cores training needs, every
            # CPU-second of it comes out of a step), the measured wall cost where that is larger
            cost = s["blocking_per_save_s"] + max(s["cpu_per_save_s"] or 0.0, s["cost_per_save_s"] - s["blocking_per_save_s"])
            steps, share = _auto(cost, s["blocking_per_save_s"], clean)
            s["auto_cost_per_save_s"], s["auto_interval_steps"], s["auto_overhead"] = cost, steps, share
    return {"clean_step_s": clean, "cpu_per_clean_step_s": cpu_step, "cases": out}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (a usage error exits 2 naming the flag)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per case (a multiple of every interval)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--intervals", default="1,10", help="save every N steps, comma-separated")
    ap.add_argument("--levers", default="0", help="background_nice values, comma-separated")
    ap.add_argument("--switch-intervals", default=str(DEFAULT_SWITCH_S),
                    help="GIL switch intervals in seconds while a window runs, comma-separated (Python's default 0.005)")
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--writers", default="stock,record",
                    help="the local tier's writer, comma-separated: record (ours) or stock (DCP's FileSystemWriter)")
    ap.add_argument("--store", choices=("file", "gcs"), default="file",
                    help="the persistent tier: a file:// directory, or the bundled fake-gcs-server through gcsfs")
    ap.add_argument("--compress", choices=("auto", "none", "bgzstd", "zstd"), default="auto",
                    help="the persistent tier's --ckpt-compress (auto, the default, codes a probe of large uploads in "
                         "the training process)")
    ap.add_argument("--upload-process", default="on",
                    help="for the persistent tier, comma-separated: on (uploads' bytes from the upload process) and/or "
                         "off (from the upload thread in the training process)")
    ap.add_argument("--profile", metavar="PREFIX", default=None,
                    help="profile rank 0's save worker: PREFIX.<manager>.prof (cProfile) and .cpu (its CPU seconds)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model and its state live")
    ap.add_argument("--world", type=int, choices=(1, 2), default=2, help="ranks (1: no DDP traffic, no peer tier)")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard with FSDP2 (fully_shard per block, as the recipe's --fsdp) instead of DDP: the state "
                         "saved is DTensors")
    ap.add_argument("--step", choices=("model", "launch"), default="model",
                    help="the training step: the model's, or a stand-in for a GPU job's launches (--launch-ops)")
    ap.add_argument("--launch-ops", type=int, default=1500, help="with --step launch: operation pairs a step")
    ap.add_argument("--pin", action="store_true",
                    help="Linux: rank r's training thread on CPU r, every other thread past the ranks' CPUs")
    ap.add_argument("--root", default=None, help="where the tiers go (default: a temporary directory)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "interference.json"))
    ap.add_argument("--summarise", metavar="JSON", default=None,
                    help="no run: summarise the rows of an earlier result again (its settings are read from it)")
    args = ap.parse_args(argv)
    args.intervals = [int(x) for x in args.intervals.split(",")]
    args.levers = [_lever(x) for x in args.levers.split(",")]
    try:
        args.switch_intervals = [float(x) for x in args.switch_intervals.split(",")]
    except ValueError:
        ap.error(f"--switch-intervals: seconds, comma-separated (such as 0.005,0.0005), got {args.switch_intervals!r}")
    if any(not 0 < x <= 1 for x in args.switch_intervals):
        ap.error("--switch-intervals: each above 0 and at most 1 s")
    args.tiers = [t.strip() for t in args.tiers.split(",")]
    args.writers = [w.strip() for w in args.writers.split(",")]
    if any(w not in ("record", "stock") for w in args.writers):
        ap.error("--writers: record, stock")
    args.upload_process = [u.strip() for u in args.upload_process.split(",")]
    if any(u not in ("on", "off") for u in args.upload_process):
        ap.error("--upload-process: on, off")
    if any(t not in TIERS for t in args.tiers):
        ap.error(f"--tiers: each of {', '.join(TIERS)}")
    if args.launch_ops < 1:
        ap.error(f"--launch-ops: at least 1, got {args.launch_ops}")
    if args.pin and (not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) <= args.world):
        ap.error(f"--pin needs Linux and more CPUs than ranks ({os.cpu_count()} CPUs, {args.world} rank(s))")
    if args.world == 1 and "peer" in args.tiers:
        ap.error("--tiers: the peer tier needs a partner rank; with --world 1 use local,persistent")
    if args.device == "cuda" and not args.summarise and not torch.cuda.is_available():
        ap.error("--device cuda: this machine's torch sees no CUDA GPU")
    if any(args.steps % n for n in args.intervals):
        ap.error("--steps must be a multiple of every interval")
    return args


def main() -> int:
    args = parse_args()
    t0 = time.time()
    load0 = os.getloadavg()
    if args.summarise:
        old = json.loads(Path(args.summarise).read_text())
        for k in ("reps", "steps"):
            setattr(args, k, old[k])
        args.n_layer, args.d_model, args.batch = (old["model"][k] for k in ("n_layer", "d_model", "batch"))
        args.device, args.world = old["model"].get("device", "cpu"), old["model"].get("ranks", 2)
        args.step, args.launch_ops = old["model"].get("step", "model"), old["model"].get("launch_ops", args.launch_ops)
        args.pin = old["model"].get("pin", False)
        args.intervals = sorted({r["interval"] for r in old["cases"].values()})
        data = {"rows": old["rows"], "state_bytes_per_rank": old["state_bytes_per_rank"],
                "device_name": old["model"].get("device_name", "cpu")}
        load0, t0 = tuple(old["load_before"]), time.time() - old["seconds"]
    else:
        root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="interference-"))
        root.mkdir(parents=True, exist_ok=True)
        raw = root / "rows.json"
        gcs = None
        if args.store == "gcs":
            from tests._helpers.gcs import LocalGCS

            gcs = LocalGCS(root / "gcs").start()
            if args.pin:  # the store's server off the training threads' CPUs, as a remote store would be
                others = set(range(args.world, os.cpu_count() or args.world + 1))
                for t in psutil.Process(gcs.proc.pid).threads():  # type: ignore[union-attr]
                    os.sched_setaffinity(t.id, others)
            gcs.make_bucket("bench")
            os.environ.update(gcs.env())  # the ranks inherit it
        try:
            mp.start_processes(_rank_main, args=(args.world, f"file://{root / 'rdzv'}", str(root), args, str(raw)),
                               nprocs=args.world, start_method="spawn")
            data = json.loads(raw.read_text())
        finally:
            if gcs is not None:
                gcs.stop()
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)
    summary = summarise(data["rows"], args)
    result = {"bench": "interference", "model": {"n_layer": args.n_layer, "d_model": args.d_model,
                                                 "batch": args.batch, "ranks": args.world, "threads_per_rank": args.threads,
                                                 "device": args.device, "device_name": data.get("device_name", "cpu"),
                                                 "step": args.step, "launch_ops": args.launch_ops, "pin": args.pin},
              "state_bytes_per_rank": data["state_bytes_per_rank"], "reps": args.reps, "steps": args.steps,
              "cpus": os.cpu_count(), "load_before": load0, "store": getattr(args, "store", "file"),
              "compress": getattr(args, "compress", "auto"),
              "load_after": json.loads(Path(args.summarise).read_text())["load_after"] if args.summarise
              else os.getloadavg(),
              "seconds": time.time() - t0, "torch": torch.__version__, **summary, "rows": data["rows"]}
    print(f"\nGPT {args.n_layer}x{args.d_model} on {data.get('device_name', 'cpu')}, {args.world} rank(s), "
          f"state {data['state_bytes_per_rank'] / 2**20:.1f} MiB a rank "
          f"(model + AdamW), clean step {summary['clean_step_s'] * 1e3:.1f} ms "
          f"({(summary['cpu_per_clean_step_s'] or 0) * 1e3:.1f} ms CPU), {args.reps} reps x {args.steps} "
          f"steps; load {load0[0]:.1f} -> {result['load_after'][0]:.1f}")
    print(f"{'tier':<11} {'every':>5} {'nice':>5} {'writer':>6} {'switch':>7} {'upload':>7} {'overhead':>9} {'spread':>17} {'cost/save ms':>12} "
          f"{'block ms':>8} {'cpu/save ms':>11} {'auto every':>10} {'auto ovh':>8}   per save, ms: staging waiting "
          f"slower no-core off-CPU")
    for s in sorted(summary["cases"].values(), key=lambda s: (s["interval"], TIERS.index(s["tier"]),
                                                              str(s["background_nice"]), s["writer"],
                                                              -float(s["switch_interval"].rstrip("ms")), s["upload"])):
        auto = (f"{s['auto_interval_steps']:>10d} {s['auto_overhead'] * 100:>7.2f}%"
                if "auto_interval_steps" in s else f"{'':>10} {'':>8}")
        print(f"{s['tier']:<11} {s['interval']:>5d} {s['background_nice']:>5} {s['writer']:>6} {s['switch_interval']:>7} "
              f"{s['upload'] if s['tier'] == 'persistent' else '':>7} "
              f"{s['overhead_median'] * 100:>8.1f}% "
              f"[{s['overhead_min'] * 100:>6.1f}%, {s['overhead_max'] * 100:>6.1f}%] "
              f"{s['cost_per_save_s'] * 1e3:>12.1f} {s['blocking_per_save_s'] * 1e3:>8.1f} "
              f"{(s['cpu_per_save_s'] or 0) * 1e3:>11.1f} {auto}"
              + ("   " + " ".join(f"{s['split_per_save_s'][k] * 1e3:>{w}.1f}" for k, w in
                                  (("staging", 7), ("waiting", 7), ("slower", 6), ("no_core", 7), ("off_cpu", 7)))
                 if "split_per_save_s" in s else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
