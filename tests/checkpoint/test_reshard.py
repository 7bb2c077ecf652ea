"""Restore at another data-parallel size: FSDP2 (and FSDP2 x TP) state saved at one size is read back at another
from whatever copies hold it, by the byte ranges the new shards need (each verification block checked), and the
peer copies are placed so that a dropped replica's shards survive. Real ranks on real gloo groups, each "node"
its own local tier, a lost node's local tier deleted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.api import FileEntry
from resilient.checkpoint.format.digests import BLOCK, blocks_of, bytes_blocks
from resilient.checkpoint.replicate.peer import partners
from resilient.checkpoint.replicate.transfer import RANGED_PIECE, wire_pieces
from resilient.checkpoint.restore.plan import plan_fetch
from resilient.checkpoint.restore.reshard import blocks_touched, box_runs, cover

from .conftest import Workers, ok

SCRIPT = Path(__file__).resolve().parent / "_reshard_train.py"


# ------------------------------------------------------------------ the geometry, without processes
def _gather_by_runs(full: torch.Tensor, c_off: tuple[int, ...], c_size: tuple[int, ...],
                    l_off: tuple[int, ...], l_size: tuple[int, ...], into: torch.Tensor) -> None:
    chunk = full[tuple(slice(o, o + s) for o, s in zip(c_off, c_size))].contiguous().view(-1)
    flat = into.view(-1)
    for c, l, n in box_runs(c_off, c_size, l_off, l_size):
        flat[l:l + n] = chunk[c:c + n]


@pytest.mark.parametrize("saved,new", [
    ((2, 1), (1, 1)),  # FSDP2 2 -> 1
    ((1, 1), (2, 1)),  # 1 -> 2
    ((2, 4), (1, 4)),  # dp=2 x tp (Shard(1)) -> dp=1
    ((2, 2), (4, 1)),  # a 2-D grid onto rows
    ((3, 1), (2, 1)),  # sizes that do not divide evenly
])
def test_box_runs_rebuild_every_new_shard_from_the_saved_chunks(saved: tuple[int, int], new: tuple[int, int]) -> None:
    full = torch.arange(12 * 8, dtype=torch.float32).view(12, 8)

    def grid(parts: tuple[int, int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        out = []
        r_cuts = [round(i * 12 / parts[0]) for i in range(parts[0] + 1)]
        c_cuts = [round(j * 8 / parts[1]) for j in range(parts[1] + 1)]
        for i in range(parts[0]):
            for j in range(parts[1]):
                out.append(((r_cuts[i], c_cuts[j]), (r_cuts[i + 1] - r_cuts[i], c_cuts[j + 1] - c_cuts[j])))
        return out

    for l_off, l_size in grid(new):
        got = torch.full(l_size, -1.0)
        for c_off, c_size in grid(saved):
            _gather_by_runs(full, c_off, c_size, l_off, l_size, got)
        want = full[l_off[0]:l_off[0] + l_size[0], l_off[1]:l_off[1] + l_size[1]]
        assert torch.equal(got, want), (saved, new, l_off)


def test_blocks_touched_and_cover() -> None:
    from resilient.checkpoint.format.spans import Span

    t = torch.zeros(10, dtype=torch.uint8)
    spans = [Span(3 * BLOCK + 5, 10, target=t), Span(BLOCK - 1, 2, target=t[:2])]
    bounds = [(i * BLOCK, (i + 1) * BLOCK) for i in range(5)]
    assert blocks_touched(bounds, spans) == frozenset({0, 1, 3})
    cut = cover(5 * BLOCK, spans)
    assert cut is not None and sum(s.n for s in cut) == 5 * BLOCK and [s.takes for s in cut] == [False, True, False,
                                                                                                 True, False]
    assert cover(5 * BLOCK, spans + [Span(BLOCK, 4, target=t)]) is None  # overlapping: not a file DCP wrote


def test_a_part_of_a_file_travels_by_its_blocks_only() -> None:
    entry = bytes_blocks(b"\1" * (3 * BLOCK + 100), BLOCK)
    pieces = wire_pieces(entry, blocks=(1, 3))
    assert sum(n for _, n in pieces) == BLOCK + 100
    assert all(BLOCK <= a and a + n <= 2 * BLOCK or a >= 3 * BLOCK for a, n in pieces)
    assert max(n for _, n in pieces) <= RANGED_PIECE
    plan = plan_fetch([["f"], []], [[], ["f"]], {"f": entry.size}, False, blocks=[{"f": (1, 3)}, {}],
                      bounds={"f": entry.bounds()})
    assert [(t.src, t.dst, t.size, t.blocks) for t in plan.transfers] == [(1, 0, BLOCK + 100, (1, 3))]
    assert len(blocks_of(FileEntry(size=10, crc32c=0))) == 1


# ------------------------------------------------------------------ peer placement, without processes
def test_partner_in_the_next_replica_at_the_same_position() -> None:
    to, said = partners(4, nodes_per_replica=2)
    assert to == [2, 3, 0, 1] and not said
    to, _ = partners(6, nodes_per_replica=3)
    assert to == [3, 4, 5, 0, 1, 2]
    assert partners(4)[0] == [1, 2, 3, 0]  # no replicas: the next node, as before
    assert partners(2, nodes_per_replica=2)[0] == [1, 0]  # one replica: the next node


def test_partner_in_another_failure_domain() -> None:
    # racks across replicas: rack a holds position 0 of each replica, rack b position 1
    to, said = partners(4, nodes_per_replica=2, domains=["a", "b", "a", "b"])
    assert not said and all(n // 2 != p // 2 and ["a", "b", "a", "b"][n] != ["a", "b", "a", "b"][p]
                            for n, p in enumerate(to))
    to, said = partners(6, domains=["r1", "r1", "r1", "r2", "r2", "r3"])
    assert not said and sorted(to) == list(range(6))
    assert all(["r1", "r1", "r1", "r2", "r2", "r3"][n] != ["r1", "r1", "r1", "r2", "r2", "r3"][p]
               for n, p in enumerate(to))
    to, said = partners(3, domains=["x", "x", "x"])  # one domain: the choice without domains, nothing said
    assert to == [1, 2, 0] and not said
    to, said = partners(4, domains=["a", "a", "a", "b"])  # a domain of more than half: told
    assert sorted(to) == [0, 1, 2, 3] and said and "failure domain" in said[0]


# ------------------------------------------------------------------ real processes
def _info(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def _run(workers: Workers, tmp: Path, phase: str, nproc: int, lws: int, steps: int, extra: list[str],
         expect: str | None = None, env: dict[str, str] | None = None) -> Path:
    out = tmp / phase
    args = ["--steps", str(steps), "--local", str(tmp / "ckpt" / "node{node}"), "--out", str(out), *extra]
    if expect:
        args += ["--expect", str(tmp / expect / "saved.pt")]
    res = ok(workers.run(SCRIPT, args, nproc, local_world_size=lws, env=env, timeout=150))
    if expect:
        assert "bit-exact" in res[0].output, res[0].output[-3000:]
    return out


def _check_ranged(info: dict, whole: int) -> None:
    """Read by the blocks the new shard touches, never the whole files; held beside the state <= 0.1x."""
    r = info["resharded"]
    assert r is not None, info
    assert r["read"] < whole, (r, whole)
    assert r["held"] <= 0.1 * r["shard"], r


def _data_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.glob("*.distcp"))


@pytest.mark.timeout(300)
def test_fsdp2_2_ranks_to_1_and_back_to_2_bit_exact_by_ranges(tmp_path: Path, workers: Workers) -> None:
    """1-node-per-replica FSDP2 (a 1-D ("dp",) mesh), one rank per node: 2 -> 1 (node 1 lost with its local
    tier: its shard is read from the peer copy on node 0) -> 2 (the new node 1 reads its half of the one
    rank's file from node 0 over the group, by blocks). Every parameter and optimizer value equals the saved
    one after each change."""
    # weights of 4 MiB, manifests with blocks of 256 KiB: runs of many blocks, as a large model's shards are
    model = ["--dim", "1024", "--blocks", "1", "--block-kib", "256"]
    _run(workers, tmp_path, "a", 2, 1, 2, model)
    assert (tmp_path / "ckpt" / "node0" / "peer" / "step_00000001" / "__1_0.distcp").exists()
    shutil.rmtree(tmp_path / "ckpt" / "node1")
    b = _run(workers, tmp_path, "b", 1, 1, 4, model, expect="a")
    i0 = _info(b, 0)
    assert i0["start"] == 2 and i0["sources"]["__1_0.distcp"] == "peer", i0
    assert i0["resharded"]["held"] <= 0.1 * i0["resharded"]["shard"], i0
    c = _run(workers, tmp_path, "c", 2, 1, 5, model, expect="b")  # node 1 new: an empty local tier
    i1 = _info(c, 1)
    assert i1["start"] == 4 and i1["sources"]["__0_0.distcp"] == "peer", i1
    _check_ranged(i1, _data_bytes(tmp_path / "ckpt" / "node0" / "step_00000003"))
    assert 0 < i1["resharded"]["peer"] < _data_bytes(tmp_path / "ckpt" / "node0" / "step_00000003")


@pytest.mark.timeout(300)
def test_fsdp2_1_rank_to_2_from_the_persistent_tier_alone_by_ranged_reads(tmp_path: Path, workers: Workers) -> None:
    """Saved by one rank, uploaded uncompressed; every local tier lost; two ranks restore, each reading the
    blocks of its half of the one rank's file from the persistent tier by ranged reads."""
    model = ["--dim", "1024", "--blocks", "1", "--block-kib", "256", "--persistent", f"file://{tmp_path}/bucket"]
    env = {"RESILIENT_CKPT_COMPRESS": "none"}
    _run(workers, tmp_path, "a", 1, 1, 2, model, env=env)
    whole = _data_bytes(tmp_path / "bucket" / "step_00000001")
    assert whole > 0
    shutil.rmtree(tmp_path / "ckpt")
    b = _run(workers, tmp_path, "b", 2, 1, 3, model, expect="a", env=env)
    for r in (0, 1):
        i = _info(b, r)
        assert i["start"] == 2 and i["sources"]["__0_0.distcp"] == "persistent", i
        assert i["resharded"]["read"] < whole, (i, whole)


@pytest.mark.timeout(480)
def test_fsdp2_x_tp_2_replicas_of_2_nodes_to_1_and_back(tmp_path: Path, workers: Workers) -> None:
    """2 replicas of 2 nodes, 2 workers each: 8 ranks on a ("dp"=2, "tp"=4) mesh (FSDP2 over dp, colwise/rowwise
    TP inside the replica) -> replica 1 dropped (nodes 2 and 3 lost with their local tiers: their shards are on
    replica 0's nodes, where the replica-aware peer placement put them) -> 4 ranks (dp=1, tp=4) -> 8 ranks."""
    model = ["--dim", "256", "--blocks", "1", "--tp", "4"]
    env = {"RESILIENT_NODES_PER_REPLICA": "2"}
    _run(workers, tmp_path, "a", 8, 2, 2, model, env=env)
    for node in (2, 3):
        shutil.rmtree(tmp_path / "ckpt" / f"node{node}")
    b = _run(workers, tmp_path, "b", 4, 2, 3, model, expect="a", env=env)
    assert {_info(b, r)["start"] for r in range(4)} == {2}
    assert any(v == "peer" for r in range(4) for v in _info(b, r)["sources"].values())
    c = _run(workers, tmp_path, "c", 8, 2, 4, model, expect="b", env=env)
    assert {_info(c, r)["start"] for r in range(8)} == {3}
    assert all(_info(c, r)["resharded"] is not None for r in range(4, 8))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("replica,domains", [(None, "a,a,b,b"), ("2", "a,b,a,b")])
def test_peer_copies_land_in_another_replica_and_failure_domain(tmp_path: Path, workers: Workers,
                                                                replica: str | None, domains: str | None) -> None:
    """Four nodes of one rank each. Racks a, a, b, b: every node's copy is in another rack (the next node, the
    partner before, is in the same rack for nodes 0 and 2). Replicas of 2 nodes with racks a, b, a, b (a rack
    holds one position of every replica): the copy is in the other replica and the other rack at once (the
    replica alone is in test_fsdp2_x_tp_2_replicas_of_2_nodes_to_1_and_back, which drops a whole replica)."""
    env = {"RESILIENT_NODES_PER_REPLICA": replica} if replica else {}
    extra = ["--dim", "64", "--blocks", "1"] + (["--domains", domains] if domains else [])
    _run(workers, tmp_path, "a", 4, 1, 1, extra, env=env)
    holder = {}
    for node in range(4):
        for f in (tmp_path / "ckpt" / f"node{node}" / "peer" / "step_00000000").glob("__*_0.distcp"):
            holder[int(f.name.split("_")[2])] = node
    assert sorted(holder) == [0, 1, 2, 3], holder
    labels = domains.split(",") if domains else None
    for n, p in holder.items():
        assert p != n
        if replica:
            assert p // 2 != n // 2, holder
        if labels:
            assert labels[p] != labels[n], holder
