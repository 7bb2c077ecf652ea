"""End to end under the real ``resilient-run``: several SIGKILLs in one job, restarts, a wiped local tier.

The job restarts in-process after each kill (``--max-restarts``) and must end bit-exact with an
uninterrupted run of the same deterministic script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.drill.spec import FaultHow, WorkerFault, plan_env

from .conftest import GCS, REPO, TRAIN, _child_env
from .test_distributed import assert_bit_exact, final

STEPS = ["--steps", "16"]


def resilient_run(tmp_path: Path, flags: list[str], script_args: list[str], env: dict[str, str],
                  timeout: float = 150) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
           "--run-dir", str(tmp_path / "run"), *flags, str(TRAIN), *script_args]
    return subprocess.run(cmd, cwd=REPO, env=_child_env(env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    base = tmp_path_factory.mktemp("e2e-ref")
    r = resilient_run(base, ["--ckpt-local", str(base / "ckpt"), "--ckpt-interval", "4"],
                      [*STEPS, "--out", str(base / "out")], {})
    assert r.returncode == 0, r.stderr[-4000:]
    return final(base / "out", 2)


def injected(run_dir: Path) -> list[str]:
    """The faults the ledger says were carried out, in order (each is recorded before it happens)."""
    return [e.details["fault"] for e in read_events(run_dir) if e.kind == EventKind.FAULT_INJECTED]


def restores(run_dir: Path) -> list[dict]:
    return [e.details | {"rank": e.rank, "attempt": e.attempt}
            for e in read_events(run_dir) if e.kind == EventKind.CKPT_RESTORE]


@pytest.mark.timeout(200)
def test_kills_mid_write_and_between_saves(tmp_path: Path, uninterrupted: list[dict]) -> None:
    # the disk tier's faults: no snapshots in node memory, which would restore a newer step than the saves
    r = resilient_run(tmp_path, ["--max-restarts", "3", "--ckpt-local", str(tmp_path / "ckpt"),
                                 "--ckpt-interval", "4", "--ckpt-snapshot", "off"],
                      [*STEPS, "--out", str(tmp_path / "out")],
                      plan_env(WorkerFault(FaultHow.KILL_MID_WRITE, rank=1, step=7, attempt=0),
                               WorkerFault(FaultHow.KILL_AFTER_SAVE, rank=1, step=11, attempt=1)))
    assert r.returncode == 0, r.stderr[-4000:]
    assert injected(tmp_path / "run") == ["kill-mid-write", "kill-after-save"]
    assert_bit_exact(uninterrupted, final(tmp_path / "out", 2))
    got = restores(tmp_path / "run")
    assert {d["step"] for d in got} >= {11}  # the last attempt resumed from the save before the kill
    assert all(d["tier"] == "local" for d in got)


@pytest.mark.timeout(240)
def test_kill_mid_upload_then_lost_local_disk_restores_from_gcs(tmp_path: Path, gcs: GCS,
                                                              uninterrupted: list[dict]) -> None:
    gcs.make_bucket("e2e")
    r = resilient_run(tmp_path, ["--max-restarts", "3", "--ckpt-local", str(tmp_path / "ckpt"),
                                 "--ckpt-persistent", "gs://e2e/run", "--ckpt-interval", "4",
                                 "--ckpt-persistent-every", "1",
                                 # the kill fires where the upload process says a file landed ("auto" leaves the
                                 # process off on a machine with fewer than 2 cores a rank)
                                 "--ckpt-upload-process", "on"],
                      [*STEPS, "--out", str(tmp_path / "out")],
                      {**gcs.env(), **plan_env(WorkerFault(FaultHow.KILL_MID_UPLOAD, rank=0, step=7, attempt=0),
                                               WorkerFault(FaultHow.LOSE_DISK, rank=0, step=11, attempt=1))})
    assert r.returncode == 0, r.stderr[-4000:]
    assert injected(tmp_path / "run") == ["kill-mid-upload", "lose-disk"]
    assert_bit_exact(uninterrupted, final(tmp_path / "out", 2))
    got = restores(tmp_path / "run")
    last = [d for d in got if d["step"] == 11]
    assert last and all(d["tier"] == "persistent" for d in last), got
    done = [e.details["step"] for e in read_events(tmp_path / "run")
            if e.kind == EventKind.CKPT_TIER_DONE and e.details["tier"] == "persistent"]
    assert 11 in done
