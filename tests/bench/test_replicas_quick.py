"""bench/replicas.py --quick: the replica scenario (4 agents of 1 worker, replicas of 2 nodes, a node lost and
back) runs to its end and reports every figure the README quotes. No timing is asserted: load decides them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "replicas.py"


@pytest.mark.timeout(420)
def test_quick_mode_reports_every_figure(tmp_path):
    out = tmp_path / "replicas.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "quick" and doc["reference"]["ok"], doc["reference"]
    run = doc["run"]
    assert run["ok"], f"{run.get('error')}\n{run.get('log_tail')}"
    assert isinstance(run["loss_to_first_step_s"], float) and run["loss_to_first_step_s"] > 0
    assert run["restore"]["seconds"] > 0 and run["restore"]["bytes"] > 0, run["restore"]
    assert 0 < run["raw_read"]["bytes"] <= run["restore"]["bytes"], run["raw_read"]
    assert isinstance(doc["max_rel_loss_deviation"], float)
    s = run["samples"]
    assert s["expected"] == doc["scenario"]["steps"] * doc["scenario"]["global_batch"]
    assert {"seen", "duplicates", "missing"} <= set(s)
    for row in ("node loss -> first step", "restore / raw read", "max relative deviation", "samples per epoch"):
        assert row in p.stdout


def test_bad_arguments_exit_2_with_one_line():
    p = subprocess.run([sys.executable, str(BENCH), "--steps", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "kill_after" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
