"""Peer restore lands a partner's copy straight in the target tensors (no receive buffer the size of the
file), verifies each 4 MiB block as it arrives, and takes a bad block again from the next tier; with no good
copy anywhere the state is undefined and every rank says so. Real processes on a real gloo group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.format.digests import BLOCK, blocks_of, bytes_blocks
from resilient.checkpoint.replicate.transfer import DIRECT_MIN, wire_pieces
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import Workers, ok

SCRIPT = '''
import json, os, sys, torch, torch.distributed as dist
from resilient.checkpoint.api import StateUndefinedError
from resilient.checkpoint.manager import CheckpointManager
dist.init_process_group("gloo")
r = dist.get_rank()
local, mode, out, url = sys.argv[1:5]
g = torch.Generator().manual_seed(7)
ref = {"model": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(6)},  # 2 MiB each, replicated
       "norm": torch.randn(300, generator=g), "mine": torch.full((50,), float(r)), "pos": 11 + r}
ck = CheckpointManager(local=local, persistent=url or None, interval=1, persistent_every=1)
if mode == "save":
    ck.save(0, ref)
    res = {}
else:
    state = {"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()}, "norm": torch.zeros(300),
             "mine": torch.zeros(50), "pos": -1}
    ptrs = {k: v.data_ptr() for k, v in state["model"].items()}
    try:
        res = {"start": ck.restore(state), "sources": ck.last_restore.sources}
        res["exact"] = (all(torch.equal(state["model"][k], v) for k, v in ref["model"].items())
                        and torch.equal(state["norm"], ref["norm"]) and torch.equal(state["mine"], ref["mine"])
                        and state["pos"] == ref["pos"])
        res["in_place"] = {k: v.data_ptr() for k, v in state["model"].items()} == ptrs
    except StateUndefinedError as e:
        res = {"undefined": str(e)}
json.dump(res, open(os.path.join(out, f"{mode}{r}.json"), "w"))
ck.close()
dist.destroy_process_group()
'''


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


def test_wire_pieces_cut_at_blocks_and_large_tensors() -> None:
    """Both ends cut a file the same way from its manifest entry: never across a verification block, and a
    large tensor's bytes in pieces of their own."""
    size = 3 * BLOCK + 100
    entry = bytes_blocks(b"\0" * size, BLOCK)
    big = (BLOCK - 1000, BLOCK // 2 + 7, DIRECT_MIN * 2)  # (item offset, data offset, bytes): crosses no block
    small = (0, 64, 100)  # staged with the bytes around it
    import dataclasses

    entry = dataclasses.replace(entry, items=(small, big))
    pieces = wire_pieces(entry)
    assert sum(n for _, n in pieces) == size and pieces[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    starts = {a for a, _, _ in blocks_of(entry)}
    for a, n in pieces:
        assert not any(a < s < a + n for s in starts)
    assert (big[1], big[2]) in pieces and not any(a == small[1] for a, _ in pieces)


@pytest.mark.timeout(150)
def test_flipped_byte_in_a_peer_copy_is_refetched_block_only(tmp_path: Path, workers: Workers) -> None:
    """Node 0 lost its disk; node 1 holds its replica with a flipped byte in block 1. Rank 0 receives the
    replica straight into its tensors, finds block 1 bad, reads that block again from the persistent tier
    into the same place, and resumes bit-exact; the ledger names the block and the tier. Then the persistent
    copy rots too: no good copy of the block anywhere, so the state is undefined, on every rank."""
    script = tmp_path / "land.py"
    script.write_text(SCRIPT)
    local, url = str(tmp_path / "node{node}"), f"file://{tmp_path}/bucket"
    env = {"RESILIENT_RUN_DIR": str(tmp_path / "run")}
    ok(workers.run(script, [local, "save", str(tmp_path), url], 2, local_world_size=1, env=env))
    shutil.rmtree(tmp_path / "node0")
    replica = tmp_path / "node1" / "peer" / "step_00000000" / "__0_0.distcp"
    assert replica.stat().st_size > BLOCK + 4096  # the file spans two blocks at least
    m = json.loads((replica.parent / "manifest-rank0.json").read_text())
    assert len(m["files"]["__0_0.distcp"]["xxh3"]) >= 2  # received blocks are verified by xxh3
    flip(replica, BLOCK + 4096)
    ok(workers.run(script, [local, "restore", str(tmp_path), url], 2, local_world_size=1, env=env))
    r0 = json.loads((tmp_path / "restore0.json").read_text())
    r1 = json.loads((tmp_path / "restore1.json").read_text())
    assert r0["start"] == r1["start"] == 1 and r0["exact"] and r1["exact"]
    assert r0["in_place"]  # the peer's bytes landed in the caller's tensors
    assert r0["sources"]["__0_0.distcp"] == "persistent"  # the slowest tier that served a block of it
    assert r0["sources"]["__1_0.distcp"] == "peer"
    assert r1["sources"]["__1_0.distcp"] == "local"
    failed = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    # rank 0 received the bad block over gloo; rank 1 read it from its own peer directory (it loads half of
    # the replicated tensors from that file): each found it and took it again from the persistent tier
    assert sorted((e.rank, e.details["tier"], e.details["error"].split(":")[0]) for e in failed) == \
        [(0, "peer", "__0_0.distcp block 1"), (1, "peer", "__0_0.distcp block 1")]
    assert r1["sources"]["__0_0.distcp"] == "persistent"

    flip(tmp_path / "bucket" / "step_00000000" / "__0_0.distcp", BLOCK + 4096)
    shutil.rmtree(tmp_path / "node0")
    ok(workers.run(script, [local, "restore", str(tmp_path), url], 2, local_world_size=1, env=env))
    for r in (0, 1):
        res = json.loads((tmp_path / f"restore{r}.json").read_text())
        assert "undefined" in res.get("undefined", ""), res
    evs = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert any(e.details.get("state_undefined") for e in evs)
    assert {("peer", "__0_0.distcp block 1"), ("persistent", "__0_0.distcp block 1")} <= \
        {(e.details["tier"], e.details["error"].split(":")[0]) for e in evs if e.rank == 0}
