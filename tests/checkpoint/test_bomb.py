"""Decompression bombs: a coded item of a few hundred KB that decodes to 4 GiB, planted with the manifests'
sizes and checksums updated to match (the tampering the threat model covers).

Restore, ``resilient ckpt export`` and ``resilient ckpt verify`` run in a subprocess whose address space is
capped at 2 GiB above what it holds once torch is imported: a decode that is not bounded by the item's true
size (from ``.metadata``) fails there instead of swapping the machine.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zstandard

from resilient.checkpoint.format import codec as coding

from resilient.checkpoint.upload import chooser
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.checkpoint.format.safe import load_metadata
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import REPO, _child_env
from .test_security import _fix_manifests

BOMB = 4 << 30  # decoded bytes
STEP = 1 << 20  # zeros fed to the compressor at a time: the bomb is never materialised

# the child's address space is capped once torch and the package are imported (its baseline)
_CAPPED = """
import resource, sys
import torch, resilient.cli, resilient.checkpoint.manager
vm = next(int(ln.split()[1]) * 1024 for ln in open('/proc/self/status') if ln.startswith('VmSize:'))
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), vm + (2 << 30)))
"""


def capped(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CAPPED + code], cwd=REPO, env=_child_env(env),
                          capture_output=True, text=True, timeout=240)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return capped(f"from resilient.cli import main\nsys.exit(main(['ckpt', *{list(args)!r}]))")


def zstd_bomb() -> bytes:
    """One stream.zstd/1 frame of BOMB zeros, its size left out of the header (decoders must count)."""
    co = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=False).compressobj()
    zero = bytes(STEP)
    out = bytearray()
    for _ in range(BOMB // STEP):
        out += co.compress(zero)
    return bytes(out + co.flush())


def bgzstd_bomb() -> bytes:
    """A resilient.bgzstd/1 stream (element size 1) of BOMB zeros: the same full block again and again."""
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=False).compress(
        bytes(coding.BLOCK))
    block = coding._U32.pack(coding.BLOCK) + coding._U32.pack(len(frame)) + frame
    return coding.MAGIC + bytes([1]) + block * (BOMB // coding.BLOCK)


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(50_000, generator=g), "b": torch.randn(300, generator=g), "extra": {"pos": 11}}


def plant(step_dir: Path, bomb: bytes, fqn: str = "w") -> str:
    """Point item ``fqn`` at ``bomb`` appended to its part file; fix ``.metadata`` and the manifests."""
    md = load_metadata((step_dir / ".metadata").read_bytes(), "x")
    idx = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[idx]
    assert info.transform_descriptors, "the persistent copy is not compressed: nothing to plant a bomb in"
    part = step_dir / info.relative_path
    blob = part.read_bytes()
    info.offset, info.length = len(blob), len(bomb)
    _fix_manifests(step_dir, info.relative_path, blob + bomb)
    _fix_manifests(step_dir, ".metadata", pickle.dumps(md))
    return info.relative_path


@pytest.fixture(params=["bgzstd", "zstd"])
def bombed(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """Steps 3 and 7 on a compressed persistent tier (file://), a bomb planted in step 7's tensor ``w``."""
    codec = request.param
    monkeypatch.setenv(chooser.ENV_MODE, codec)
    bucket = tmp_path / "bucket"
    ck = CheckpointManager(local=tmp_path / "local", persistent=f"file://{bucket}", interval=1, persistent_every=1)
    s = state()
    for step in (3, 7):
        s["extra"]["pos"] = 100 + step
        assert ck.save(step, s, force=True)
        assert ck.wait(60)
    ck.close()
    bomb = bgzstd_bomb() if codec == "bgzstd" else zstd_bomb()
    assert len(bomb) < 300_000  # a few hundred KB on the tier
    name = plant(bucket / "step_00000007", bomb)
    return bucket, name


@pytest.mark.timeout(300)
def test_verify_decodes_and_names_the_bomb(bombed: tuple[Path, str]) -> None:
    bucket, name = bombed
    r = cli("verify", str(bucket / "step_00000007"))
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith(f"{bucket}") and name in ln), "")
    assert "decompression bomb" in line and "'w'" in line, r.stdout
    assert "MemoryError" not in r.stdout + r.stderr
    ok = cli("verify", str(bucket / "step_00000003"))
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stdout + ok.stderr[-3000:]


@pytest.mark.timeout(300)
def test_export_refuses_the_bomb_and_leaves_nothing(bombed: tuple[Path, str], tmp_path: Path) -> None:
    bucket, name = bombed
    out = tmp_path / "exported"
    r = cli("export", str(bucket / "step_00000007"), str(out))
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("resilient ckpt export")]
    assert r.returncode == 2 and len(ours) == 1, r.stdout + r.stderr[-3000:]
    assert name in ours[0] and "decompression bomb" in ours[0] and "Traceback" not in r.stderr, ours
    assert not out.exists()
    r = cli("export", str(bucket / "step_00000003"), str(out))  # the intact step still exports
    assert r.returncode == 0 and "exported step 3" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.timeout(300)
def test_restore_refuses_the_bomb_and_falls_back_to_the_older_step(bombed: tuple[Path, str],
                                                                   tmp_path: Path) -> None:
    bucket, name = bombed
    run = tmp_path / "run"
    code = f"""
import json, torch
from resilient.checkpoint.manager import CheckpointManager
s = {{"w": torch.zeros(50_000), "b": torch.zeros(300), "extra": {{"pos": 0}}}}
ck = CheckpointManager(local={str(tmp_path / "fresh")!r}, persistent={f"file://{bucket}"!r}, interval=1)
start = ck.restore(s)
ck.close()
print("RESULT", json.dumps({{"start": start, "pos": s["extra"]["pos"], "tier": ck.last_restore.tier}}))
"""
    r = capped(code, env={"RESILIENT_RUN_DIR": str(run)})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")).split(" ", 1)[1])
    assert res == {"start": 4, "pos": 103, "tier": "persistent"}, res
    failed = [e.details for e in read_events(run) if e.kind == EventKind.CKPT_TIER_FAILED]
    assert failed and "decompression bomb" in json.dumps(failed) and name in json.dumps(failed), failed


@pytest.mark.timeout(120)
def test_object_items_are_bounded_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object (a bytes item) has no size in ``.metadata``: its decode stops at RESILIENT_CKPT_MAX_OBJECT_MB;
    a tensor's at its chunk's bytes plus torch.save's records; a legit coded item decodes whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from resilient.checkpoint.api import DCP_METADATA

    dcp.save(state(), storage_writer=FileSystemWriter(tmp_path / "s"), no_dist=True)
    md = load_metadata((tmp_path / "s" / DCP_METADATA).read_bytes(), "x")
    obj = next(i for i in md.storage_data if i.fqn == "extra.pos")
    w = next(i for i in md.storage_data if i.fqn == "w")
    assert coding.item_limit(md, w) == 50_000 * 4 + coding.SAVE_SLACK
    monkeypatch.setenv(coding.ENV_MAX_OBJECT_MB, "1")
    assert coding.item_limit(md, obj) == 1 << 20
    for desc, bomb in (("resilient.bgzstd/1", bgzstd_bomb()), ("stream.zstd/1", zstd_bomb())):
        with pytest.raises(coding.ItemTooLargeError, match="more than 1,048,576 bytes"):
            coding.decode_item(bomb, [desc], coding.item_limit(md, obj))
        with pytest.raises(coding.ItemTooLargeError):
            for _ in coding.iter_decode(bomb, [desc], coding.item_limit(md, obj)):
                pass
    info = md.storage_data[w]
    raw = (tmp_path / "s" / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    assert bytes(coding.decode_item(coding.encode(raw, 4), ["resilient.bgzstd/1"], coding.item_limit(md, w))) == raw
    coded = zstandard.ZstdCompressor().compress(raw)
    assert bytes(coding.decode_item(coded, ["stream.zstd/1"], coding.item_limit(md, w))) == raw
    # a frame declaring more than the limit is refused from its header, before anything is decoded
    with pytest.raises(coding.ItemTooLargeError):
        coding.decode_item(coded, ["stream.zstd/1"], len(raw) - 1)
