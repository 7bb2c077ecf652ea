import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests._helpers.wait import wait_for  # noqa: F401 - the tests import it from here

SCRIPTS = Path(__file__).parent / "scripts"


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "resilient.run", *args]


def run_launcher(args, cwd, timeout=120, env=None):
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    if env:
        e.update(env)
    return subprocess.run(launcher_cmd(*args), cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def leftovers(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture
def scripts():
    return SCRIPTS
