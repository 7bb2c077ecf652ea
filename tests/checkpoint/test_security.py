"""Tampered checkpoints: a payload planted with matching crc32c and sizes must never run on restore or verify.

crc32c protects against rot, not against someone who can write to a tier: these tests rewrite the
manifests too, so only the content check stands between the payload and the process.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from resilient.checkpoint.api import NoRestorableStepError
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.checkpoint.format.safe import load_metadata
from resilient.checkpoint.format.digests import crc_bytes
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import REPO, _child_env


class Payload:
    """Unpickled by a general unpickler, it creates ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"model": model, "extra": {"pos": 17 + seed, "names": ["a", "b"]}}


def _entry(data: bytes) -> dict:
    return {"size": len(data), "crc32c": crc_bytes(data)}


def _fix_manifests(step_dir: Path, name: str, data: bytes) -> None:
    """Write ``name`` and make every manifest agree with it (size and crc32c), as an attacker would."""
    (step_dir / name).write_bytes(data)
    for mp in step_dir.glob("manifest-rank*.json"):
        m = json.loads(mp.read_text())
        if name == ".metadata":
            m["metadata"] = _entry(data)
        elif name in m["files"]:
            m["files"][name] = _entry(data)
        mp.write_text(json.dumps(m))


def plant_in_metadata(step_dir: Path, marker: Path) -> None:
    md = load_metadata((step_dir / ".metadata").read_bytes(), "x")
    md.storage_meta.modules = [Payload(marker)]  # the rest stays a valid Metadata: a restore would "succeed"
    _fix_manifests(step_dir, ".metadata", pickle.dumps(md))


def plant_in_object(step_dir: Path, marker: Path, fqn: str = "extra.pos") -> None:
    """Point the object item ``fqn`` at a torch.save'd payload appended to its data file."""
    md = load_metadata((step_dir / ".metadata").read_bytes(), "x")
    idx = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[idx]
    data_file = step_dir / info.relative_path
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    blob = data_file.read_bytes()
    info.offset, info.length = len(blob), len(buf.getvalue())
    _fix_manifests(step_dir, info.relative_path, blob + buf.getvalue())
    _fix_manifests(step_dir, ".metadata", pickle.dumps(md))


def verify(target: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resilient.checkpoint.cli", "verify", str(target)], cwd=REPO,
                          env=_child_env(None), capture_output=True, text=True, timeout=120)


def save_steps(root: Path, steps: list[int], **kw) -> dict:
    st = state()
    ck = CheckpointManager(local=root, interval=1, keep_local=5, **kw)
    for s in steps:
        st["extra"]["pos"] = 100 + s
        assert ck.save(s, st, force=True)
    ck.close()
    return st


@pytest.mark.parametrize("where", ["metadata", "object"])
def test_tampered_newest_step_never_runs_and_falls_back(tmp_path: Path, where: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    root = tmp_path / "ckpt"
    save_steps(root, [3, 7])
    marker = tmp_path / "PWNED"
    step7 = root / "step_00000007"
    (plant_in_metadata if where == "metadata" else plant_in_object)(step7, marker)

    # a general unpickler would run the payload: proof the planted file is a real threat
    if where == "metadata":
        pickle.loads((step7 / ".metadata").read_bytes())
        assert marker.exists()
        marker.unlink()

    got = state(seed=9)
    ck = CheckpointManager(local=root, interval=1)
    assert ck.restore(got) == 4  # step 7 refused, step 3 restored
    ck.close()
    assert not marker.exists()
    assert got["extra"]["pos"] == 103
    refused = [e.details for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert refused and refused[0]["step"] == 7 and refused[0]["error"].startswith("unsafe:"), refused
    assert re.search(r"forbidden global (builtins\.)?exec", refused[0]["error"]), refused

    r = verify(step7)
    assert r.returncode == 1
    assert "unsafe" in r.stdout and re.search(r"forbidden global (builtins\.)?exec", r.stdout), r.stdout
    assert not marker.exists()
    assert verify(root / "step_00000003").returncode == 0


def test_tampered_local_copy_falls_back_to_the_persistent_tier_same_step(tmp_path: Path) -> None:
    root, bucket = tmp_path / "ckpt", tmp_path / "bucket"
    saved = save_steps(root, [5], persistent=f"file://{bucket}", persistent_every=1)
    marker = tmp_path / "PWNED"
    plant_in_object(root / "step_00000005", marker)
    got = state(seed=9)
    ck = CheckpointManager(local=root, persistent=f"file://{bucket}", interval=1)
    assert ck.restore(got) == 6
    assert ck.last_restore is not None and ck.last_restore.tier == "persistent"
    ck.close()
    assert not marker.exists()
    assert got["extra"]["pos"] == 105
    assert torch.equal(got["model"].weight, saved["model"].weight)


def test_every_step_tampered_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_steps(root, [2])
    marker = tmp_path / "PWNED"
    plant_in_metadata(root / "step_00000002", marker)
    ck = CheckpointManager(local=root, interval=1)
    with pytest.raises(NoRestorableStepError, match=r"unsafe.*exec"):
        ck.restore(state(seed=9))
    ck.close()
    assert not marker.exists()


@pytest.mark.parametrize("bad", ["../outside.distcp", "/etc/passwd"])
def test_manifest_path_escaping_the_step_is_unsafe(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "ckpt"
    save_steps(root, [1])
    mp = root / "step_00000001" / "manifest-rank0.json"
    m = json.loads(mp.read_text())
    m["files"][bad] = {"size": 1, "crc32c": 0}
    mp.write_text(json.dumps(m))
    r = verify(root)
    assert r.returncode == 1
    assert "unsafe" in r.stdout and "escapes the checkpoint directory" in r.stdout, r.stdout
    # restore ignores the manifest that names it: no file outside the step is ever opened
    got = state(seed=9)
    ck = CheckpointManager(local=root, interval=1)
    with pytest.raises(NoRestorableStepError):
        ck.restore(got)
    ck.close()


def test_legit_non_tensor_state_restores_bit_exact(tmp_path: Path) -> None:
    random.seed(5)
    np.random.seed(5)
    extra = {"pos": 17, "ratio": 0.25, "flag": True, "none": None, "name": "run-7", "lists": [1, 2.5, "a"],
             "nested": {"a": {"b": 3}}, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
             "np_rng": np.random.get_state(), "np_arr": np.arange(6, dtype=np.float32).reshape(2, 3),
             "gen": torch.Generator().manual_seed(3).get_state()}
    root = tmp_path / "ckpt"
    ck = CheckpointManager(local=root, interval=1)
    ck.save(0, {"extra": extra}, force=True)
    ck.close()
    got = {"extra": copy.deepcopy(extra)}  # same layout, other values
    g = got["extra"]
    g.update(pos=0, ratio=0.0, flag=False, name="", lists=[0, 0.0, ""], nested={"a": {"b": 0}}, py_rng=None,
             np_rng=None, np_arr=None)
    g["torch_rng"].zero_()
    g["gen"].zero_()
    ck = CheckpointManager(local=root, interval=1)
    assert ck.restore(got) == 1
    ck.close()
    g = got["extra"]
    for k in ("pos", "ratio", "flag", "none", "name", "lists", "nested", "py_rng"):
        assert g[k] == extra[k], k
    assert torch.equal(g["torch_rng"], extra["torch_rng"]) and torch.equal(g["gen"], extra["gen"])
    assert np.array_equal(g["np_arr"], extra["np_arr"]) and g["np_arr"].dtype == np.float32
    assert g["np_rng"][0] == extra["np_rng"][0] and np.array_equal(g["np_rng"][1], extra["np_rng"][1])
    assert g["np_rng"][2:] == extra["np_rng"][2:]
    assert verify(root).returncode == 0
