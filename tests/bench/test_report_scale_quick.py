"""bench/report_scale.py --quick: the goodput report (alone and with --plot) and the Prometheus collector's scrapes
are measured against the code of another commit (here HEAD, which every clone has) on the same synthetic ledger, and
both reach the same answer. No timing is asserted: load decides them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "report_scale.py"


@pytest.mark.timeout(300)
def test_quick_mode_measures_the_report_and_a_scrape_against_another_commit(tmp_path: Path) -> None:
    out = tmp_path / "report_scale.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--before", "HEAD", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["reader"] for r in rows] == ["report", "scrape", "plot"]
    for r in rows:
        assert r["steps"] == 20000 and r["same_answer"] is True, r
        assert r["new_seconds"] > 0 and r["before_seconds"] > 0 and r["new_peak_rss_mib"] > 0, r
    scrape = rows[1]
    assert scrape["new_held_rss_mib"] > 0 and scrape["new_next_scrape_seconds"] > 0, scrape
    assert "next scrape" in p.stdout
    # the worktree of the other commit is gone again
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, timeout=60)
    assert "before" not in listed.stdout
