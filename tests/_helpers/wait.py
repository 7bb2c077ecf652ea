"""Waiting on real conditions in tests: poll, with a timeout, and fail with a message that says what was awaited."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None, *,
             interval: float = 0.02) -> object:
    """Poll ``pred`` (a condition on real files or processes) until it returns something truthy, which is
    returned; fails with a message naming ``what`` instead of hanging, and at once if ``proc`` (the process
    expected to bring the condition about) has exited meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}: {err}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)

