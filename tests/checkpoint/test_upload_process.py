"""The upload process: persistent uploads' bytes sent from a process of their own, against a real GCS API server.
The managers here ask for it (``upload_process=True``): "auto", the default, leaves it off on a machine with fewer than
2 cores a rank.

Real faults on the real process: SIGKILL and SIGSTOP while it holds a step half uploaded (the hold is
``_upload_hold/sitecustomize.py``, which the upload process imports at start since it inherits ``PYTHONPATH``); a
filesystem registered only in the training process; a tier that lives inside the training process; bad settings.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import fsspec
import psutil
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from resilient.checkpoint.api import CheckpointConfig, CheckpointConfigError
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.checkpoint.storage.tiers import FsspecTier
from resilient.checkpoint.upload import chooser, uploader as uploader_mod
from resilient.checkpoint.upload.process import (SendProcess, SenderUnavailable, TierSpec, available_cores,
                                                 use_process)
from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.goodput.checkpoints import checkpoint_summary

from tests._helpers.wait import wait_for

from .conftest import GCS, REPO

HOLD_HOOK = Path(__file__).resolve().parent / "_upload_hold"


def state(v: float) -> dict:
    # several files' worth: a tensor larger than a part (4 MiB) goes up in parts composed by the store
    return {"w": torch.full((1024, 1280), v), "b": torch.full((7,), v), "meta": {"v": v}}


def restored_from_store(tmp_path: Path, url: str, **kw: object) -> tuple[int, dict]:
    """A fresh manager with an empty local tier: what the store holds, restored."""
    st = {"w": torch.zeros(1024, 1280), "b": torch.zeros(7), "meta": {"v": -1.0}}
    ck = CheckpointManager(local=tmp_path / "fresh-local", persistent=url, interval=1, **kw)  # type: ignore[arg-type]
    try:
        start = ck.restore(st)
        assert ck.last_restore is not None and ck.last_restore.tier == "persistent"
    finally:
        ck.close()
    return start, st


def thread_fallbacks(monkeypatch: pytest.MonkeyPatch, fn: str) -> list[int]:
    """The steps the upload thread sent (``send_files``) or coded and sent (``code_files``) by itself, its fallback,
    counted where it calls that function."""
    steps: list[int] = []
    real = getattr(uploader_mod, fn)

    def counting(tier, job, should_stop=None):  # type: ignore[no-untyped-def]
        steps.append(job.step)
        return real(tier, job, should_stop)

    monkeypatch.setattr(uploader_mod, fn, counting)
    return steps


def sent_in_thread(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return thread_fallbacks(monkeypatch, "send_files")


def hold(monkeypatch: pytest.MonkeyPatch, drill: Path, step: int) -> None:
    """The upload process (not this one) holds its upload of ``step`` half done until ``store-killed`` appears."""
    drill.mkdir(exist_ok=True)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HOLD_HOOK), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DRILL_DIR", str(drill))
    monkeypatch.setenv("DRILL_HOLD_UPLOAD", str(step))
    monkeypatch.setenv("DRILL_WAIT_S", "60")
    monkeypatch.setenv("RANK", "0")


@pytest.mark.timeout(120)
def test_uploads_go_from_the_upload_process_and_restore_bit_exact(tmp_path: Path, gcs: GCS,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gcs.make_bucket("up")
    url = f"gs://up/{tmp_path.name}"
    in_thread = sent_in_thread(monkeypatch)
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1)
    pids = set()
    try:
        for s in range(3):
            ck.save(s, state(float(s)))
            assert ck.wait(60)
            sender = ck._up.sender
            assert sender is not None and sender.pid is not None
            pids.add(sender.pid)
            # a child of this process that imports no torch (it only moves bytes)
            child = psutil.Process(sender.pid)
            assert child.ppid() == os.getpid()
            assert not any("torch" in m.path for m in child.memory_maps()), "the upload process loaded torch"
            if s == 0:
                # what a preemption or Ctrl-C sends the job's process group: the process outlives both, its end is
                # its socket's (the training process's last upload still needs it)
                os.kill(sender.pid, signal.SIGTERM)
                os.kill(sender.pid, signal.SIGINT)
        assert ck.persistent is not None and ck.persistent.steps() == {0: True, 1: True, 2: True}
    finally:
        ck.close()
    assert in_thread == [], "the upload thread sent bytes itself"
    assert len(pids) == 1, pids  # one process for the manager's life
    (pid,) = pids
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
             "the upload process gone after close()")
    start, st = restored_from_store(tmp_path, url)
    assert start == 3 and torch.equal(st["w"], torch.full((1024, 1280), 2.0)) and st["meta"] == {"v": 2.0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_an_upload_process_lost_mid_upload_loses_no_step(fault: str, tmp_path: Path, gcs: GCS,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Killed, or stopped (then killed when the upload's bound runs out), with step 1 half uploaded: the upload thread
    sends step 1 itself, a warning and a ledger record name what happened (``resilient goodput`` counts it), and the
    next upload goes from a new process. The manager's own kill at exit is no failure."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    gcs.make_bucket("up")
    url = f"gs://up/{tmp_path.name}"
    drill = tmp_path / "drill"
    hold(monkeypatch, drill, 1)
    in_thread = sent_in_thread(monkeypatch)
    caplog.set_level(logging.WARNING, logger="resilient.checkpoint.upload")
    # a stopped process is given the upload's whole bound: short calls and no retries keep it to seconds
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1,
                           persistent_timeout_s=1.0, upload_retries=0, upload_backoff_max_s=0.1)
    try:
        ck.save(0, state(0.0))
        assert ck.wait(60)
        assert ck._up.sender is not None
        first = ck._up.sender.pid
        ck.save(1, state(1.0))
        wait_for((drill / "upload-in-flight").exists, 60, "the upload process holding step 1 half uploaded")
        assert ck.persistent is not None and ck.persistent.steps().get(1) is not True
        os.kill(first, getattr(signal, fault))
        assert ck.wait(120)
        assert ck._up.outcomes.get(1) is True, ck._up.errors
        assert in_thread == [1]
        ck.save(2, state(2.0))
        assert ck.wait(60)
        second = ck._up.sender.pid
        assert second is not None and second != first and in_thread == [1]
        assert ck.persistent.steps() == {0: True, 1: True, 2: True}
    finally:
        if fault == "SIGSTOP" and psutil.pid_exists(first):
            os.kill(first, signal.SIGKILL)
        ck.close()
    said = "\n".join(r.getMessage() for r in caplog.records)
    expect = "died (killed by SIGKILL)" if fault == "SIGKILL" else "sent nothing back within its bound"
    assert f"the upload process (pid {first}) {expect}" in said and "this thread sends step 1 itself" in said, said
    events = list(read_events(tmp_path / "run"))
    died = [e.details for e in events if e.kind is EventKind.CKPT_UPLOAD_PROCESS]
    assert [(d["step"], d["state"]) for d in died] == [(1, "died")], died
    assert f"(pid {first}) {expect}" in died[0]["error"]
    summary = checkpoint_summary(events)
    assert summary.upload_process_failures == 1 and summary.upload_process_off == []
    assert any("upload process failed 1 time(s)" in line for line in summary.lines()), summary.lines()
    start, st = restored_from_store(tmp_path, url)
    assert start == 3 and torch.equal(st["w"], torch.full((1024, 1280), 2.0))


@pytest.mark.timeout(120)
def test_the_managers_own_kill_at_exit_is_no_failure_of_the_process(tmp_path: Path, gcs: GCS,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """close() abandons an upload the process holds half done (the upload grace ran out) and kills the process: the
    ledger records the abandoned step, and no failure of the upload process (it did what it was told)."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    drill = tmp_path / "drill"
    hold(monkeypatch, drill, 1)
    gcs.make_bucket("up")
    ck = CheckpointManager(local=tmp_path / "local", persistent=f"gs://up/{tmp_path.name}", interval=1,
                           upload_process=True, persistent_every=1, upload_grace_s=0.5)
    assert ck._up.sender is not None and ck._up.sender.on_failure is not None
    told: list[str] = []
    report = ck._up.sender.on_failure
    # watched where it is said (the ledger may be closed by the time the upload thread sees the end)
    ck._up.sender.on_failure = lambda e, step: (told.append(str(e)), report(e, step))  # type: ignore
    ck.save(0, state(0.0))
    assert ck.wait(60, upload_timeout=60)
    ck.save(1, state(1.0))
    wait_for((drill / "upload-in-flight").exists, 60, "the upload process holding step 1 half uploaded")
    ck.close()
    thread = ck._up._thread
    assert thread is not None
    thread.join(30)  # the upload thread has seen the process end, and said whatever it says of it
    assert not thread.is_alive()
    events = list(read_events(tmp_path / "run"))
    abandoned = [e.details["step"] for e in events
                 if e.kind is EventKind.CKPT_TIER_FAILED and e.details.get("error") == "abandoned at exit"]
    assert abandoned == [1], abandoned
    assert told == [] and [e for e in events if e.kind is EventKind.CKPT_UPLOAD_PROCESS] == []


@pytest.mark.timeout(150)
def test_a_dead_store_is_reported_and_a_newer_step_ends_the_retries(tmp_path: Path, gcs: GCS,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The store SIGKILLed while the upload process holds step 1 half sent: its failures come back as the store's
    (reported in the ledger, never taken for the process's death), a newer step ends the process's retries of step 1
    (a thousand of them would outlast the test), and once the store is back the newer step lands."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    drill = tmp_path / "drill"
    hold(monkeypatch, drill, 1)
    gcs.make_bucket("up")
    url = f"gs://up/{tmp_path.name}"
    in_thread = sent_in_thread(monkeypatch)
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1,
                           upload_retries=1000, upload_backoff_s=0.1, upload_backoff_max_s=0.2,
                           persistent_timeout_s=2.0)
    try:
        ck.save(0, state(0.0))
        assert ck.wait(60) and ck._up.outcomes.get(0) is True
        ck.save(1, state(1.0))
        wait_for((drill / "upload-in-flight").exists, 60, "the upload process holding step 1 half sent")
        gcs.stop()
        (drill / "store-killed").touch()
        ck.save(2, state(2.0))  # a newer step waits: the process stops retrying step 1's parts
        wait_for(lambda: 1 in ck._up.errors, 90, "step 1's upload given up")
        assert "gave up: step 2 is waiting" in ck._up.errors[1], ck._up.errors
        gcs.start()
        assert ck.wait(90) and ck._up.outcomes.get(2) is True, ck._up.errors
        assert ck.persistent is not None and ck.persistent.steps().get(2) is True
        assert ck._up.sender is not None and ck._up.sender.deaths == 0 and ck._up.sender.off is None
    finally:
        ck.close()
    assert in_thread == []
    failed = [e.details for e in read_events(tmp_path / "run") if e.kind == EventKind.CKPT_TIER_FAILED]
    assert [d["step"] for d in failed if d["tier"] == "persistent"] == [1], failed


class ParentOnlyFS(LocalFileSystem):
    """A filesystem a training script registers for itself: no other process knows its protocol."""

    protocol = "parentonly"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(str(path).replace("parentonly://", "", 1))


@pytest.mark.timeout(120)
def test_a_store_only_the_training_process_can_reach_is_uploaded_from_its_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fsspec.register_implementation("parentonly", ParentOnlyFS, clobber=True)
    in_thread = sent_in_thread(monkeypatch)
    caplog.set_level(logging.WARNING, logger="resilient.checkpoint.upload")
    url = f"parentonly://{tmp_path}/bucket"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1)
    try:
        for s in range(3):
            ck.save(s, state(float(s)))
            assert ck.wait(60)
        assert ck.persistent is not None and ck.persistent.steps() == {0: True, 1: True, 2: True}
    finally:
        ck.close()
    assert in_thread == [0, 1, 2]
    warned = [r.getMessage() for r in caplog.records if "the upload process cannot be used" in r.getMessage()]
    assert len(warned) == 1 and "parentonly" in warned[0], warned  # once, naming why
    start, st = restored_from_store(tmp_path, url)
    assert start == 3 and torch.equal(st["b"], torch.full((7,), 2.0))


@pytest.mark.timeout(60)
def test_a_store_inside_the_training_process_is_never_sent_from_another(tmp_path: Path) -> None:
    url = f"memory://{tmp_path.name}/bucket"
    spec = TierSpec(url=url, name="persistent")
    assert spec.why_not() is not None and "memory://" in spec.why_not()  # type: ignore[operator]
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1)
    try:
        ck.save(0, state(0.0))
        assert ck.wait(60)
        assert ck._up.sender is not None and ck._up.sender.pid is None  # never started
        assert FsspecTier(url, "persistent").steps() == {0: True}  # in this process's memory filesystem
    finally:
        ck.close()


@pytest.mark.timeout(60)
def test_an_upload_process_that_cannot_start_says_why(tmp_path: Path) -> None:
    told: list[tuple[str, int | None]] = []
    sender = SendProcess(TierSpec(url=f"file://{tmp_path}", name="persistent"), python=str(tmp_path / "no-python"))
    sender.on_failure = lambda e, step: told.append((str(e), step))
    from resilient.checkpoint.upload.send import SendJob

    with pytest.raises(SenderUnavailable, match="could not be started .*no-python"):
        sender.send(SendJob(step=0, src=str(tmp_path), names=(), data=frozenset()), lambda: False)
    assert len(told) == 1 and "could not be started" in told[0][0], told  # once, as it is found
    # an interpreter that starts but cannot run the process (exits at once)
    sender = SendProcess(TierSpec(url=f"file://{tmp_path}", name="persistent"), python=sys.executable)
    sender.on_failure = lambda e, step: told.append((str(e), step))
    sender.python = "/bin/false"
    with pytest.raises(SenderUnavailable, match="did not start"):
        sender.send(SendJob(step=0, src=str(tmp_path), names=(), data=frozenset()), lambda: False)
    assert sender.off is not None
    assert len(told) == 2 and "did not start" in told[1][0], told


@pytest.mark.timeout(60)
def test_a_store_only_the_training_process_can_reach_is_recorded_in_the_ledger_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process turned off for the run is one ledger record (state "off", the rank named), however many uploads
    follow; the summary names the rank."""
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    fsspec.register_implementation("parentonly", ParentOnlyFS, clobber=True)
    ck = CheckpointManager(local=tmp_path / "local", persistent=f"parentonly://{tmp_path}/bucket", interval=1,
                           upload_process=True,
                           persistent_every=1)
    try:
        for s in range(2):
            ck.save(s, state(float(s)))
            assert ck.wait(60)
    finally:
        ck.close()
    events = list(read_events(tmp_path / "run"))
    off = [e for e in events if e.kind is EventKind.CKPT_UPLOAD_PROCESS]
    assert [(e.rank, e.details["state"]) for e in off] == [(0, "off")], off
    assert "parentonly" in off[0].details["error"]
    summary = checkpoint_summary(events)
    assert summary.upload_process_off == [0] and summary.to_json()["upload_process"]["failures"] == 1


@pytest.mark.parametrize("value", ["maybe", 2, None])
def test_bad_upload_process_settings_name_the_field(tmp_path: Path, value: object) -> None:
    with pytest.raises(CheckpointConfigError, match="upload_process"):
        CheckpointConfig(local=str(tmp_path), upload_process=value)  # type: ignore[arg-type]
    assert CheckpointConfig(local=str(tmp_path), upload_process="off").upload_process is False
    assert CheckpointConfig(local=str(tmp_path), upload_process=" ON ").upload_process is True
    assert CheckpointConfig(local=str(tmp_path), upload_process="Auto").upload_process == "auto"
    assert CheckpointConfig(local=str(tmp_path)).upload_process == "auto"


@pytest.mark.timeout(60)
def test_storage_options_that_cannot_be_pickled_are_said_once_and_every_step_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    caplog.set_level(logging.WARNING, logger="resilient.checkpoint.upload")
    in_thread = sent_in_thread(monkeypatch)
    url = f"file://{tmp_path}/bucket"
    # an option only this process can hold (a credentials callback, say): LocalFileSystem keeps and ignores it
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1,
                           storage_options={"token_refresh": lambda: "secret"})
    try:
        for s in range(2):
            ck.save(s, state(float(s)))
            assert ck.wait(60)
        assert ck._up.sender is not None and ck._up.sender.pid is None  # never started
    finally:
        ck.close()
    assert in_thread == [0, 1]
    warned = [r.getMessage() for r in caplog.records if "the upload process cannot be used" in r.getMessage()]
    assert len(warned) == 1 and "cannot be sent to another process" in warned[0], warned
    off = [e.details for e in read_events(tmp_path / "run") if e.kind is EventKind.CKPT_UPLOAD_PROCESS]
    assert [d["state"] for d in off] == ["off"] and "storage options" in off[0]["error"], off
    assert FsspecTier(url, "persistent").steps() == {0: True, 1: True}


def coded_in_thread(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return thread_fallbacks(monkeypatch, "code_files")


def assert_coded(url: str, step: int) -> None:
    """Every item of ``step`` on the store is coded (bgzstd), in part objects beside each file's first."""
    from resilient.checkpoint.api import DCP_METADATA
    from resilient.checkpoint.format.safe import load_metadata

    md = load_metadata(FsspecTier(url, "persistent").read_bytes(step, DCP_METADATA), what=DCP_METADATA)
    assert md.storage_data and all(i.transform_descriptors == ["resilient.bgzstd/1"] for i in md.storage_data.values())


@pytest.mark.timeout(120)
def test_compressed_uploads_are_coded_in_the_upload_process_and_restore_bit_exact(
        tmp_path: Path, gcs: GCS, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced codec: the upload process codes and sends the parts (the upload thread codes nothing), the store holds
    coded items (the large one streamed alone), and the newest step restores bit-exact from the store alone."""
    monkeypatch.setenv(chooser.ENV_MODE, "bgzstd")
    gcs.make_bucket("up")
    url = f"gs://up/{tmp_path.name}"
    in_thread = coded_in_thread(monkeypatch)
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1)
    try:
        for s in range(2):
            ck.save(s, state(float(s) + 0.5))
            assert ck.wait(60, upload_timeout=60)
        assert ck._up.sender is not None and ck._up.sender.pid is not None and ck._up.sender.deaths == 0
        assert ck.persistent is not None and ck.persistent.steps() == {0: True, 1: True}
    finally:
        ck.close()
    assert in_thread == []
    assert_coded(url, 1)
    start, st = restored_from_store(tmp_path, url)
    assert start == 2 and torch.equal(st["w"], torch.full((1024, 1280), 1.5)) and st["meta"] == {"v": 1.5}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_an_upload_process_lost_mid_compressed_upload_loses_no_step(
        fault: str, tmp_path: Path, gcs: GCS, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Killed, or stopped (then killed when the coded upload's bound runs out), with step 1's coded parts half sent:
    the upload thread codes and sends step 1 itself (a warning and a ledger record say so), the next step goes from a
    new process, and both restore bit-exact."""
    monkeypatch.setenv(chooser.ENV_MODE, "bgzstd")
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    gcs.make_bucket("up")
    url = f"gs://up/{tmp_path.name}"
    drill = tmp_path / "drill"
    hold(monkeypatch, drill, 1)
    in_thread = coded_in_thread(monkeypatch)
    caplog.set_level(logging.WARNING, logger="resilient.checkpoint.upload")
    # a stopped process is given the coded upload's whole bound (parts, retries, coding): short calls and no retries
    # keep it to seconds
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1,
                           upload_process=True, persistent_every=1,
                           persistent_timeout_s=1.0, upload_retries=0, upload_backoff_max_s=0.1)
    first = None
    try:
        ck.save(0, state(0.0))
        assert ck.wait(60, upload_timeout=60)
        assert ck._up.sender is not None
        first = ck._up.sender.pid
        assert first is not None
        ck.save(1, state(1.0))
        wait_for((drill / "upload-in-flight").exists, 60, "the upload process holding step 1's coded parts")
        os.kill(first, getattr(signal, fault))
        wait_for(lambda: ck._up.outcomes.get(1) is not None, 90, "step 1's upload ended")
        assert ck._up.outcomes[1] is True, ck._up.errors
        assert in_thread == [1]
        ck.save(2, state(2.0))
        assert ck.wait(60, upload_timeout=60)
        assert ck._up.sender.pid not in (None, first) and in_thread == [1]
        assert ck.persistent is not None and ck.persistent.steps() == {0: True, 1: True, 2: True}
    finally:
        if fault == "SIGSTOP" and first is not None and psutil.pid_exists(first):
            os.kill(first, signal.SIGKILL)
        ck.close()
    said = "\n".join(r.getMessage() for r in caplog.records)
    expect = "died (killed by SIGKILL)" if fault == "SIGKILL" else "sent nothing back within its bound"
    assert f"the upload process (pid {first}) {expect}" in said, said
    assert "this thread codes and sends step 1 itself" in said, said
    died = [e.details for e in read_events(tmp_path / "run") if e.kind is EventKind.CKPT_UPLOAD_PROCESS]
    assert [(d["step"], d["state"]) for d in died] == [(1, "died")], died
    assert f"(pid {first}) {expect}" in died[0]["error"]
    assert_coded(url, 1)
    assert_coded(url, 2)
    start, st = restored_from_store(tmp_path, url)
    assert start == 3 and torch.equal(st["w"], torch.full((1024, 1280), 2.0))



@pytest.mark.parametrize("cores,ranks,use", [(2, 2, False), (2, 1, True), (16, 8, True), (15, 8, False), (1, 1, False)])
def test_auto_starts_an_upload_process_only_with_two_cores_a_local_rank(cores: int, ranks: int, use: bool) -> None:
    got, why = use_process("auto", ranks, cores)
    assert got is use and f"{cores} core" in why and f"{ranks} local rank" in why
    assert use_process(True, ranks, cores)[0] is True and use_process(False, ranks, cores)[0] is False


def test_a_containers_cpu_quota_counts_as_its_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod limited to 1.5 CPUs on a host whose cores its affinity shows: the quota is what it may use (cgroup v2's
    cpu.max, else v1's quota and period; "max" or -1: no limit)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    v2, q1, p1 = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    none = (str(tmp_path / "no-quota"), str(tmp_path / "no-period"))
    v2.write_text("150000 100000\n")
    assert available_cores(str(v2), none) == 1.5
    assert use_process("auto", 1, available_cores(str(v2), none)) == (
        False, "auto: 1.5 core(s) for 1 local rank(s), fewer than 2 a rank, where an upload process would take a core "
        "from training (--ckpt-upload-process on to use it anyway)")
    v2.write_text("max 100000\n")
    assert available_cores(str(v2), none) == 64
    q1.write_text("800000\n")
    p1.write_text("100000\n")
    assert available_cores(str(tmp_path / "no-v2"), (str(q1), str(p1))) == 8
    q1.write_text("-1\n")
    assert available_cores(str(tmp_path / "no-v2"), (str(q1), str(p1))) == 64
    assert available_cores(str(tmp_path / "no-v2"), none) == 64


@pytest.mark.timeout(60)
def test_auto_on_a_node_without_cores_to_spare_uploads_from_the_thread_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The default: this process's affinity narrowed to one core (a rank with no core to spare), so every upload goes
    from the upload thread, no process is started, and rank 0 logs why; every step lands."""
    caplog.set_level(logging.INFO, logger="resilient.checkpoint.upload")
    in_thread = sent_in_thread(monkeypatch)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    url = f"file://{tmp_path}/bucket"
    ck = CheckpointManager(local=tmp_path / "local", persistent=url, interval=1, persistent_every=1)
    try:
        assert ck.config.upload_process == "auto" and ck._up.sender is None
        for s in range(2):
            ck.save(s, state(float(s)))
            assert ck.wait(60)
    finally:
        ck.close()
    assert in_thread == [0, 1] and FsspecTier(url, "persistent").steps() == {0: True, 1: True}
    said = [r.getMessage() for r in caplog.records if "uploads to the persistent tier from" in r.getMessage()]
    assert len(said) == 1 and "the upload thread: auto: 1 core(s) for 1 local rank(s)" in said[0], said
