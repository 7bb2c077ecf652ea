"""bench/ledger_looks.py --quick: a quiet look is timed for each number of files and every follower's looks are
given before and after the spacing; past 500 files (1 s / 2 ms) the interval tuner's stats a second fall. No timing is
asserted: load decides the looks' seconds."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "ledger_looks.py"


@pytest.mark.timeout(120)
def test_quick_mode_gives_each_follower_its_looks_before_and_after(tmp_path: Path) -> None:
    out = tmp_path / "looks.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=100)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["files"], r["follower"]) for r in rows] == [
        (n, f) for n in (8, 1000) for f in ("interval tuner", "checkpoint follower")]
    for r in rows:
        assert r["look_s"] > 0 and r["stats_per_s"] <= r["stats_per_s_before"], r
    tuner = {r["files"]: r for r in rows if r["follower"] == "interval tuner"}
    assert tuner[8]["stats_per_s"] == tuner[8]["stats_per_s_before"]  # a few files: looked at as often as before
    assert tuner[1000]["stats_per_s"] == pytest.approx(500) and tuner[1000]["stats_per_s_before"] == pytest.approx(1000)
    assert "interval tuner" in p.stdout and "stats/s" in p.stdout


@pytest.mark.timeout(60)
def test_bad_files_is_a_usage_error(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(BENCH), "--files", "8,many", "--out", str(tmp_path / "x.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert p.returncode == 2 and "--files" in p.stderr and not (tmp_path / "x.json").exists(), p.stderr
