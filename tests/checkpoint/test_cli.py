"""``resilient ckpt ls|verify`` as a user runs it (a subprocess of the real CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.save.manager import CheckpointManager

from .conftest import GCS, REPO, _child_env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resilient.cli", "ckpt", *args], cwd=REPO, env=_child_env(env),
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    ck = CheckpointManager(local=tmp_path / "ckpt", interval=1, keep_local=3)
    for s in range(3):
        ck.save(s, {"w": torch.full((1000,), float(s))})
    ck.close()
    (tmp_path / "ckpt" / "step_00000003").mkdir()  # a partial step
    return tmp_path / "ckpt"


def test_ls_json_and_table(ckpt_dir: Path) -> None:
    r = cli("ls", str(ckpt_dir), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["step"], x["complete"]) for x in rows] == [(0, True), (1, True), (2, True), (3, False)]
    assert rows[0]["ranks"] == [0] and rows[0]["world_size"] == 1 and rows[0]["bytes"] > 4000
    r = cli("ls", str(ckpt_dir))
    assert r.returncode == 0 and "partial" in r.stdout and "step" in r.stdout


def test_ls_starts_without_torch(ckpt_dir: Path) -> None:
    """``ls`` reads manifests and markers only: importing torch would cost it seconds of CPU per call (DCP's
    extension classes were once imported with the codec). ``verify`` loads items as restore does, with torch."""
    code = ("import sys\nfrom resilient.cli import main\nrc = main(['ckpt', 'ls', sys.argv[1], '--json'])\n"
            "print('torch' in sys.modules, file=sys.stderr)\nsys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(ckpt_dir)], cwd=REPO, env=_child_env(None), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in json.loads(r.stdout)] == [0, 1, 2, 3]
    assert r.stderr.strip().splitlines()[-1] == "False", r.stderr


def test_verify_finds_a_flipped_byte(ckpt_dir: Path) -> None:
    r = cli("verify", str(ckpt_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 2: 2 files, ok" in r.stdout
    f = ckpt_dir / "step_00000001" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0x10
    f.write_bytes(bytes(data))
    r = cli("verify", str(ckpt_dir))
    assert r.returncode == 1
    assert "step 1 __0_0.distcp: xxh3 of block 0" in r.stdout
    # manifests written before xxh3 existed are verified by crc32c, the flip found all the same
    for step in (1, 2):
        m = ckpt_dir / f"step_0000000{step}" / "manifest-rank0.json"
        d = json.loads(m.read_text())
        assert all("xxh3" in fe for fe in [*d["files"].values(), d["metadata"]])
        for fe in [*d["files"].values(), d["metadata"]]:
            del fe["xxh3"]
        m.write_text(json.dumps(d))
    r = cli("verify", str(ckpt_dir))
    assert r.returncode == 1 and "step 2: 2 files, ok" in r.stdout
    assert "step 1 __0_0.distcp: crc32c" in r.stdout
    r = cli("verify", str(ckpt_dir / "step_00000002"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["steps"][0]["step"] == 2


def test_ls_and_verify_gcs(tmp_path: Path, gcs: GCS) -> None:
    gcs.make_bucket("cli")
    ck = CheckpointManager(local=tmp_path / "l", persistent="gs://cli/run", interval=1, persistent_every=1)
    ck.save(0, {"w": torch.ones(100)})
    ck.close()
    r = cli("ls", "gs://cli/run", "--json", env=gcs.env())
    assert r.returncode == 0, r.stderr
    assert [(x["step"], x["complete"]) for x in json.loads(r.stdout)] == [(0, True)]
    r = cli("verify", "gs://cli/run", env=gcs.env())
    assert r.returncode == 0 and "1 files" not in r.stdout and "ok" in r.stdout


def test_bad_target_is_reported(tmp_path: Path) -> None:
    r = cli("ls", "/nonexistent/dir")
    assert r.returncode == 2 and "no such directory" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("ls", str(tmp_path))  # an existing, empty tier is not an error
    assert r.returncode == 0 and "no checkpoint steps" in r.stdout
    r = cli("verify", "/nonexistent/dir")
    assert r.returncode == 1


def test_ls_missing_bucket_is_an_error(gcs: GCS) -> None:
    gcs.make_bucket("there")
    r = cli("ls", "gs://missing-bucket/x", env=gcs.env())
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "bucket 'missing-bucket' does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("ls", "gs://there/empty", env=gcs.env())
    assert r.returncode == 0 and "no checkpoint steps" in r.stdout


def test_local_tier_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    from resilient.checkpoint.api import CheckpointConfigError

    f = tmp_path / "a-file"
    f.write_text("keep me")
    with pytest.raises(CheckpointConfigError, match="is a file, not a directory"):
        CheckpointManager(local=f)
    assert f.read_text() == "keep me"
