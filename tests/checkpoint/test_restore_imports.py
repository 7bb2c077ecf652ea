"""A restore in a freshly started worker pays no import it does not need: psutil (60-150 ms to import) is not
imported by a restore (a hot swap's spare restores first thing after its start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = '''
import sys, torch
from resilient.checkpoint.manager import CheckpointManager
ck = CheckpointManager(local=sys.argv[1], interval=1)
ck.save(0, {"w": torch.ones(64)})
ck.close()
had = "psutil" in sys.modules
ck = CheckpointManager(local=sys.argv[1], interval=1)
state = {"w": torch.zeros(64)}
ck.restore(state)
ck.close()
assert bool(state["w"].eq(1).all()), state
print(int(had), int("psutil" in sys.modules))
'''


@pytest.mark.timeout(120)
def test_restore_does_not_import_psutil(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=100, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    had, now = out.stdout.split()[-2:]
    if had == "1":
        pytest.skip("psutil was imported before the restore by something else; nothing to check")
    assert now == "0", "a restore imported psutil"
