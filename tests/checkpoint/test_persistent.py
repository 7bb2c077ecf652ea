"""Persistent tier through fsspec: a real GCS API server (fake-gcs-server), outages, fallback."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient.checkpoint.storage import tiers
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import GCS


def state(v: float) -> dict:
    return {"w": torch.full((256, 256), v), "meta": {"v": v}}


def restored(ck: CheckpointManager) -> tuple[int, dict]:
    st = state(-1.0)
    return ck.restore(st), st


@pytest.mark.timeout(60)
def test_upload_every_nth_save_and_restore_from_gcs_after_wiping_local(tmp_path: Path, gcs: GCS) -> None:
    gcs.make_bucket("ckpt")
    url = f"gs://ckpt/{tmp_path.name}"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=2)
    for s in range(4):
        ck.save(s, state(float(s)))
    assert ck.wait(30)
    ck.close()
    assert ck.persistent is not None
    assert ck.persistent.steps() == {1: True, 3: True}
    shutil.rmtree(tmp_path / "local")
    ck2 = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1)
    start, st = restored(ck2)
    ck2.close()
    assert start == 4 and torch.equal(st["w"], torch.full((256, 256), 3.0)) and st["meta"] == {"v": 3.0}
    assert ck2.last_restore is not None and ck2.last_restore.tier == "persistent"
    # a plain DCP read of the bucket's copy, without this package
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    target = {"w": torch.zeros(256, 256)}
    dcp.load(target, storage_reader=FsspecReader(f"{url}/step_00000003", token="anon",
                                                 endpoint_url=gcs.url), no_dist=True)
    assert torch.equal(target["w"], torch.full((256, 256), 3.0))


@pytest.mark.timeout(60)
def test_persistent_only(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    ck = CheckpointManager(persistent=url, interval=1, persistent_every=1)
    ck.save(0, state(1.0))
    ck.save(1, state(2.0))
    ck.close()
    start, st = restored(CheckpointManager(persistent=url, interval=1))
    assert start == 2 and torch.equal(st["w"], torch.full((256, 256), 2.0))


@pytest.mark.timeout(60)
def test_corrupt_local_copy_falls_back_to_persistent(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1)
    ck.save(0, state(5.0))
    ck.close()
    f = tmp_path / "local" / "step_00000000" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    ck2 = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1)
    start, st = restored(ck2)
    assert start == 1 and torch.equal(st["w"], torch.full((256, 256), 5.0))
    assert ck2.last_restore.sources["__0_0.distcp"] == "persistent"  # type: ignore[union-attr]
    assert ck2.last_restore.sources[".metadata"] == "local"  # type: ignore[union-attr]
    ck2.close()


@pytest.mark.timeout(120)
def test_store_outage_mid_upload_never_blocks_training(tmp_path: Path, gcs: GCS, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """The server dies after the first file of an upload and comes back later: training goes on at full
    speed meanwhile, the upload is retried and completes, and the failure is reported if retries run out."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    gcs.make_bucket("ckpt")
    url = f"gs://ckpt/{tmp_path.name}"
    outage = threading.Event()
    back = threading.Event()
    orig_write = tiers.FsspecTier.write_bytes

    def write(self, step, name, data):  # type: ignore[no-untyped-def]
        orig_write(self, step, name, data)  # plain files of one part go up in one request each
        if step == 1 and not outage.is_set():
            outage.set()
            gcs.stop()  # the store goes away in the middle of this step's upload

    monkeypatch.setattr(tiers.FsspecTier, "write_bytes", write)
    # the fault is patched into this process: its upload thread sends
    # (the upload process's own faults: test_upload_process.py)
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=2,
                           upload_retries=30, upload_backoff_s=0.1, upload_backoff_max_s=0.5,
                           upload_process=False)
    blocking = []
    for s in range(2):
        t0 = time.perf_counter()
        ck.save(s, state(float(s)))
        blocking.append(time.perf_counter() - t0)
    assert outage.wait(30)
    # training continues while the store is down: saves return, local checkpoints land
    for s in range(2, 5):
        ck.save(s, state(float(s)))
    assert ck.local is not None
    deadline = time.monotonic() + 30
    while 4 not in ck.local.steps() or not ck.local.steps()[4]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ck.persistent is not None
    gcs.start()
    back.set()
    assert ck.wait(60)
    ck.close()
    steps = ck.persistent.steps()
    assert steps.get(1) is True or steps.get(3) is True
    start, st = restored(CheckpointManager(persistent=url, interval=1))
    # 1 and 3 by persistent_every=2; 4, the last step, by close() (the final step is made durable)
    assert start - 1 in (1, 3, 4) and torch.equal(st["w"], torch.full((256, 256), float(start - 1)))
    evs = list(read_events(tmp_path / "run"))
    done = [e.details["step"] for e in evs if e.kind == EventKind.CKPT_TIER_DONE and e.details["tier"] == "persistent"]
    assert done


@pytest.mark.timeout(60)
def test_dead_store_gives_up_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that never answers: the upload fails after its retries, reported in the ledger, no exception."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    url = f"file://{tmp_path}/bucket"

    def broken(self, step, name, local_path):  # type: ignore[no-untyped-def]
        raise OSError("store unreachable")

    monkeypatch.setattr(tiers.FsspecTier, "put_file", broken)
    monkeypatch.setattr(tiers.FsspecTier, "write_bytes", broken)  # files of one part: one request each
    # the fault is patched into this process: its upload thread sends
    # (the upload process's own faults: test_upload_process.py)
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1,
                           upload_retries=2, upload_backoff_s=0.01, upload_process=False)
    ck.save(0, state(1.0))
    assert ck.wait(30)
    ck.save(1, state(2.0))
    ck.close()
    failed = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert failed and failed[0].details["tier"] == "persistent" and "unreachable" in failed[0].details["error"]
    assert ck.local is not None and ck.local.steps() == {0: True, 1: True}


@pytest.mark.timeout(90)
def test_plain_file_larger_than_a_part_goes_up_in_parts_composed_by_gcs(tmp_path: Path, gcs: GCS) -> None:
    """A plain data file of several parts: each part one request, then one object made by the store; the
    bucket's copy is byte-identical to the local one, no part is left behind, and a plain DCP read takes it."""
    import gcsfs

    from resilient.checkpoint.storage.parts import part_size

    gcs.make_bucket("parts")
    url = f"gs://parts/{tmp_path.name}"
    w = torch.randn(10 << 18)  # 10 MiB: three parts
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1)
    ck.save(0, {"w": w})
    assert ck.wait(60)
    ck.close()
    local = (tmp_path / "local" / "step_00000000" / "__0_0.distcp").read_bytes()
    assert len(local) > part_size(len(local))  # more than one part
    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    root = f"parts/{tmp_path.name}/step_00000000"
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    assert "COMMITTED" in names and not [n for n in names if ".up" in n], names
    assert fs.cat_file(f"{root}/__0_0.distcp") == local
    target = {"w": torch.zeros_like(w)}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dcp.load(target, storage_reader=FsspecReader(f"{url}/step_00000000", token="anon", endpoint_url=gcs.url),
             no_dist=True)
    assert torch.equal(target["w"], w)


@pytest.mark.timeout(60)
def test_a_file_that_cannot_be_composed_leaves_the_step_uncommitted(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part of the data file lands, but the file cannot be made of them (a directory is in its place):
    the upload is reported failed and the step is never committed on the persistent tier."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "bucket" / "step_00000000" / "__0_0.distcp").mkdir(parents=True)
    ck = CheckpointManager(local=tmp_path / "local", persistent=str(tmp_path / "bucket"), interval=1,
                           persistent_every=1, upload_retries=0)
    ck.save(0, {"w": torch.randn(10 << 18)})
    assert ck.wait(30)
    ck.close()
    assert ck.persistent is not None and ck.persistent.steps() == {0: False}
    assert [p.name for p in (tmp_path / "bucket" / "step_00000000").glob(".__0_0.distcp.up*")]  # parts landed
    failed = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert [(e.details["tier"], e.details["step"]) for e in failed] == [("persistent", 0)], failed
    assert "compose" in failed[0].details["error"] or "directory" in failed[0].details["error"], failed[0].details


@pytest.mark.timeout(90)
def test_a_store_back_from_an_outage_is_called_at_once_while_the_calls_it_left_behind_still_retry(
        tmp_path: Path, gcs: GCS) -> None:
    """gcsfs retries a refused connection for about 30 s (backoff up to 16 s between tries) and its calls cannot
    be cancelled: once the bound's cap of calls left behind was reached, every call was refused as busy until they
    gave up, for up to a minute after the store was back. Now one probe at a time goes out; the store's answer
    opens the way while the calls left behind still run."""
    gcs.make_bucket("ckpt")
    tier = tiers.BoundedTier(tiers.FsspecTier(f"gs://ckpt/{tmp_path.name}"), timeout_s=1.0, max_abandoned=2)
    f = tmp_path / "f"
    f.write_bytes(b"x" * 1000)
    tier.put_file(1, "f", str(f))
    gcs.stop()  # SIGKILL: connections refused, gcsfs retries with backoff
    for what in ("left behind", "left behind", "a probe, the store still dead"):
        with pytest.raises(TimeoutError, match="no answer within"):
            tier.put_file(2, "f", str(f))
    assert tier._caller.abandoned() == 3
    gcs.start()  # the same port and data directory
    tier.put_file(3, "f", str(f))  # a probe: the store answers
    tier.put_file(4, "f", str(f))  # and calls go through again
    assert tier._caller.abandoned() >= 1, "the calls left behind ended before the store came back: nothing tested"
    assert tier.list_files(3) == {"f": 1000} and tier.list_files(4) == {"f": 1000}
