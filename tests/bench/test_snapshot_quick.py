"""bench/snapshot.py --quick: a snapshot's blocking time and a fresh process's restore from it, against their
baselines, on real processes and real /dev/shm. No timing is asserted: the machine's load decides the numbers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_quick_mode_measures_every_state_and_restores_from_the_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "snapshot.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "snapshot.py"), "--quick", "--reps", "1", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [b["state"] for b in doc["blocking"]] == ["recipe", "large"]
    for r in doc["restore"]:  # each measured restore came from the tier it was meant to
        assert r["tiers"] == [["local", "local"], ["snapshot", "snapshot"]], r
    for b in doc["blocking"]:
        assert b["snapshot_over_copy"]["median"] > 0 and b["tensors"] > 0
    assert "local ÷ snap" in p.stdout
