"""Restore planning at scale: what one rank of an FSDP2 job of W ranks pays to plan its restore, against DCP's own.

    python bench/metadata_scale.py                      # W = 8, 64, 256, 1024; 900 tensors; 3 repetitions
    python bench/metadata_scale.py --quick              # W = 4, 16; 60 tensors; 1 repetition (seconds)

DCP's ``.metadata`` is global: it lists every rank's chunk of every tensor, so an FSDP2 job of W ranks and T
sharded tensors (parameters and optimizer moments, ``Shard(0)`` over one ``dp`` mesh) writes W x T chunk entries,
and every rank parses all of them at every restart. This measures, for rank 0 of W, with the same state
(real ``DTensor`` targets of the job's layout, over torch's fake process group so one process can hold rank 0 of
any W) and the same ``.metadata`` bytes (DCP's own classes, pickled as DCP writes them):

* DCP's restore planning: ``pickle.loads`` of the bytes (what ``FileSystemReader.read_metadata`` does) and
  ``create_default_local_load_plan`` (``dcp.load``'s planner for this rank);
* ours: ``load_metadata`` (the restricted unpickler and its file-name checks), then the restore's own planning
  functions as ``restore()`` calls them (``_plan_load``: what this rank loads, ``_direct_plan``: which chunks land
  straight in the targets and where; it walks every storage item once).

* ours from the rank index (``format/rank_index.py``): what a restart of the layout it saved does instead, decoding
  the rank's own entries kept in its manifest, planning from them and checking they hold every target (the chunks
  it plans to must be the whole file's: asserted). Such a rank reads nothing of ``.metadata``; before, it still
  mapped the file and verified it (timed here from the page cache, as ``metadata_verify_before_s``).

Beside them, the restore's first collective, which DCP does not have: every rank receives every rank's manifest
(its files' block digests for a checkpoint of ``--state-gb`` cut in W shards, and where each tensor's bytes start)
and unpickles them; reported as the bytes one rank receives and its seconds to unpickle them (a node also offers its
replica partner's copies, which doubles both; the transfer itself needs W machines and is not measured).

And the save side, per local save of a multi-node job (``_spread_costs``): what rank 0 spends writing ``.metadata``
as the last one with new ids, and what reaches the other nodes: before, the whole file broadcast to every rank; now,
the ids' places and bytes, from which each node's leader makes the file out of its copy of the last step's (timed:
read from the page cache, ids written, crc32c checked). Before, every rank also read the file back and hashed it for
its manifest (timed); now the offer carries its entry, hashed by rank 0's writer as it wrote the file.

No data is read: the planning alone, the part that grows with W. The cyclic collector is paused around each
measurement, as ``restore()`` pauses it. Each W runs in a fresh process (its peak memory is its own). Reported per
W: the ``.metadata`` size, both sides' seconds (median of ``--reps``), our total ÷ DCP's, and the process's peak
memory growth while holding the parsed metadata (``parsed``). Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

ROWS, COLS = 4, 8  # each rank's shard of each tensor: planning cost does not depend on the bytes
RECORD = 1600  # torch.save's records around a tensor's bytes in a .distcp file (1.5-1.6 KB measured)


def _metadata(world: int, tensors: int) -> bytes:
    """The job's ``.metadata`` as DCP writes it: every rank's chunk of every tensor (DCP's own classes, pickled)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for t in range(tensors):
        fqn = f"model.{_name(t)}"
        chunks = []
        for r in range(world):
            off = torch.Size([r * ROWS, 0])
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=torch.Size([ROWS, COLS])))
            storage[MetadataIndex(fqn, off, r)] = _StorageInfo(f"__{r}_0.distcp", t * ITEM, ITEM)
        sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                         size=torch.Size([ROWS * world, COLS]), chunks=chunks)
    return pickle.dumps(Metadata(state_dict_metadata=sdm, storage_data=storage, storage_meta=_meta(4)))


def _meta(step: int) -> Any:
    """The ids a save writes into its ``.metadata``: its directory and a uuid (as ``FileSystemWriter`` makes)."""
    import uuid
    from pathlib import PurePosixPath

    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta(checkpoint_id=PurePosixPath(f"/ckpt/step_{step:08d}"), save_id=str(uuid.UUID(int=step)))


def _name(t: int) -> str:
    return f"layers.{t // 9}.w{t % 9}"


NBYTES = ROWS * COLS * 4
ITEM = RECORD + NBYTES  # one tensor's record in a rank's file


def _rank0(world: int, tensors: int, md_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0's state (DTensors sharded over ``world`` ranks) and its manifest's entries: ``.metadata`` and its one
    data file with the layout the save records (where each tensor's bytes start)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from resilient.checkpoint.api import FileEntry

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = {_name(t): DTensor.from_local(torch.zeros(ROWS, COLS), mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size([ROWS * world, COLS]), stride=(COLS, 1))
             for t in range(tensors)}
    layout = tuple((t * ITEM, t * ITEM + RECORD - 64, NBYTES) for t in range(tensors))
    files = {".metadata": FileEntry(size=md_size, crc32c=0),
             "__0_0.distcp": FileEntry(size=tensors * ITEM, crc32c=0, items=layout)}
    return {"model": model}, files


def _manifest(rank: int, world: int, tensors: int, md_size: int, state_bytes: int) -> Any:
    """Rank ``rank``'s manifest as the save writes it: its one data file with a verification digest per block (the
    job's checkpoint of ``state_bytes`` cut in ``world`` shards) and where each tensor's bytes start."""
    import random

    from resilient.checkpoint.api import FileEntry, Manifest
    from resilient.checkpoint.format.digests import BLOCK

    size = max(tensors * ITEM, state_bytes // world)
    per = size // tensors
    n = -(-size // BLOCK)
    rnd = random.Random(rank)  # digests look random: pickled, small ints would be shorter than real ones
    digests = tuple(rnd.getrandbits(32) for _ in range(n))
    data = FileEntry(size=size, crc32c=rnd.getrandbits(32), block_size=BLOCK, blocks=digests,
                     items=tuple((t * per, t * per + RECORD - 64, per - RECORD) for t in range(tensors)),
                     xxh3=tuple(rnd.getrandbits(64) for _ in range(n)))
    return Manifest(step=100, rank=rank, world_size=world, files={f"__{rank}_0.distcp": data},
                    metadata=FileEntry(size=md_size, crc32c=1), wall=1.0)


def _timed(fn: Any) -> tuple[float, Any]:
    gc.disable()  # as restore() runs: with gc on, a parse of a million objects is a series of full passes
    try:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    finally:
        gc.enable()


def _spread_costs(raw: bytes, md_path: Path, reps: int) -> dict[str, Any]:
    """The save side, per local save of a multi-node job after the first: rank 0 writes ``.metadata`` as the last
    one with new ids (before: each differing id counted and replaced in the whole file; now: written at the places
    found once), and every other node gets it (before: the whole file broadcast to every rank; now: the ids'
    places and bytes, which each node's leader writes into its copy of the last step's file and checks by crc32c)."""
    import torch.distributed as dist

    from resilient.checkpoint.api import FileEntry
    from resilient.checkpoint.format.digests import crc_bytes
    from resilient.checkpoint.save.writer import RecordMemo, _ids

    md_obj, results = object(), object()
    old_meta, new_meta = _meta(4), _meta(5)
    old, new = _ids(old_meta), _ids(new_meta)
    assert old is not None and new is not None
    memo = RecordMemo()
    keep_s, _ = _timed(lambda: memo.keep_metadata(md_obj, results, old_meta, raw))
    before, now, leader = [], [], []
    for _ in range(reps):
        def old_way() -> bytes:
            blob = raw
            for a, b in zip(old, new):
                if a != b:
                    assert blob.count(a) == 1
                    blob = blob.replace(a, b)
            return blob
        s, want = _timed(old_way)
        before.append(s)
        s, pieces = _timed(lambda: memo.metadata_bytes(md_obj, results, new_meta))
        now.append(s)
        assert b"".join(pieces) == want  # type: ignore[union-attr]
        offer = [(at, a, b) for at, a, b in zip(memo.id_offsets(), old, new) if a != b]

        def make() -> int:
            with open(md_path, "rb") as f:  # the last step's file, from the page cache
                buf = bytearray(len(raw))
                f.readinto(buf)
            for at, a, b in offer:
                assert buf[at:at + len(a)] == a
                buf[at:at + len(b)] = b
            return crc_bytes(buf)
        s, crc = _timed(make)
        leader.append(s)
        assert crc == crc_bytes(want)
    # before, every rank also read the step's .metadata back and hashed it for its manifest; now the entry travels
    # in the offer (rank 0's writer hashed the pieces as it wrote them)
    from resilient.checkpoint.format.digests import file_entry

    hashed = [_timed(lambda: file_entry(md_path))[0] for _ in range(reps)]
    world = dist.get_world_size()
    return {"keep_s": keep_s, "manifest_hash_before_s": statistics.median(hashed), "rank0_before_s": statistics.median(before), "rank0_now_s": statistics.median(now),
            "leader_make_s": statistics.median(leader), "offer_bytes": len(pickle.dumps((3, offer, FileEntry(size=len(raw), crc32c=crc, xxh3=(2**63,))))),
            "sent_before_bytes": len(raw) * (world - 1)}


def one_world(world: int, tensors: int, reps: int, md_path: Path, state_gb: float = 84.0) -> dict[str, Any]:
    """Child process: rank 0 of ``world`` over torch's fake process group, the job's ``.metadata`` written by
    another process (so this one's memory holds only what a restarted rank's does)."""
    import psutil
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from resilient.checkpoint.format.safe import load_metadata
    from resilient.checkpoint.restore.restore import Restorer, _items_read

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    raw = md_path.read_bytes()
    state, files = _rank0(world, tensors, len(raw))
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    # _plan_load reads the rank and the world size from its context, nothing else
    me = SimpleNamespace(ctx=SimpleNamespace(rank=0, world_size=world), _is_object=Restorer._is_object)
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    # an untimed parse first: the process's memory grows to hold it once (measured here), so the timed parses
    # below, DCP's and ours alike, reuse it instead of the first one paying for the growth
    md = _timed(lambda: load_metadata(raw, what="bench"))[1]
    held = proc.memory_info().rss - rss0
    # rank 0's rank index, as its save keeps it (from its local plan and the finished metadata: once per layout)
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    from resilient.checkpoint.format import rank_index
    from resilient.checkpoint.restore.restore import _shards

    local_items = create_default_local_save_plan(flat, True).items
    index_build_s, blob = _timed(lambda: rank_index.build(md, local_items))
    assert blob is not None
    index = rank_index.encode(blob, metadata_crc=1)
    md = None
    rows: dict[str, list[float]] = {k: [] for k in ("dcp_unpickle", "dcp_plan", "metadata", "plan_load",
                                                    "direct_plan", "manifests", "index", "metadata_verify")}
    from resilient.checkpoint.format.digests import file_entry, map_verified

    entry = file_entry(md_path)
    # the restore's first collective: every rank's manifests, pickled by all_gather_object (a node also offers its
    # replica partner's, which doubles this), unpickled by every rank
    blobs = [pickle.dumps({r: _manifest(r, world, tensors, len(raw), int(state_gb * 1e9))}) for r in range(world)]
    items = 0
    for _ in range(reps):
        s, md = _timed(lambda: pickle.loads(raw))
        rows["dcp_unpickle"].append(s)
        s, _ = _timed(lambda: create_default_local_load_plan(flat, md))
        rows["dcp_plan"].append(s)
        md = None
        s, md = _timed(lambda: load_metadata(raw, what="bench"))
        rows["metadata"].append(s)
        s, plan = _timed(lambda: Restorer._plan_load(me, 0, state, md.state_dict_metadata, set(), world))  # type: ignore[arg-type]
        rows["plan_load"].append(s)

        def direct() -> Any:
            need = {".metadata"} | {info.relative_path for _, info in _items_read(md, plan)}
            return Restorer._direct_plan(None, md, plan, need, files), need  # type: ignore[arg-type]
        s, (d, need) = _timed(direct)
        rows["direct_plan"].append(s)
        s, _ = _timed(lambda: [pickle.loads(b) for b in blobs])
        rows["manifests"].append(s)

        def from_index() -> Any:
            # what a restart of the same layout does instead of the three steps above: decode the rank's own
            # entries, plan from them, check they hold every target, plan where each chunk lands
            small = rank_index.decode(index, 1, what="bench")
            p = Restorer._plan_load(me, 0, state, small.state_dict_metadata, set(), world)  # type: ignore[arg-type]
            assert rank_index.fits(small, p.load_sd, _shards(p))
            need = {info.relative_path for _, info in _items_read(small, p)}  # no .metadata: it reads none
            return Restorer._direct_plan(None, small, p, need, files), need  # type: ignore[arg-type]
        s, (di, need_i) = _timed(from_index)
        rows["index"].append(s)
        assert need_i | {".metadata"} == need and di.per_file.keys() == d.per_file.keys() and not di.slow
        assert [(i.offset, i.length) for i in di.per_file["__0_0.distcp"]] == \
            [(i.offset, i.length) for i in d.per_file["__0_0.distcp"]]
        di = None
        items = sum(len(v) for v in d.per_file.values())
        assert need == {".metadata", "__0_0.distcp"} and items == tensors and not d.slow, (need, items, d.slow)
        md = plan = d = None
        # what a restart planned from its index also did before it read nothing of .metadata: map the file and
        # verify it (from the page cache; on a hot-swapped node, a fetch of the whole file from a peer first)
        s, mapped = _timed(lambda: map_verified(md_path, entry))
        rows["metadata_verify"].append(s)
        if hasattr(mapped, "close"):
            mapped.close()
    spread = _spread_costs(raw, md_path, reps)
    med = {k: statistics.median(v) for k, v in rows.items()}
    dcp = med["dcp_unpickle"] + med["dcp_plan"]
    ours = med["metadata"] + med["plan_load"] + med["direct_plan"]
    return {"world": world, "tensors": tensors, "chunks": world * tensors, "metadata_bytes": len(raw),
            "seconds": {k: {"median": med[k], "all": v} for k, v in rows.items()},
            "dcp_s": dcp, "ours_s": ours, "ours_over_dcp": ours / dcp if dcp else None,
            "planned_straight": items, "parsed_rss_mb": held / 2**20, "state_gb": state_gb,
            "index_s": med["index"], "index_over_dcp": med["index"] / dcp if dcp else None,
            "metadata_verify_before_s": med["metadata_verify"],
            "index_bytes": len(index.data), "index_build_s": index_build_s, "spread": spread,
            "manifests_received_bytes": sum(len(b) for b in blobs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="8,64,256,1024", help="comma-separated world sizes (default %(default)s)")
    ap.add_argument("--tensors", type=int, default=900,
                    help="sharded tensors a rank holds (default %(default)s: a 7B-class model's ~300 parameters "
                         "and AdamW's two moments each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--state-gb", type=float, default=84.0,
                    help="the job's whole checkpoint, cut in W shards: sets each manifest's block digests (default "
                         "%(default)s: 7B parameters and two moments in fp32)")
    ap.add_argument("--quick", action="store_true", help="W = 4, 16; 60 tensors; 1 repetition")
    ap.add_argument("--out", default=str(HERE / "results" / "metadata-scale.json"))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process for one world size
    ap.add_argument("--make", type=int, help=argparse.SUPPRESS)  # the child writing one world's .metadata
    ap.add_argument("--metadata", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.worlds, a.tensors, a.reps = "4,16", 60, 1
    if a.make is not None:
        a.metadata.write_bytes(_metadata(a.make, a.tensors))
        return 0
    if a.one is not None:
        print(json.dumps(one_world(a.one, a.tensors, a.reps, a.metadata, a.state_gb)))
        return 0
    try:
        worlds = [int(w) for w in a.worlds.split(",") if w.strip()]
    except ValueError:
        ap.error(f"--worlds {a.worlds!r}: give comma-separated whole numbers, such as 8,64,256")
    if not worlds or min(worlds) < 1 or a.tensors < 1 or a.reps < 1 or not a.state_gb > 0:
        ap.error("--worlds, --tensors, --reps and --state-gb must be at least 1 (--state-gb: above 0)")
    import torch
    rows = []
    print(f"{'ranks':>6} {'chunks':>9} {'.metadata':>10} {'DCP: parse + plan':>19} {'ours: parse + plan':>19} "
          f"{'ours/DCP':>9} {'parsed':>8} {'manifests in':>13} {'unpickled':>10} {'rank index':>11} "
          f"{'index plan':>11} {'index/DCP':>10}")
    for w in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            md_path = Path(tmp) / ".metadata"
            for args in (["--make", str(w)], ["--one", str(w), "--reps", str(a.reps), "--state-gb", str(a.state_gb)]):
                p = subprocess.run([sys.executable, __file__, *args, "--tensors", str(a.tensors), "--metadata",
                                    str(md_path)], capture_output=True, text=True, timeout=3600)
                if p.returncode != 0:
                    print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                    return 1
        r = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(r)
        sec = r["seconds"]
        print(f"{w:>6} {r['chunks']:>9,} {r['metadata_bytes'] / 1e6:>8.1f}MB "
              f"{sec['dcp_unpickle']['median']:>8.3f} + {sec['dcp_plan']['median']:.3f} s "
              f"{sec['metadata']['median']:>8.3f} + {sec['plan_load']['median'] + sec['direct_plan']['median']:.3f} s "
              f"{r['ours_over_dcp']:>9.2f} {r['parsed_rss_mb']:>6.0f}MB "
              f"{r['manifests_received_bytes'] / 1e6:>11.1f}MB {sec['manifests']['median']:>8.3f} s "
              f"{r['index_bytes'] / 1e3:>9.0f}kB {r['index_s']:>9.4f} s {r['index_over_dcp']:>10.4f}", flush=True)
    print(f"\n{'ranks':>6} {'rank 0 patch before':>20} {'now':>9} {'sent a save before':>19} {'now, a rank':>12} "
          f"{'a leader makes it':>18} {'each rank hashed it, before':>28} {'indexed restart verified it, before':>36}")
    for r in rows:
        sp = r["spread"]
        print(f"{r['world']:>6} {sp['rank0_before_s']:>18.3f} s {sp['rank0_now_s'] * 1e6:>6.0f} us "
              f"{sp['sent_before_bytes'] / 1e9:>16.2f} GB {sp['offer_bytes']:>10} B {sp['leader_make_s']:>16.3f} s "
              f"{sp['manifest_hash_before_s']:>26.3f} s {r['metadata_verify_before_s']:>34.3f} s")
    doc = {"mode": "quick" if a.quick else "full", "tensors": a.tensors, "reps": a.reps, "worlds": rows,
           "cpus": os.cpu_count(), "torch": torch.__version__}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
