"""bench/goodput.py --quick: the headline benchmark's baseline (torchrun with synchronous DCP) and
resilient-run each run the real recipe under the real launcher with a real SIGKILLed worker, and
each produce a goodput figure. No timing is asserted: the machine's load decides the numbers."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "goodput.py"


@pytest.mark.timeout(420)
def test_quick_mode_gives_every_configuration_a_number(tmp_path):
    out = tmp_path / "goodput.json"
    # the baseline and ours: the suite's time budget does not hold all three (ft_launcher runs in the bench)
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--configs", "torchrun,resilient-run", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "quick"
    assert set(doc["results"]) == {"torchrun", "resilient-run"}
    for name, r in doc["results"].items():
        assert r["finished"], f"{name}: {r.get('error')}\n{r.get('log_tail', '')}"
        assert len(r["injected"]) == 1, f"{name}: the worker kill was not carried out: {r}"
        assert isinstance(r["goodput"], float) and 0 < r["goodput"] <= 1.0 and math.isfinite(r["goodput"]), r
        assert r["useful_steps"] == doc["steps"]
    ledger = doc["results"]["resilient-run"]["ledger"]
    assert isinstance(ledger.get("goodput"), float), ledger
    assert isinstance(doc["loadavg_before"], list) and len(doc["loadavg_before"]) == 3
    for name in doc["results"]:  # the table names each configuration
        assert name in p.stdout


@pytest.mark.parametrize("argv, says", [
    (["--configs", "slurm"], "unknown configuration"),
    (["--mtbf", "-5"], "finite positive"),
    (["--minutes", "nan"], "finite positive"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, says):
    p = subprocess.run([sys.executable, str(BENCH), *argv, "--out", str(tmp_path / "x.json")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], p.stderr
    assert not (tmp_path / "x.json").exists()
