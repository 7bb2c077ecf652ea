"""``background_nice``: a real save and upload whose background threads report their scheduling priority.

The save worker and the uploader lower their own priority; every thread they start inherits it (here the
persistent store's calls, each in a thread of its own started by the upload thread, report theirs through a
recording fsspec filesystem: the store, not the thing under test). The training thread keeps its own.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from fsspec import register_implementation
from fsspec.implementations.local import LocalFileSystem

from resilient.checkpoint.api import CheckpointConfig, CheckpointConfigError
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.checkpoint.storage.priority import thread_priority

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")]


class _RecordingFS(LocalFileSystem):
    """A local filesystem that notes which thread, at which priority, opened each file for writing."""

    protocol = "nicefile"
    seen: list[tuple[str, tuple[int, str] | None]] = []

    @classmethod
    def _strip_protocol(cls, path):  # type: ignore[no-untyped-def]
        if isinstance(path, str) and path.startswith("nicefile://"):
            path = path[len("nicefile://"):]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):  # type: ignore[no-untyped-def]
        if "w" in mode:
            _RecordingFS.seen.append((threading.current_thread().name, thread_priority()))
        return super()._open(path, mode, **kwargs)


register_implementation("nicefile", _RecordingFS, clobber=True)


def _threads() -> dict[str, threading.Thread]:
    return {t.name: t for t in threading.enumerate()}


def _priority_of(t: threading.Thread) -> tuple[int, str]:
    # the kernel's view of that thread (field 19 of its stat: nice), not the thread's own report
    fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16]), fields[0]


def _save(tmp_path: Path, nice: int | str) -> tuple[CheckpointManager, list]:
    _RecordingFS.seen.clear()
    model = torch.nn.Linear(64, 64)
    ck = CheckpointManager(local=tmp_path / "local", persistent=f"nicefile://{tmp_path / 'store'}", interval=1,
                           persistent_every=1, background_nice=nice, upload_grace_s=60)
    assert ck.save(0, {"model": model})
    assert ck.wait(timeout=60, upload_timeout=60)
    return ck, list(_RecordingFS.seen)


def test_background_threads_run_at_the_configured_nice_and_training_keeps_its_own(tmp_path: Path) -> None:
    main_before = thread_priority()
    assert main_before is not None and main_before[0] < 7, "the test needs a process nicer than 7 to start from"
    ck, seen = _save(tmp_path, 7)
    try:
        threads = _threads()
        for name in ("resilient-ckpt-save", "resilient-ckpt-upload"):
            assert _priority_of(threads[name])[0] == 7, name
        assert thread_priority() == main_before  # the training thread is untouched
        # the store's calls ran in threads the upload thread started: they inherited its priority
        writers = [(n, p) for n, p in seen if n.startswith("resilient-")]
        assert writers, seen
        assert all(p is not None and p[0] == 7 for _, p in writers), writers
    finally:
        ck.close(timeout=60)


def test_idle_policy_and_zero_leaves_the_threads_as_the_process(tmp_path: Path) -> None:
    ck, seen = _save(tmp_path / "idle", "idle")
    try:
        assert all(p is not None and p[1] == "idle" for n, p in seen if n.startswith("resilient-")), seen
    finally:
        ck.close(timeout=60)
    main = thread_priority()
    assert main is not None and main[1] != "idle"
    ck, seen = _save(tmp_path / "zero", 0)
    try:
        assert _priority_of(_threads()["resilient-ckpt-save"])[0] == main[0]
        assert all(p == main for n, p in seen if n.startswith("resilient-")), seen
    finally:
        ck.close(timeout=60)


@pytest.mark.parametrize("bad", [-1, 20, "low", True, 2.5])
def test_background_nice_is_validated(tmp_path: Path, bad: object) -> None:
    with pytest.raises(CheckpointConfigError, match="background_nice"):
        CheckpointConfig(local=str(tmp_path), background_nice=bad)  # type: ignore[arg-type]


def test_background_nice_accepts_text_from_the_environment(tmp_path: Path) -> None:
    assert CheckpointConfig(local=str(tmp_path), background_nice="10").background_nice == 10
    assert CheckpointConfig(local=str(tmp_path), background_nice=" IDLE ").background_nice == "idle"
