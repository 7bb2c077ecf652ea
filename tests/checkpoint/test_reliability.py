"""Faults of the checkpoint tiers under the real ``resilient-run``: a full local disk, a dead persistent store.

Each test is a fault scenario: the job must train through it, report it in the ledger, and a restart
must still restore bit-exact.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.launcher.api import NOT_DURABLE_EXIT_CODE
from resilient.drill.spec import FaultHow, WorkerFault, plan_env

from .conftest import GCS
from .test_distributed import assert_bit_exact, final
from .test_e2e_launcher import injected, resilient_run

# hidden=50000: one checkpoint (model + AdamW state, deduplicated across the 2 ranks) is about 14 MB, so a
# 20 MB disk holds the first save and no second one
BIG = ["--steps", "16", "--hidden", "50000"]


@pytest.fixture
def tiny_disk() -> Iterator[Path]:
    """A real 20 MB filesystem (tmpfs): writes past its size fail with ENOSPC."""
    d = Path(tempfile.mkdtemp(prefix="tiny-disk-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a 20 MB tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
        d.rmdir()


@pytest.fixture(scope="module")
def big_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    base = tmp_path_factory.mktemp("big-ref")
    r = resilient_run(base, ["--ckpt-local", str(base / "ckpt"), "--ckpt-interval", "4"],
                      [*BIG, "--out", str(base / "out")], {})
    assert r.returncode == 0, r.stderr[-4000:]
    return final(base / "out", 2)


def tier_events(run_dir: Path, kind: EventKind, tier: str) -> list[dict]:
    return [e.details | {"rank": e.rank, "attempt": e.attempt} for e in read_events(run_dir)
            if e.kind == kind and e.details.get("tier") == tier]


@pytest.mark.timeout(300)
def test_full_local_disk_training_goes_on_persistent_gets_every_step(
        tmp_path: Path, tiny_disk: Path, big_reference: list[dict]) -> None:
    persistent = tmp_path / "bucket"
    r = resilient_run(tmp_path, ["--max-restarts", "2", "--ckpt-local", str(tiny_disk),
                                 "--ckpt-persistent", f"file://{persistent}", "--ckpt-interval", "4",
                                 "--ckpt-persistent-every", "1"],
                      [*BIG, "--out", str(tmp_path / "out")],
                      # a crash after step 11 was saved: the restart must restore it from the persistent tier
                      plan_env(WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=1, step=11)), timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert injected(tmp_path / "run") == ["kill-after-save"]
    run = tmp_path / "run"
    failed = tier_events(run, EventKind.CKPT_TIER_FAILED, "local")
    # torch's zip writer reports a full disk as "unexpected pos" (its write came up short), DCP's own
    # writes as ENOSPC
    assert failed and all(d["error"] for d in failed), failed
    assert {d["step"] for d in failed} >= {7, 15}
    done = {d["step"] for d in tier_events(run, EventKind.CKPT_TIER_DONE, "persistent")}
    assert {3, 7, 11, 15} <= done, done
    restored = [e.details for e in read_events(run) if e.kind == EventKind.CKPT_RESTORE]
    assert restored and all(d["step"] == 11 and d["tier"] == "persistent" for d in restored), restored
    assert_bit_exact(big_reference, final(tmp_path / "out", 2))
    steps = sorted(p.name for p in persistent.iterdir() if (p / "COMMITTED").exists())
    assert steps[-1] == "step_00000015"
    assert "local tier: save of step 7 failed, skipping the tier" in r.stderr  # the warning a user sees
    # the disk holds nothing half-written: every step directory left on it is complete
    assert all((p / "COMMITTED").exists() for p in tiny_disk.iterdir() if p.name.startswith("step_"))


def _dead_gcs(tmp_path: Path) -> GCS:
    """A GCS server that held the bucket and is now down: its port refuses connections."""
    server = GCS(tmp_path / "gcs-data")
    server.start()
    server.make_bucket("dead")
    server.stop()
    return server


@pytest.mark.timeout(300)
def test_dead_persistent_store_neither_delays_start_nor_exit(tmp_path: Path) -> None:
    server = _dead_gcs(tmp_path)
    grace = 5.0
    t0 = time.time()
    r = resilient_run(tmp_path, ["--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-persistent", "gs://dead/run",
                                 "--ckpt-interval", "4", "--ckpt-persistent-every", "1", "--upload-grace", str(grace)],
                      ["--steps", "16", "--out", str(tmp_path / "out")], server.env(), timeout=240)
    t_end = time.time()
    # training finished, but its last step is on the local tier only: the exit status says so
    assert r.returncode == NOT_DURABLE_EXIT_CODE, r.stderr[-4000:]
    events = list(read_events(tmp_path / "run"))
    saves = [e for e in events if e.kind == EventKind.CKPT_SAVE]
    assert [e.details["step"] for e in saves] == [3, 7, 11, 15]  # every local save happened
    failed = [e.details for e in events if e.kind == EventKind.CKPT_TIER_FAILED and e.details["tier"] == "persistent"]
    probe = [d for d in failed if "unreachable at restore" in d["error"]]
    assert probe, failed  # start-up went on without the store, and said so
    abandoned = {d["step"] for d in failed if d["error"] == "abandoned at exit"}
    assert 15 in abandoned, failed
    assert not [e for e in events if e.kind == EventKind.CKPT_TIER_DONE and e.details["tier"] == "persistent"]
    local_done = {e.details["step"] for e in events if e.kind == EventKind.CKPT_TIER_DONE
                  and e.details["tier"] == "local"}
    assert local_done == {3, 7, 11, 15}
    # start-up: the first save comes within the restore probe (5 s) plus the launch itself
    first = min(e.wall for e in saves)
    assert first - t0 < 45, f"first save {first - t0:.1f} s after launch"
    # exit: within the grace (plus process teardown) after the last save
    last = max(e.wall for e in saves)
    assert t_end - last < grace + 20, f"exit {t_end - last:.1f} s after the last save (grace {grace} s)"
    print(f"launch to first save {first - t0:.1f} s; last save to exit {t_end - last:.1f} s (grace {grace} s)")
