"""CPU contention beside the code under test: busy-looping processes, always ended."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_burners(n: int = 2, *, max_seconds: float = 600.0) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` busy-looping processes beside the code under test (CPU contention), always killed on exit and
    bounded by ``max_seconds`` even if this process dies (they run under ``timeout``)."""
    n = max(0, min(int(n), 2))  # a shared machine: at most two
    code = "import time\nend = time.monotonic() + %r\nwhile time.monotonic() < end: pass\n" % float(max_seconds)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)
