"""bench/interference.py at tiny sizes: the one-rank shape (what ``--device cuda --world 1`` measures on a GPU)
gives every case its overhead against its own repetition's baseline and records where it ran, each GIL switch
interval a case of its own; a peer tier with one rank, CUDA on a machine without it, or a switch interval that is not a
positive number of seconds is a usage error. No timing is asserted: load decides the figures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "interference.py"
TINY = ["--reps", "1", "--steps", "2", "--warmup", "1", "--intervals", "1", "--writers", "record",
        "--n-layer", "1", "--d-model", "32", "--batch", "2"]


@pytest.mark.timeout(120)
def test_one_rank_local_and_persistent_cases_are_measured_against_the_baseline(tmp_path: Path) -> None:
    out = tmp_path / "i.json"
    p = subprocess.run([sys.executable, str(BENCH), *TINY, "--world", "1", "--tiers", "local,persistent",
                        "--switch-intervals", "0.005,0.0005", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=100)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["model"]["ranks"] == 1 and doc["model"]["device"] == "cpu" and doc["model"]["device_name"] == "cpu"
    assert sorted(doc["cases"]) == ["local/every1/nice=0/record", "local/every1/nice=0/record/switch=0.5ms",
                                    "persistent/every1/nice=0/record", "persistent/every1/nice=0/record/switch=0.5ms"]
    assert sorted(r["case"] for r in doc["rows"]) == sorted(["none", *doc["cases"]])
    assert {c["switch_interval"] for c in doc["cases"].values()} == {"5ms", "0.5ms"}
    for c in doc["cases"].values():
        assert c["blocking_per_save_s"] > 0 and "auto_overhead" in c, c
    assert "1 rank(s)" in p.stdout
    # summarising the result again reads its shape back from it
    again = tmp_path / "again.json"
    p = subprocess.run([sys.executable, str(BENCH), "--summarise", str(out), "--out", str(again)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(again.read_text())["model"] == doc["model"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, names", [
    (["--world", "1", "--tiers", "local,peer"], "--world 1"),
    (["--device", "cuda"], "no CUDA GPU"),
    (["--switch-intervals", "0.005,0"], "--switch-intervals"),
    (["--switch-intervals", "fast"], "--switch-intervals"),
])
def test_bad_shapes_are_usage_errors(tmp_path: Path, extra: list[str], names: str) -> None:
    if "cuda" in extra and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: --device cuda is no error here")
    p = subprocess.run([sys.executable, str(BENCH), *TINY, *extra, "--out", str(tmp_path / "x.json")], cwd=ROOT,
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 2 and names in p.stderr and not (tmp_path / "x.json").exists(), p.stderr
