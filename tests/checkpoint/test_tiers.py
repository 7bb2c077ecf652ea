"""One conformance suite for every tier implementation (the Tier protocol in resilient/checkpoint/api.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.checkpoint.api import COMMIT_MARKER, Tier
from resilient.checkpoint.storage.tiers import DirTier, FsspecTier, make_tier, step_info, verify_step

from .conftest import GCS

KINDS = ["local", "peer", "file-url", "gcs"]


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCS]:
    server = GCS(tmp_path_factory.mktemp("gcs-conformance"))
    server.start()
    server.make_bucket("conformance")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=KINDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tier:
    kind = request.param
    if kind == "local":
        return DirTier(tmp_path / "local", name="local")
    if kind == "peer":
        return DirTier(tmp_path / "local" / "peer", name="peer")
    if kind == "file-url":
        return make_tier(f"file://{tmp_path}/persistent", "persistent")
    server: GCS = request.getfixturevalue("gcs_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return FsspecTier(f"gs://conformance/{tmp_path.name}", name="persistent")


def test_is_a_tier(tier: Tier) -> None:
    assert isinstance(tier, Tier)
    assert tier.steps() == {}
    assert tier.list_files(3) == {}


def test_write_read_list(tier: Tier, tmp_path: Path) -> None:
    tier.write_bytes(5, "a.bin", b"hello")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    tier.put_file(5, "b.bin", str(src))
    assert tier.read_bytes(5, "a.bin") == b"hello"
    assert tier.list_files(5) == {"a.bin": 5, "b.bin": 1000}
    dst = tmp_path / "dst.bin"
    tier.get_file(5, "b.bin", str(dst))
    assert dst.read_bytes() == b"x" * 1000
    assert tier.steps() == {5: False}
    assert tier.url(5).endswith("step_00000005")


def test_commit_marker_makes_a_step_complete(tier: Tier) -> None:
    tier.write_bytes(1, "f", b"1")
    tier.write_bytes(2, "f", b"2")
    tier.write_bytes(2, COMMIT_MARKER, json.dumps({"step": 2, "world_size": 1, "ranks": [0]}).encode())
    assert tier.steps() == {1: False, 2: True}
    info = step_info(tier, 2, True)
    assert info.committed and info.world_size == 1


def test_delete(tier: Tier) -> None:
    tier.write_bytes(7, "f", b"1")
    tier.write_bytes(7, COMMIT_MARKER, b"{}")
    tier.write_bytes(8, "f", b"1")
    tier.delete_file(7, "f")
    assert "f" not in tier.list_files(7)
    tier.delete_file(7, "does-not-exist")
    tier.delete_step(7)
    assert tier.steps() == {8: False}
    tier.delete_step(99)


def test_missing_file_raises(tier: Tier, tmp_path: Path) -> None:
    with pytest.raises((FileNotFoundError, OSError)):
        tier.read_bytes(1, "nope")
    with pytest.raises((FileNotFoundError, OSError)):
        tier.get_file(1, "nope", str(tmp_path / "x"))


def test_verify_step_finds_damage(tier: Tier, tmp_path: Path) -> None:
    from resilient.checkpoint.api import FileEntry, Manifest
    from resilient.checkpoint.format.digests import crc_bytes

    data, meta = b"0123456789" * 100, b"meta"
    m = Manifest(step=3, rank=0, world_size=1, files={"__0_0.distcp": FileEntry(len(data), crc_bytes(data))},
                 metadata=FileEntry(len(meta), crc_bytes(meta)))
    tier.write_bytes(3, "manifest-rank0.json", json.dumps(m.to_json()).encode())
    tier.write_bytes(3, ".metadata", meta)
    tier.write_bytes(3, "__0_0.distcp", data)
    assert set(verify_step(tier, 3, tmp_path, content=False).values()) == {"ok"}
    # sizes and checksums match, but the content is no DCP metadata: the content check says so
    assert verify_step(tier, 3, tmp_path)[".metadata"].startswith("unreadable")
    tier.write_bytes(3, "__0_0.distcp", data[:-1] + b"X")
    assert "crc32c" in verify_step(tier, 3, tmp_path)["__0_0.distcp"]
    tier.delete_file(3, ".metadata")
    assert verify_step(tier, 3, tmp_path)[".metadata"] == "missing"
