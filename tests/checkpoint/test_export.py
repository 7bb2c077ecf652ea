"""``resilient ckpt export`` and ``ls`` on a real two-node checkpoint: two ranks as two "nodes" (one local
tier each, LOCAL_WORLD_SIZE=1), each node's files replicated to the other's ``peer/`` area over the
manager's gloo group, and a compressed persistent copy. A node's local tier holds one rank of two: export
must write every rank's files (from the peer area or the other sources given) or refuse, naming the
missing ranks; ``ls`` must say that the tier alone cannot restore the step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.checkpoint.format.safe import load_metadata

from .conftest import REPO, TRAIN, Workers, _child_env, ok
from .test_cli import cli

STEP = "step_00000003"

# a process that never imports this package: plain DCP must read the copy whole
_PLAIN_LOAD = """
import json, sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
md = FileSystemReader(sys.argv[1]).read_metadata()
sd = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
      if isinstance(v, TensorStorageMetadata)}
dcp.load(sd, storage_reader=FileSystemReader(sys.argv[1]), no_dist=True)
assert "resilient" not in sys.modules
print(json.dumps({k: v.double().sum().item() for k, v in sd.items()}))
"""


def plain_load(d: Path) -> dict[str, float]:
    r = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(d)], cwd=d, env=_child_env(None),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 3 of a 2-rank job on two nodes, uploaded (bgzstd-compressed) to a file:// bucket."""
    base = tmp_path_factory.mktemp("two_nodes")
    w = Workers()
    try:
        ok(w.run(TRAIN, ["--steps", "4", "--interval", "2", "--local", str(base / "node{node}"), "--persistent",
                         f"file://{base / 'bucket'}", "--persistent-every", "1", "--out", str(base / "out")], 2,
                 local_world_size=1, env={"RESILIENT_CKPT_COMPRESS": "bgzstd"}))
    finally:
        w.close()
    assert sorted(p.name for p in (base / "node1" / STEP).glob("*.distcp")) == ["__1_0.distcp"]
    assert (base / "node1" / "peer" / STEP / "__0_0.distcp").exists()
    md = load_metadata((base / "bucket" / STEP / ".metadata").read_bytes(), "x")
    assert all(i.transform_descriptors == ["resilient.bgzstd/1"] for i in md.storage_data.values())
    return base


@pytest.fixture
def nodes(two_nodes: Path, tmp_path: Path) -> Path:
    """A copy each test may damage."""
    shutil.copytree(two_nodes, tmp_path / "c", symlinks=True)
    return tmp_path / "c"


@pytest.mark.timeout(240)
def test_export_of_one_node_takes_the_other_rank_from_its_peer_area(nodes: Path, tmp_path: Path) -> None:
    out = tmp_path / "exp"
    r = cli("export", str(nodes / "node1"), str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exported step 3" in r.stdout and "ranks 0-1 of 2" in r.stdout, r.stdout
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # each rank's file as its node wrote it
    assert (out / "__0_0.distcp").read_bytes() == (nodes / "node0" / STEP / "__0_0.distcp").read_bytes()
    assert (out / "__1_0.distcp").read_bytes() == (nodes / "node1" / STEP / "__1_0.distcp").read_bytes()
    got = plain_load(out)
    assert any(k.startswith("model.") for k in got) and any(k.startswith("optim.") for k in got), sorted(got)


@pytest.mark.timeout(360)  # six interpreters importing torch, on busy cores
def test_export_refuses_a_rank_in_no_source_and_takes_it_from_another_source(nodes: Path, tmp_path: Path) -> None:
    shutil.rmtree(nodes / "node1" / "peer")  # the replica of rank 0 is gone with it
    out = tmp_path / "exp"
    r = cli("export", str(nodes / "node1"), str(out))
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("resilient ckpt export")]
    assert r.returncode == 2 and len(ours) == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "step 3 has rank 1 of 2" in ours[0] and "rank 0 are in none of them" in ours[0], ours
    assert not out.exists()  # nothing left behind
    out.mkdir()
    r = cli("export", str(nodes / "node1" / STEP), str(out))  # a step directory, into an empty directory
    assert r.returncode == 2 and not any(out.iterdir()), r.stderr

    # rank 0 from the compressed persistent copy, rank 1 from node 1's plain local copy: one plain copy
    r = cli("export", str(nodes / "node1"), f"file://{nodes / 'bucket'}", str(out))
    assert r.returncode == 0 and "ranks 0-1 of 2" in r.stdout, r.stdout + r.stderr
    mixed = plain_load(out)
    ref = tmp_path / "ref"
    r = cli("export", str(nodes / "node0"), str(nodes / "node1"), str(ref))
    assert r.returncode == 0, r.stdout + r.stderr
    assert mixed == plain_load(ref)


@pytest.mark.timeout(120)
def test_ls_says_what_a_node_tier_alone_can_restore(nodes: Path) -> None:
    r = cli("ls", str(nodes / "node1"), "--json")
    assert r.returncode == 0, r.stderr
    rows = {(x["tier"].rsplit("/", 1)[-1], x["step"]): x for x in json.loads(r.stdout)}
    own, peer = rows[("node1", 3)], rows[("peer", 3)]
    assert (own["complete"], own["committed"], own["ranks"], own["missing_ranks"]) == (False, True, [1], [0])
    assert (peer["complete"], peer["ranks"], peer["missing_ranks"]) == (False, [0], [1])
    r = cli("ls", f"file://{nodes / 'bucket'}", "--json")
    assert r.returncode == 0 and all(x["complete"] and x["missing_ranks"] == [] for x in json.loads(r.stdout))
    shutil.rmtree(nodes / "node1" / "peer")
    r = cli("ls", str(nodes / "node1"))
    assert r.returncode == 0, r.stderr
    assert "partial: rank 1 of 2; rank 0 needs another node's local tier or the persistent tier" in \
        " ".join(r.stdout.split()), r.stdout
