"""bench/ledger_read.py --quick: each reader (a restart's tuner, an exit's checkpoint lines, the goodput report) is
measured against the decoding before on the same synthetic ledger, the exit with the launcher's follower and the
restart with the tuner's cache against the exit and the restart that read the whole run, and both of each pair reach
the same answer. No timing is asserted: load decides them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "ledger_read.py"


@pytest.mark.timeout(300)
def test_quick_mode_measures_every_reader_against_the_old_decoding(tmp_path: Path) -> None:
    out = tmp_path / "ledger_read.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["reader"] for r in rows] == ["restart", "restart-cached", "exit", "exit-followed", "report"]
    for r in rows:
        assert r["steps"] == 20000 and r["ledger_mib"] > 1, r
        assert r["same_answer"] is True, r
        assert r["new_seconds"] > 0 and r["old_seconds"] > 0 and r["new_peak_rss_mib"] > 0, r
    assert "restart" in p.stdout and "new RSS" in p.stdout
