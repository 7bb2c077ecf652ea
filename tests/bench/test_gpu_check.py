"""bench/gpu/check.sh --dry-run: the device check runs every part on CPU through the same scripts, so it cannot
rot between the rare runs on a GPU. No figure is asserted (a dry run's figures mean nothing); each part must
finish, write its JSON and mark it as a dry run, and the CUDA-only tests must be skipped with a reason."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu" / "check.sh"


@pytest.mark.timeout(420)
def test_dry_run_runs_every_part_and_writes_one_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("TORCHTITAN_ROOT", None)
    p = subprocess.run(["bash", str(CHECK), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    log = (tmp_path / "check.log").read_text() if (tmp_path / "check.log").exists() else ""
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:] + log[-6000:]
    outs = sorted(tmp_path.glob("gpu-*.json"))
    assert [o.name for o in outs] == ["gpu-cpu.json"], outs
    doc = json.loads(outs[0].read_text())
    assert doc["env"]["torch"], doc["env"]
    parts = doc["parts"]
    for name in ("health", "staging", "restart"):
        assert parts[name]["status"] == "ok", (name, parts[name])
        assert parts[name]["figures"].get("dry_run") is True, (name, parts[name])
    tests = parts["pytest"]["tests"]
    assert tests["failed"] == 0 and tests["passed"] + tests["skipped"] >= 1, tests
    for t in tests["tests"]:  # on CPU every CUDA-only test says why it did not run
        assert t["verdict"] == "passed" or t.get("why"), t
    interference = parts["interference"]
    assert interference["status"] == "ok" and interference["figures"]["model"]["device"] == "cpu", interference
    assert list(interference["figures"]["cases"]) == ["local/every1/nice=0/record"], interference["figures"]["cases"]
    assert parts["titan"]["status"] == "skipped" and parts["titan"]["reason"], parts["titan"]
    for name in parts:  # the table names each part
        assert name in p.stdout


def test_summary_names_what_is_missing(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "summary.py"), "--merge", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--out" in p.stderr, p.stderr
