"""The snapshot tier: each rank's state in node memory after a step, restored after a worker's death on the same node.

Real ranks on real gloo groups (``examples/ckpt_train.py``), a real SIGKILL of a rank right after a step, then the
same job started again as ``resilient-run`` would start it (attempt 1): it must resume from the snapshot of the last
step (not the last save on disk) and end bit-exact with an uninterrupted run. Each way a snapshot can be bad — a flipped
byte, a torn (truncated) slot, a missing commit record, a full ``/dev/shm`` — must fall back to the disk tiers and still
end bit-exact; none may stop training.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.api import CheckpointConfig, CheckpointConfigError
from resilient.checkpoint.restore.restore import _agreed_snapshot
from resilient.checkpoint.save.manager import _AGREE_AHEAD, _REAGREE_CALLS
from resilient.checkpoint.snapshot import dirs
from resilient.checkpoint.snapshot.ring import SnapshotRing, _plan_load, Leaf
from resilient.drill.spec import FaultHow, WorkerFault, plan_env
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import REPO, TRAIN, Workers, _child_env, ok
from .test_distributed import assert_bit_exact, final
from .test_failed_saves import full_disk  # noqa: F401 - a real full file system for the snapshots
from .test_reliability import tiny_disk  # noqa: F401 - the file system full_disk fills

STEPS = 16
INTERVAL = "4"  # disk saves after steps 3, 7, 11, 15: a kill after step 9 loses 2 steps without snapshots
SETTLED = ("--settle-before", "9")  # step 7's disk save committed before the kill after step 9 (see below)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A snapshot directory in real memory (``/dev/shm``), as the agent makes one. Not named like an agent's: an
    agent starting in a parallel test would take one without an owner record for a dead agent's, and sweep it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    d = Path(tempfile.mkdtemp(prefix="snap-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    base = tmp_path_factory.mktemp("snap-ref")
    w = Workers()
    try:
        ok(w.run(TRAIN, ["--steps", str(STEPS), "--interval", INTERVAL, "--local", str(base / "ckpt"),
                         "--out", str(base / "out")], 2))
    finally:
        w.close()
    return final(base / "out", 2)


def _job(workers: Workers, tmp: Path, snap: Path | None, attempt: int, extra: dict[str, str] | None = None,
         every: str = "1", interval: str = INTERVAL, steps: int = STEPS, args: tuple[str, ...] = ()) -> list:
    env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), **(extra or {})}
    if snap is not None:
        env.update(RESILIENT_CKPT_SNAPSHOT_DIR=str(snap), RESILIENT_CKPT_SNAPSHOT=every)
    return workers.run(TRAIN, ["--steps", str(steps), "--interval", interval, "--local", str(tmp / "ckpt"),
                               "--out", str(tmp / "out"), *args], 2, env=env)


def _killed_after_step_9(workers: Workers, tmp: Path, snap: Path) -> None:
    """Attempt 0: rank 1 SIGKILLs itself right after step 9 (its snapshot of 9 may or may not be committed); the
    survivor is killed as torchrun and resilient-run kill it. Rank 1 settles before step 9, so step 7's disk save is
    committed: on a loaded machine a background commit can outlast the six short steps since step 3, and a kill then
    leaves no disk step at all, which is not the fallback these tests are about."""
    res = _job(workers, tmp, snap, 0, plan_env(WorkerFault(FaultHow.KILL, rank=1, step=9, attempt=0)),
               args=SETTLED)
    assert any(r.returncode != 0 for r in res)
    assert not (tmp / "out" / "rank0.pt").exists()


def _heads(snap: Path, rank: int) -> dict[Path, dict]:
    out = {}
    for rec in snap.glob(f"rank{rank}-slot*.json"):
        out[rec] = json.loads(rec.read_bytes().partition(b"\n")[0])
    return out


def _restored(tmp: Path) -> list[dict]:
    return [torch.load(tmp / "out" / f"rank{r}.pt", weights_only=False)["restore"] for r in range(2)]


@pytest.mark.timeout(240)
def test_a_killed_rank_resumes_from_the_snapshot_of_the_last_step_bit_exact(
        tmp_path: Path, shm: Path, workers: Workers, reference: list[dict]) -> None:
    _killed_after_step_9(workers, tmp_path, shm)
    committed = {r: sorted(h["step"] for h in _heads(shm, r).values()) for r in range(2)}
    assert max(committed[1]) in (8, 9), committed  # two slots: the last steps, whichever the kill left committed
    ok(_job(workers, tmp_path, shm, 1))
    got = _restored(tmp_path)
    assert [g["tier"] for g in got] == ["snapshot", "snapshot"], got
    assert {g["step"] for g in got} == {min(max(committed[0]), max(committed[1]))}
    assert got[0]["step"] > 7  # newer than the last save on disk
    assert_bit_exact(reference, final(tmp_path / "out", 2))


@pytest.mark.timeout(180)
def test_auto_cadence_is_agreed_so_every_rank_snapshots_the_same_steps(tmp_path: Path, shm: Path,
                                                                      workers: Workers) -> None:
    """Each rank measures its own cost; snapshots of different steps on different ranks would be useless, so the
    ranks agree on one cadence a few steps in (on the save worker, at the third step), from a step none has reached
    (step 6), and again at each disk save."""
    ok(_job(workers, tmp_path, shm, 0, every="auto"))
    held = [sorted(h["step"] for h in _heads(shm, r).values()) for r in range(2)]
    # both ranks' newest snapshot is of the same step, on the agreed schedule (it starts at step 2 + 4). The older
    # slot may differ: a rank whose training passed the agreed first step before its save worker installed the
    # cadence (a loaded machine, steps of a few ms) keeps a measuring snapshot there instead, as the design allows
    # (manager.py, _AGREE_AHEAD); seen in CI as [[1, 12], [6, 12]]
    assert held[0][-1] == held[1][-1] >= 6, held


@pytest.mark.timeout(240)
def test_a_long_disk_interval_still_has_snapshots_from_the_first_attempts_early_steps(
        tmp_path: Path, shm: Path, workers: Workers) -> None:
    """The cadence is agreed a few steps in, not at the first disk save: with saves far apart (none in this first
    attempt) the attempt would otherwise hold only the two measuring snapshots of its first steps until a disk save,
    and a worker killed after step 20 would start over from step 0. The ranks settle before step 9 (they wait for
    their save workers, which includes the agreement): this job's steps take a few milliseconds, so on a loaded
    machine a save worker kept off a core for tens of them would agree a first step past the kill (as it should: no
    rank may have passed it), and the test would not be about the agreement coming early. A snapshot may cost the
    whole step here: at the default 1 % of steps of a few milliseconds, a loaded machine's measured cost sets a
    cadence of 17-40 steps (measured beside two CPU burners), so only the agreed first step is taken before the
    kill. Both ranks once held only the measuring snapshots in a fresh-clone run under load, most likely because
    their save workers installed the cadence after training passed that step (the early agreement's margin is 4
    steps: 20 ms here). With a cadence of a step or two, the steps after it are taken by both."""
    res = _job(workers, tmp_path, shm, 0, plan_env(WorkerFault(FaultHow.KILL, rank=1, step=20, attempt=0)),
               every="auto", interval="100", steps=24, args=(*SETTLED, "--snapshot-budget", "1"))
    assert any(r.returncode != 0 for r in res)
    held = [{h["step"] for h in _heads(shm, r).values()} for r in range(2)]
    common = held[0] & held[1]
    # agreed at step 2, from step 2 + 4 (or 4 past where the ranks were when their workers met), on both ranks
    assert common and max(common) >= 6, (held, [r.output[-2000:] for r in res])
    ok(_job(workers, tmp_path, shm, 1, every="auto", interval="100", steps=24))
    got = _restored(tmp_path)
    assert [g["tier"] for g in got] == ["snapshot", "snapshot"] and {g["step"] for g in got} == {max(common)}, got
    whole = tmp_path / "uninterrupted"
    ok(_job(workers, whole, None, 0, interval="100", steps=24))
    assert_bit_exact(final(whole / "out", 2), final(tmp_path / "out", 2))


@pytest.mark.timeout(300)
def test_the_cadence_carries_over_a_restart_so_snapshots_resume_at_once(tmp_path: Path, shm: Path,
                                                                       workers: Workers,
                                                                       reference: list[dict]) -> None:
    """A worker killed before its attempt's first disk save must still find snapshots of that attempt: the attempt
    after a restore snapshots from its first step under the cadence its predecessor's snapshots recorded, instead of
    taking two and waiting for a disk save's agreement."""
    run = {"RESILIENT_RUN_DIR": str(tmp_path / "run")}  # the ledger, for the cadence events
    res = _job(workers, tmp_path, shm, 0, {**run, **plan_env(WorkerFault(FaultHow.KILL, rank=1, step=9, attempt=0))},
               every="auto")
    assert any(r.returncode != 0 for r in res)
    before = {r: _heads(shm, r) for r in range(2)}
    newest = {r: max(before[r].values(), key=lambda h: h["step"]) for r in range(2)}
    k0 = newest[0]["every"]
    assert isinstance(k0, int) and k0 >= 1 and newest[1]["every"] == k0, newest  # agreed at the save of step 3
    epochs0 = {h["epoch"] for r in range(2) for h in before[r].values()}
    # attempt 1 restores, then rank 1 dies after step 12: its first disk save (step 11) may not be committed
    res = _job(workers, tmp_path, shm, 1, {**run, **plan_env(WorkerFault(FaultHow.KILL, rank=1, step=12, attempt=1))},
               every="auto")
    assert any(r.returncode != 0 for r in res)
    for r in range(2):
        ours = [h for h in _heads(shm, r).values() if h["epoch"] not in epochs0]
        assert ours, f"rank {r}: attempt 1 took no snapshot before its first disk save"
        # until attempt 1's own first agreement (at its first disk save) takes effect: the carried cadence, not a
        # measuring snapshot nor an early agreement of its own
        firsts = [e.details["from_step"] for e in read_events(tmp_path / "run")
                  if e.kind is EventKind.CKPT_SNAPSHOT_CADENCE and e.attempt == 1 and e.details["source"] == "agreed"]
        carried = [h for h in ours if h["step"] < min(firsts, default=STEPS)]
        assert carried and all(h["every"] == k0 for h in carried), (k0, ours, firsts)
    # the same steps on both ranks: of use at the next restore (the killed rank's snapshot of the step it died after
    # may or may not be committed)
    steps1 = [sorted(h["step"] for h in _heads(shm, r).values() if h["epoch"] not in epochs0 and h["step"] < 12)
              for r in range(2)]
    assert steps1[0] and steps1[0] == steps1[1], steps1
    # the ledger says so: attempt 0 agreed k0 at a disk save (from every rank's proposal), attempt 1 resumed it at
    # its restore, from the step after the one it restored
    cadence = [e for e in read_events(tmp_path / "run") if e.kind is EventKind.CKPT_SNAPSHOT_CADENCE]
    assert {e.rank for e in cadence} == {0}, cadence
    agreed = [e.details for e in cadence if e.attempt == 0 and e.details["source"] == "agreed"]
    # the agreement in force at the newest snapshot: under load the save of step 7 may agree another cadence, from
    # step 12, which the kill after step 9 never let take effect
    in_force = [a for a in agreed if a["from_step"] <= newest[0]["step"]]
    assert in_force and in_force[-1]["every"] == k0 and len(in_force[-1]["proposals"]) == 2, cadence
    resumed = [e.details for e in cadence if e.attempt == 1 and e.details["source"] == "resumed"]
    restored = [e.details["step"] for e in read_events(tmp_path / "run")
                if e.kind is EventKind.CKPT_RESTORE and e.attempt == 1 and e.rank == 0]
    assert len(resumed) == 1 and resumed[0]["every"] == k0 and [resumed[0]["from_step"]] == [s + 1 for s in restored]
    ok(_job(workers, tmp_path, shm, 2, every="auto"))
    assert_bit_exact(reference, final(tmp_path / "out", 2))


def test_a_restore_carries_the_slowest_recorded_cadence(shm: Path) -> None:
    for d in "abcde":
        (shm / d).mkdir()
    a = SnapshotRing(shm / "a", rank=0, world_size=2, every="auto")
    b = SnapshotRing(shm / "b", rank=1, world_size=2, every="auto")
    for ring, k in ((a, 3), (b, 5)):
        ring.agree(k, 0)
        assert ring.take(6, {"w": torch.zeros(4)}) and ring.flush(10)
    offers = [a.offer(), b.offer()]
    assert [o.every for o in offers] == [3, 5]
    fresh = SnapshotRing(shm / "c", rank=1, world_size=2, every="auto")  # a replacement node's empty memory
    assert fresh.offer().every is None
    assert fresh.resume([offers[0], fresh.offer()], 7) == 3  # takes the others' cadence
    assert [s for s in range(7, 20) if fresh.due(s)] == [7, 10, 13, 16, 19]
    again = SnapshotRing(shm / "a", rank=0, world_size=2, every="auto")
    assert again.resume(offers, 7) == 5  # the slowest rank's
    assert [s for s in range(7, 20) if again.due(s)] == [7, 12, 17]
    first = SnapshotRing(shm / "d", rank=0, world_size=2, every="auto")  # nothing recorded anywhere: measure first
    assert first.resume([first.offer(), fresh.offer()], 0) is None and first.due(0) and first.agreed is None
    assert first.resume([first.offer(), None], 0) is None  # a rank without the tier: no snapshot is of use
    fixed = SnapshotRing(shm / "e", rank=0, world_size=2, every=2)
    assert fixed.resume(offers, 7) is None  # a fixed cadence is the user's
    for ring in (a, b, fresh, again, first, fixed):
        ring.close()


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["flipped-byte", "torn-slot", "no-commit-record", "flipped-object"])
def test_a_bad_snapshot_falls_back_to_the_disk_tiers_bit_exact(
        tmp_path: Path, shm: Path, workers: Workers, reference: list[dict], fault: str) -> None:
    _killed_after_step_9(workers, tmp_path, shm)
    # rank 1's slots, both: whichever step the ranks would agree on is bad on rank 1
    for rec in _heads(shm, 1):
        stem = str(rec)[:-len(".json")]
        if fault == "flipped-byte":
            _flip(Path(stem + ".bin"))
        elif fault == "torn-slot":
            _truncate(Path(stem + ".bin"))
        elif fault == "flipped-object":
            _flip(Path(stem + ".obj"))
        else:
            rec.unlink()
    ok(_job(workers, tmp_path, shm, 1))
    got = _restored(tmp_path)
    assert [g["tier"] for g in got] == ["local", "local"], got
    assert got[0]["step"] == got[1]["step"] == 7  # the newest save on disk
    assert_bit_exact(reference, final(tmp_path / "out", 2))


@pytest.mark.timeout(240)
def test_one_rank_without_snapshots_means_none_is_used(tmp_path: Path, shm: Path, workers: Workers,
                                                      reference: list[dict]) -> None:
    """As after a hot swap: the replacement node's memory holds nothing, so every rank restores from disk."""
    _killed_after_step_9(workers, tmp_path, shm)
    for p in shm.glob("rank0-*"):
        p.unlink()
    ok(_job(workers, tmp_path, shm, 1))
    assert [g["tier"] for g in _restored(tmp_path)] == ["local", "local"]
    assert_bit_exact(reference, final(tmp_path / "out", 2))


@pytest.mark.timeout(240)
def test_a_full_shm_turns_the_tier_off_and_training_goes_on(tmp_path: Path, full_disk: Path,  # noqa: F811
                                                            workers: Workers, reference: list[dict]) -> None:
    """A real tmpfs with no room: the slot's memory is reserved up front (posix_fallocate), so the snapshot fails
    with ENOSPC at once instead of a SIGBUS later; the rank says so and trains on with its disk saves. The ledger
    records it and the checkpoint report names the ranks and why (a log line alone reaches no one)."""
    from resilient import env as renv
    from resilient.goodput.checkpoints import checkpoint_summary

    res = ok(_job(workers, tmp_path, full_disk, 0, {renv.RUN_DIR: str(tmp_path / "run")}))
    assert all("the snapshot tier is off" in r.output for r in res), res[0].output[-3000:]
    assert_bit_exact(reference, final(tmp_path / "out", 2))
    assert not list(full_disk.glob("rank*-slot*.json"))
    summary = checkpoint_summary(read_events(tmp_path / "run"))
    assert summary.snapshots_off == [0, 1] and "No space left" in (summary.off_reason or ""), summary
    assert summary.failed == [] and summary.tiers["local"].count > 0  # no save failed: the disk tiers have them
    line = next(ln for ln in summary.lines() if "snapshots in node memory off" in ln)
    assert line.startswith("checkpoints: snapshots in node memory off on 2 rank(s) (0, 1), their restarts restore "
                           "from disk; first: "), line
    assert summary.to_json()["snapshots_off"]["ranks"] == [0, 1]


def test_a_missing_snapshot_directory_is_in_the_ledger(tmp_path: Path, monkeypatch) -> None:
    """The tier cannot start (its directory is gone): training goes on without it, and the ledger says why."""
    from resilient import env as renv
    from resilient.checkpoint import CheckpointManager
    from resilient.goodput.checkpoints import checkpoint_summary

    monkeypatch.setenv(renv.RUN_DIR, str(tmp_path / "run"))
    with CheckpointManager(local=tmp_path / "ckpt", interval=2, peer=False, snapshot=1,
                           snapshot_dir=tmp_path / "gone") as ck:
        assert ck.snapshot is None
        ck.save(0, {"w": torch.ones(3)}, force=True)
        assert ck.wait(60)
    summary = checkpoint_summary(read_events(tmp_path / "run"))
    assert summary.snapshots_off == [0] and "gone does not exist" in (summary.off_reason or ""), summary
    assert summary.failed == [] and summary.tiers["local"].newest == 0


# ---------------------------------------------------------------------------------------------- under resilient-run
def resilient_run(tmp: Path, flags: list[str], env: dict[str, str], timeout: float = 200,
                  args: tuple[str, ...] = ()):
    """The job under the real launcher; returns (completed process, the launcher's pid: its agent's)."""
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir",
           str(tmp / "run"), "--ckpt-local", str(tmp / "ckpt"), "--ckpt-interval", INTERVAL, *flags, str(TRAIN),
           "--steps", str(STEPS), "--out", str(tmp / "out"), *args]
    p = subprocess.Popen(cmd, cwd=REPO, env=_child_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), p.pid


@pytest.mark.timeout(240)
def test_resilient_run_restarts_from_the_snapshot_and_removes_it_at_the_end(tmp_path: Path,
                                                                          reference: list[dict]) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    r, agent = resilient_run(tmp_path, ["--max-restarts", "2", "--ckpt-snapshot", "1"],
                             plan_env(WorkerFault(FaultHow.KILL, rank=1, step=9, attempt=0)))
    assert r.returncode == 0, r.stderr[-4000:]
    evs = read_events(tmp_path / "run")
    restores = [e for e in evs if e.kind is EventKind.CKPT_RESTORE and e.attempt == 1]
    # what each rank's restore found, and what failed before it, if an assertion below fails
    seen = ([(e.rank, e.details) for e in restores],
            [(e.kind.value, e.rank, e.details) for e in evs if e.kind is EventKind.CKPT_TIER_FAILED])
    assert sorted(e.rank for e in restores) == [0, 1], seen
    assert {e.details["tier"] for e in restores} == {"snapshot"}, seen  # so the agent's directory was there
    assert {e.details["step"] for e in restores} <= {8, 9}, seen
    assert_bit_exact(reference, final(tmp_path / "out", 2))
    # the agent took the node's snapshots with it
    assert [p for p in os.listdir("/dev/shm") if p.startswith(dirs.PREFIX) and p.endswith(f"-{agent}")] == []


@pytest.mark.timeout(120)
def test_resilient_run_snapshot_off_restores_from_disk(tmp_path: Path, reference: list[dict]) -> None:
    r, _ = resilient_run(tmp_path, ["--max-restarts", "1", "--ckpt-snapshot", "off"],
                         plan_env(WorkerFault(FaultHow.KILL, rank=1, step=9, attempt=0)), args=SETTLED)
    assert r.returncode == 0, r.stderr[-4000:]
    restores = [e for e in read_events(tmp_path / "run") if e.kind is EventKind.CKPT_RESTORE and e.attempt == 1]
    assert {e.details["tier"] for e in restores} == {"local"}
    assert [e.details["step"] for e in restores] == [7, 7]
    assert [e.details["covered_by_snapshot"] for e in restores] == [False, False]  # no snapshot anywhere
    assert_bit_exact(reference, final(tmp_path / "out", 2))


@pytest.mark.timeout(120)
def test_a_disk_step_newer_than_the_snapshots_is_restored_and_the_restart_still_counts_as_covered(
        tmp_path: Path, reference: list[dict]) -> None:
    """Snapshots every 5 steps (after steps 4, 9, 14), disk saves after 3, 7, 11: a kill after step 13 finds step 11
    on disk newer than the snapshots of 9, and restores it; node memory alone would have lost two steps more, so the
    interruption did not need a disk tier (what ``--ckpt-interval auto`` counts: the restart is in the ledger as
    covered, and the next attempt's tuner reads it so)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    r, _ = resilient_run(tmp_path, ["--max-restarts", "1", "--ckpt-snapshot", "5"],
                         plan_env(WorkerFault(FaultHow.KILL, rank=1, step=13, attempt=0)),
                         args=("--settle-before", "13"))
    assert r.returncode == 0, r.stderr[-4000:]
    restores = [e for e in read_events(tmp_path / "run") if e.kind is EventKind.CKPT_RESTORE and e.attempt == 1]
    assert [(e.details["tier"], e.details["step"]) for e in restores] == [("local", 11)] * 2, restores
    assert [e.details["covered_by_snapshot"] for e in restores] == [True, True]
    assert_bit_exact(reference, final(tmp_path / "out", 2))
    from resilient.checkpoint.save.interval import IntervalTuner

    assert IntervalTuner.from_run_dir(tmp_path / "run").inputs()["interruptions_from_snapshots"] == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("snapshot, covered", [("1", 2), ("off", 0)])
def test_auto_interval_counts_only_the_restarts_that_needed_a_disk_tier(tmp_path: Path, snapshot: str,
                                                                       covered: int) -> None:
    """Two real kills under ``--ckpt-interval auto``: with snapshots both attempts resume from node memory, so the
    tuner's MTBF (what sets the disk interval) counts neither; without, both. The second restart is learnt from the
    ledger (attempt 1's restore), the current one from the restore itself."""
    if snapshot != "off" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    # after the first disk save (step 9: no step time known yet, 10 steps) has committed
    faults = plan_env(WorkerFault(FaultHow.KILL, rank=1, step=25, attempt=0),
                      WorkerFault(FaultHow.KILL, rank=0, step=40, attempt=1))
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--run-dir",
           str(tmp_path / "run"), "--ckpt-local", str(tmp_path / "ckpt"), "--ckpt-interval", "auto",
           "--ckpt-snapshot", snapshot, "--max-restarts", "2", str(TRAIN), "--steps", "60", "--out",
           str(tmp_path / "out")]
    r = subprocess.run(cmd, cwd=REPO, env=_child_env(faults), capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = list(read_events(tmp_path / "run"))
    tiers = {e.attempt: e.details["tier"] for e in evs if e.kind is EventKind.CKPT_RESTORE and e.rank == 0}
    assert tiers == ({1: "snapshot", 2: "snapshot"} if covered else {1: "local", 2: "local"}), tiers
    decided = [e.details["inputs"] for e in evs if e.kind is EventKind.CKPT_INTERVAL and e.attempt == 2]
    assert decided, "attempt 2 made no interval decision"
    for inputs in decided:
        assert (inputs["interruptions"], inputs["interruptions_from_snapshots"]) == (2, covered), inputs
        prior = 0.5 * inputs["prior_mtbf_seconds"] + inputs["uptime_seconds"]
        assert inputs["mtbf_seconds"] == pytest.approx(prior / (0.5 + 2 - covered)), inputs


@pytest.mark.timeout(240)
def test_auto_cadence_follows_a_slower_step_between_disk_saves(tmp_path: Path) -> None:
    """No disk save in the run (interval 1000), so no disk save re-agrees the cadence: steps become 200 ms slower after
    step 30 (rank 1 sleeps; rank 0 waits for it in the all-reduce), which makes a snapshot relatively cheaper, and the
    ranks must agree a shorter cadence within about ``_REAGREE_CALLS`` steps, from a step no rank has passed.

    The slowdown is an order of magnitude over the step: a snapshot's measured cost wavers 2-3x beside other work
    (0.5-1.8 ms here), and with steps only 3x slower (50 ms) the cost measured under load once outweighed it (the
    proposals stayed within a quarter of the cadence in force, which keeps it, by design)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    r, _ = resilient_run(tmp_path, ["--ckpt-snapshot", "auto", "--ckpt-interval", "1000"],
                         plan_env(WorkerFault(FaultHow.SLOW, rank=1, step=30, attempt=None, seconds=0.2)),
                         args=("--steps", "60"))  # the re-agreement comes at the 53rd save() call
    assert r.returncode == 0, r.stderr[-4000:]
    agreed = [e.details for e in read_events(tmp_path / "run")
              if e.kind is EventKind.CKPT_SNAPSHOT_CADENCE and e.details["source"] == "agreed"]
    assert agreed and agreed[0]["from_step"] < 30, agreed
    fast = agreed[0]["every"]
    later = [a for a in agreed[1:] if a["from_step"] > 30]
    said = [ln for ln in r.stderr.splitlines() if "cadence" in ln]
    assert later, f"the cadence agreed at the start ({fast}) was never agreed again: {agreed}; {said[-10:]}"
    assert later[-1]["every"] < fast, agreed
    assert all(a["from_step"] <= 30 + _REAGREE_CALLS + 2 * _AGREE_AHEAD for a in later[:1]), agreed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["sometimes", "-1"])
def test_resilient_run_refuses_a_bad_ckpt_snapshot(tmp_path: Path, bad: str) -> None:
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1", "--run-dir",
           str(tmp_path / "run"), f"--ckpt-snapshot={bad}", str(TRAIN)]
    r = subprocess.run(cmd, cwd=REPO, env=_child_env({}), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--ckpt-snapshot" in r.stderr and "auto" in r.stderr and "off" in r.stderr, r.stderr


def test_a_bad_snapshot_environment_value_is_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1", "--run-dir",
           str(tmp_path / "run"), str(TRAIN)]
    r = subprocess.run(cmd, cwd=REPO, env=_child_env({"RESILIENT_CKPT_SNAPSHOT": "often"}), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert "RESILIENT_CKPT_SNAPSHOT" in r.stderr and "often" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- pieces
@pytest.mark.parametrize("kw, word", [({"snapshot": "sometimes"}, "snapshot="), ({"snapshot": -2}, "snapshot="),
                                      ({"snapshot_budget": 0}, "snapshot_budget"),
                                      ({"snapshot_budget": 2.0}, "snapshot_budget")])
def test_config_refuses_bad_snapshot_values(tmp_path: Path, kw: dict, word: str) -> None:
    with pytest.raises(CheckpointConfigError, match=word):
        CheckpointConfig(local=str(tmp_path), **kw)


def test_config_reads_snapshot_spellings(tmp_path: Path) -> None:
    assert CheckpointConfig(local=str(tmp_path), snapshot="OFF").snapshot == 0
    assert CheckpointConfig(local=str(tmp_path), snapshot="3").snapshot == 3
    assert CheckpointConfig(local=str(tmp_path), snapshot=" auto ").snapshot == "auto"


def test_agreement_takes_the_newest_step_every_rank_holds_in_one_lineage() -> None:
    assert _agreed_snapshot([[(9, "a"), (8, "a")], [(8, "a"), (7, "a")]]) == (8, "a")
    # the same step of two lineages (before and after a restore from an older step) never mixes
    assert _agreed_snapshot([[(9, "b"), (8, "a")], [(9, "a"), (8, "b")]]) is None
    assert _agreed_snapshot([[(9, "a")], None]) is None  # a rank without the tier
    assert _agreed_snapshot([[(9, "a")], []]) is None


def test_a_snapshot_of_another_model_does_not_fit_and_says_why() -> None:
    state = {"w": torch.zeros(3, 4), "opt": {"state": {}}, "pos": 3}
    layout = [Leaf("w", ("w",), "t", "float32", (3, 5), 0, 60), Leaf("pos", ("pos",), "o"),
              Leaf("opt.state.0.m", ("opt", "state", 0, "m"), "t", "float32", (3, 4), 64, 48)]
    why = _plan_load(layout, state, None)
    assert isinstance(why, str) and "'w'" in why and "[3, 5]" in why
    layout[0] = Leaf("w", ("w",), "t", "float32", (3, 4), 0, 48)
    assert not isinstance(_plan_load(layout, state, None), str)  # a fresh optimizer's moments are made
    assert "not in the snapshot" in _plan_load(layout[:1] + layout[2:], state, None)  # type: ignore[operator]
    assert "not in the state" in _plan_load(layout + [Leaf("b", ("b",), "o")], state, None)  # type: ignore[operator]


def test_a_ring_of_another_rank_or_world_offers_nothing(shm: Path) -> None:
    a = SnapshotRing(shm, rank=0, world_size=2, every=1)
    a.take(5, {"w": torch.arange(6.0)})
    assert a.flush(10)
    assert a.offer().held == [(5, a.epoch)]
    assert SnapshotRing(shm, rank=0, world_size=4, every=1).offer().held == []
    assert SnapshotRing(shm, rank=1, world_size=2, every=1).offer().held == []
    a.close()


def test_a_rank_killed_while_a_digest_lags_still_holds_a_committed_snapshot(shm: Path, monkeypatch) -> None:
    """Under load the commit thread can lag a step behind: the newer slot's digest still running when the next
    snapshot would overwrite the older slot. Dropping the older slot's commit record then would leave a rank killed at
    that instant no snapshot (a restart fell back to a disk tier, seen beside two CPU burners); the next snapshot
    waits for it instead, and is skipped when it stays stalled. A fresh ring on the directory is what a restarted
    process sees."""
    import threading

    from resilient.checkpoint.snapshot import ring as ring_mod

    stalled, entered = threading.Event(), threading.Event()
    real_write = ring_mod._write_file

    def stalling_write(path, data):  # a write that hangs until released: the digest thread stuck mid-commit
        if not stalled.is_set():
            entered.set()
            assert stalled.wait(30), "the stalled write was never released"
        return real_write(path, data)

    monkeypatch.setattr(ring_mod, "_COMMIT_WAIT_S", 0.3)
    skips: list[tuple[int, str]] = []
    r = SnapshotRing(shm, rank=0, world_size=1, every=1, on_skipped=lambda step, why: skips.append((step, why)))
    state = {"w": torch.arange(6.0)}
    assert r.take(0, state) and r.take(1, state) and r.flush(10)
    monkeypatch.setattr(ring_mod, "_write_file", stalling_write)
    assert r.take(2, state) and entered.wait(10)  # slot of step 0 rewritten; its commit hangs
    held = lambda: sorted(s for s, _ in SnapshotRing(shm, rank=0, world_size=1, every=1).offer().held)  # noqa: E731
    assert held() == [1]
    assert not r.take(3, state)  # would drop step 1's record while step 2's is not written: skipped
    assert held() == [1], "a kill now would leave this rank no snapshot"
    assert [step for step, _ in skips] == [3] and "still running" in skips[0][1]
    stalled.set()
    assert r.flush(10) and held() == [1, 2]
    assert r.take(3, state) and r.flush(10) and held() == [2, 3]
    r.close()


def test_a_skipped_snapshot_is_in_the_ledger_and_the_report_not_as_a_failed_save(tmp_path: Path, shm: Path,
                                                                                   monkeypatch) -> None:
    """A snapshot skipped while an earlier one's digest stalls is a tier a restart may not find: the ledger records it
    (a log line alone reaches no one) and the checkpoint report says so, without counting a failed save."""
    import threading

    from resilient import env as renv
    from resilient.checkpoint import CheckpointManager
    from resilient.checkpoint.snapshot import ring as ring_mod
    from resilient.goodput.checkpoints import checkpoint_summary

    run = tmp_path / "run"
    monkeypatch.setenv(renv.RUN_DIR, str(run))
    stalled = threading.Event()
    real_write = ring_mod._write_file

    def stalling_write(path, data):
        assert stalled.wait(30), "the stalled write was never released"
        return real_write(path, data)

    monkeypatch.setattr(ring_mod, "_COMMIT_WAIT_S", 0.3)
    state = {"w": torch.arange(6.0)}
    with CheckpointManager(local=tmp_path / "ckpt", interval=5, peer=False, snapshot=1, snapshot_dir=shm) as ck:
        for step in range(2):
            ck.save(step, state)
        assert ck.snapshot.flush(10)
        monkeypatch.setattr(ring_mod, "_write_file", stalling_write)
        for step in range(2, 4):  # step 2's commit stalls, so step 3's snapshot is skipped
            ck.save(step, state)
        stalled.set()
        assert ck.wait(60) and ck.snapshot.flush(10)
    evs = list(read_events(run))
    skipped = [e for e in evs if e.kind is EventKind.CKPT_TIER_FAILED and e.details.get("skipped")]
    assert [(e.details["step"], e.details["tier"]) for e in skipped] == [(3, "snapshot")], skipped
    summary = checkpoint_summary(evs)
    assert summary.failed == [] and summary.snapshots_skipped == [3]
    assert any("1 snapshot(s) in node memory skipped: steps 3" in line for line in summary.lines()), summary.lines()


def test_auto_cadence_follows_cost_over_step_time_and_waits_for_the_agreement(shm: Path) -> None:
    r = SnapshotRing(shm, rank=0, world_size=2, every="auto", budget=0.01)
    assert r.due(0) and r.proposal() is None  # nothing measured: the first two snapshots measure its cost
    assert r.take(0, {"w": torch.zeros(4)}) and r.flush(10) and r.due(1)
    assert r.take(1, {"w": torch.zeros(4)}) and r.flush(10)
    assert not r.due(2)  # no snapshot a rank alone decides on: the ranks agree first
    r._step_s, r._cost_s, r._digest_s = 0.2, 0.001, 0.0  # 1 ms against 1 % of 200 ms: every step
    assert r.proposal() == 1
    r._cost_s = 0.05  # 50 ms: every 25 steps
    assert r.proposal() == 25
    assert r.agree(25, 11)
    assert [s for s in range(0, 70) if r.due(s)] == [11, 36, 61]
    assert not r.agree(22, 50)  # within a quarter: the schedule in force stays
    assert r.due(61) and not r.due(50)
    assert r.agree(0, 70)
    assert not any(r.due(s) for s in range(70, 200))
    r.close()


def test_a_new_cadence_starts_at_its_step_and_the_old_one_runs_until_then(shm: Path) -> None:
    """Each agreed change takes effect an interval ahead (no rank has passed it); the steps in between keep the cadence
    in force, so a cost that moves between 3 and 4 steps never leaves a kill without a recent snapshot."""
    r = SnapshotRing(shm, rank=0, world_size=2, every="auto")
    assert r.agree(3, 11)
    assert r.agree(5, 40)  # agreed at the save of step 29: steps 30-39 keep every 3
    assert [s for s in range(0, 60) if r.due(s)] == [11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 40, 45, 50, 55]
    assert r.agree(2, 51)  # and again before 40 was reached by some rank: each segment starts at its own step
    assert [s for s in range(30, 60) if r.due(s)] == [32, 35, 38, 40, 45, 50, 51, 53, 55, 57, 59]
    assert r.take(52, {"w": torch.zeros(2)}) and r.flush(10)
    assert r.offer().every == 2  # a snapshot records the cadence in force at its step
    r.close()


def test_the_agents_directory_is_swept_when_its_owner_is_gone(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = dirs._start_time(p.pid)
        assert start is not None
        alive = tmp_path / f"{dirs.PREFIX}job-{p.pid}"
        alive.mkdir()
        ns = os.readlink("/proc/self/ns/pid")
        (alive / dirs.OWNER).write_text(f"{p.pid} {start} {ns}\n")
        reused = tmp_path / f"{dirs.PREFIX}job-reused"  # the pid lives, but it is another process now
        reused.mkdir()
        (reused / dirs.OWNER).write_text(f"{p.pid} {int(start) - 1} {ns}\n")
        other = tmp_path / f"{dirs.PREFIX}job-other-container"  # pids of another namespace say nothing here
        other.mkdir()
        (other / dirs.OWNER).write_text("1 1 pid:[1]\n")
        ownerless = tmp_path / f"{dirs.PREFIX}job-ownerless"  # being made this instant, or not an agent's
        ownerless.mkdir()
        assert dirs.sweep(tmp_path) == [str(reused)]
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(30)
        assert dirs.sweep(tmp_path) == [str(alive)]
        assert other.exists() and ownerless.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    mine = dirs.make_dir("run/7 x", root=tmp_path)
    assert mine is not None and Path(mine).name == f"{dirs.PREFIX}run_7_x-{os.getpid()}"
    assert oct(Path(mine).stat().st_mode & 0o777) == oct(0o700)
    assert dirs.sweep(tmp_path) == []  # its owner (this process) is alive
    dirs.remove_dir(mine)
    assert not Path(mine).exists()
    assert dirs.make_dir("x", root=tmp_path / "absent") is None


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(33, 7, generator=g), "h": torch.randn(129, 3, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 30, (17,), generator=g), "t": torch.randn(6, 8, generator=g).t(),
            "z": torch.empty(0, 5), "s": torch.tensor(3.25), "b": torch.tensor([True, False])}


def test_a_process_restores_its_own_snapshot_of_mixed_tensors_bit_exact(tmp_path: Path, shm: Path) -> None:
    """One process, no group: bf16, integers, bools, a 0-d and a 0-size tensor, a non-contiguous source and target,
    and objects; the newest snapshot wins over an older save on disk."""
    from resilient.checkpoint import CheckpointManager

    st = _mixed()
    with CheckpointManager(local=tmp_path / "ckpt", interval=5, peer=False, snapshot=1, snapshot_dir=shm) as ck:
        assert ck.restore({"m": st}) == 0
        for step in range(7):
            for v in st.values():
                if v.dtype.is_floating_point:
                    v.add_(1)
            ck.save(step, {"m": st, "pos": {"step": step, "name": f"s{step}"}})
        assert ck.wait(60) and ck.snapshot.flush(30)
    want = {k: v.clone() for k, v in st.items()}
    fresh = {k: torch.full_like(v, 7) for k, v in st.items()}
    fresh["w"] = torch.zeros(7, 33).t()  # a non-contiguous target: bytes land in its own layout
    state = {"m": fresh, "pos": {"step": -1, "name": ""}}
    with CheckpointManager(local=tmp_path / "ckpt", interval=5, peer=False, snapshot=1, snapshot_dir=shm) as ck:
        assert ck.restore(state) == 7  # the snapshot of step 6, not the save of step 4
        assert ck.last_restore.tier == "snapshot"
    assert state["pos"] == {"step": 6, "name": "s6"}
    for k in want:
        assert fresh[k].dtype == want[k].dtype and torch.equal(fresh[k], want[k]), k
