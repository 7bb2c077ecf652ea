"""bench/reshard.py --quick: both changes of size (2 -> 1 and 4 -> 2 ranks) restore bit-exact at the new size and
report every figure the README quotes. No timing is asserted: load decides them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "reshard.py"


@pytest.mark.timeout(600)
def test_quick_mode_reports_restore_against_raw_read(tmp_path: Path) -> None:
    out = tmp_path / "reshard.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--reps", "1", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "quick" and [(s["old_ranks"], s["new_ranks"]) for s in doc["scenarios"]] == [(2, 1), (4, 2)]
    for s in doc["scenarios"]:
        assert len(s["restore_over_raw"]["all"]) == doc["reps"] and s["restore_over_raw"]["median"] > 0
        ranks = [r for r in s["per_rank"] if r]
        assert len(ranks) == s["new_ranks"], s["per_rank"]  # every new rank read a resharded state
        assert all(r["shard"] > 0 and r["read"] >= r["shard"] for r in ranks), ranks
    assert "2 -> 1" in p.stdout and "4 -> 2" in p.stdout and "restore / raw" in p.stdout
