"""CheckpointManager in one process (no process group): round trips, retention, errors, corruption."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient.checkpoint.api import (CheckpointConfigError, CheckpointMismatchError, NoRestorableStepError)
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.events.api import EventKind
from resilient.events.ledger import read_events


def make(seed: int = 0, hidden: int = 8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Linear(hidden, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optim


def train(model, optim, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(5, 4, generator=g)).pow(2).sum()
        optim.zero_grad()
        loss.backward()
        optim.step()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_into_fresh_objects(tmp_path: Path) -> None:
    model, optim = make()
    train(model, optim, 3)
    extra = {"pos": 17, "t": torch.arange(5.0), "nested": {"names": ["a", "b"]}}
    ck = CheckpointManager(local=tmp_path / "ckpt", interval=1)
    assert ck.restore({"model": model}) == 0
    assert ck.save(41, {"model": model, "optim": optim, "extra": extra})
    ck.close()
    ref_model = {k: v.clone() for k, v in model.state_dict().items()}
    ref_optim = optim.state_dict()

    m2, o2 = make(seed=5)
    extra2 = {"pos": 0, "t": torch.zeros(5), "nested": {"names": []}}
    ck2 = CheckpointManager(local=tmp_path / "ckpt", interval=1)
    assert ck2.restore({"model": m2, "optim": o2, "extra": extra2}) == 42
    ck2.close()
    assert same(ref_model, m2.state_dict())
    assert extra2["pos"] == 17 and torch.equal(extra2["t"], torch.arange(5.0))
    assert extra2["nested"]["names"] == ["a", "b"]
    got = o2.state_dict()
    assert got["state"].keys() == ref_optim["state"].keys()
    for i in got["state"]:
        assert same(got["state"][i], ref_optim["state"][i])
    assert ck2.last_restore is not None and ck2.last_restore.tier == "local"


def test_plain_dcp_reads_the_checkpoint(tmp_path: Path) -> None:
    model, optim = make()
    ck = CheckpointManager(local=tmp_path, interval=1)
    ck.save(0, {"model": model, "optim": optim})
    ck.close()
    target = {"model": make(seed=3)[0].state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "step_00000000"), no_dist=True)
    assert same(target["model"], model.state_dict())


def test_interval_and_force(tmp_path: Path) -> None:
    model, _ = make()
    ck = CheckpointManager(local=tmp_path, interval=4, keep_local=10)
    saved = [s for s in range(10) if ck.save(s, {"model": model})]
    assert saved == [3, 7]
    assert ck.save(8, {"model": model}, force=True)
    ck.close()
    assert sorted(ck.local.steps()) == [3, 7, 8]  # type: ignore[union-attr]
    assert all(ck.local.steps().values())  # type: ignore[union-attr]


def test_mutation_right_after_save_does_not_leak(tmp_path: Path) -> None:
    t = torch.zeros(1 << 20)
    ck = CheckpointManager(local=tmp_path, interval=1)
    ck.save(0, {"t": t})
    t.add_(1)  # training goes on at once
    ck.close()
    back = {"t": torch.full((1 << 20,), 7.0)}
    CheckpointManager(local=tmp_path, interval=1).restore(back)
    assert torch.count_nonzero(back["t"]) == 0


def test_retention_keeps_last_k_and_layout(tmp_path: Path) -> None:
    model, _ = make()
    ck = CheckpointManager(local=tmp_path, interval=1, keep_local=2)
    for s in range(5):
        ck.save(s, {"model": model})
    ck.close()
    assert ck.local is not None
    assert ck.local.steps() == {3: True, 4: True}
    d = tmp_path / "step_00000004"
    names = sorted(os.listdir(d))
    assert names == [".metadata", "COMMITTED", "__0_0.distcp", "manifest-rank0.json"]
    m = json.loads((d / "manifest-rank0.json").read_text())
    assert m["files"]["__0_0.distcp"]["size"] == (d / "__0_0.distcp").stat().st_size
    assert "crc32c" in m["metadata"]


def test_other_model_names_mismatched_keys(tmp_path: Path) -> None:
    model, _ = make()
    ck = CheckpointManager(local=tmp_path, interval=1)
    ck.save(0, {"model": model})
    ck.close()
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(CheckpointMismatchError) as e:
        CheckpointManager(local=tmp_path, interval=1).restore({"model": other})
    msg = str(e.value)
    assert "model.1.weight" in msg and "shape mismatch" in msg
    assert "model.1.running_mean" in msg  # in the checkpoint, not in this model
    wider, _ = make(hidden=16)
    with pytest.raises(CheckpointMismatchError, match=r"model\.0\.weight: checkpoint \[8, 4\] vs state \[16, 4\]"):
        CheckpointManager(local=tmp_path, interval=1).restore({"model": wider})


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_newest_falls_back_to_older_step(tmp_path: Path, damage: str, caplog) -> None:
    t = torch.arange(1000.0)
    ck = CheckpointManager(local=tmp_path, interval=1, keep_local=3)
    ck.save(0, {"t": t})
    t += 1
    ck.save(1, {"t": t})
    ck.close()
    f = tmp_path / "step_00000001" / "__0_0.distcp"
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(f, f.stat().st_size - 10)
    else:
        f.unlink()
    back = {"t": torch.zeros(1000)}
    assert CheckpointManager(local=tmp_path, interval=1).restore(back) == 1  # step 0 + 1
    assert torch.equal(back["t"], torch.arange(1000.0))
    assert "skipped" in caplog.text or "no tier" in caplog.text


def test_all_steps_corrupt_is_an_error(tmp_path: Path) -> None:
    ck = CheckpointManager(local=tmp_path, interval=1)
    ck.save(0, {"t": torch.ones(10)})
    ck.close()
    (tmp_path / "step_00000000" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(NoRestorableStepError):
        CheckpointManager(local=tmp_path, interval=1).restore({"t": torch.ones(10)})


def test_partial_steps_are_invisible_and_cleaned(tmp_path: Path) -> None:
    ck = CheckpointManager(local=tmp_path, interval=1)
    ck.save(0, {"t": torch.ones(10)})
    ck.save(1, {"t": torch.ones(10) * 2})
    ck.close()
    (tmp_path / "step_00000001" / "COMMITTED").unlink()  # as if killed before the commit
    (tmp_path / "step_00000002").mkdir()
    back = {"t": torch.zeros(10)}
    assert CheckpointManager(local=tmp_path, interval=1).restore(back) == 1
    assert torch.equal(back["t"], torch.ones(10))
    assert sorted(os.listdir(tmp_path)) == ["step_00000000"]


def test_events_in_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    ck = CheckpointManager(local=tmp_path / "ckpt", interval=1)
    ck.save(0, {"t": torch.ones(10)})
    ck.close()
    CheckpointManager(local=tmp_path / "ckpt", interval=1).restore({"t": torch.ones(10)})
    evs = list(read_events(tmp_path / "run"))
    kinds = [e.kind for e in evs]
    assert EventKind.CKPT_SAVE in kinds and EventKind.CKPT_TIER_DONE in kinds and EventKind.CKPT_RESTORE in kinds
    save = next(e for e in evs if e.kind == EventKind.CKPT_SAVE)
    assert save.details["step"] == 0 and save.details["blocking_seconds"] >= 0 and save.details["bytes"] == 40
    done = next(e for e in evs if e.kind == EventKind.CKPT_TIER_DONE)
    assert done.details["tier"] == "local" and done.details["seconds"] > 0
    rest = next(e for e in evs if e.kind == EventKind.CKPT_RESTORE)
    assert rest.details["tier"] == "local" and rest.details["step"] == 0 and rest.details["seconds"] > 0


def test_config_errors_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CheckpointConfigError, match="at least one tier"):
        CheckpointManager()
    with pytest.raises(CheckpointConfigError, match="interval"):
        CheckpointManager(local="/tmp/x", interval=0)
    with pytest.raises(CheckpointConfigError, match="interval"):
        CheckpointManager(local="/tmp/x", interval="often")


def test_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_CKPT_LOCAL", str(tmp_path))
    monkeypatch.setenv("RESILIENT_CKPT_INTERVAL", "3")
    monkeypatch.setenv("RESILIENT_CKPT_PERSISTENT_EVERY", "2")
    ck = CheckpointManager.from_env()
    assert ck.interval == 3 and ck.config.persistent_every == 2 and ck.persistent is None
    ck.close()


def test_fast_reader_reads_plain_dcp_checkpoints(tmp_path: Path) -> None:
    """The direct read path takes whole contiguous tensors, DCP's path the rest; same values either way."""
    from resilient.checkpoint.restore.reader import FastReader

    src = {"a": torch.randn(300, 7), "b": torch.arange(10, dtype=torch.int16), "obj": {"x": [1, 2]},
           "bf": torch.randn(33).to(torch.bfloat16)}
    dcp.save(src, checkpoint_id=str(tmp_path), no_dist=True)
    dst = {"a": torch.zeros(7, 300).t(), "b": torch.zeros(10, dtype=torch.int16), "obj": {"x": []},
           "bf": torch.zeros(33, dtype=torch.bfloat16)}
    reader = FastReader(tmp_path)
    dcp.load(dst, storage_reader=reader, no_dist=True)
    assert torch.equal(dst["a"], src["a"]) and torch.equal(dst["b"], src["b"]) and torch.equal(dst["bf"], src["bf"])
    assert dst["obj"] == {"x": [1, 2]}
    assert reader.fast_items == 2  # b and bf; a's target is transposed, obj is bytes
    mem = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    dst2 = {"a": torch.zeros(300, 7)}
    reader = FastReader(tmp_path / "nowhere", mem)  # everything from memory
    dcp.load(dst2, storage_reader=reader, no_dist=True)
    assert torch.equal(dst2["a"], src["a"]) and reader.fast_items == 1


def test_exit_without_close_finishes_the_last_save(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import torch\nfrom resilient.checkpoint.manager import CheckpointManager\n"
            f"ck = CheckpointManager(local={str(tmp_path)!r}, interval=1)\n"
            "ck.save(0, {'w': torch.ones(1 << 22)}, force=True)\n")  # and exit at once
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "step_00000000" / "COMMITTED").exists()


def test_the_config_reads_no_environment_the_manager_takes_the_jobs_upload_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CheckpointConfig`` is what it is given; ``--upload-grace`` reaches a worker's manager through the
    environment ``resilient-run`` writes, read where the manager meets the job."""
    from resilient import env
    from resilient.checkpoint.api import DEFAULT_UPLOAD_GRACE_S, CheckpointConfig

    monkeypatch.setenv(env.UPLOAD_GRACE, "7")
    assert CheckpointConfig(local=str(tmp_path)).upload_grace_s == DEFAULT_UPLOAD_GRACE_S
    ck = CheckpointManager(local=tmp_path)
    ck.close()
    assert ck.config.upload_grace_s == 7.0
    given = CheckpointManager(local=tmp_path / "b", upload_grace_s=3)
    given.close()
    assert given.config.upload_grace_s == 3
    monkeypatch.setenv(env.UPLOAD_GRACE, "soon")
    with pytest.raises(CheckpointConfigError, match=env.UPLOAD_GRACE):
        CheckpointManager(local=tmp_path / "c")
