"""bench/interference.py at tiny sizes: the one-rank shape (what ``--device cuda --world 1`` measures on a GPU)
gives every case its overhead against its own repetition's baseline and records where it ran, each GIL switch
interval a case of its own; a peer tier with one rank, CUDA on a machine without it, or a switch interval that is not a
positive number of seconds is a usage error. No timing is asserted: load decides the figures."""
import json
import os
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
    for c in doc["cases"].values():  # where each save's cost went, from the training thread's own accounting
        assert set(c["split_per_save_s"]) == {"staging", "waiting", "slower", "no_core", "off_cpu"}, c
        assert c["split_per_save_s"]["staging"] > 0, c
    # summarising the result again reads its shape back from it
    again = tmp_path / "again.json"
    p = subprocess.run([sys.executable, str(BENCH), "--summarise", str(out), "--out", str(again)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(again.read_text())["model"] == doc["model"]


@pytest.mark.timeout(120)
def test_the_launch_bound_stand_in_pinned_apart_from_the_saves(tmp_path: Path) -> None:
    # a GPU job's training thread on a CPU machine: dispatch-bound operations, on its own CPU
    out = tmp_path / "launch.json"
    p = subprocess.run([sys.executable, str(BENCH), *TINY, "--world", "1", "--tiers", "local", "--step", "launch",
                        "--launch-ops", "50", "--pin", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["model"]["step"] == "launch" and doc["model"]["launch_ops"] == 50 and doc["model"]["pin"] is True
    # the optimizer's state was made before the stand-in took over: the saved state is the model's and AdamW's
    assert doc["state_bytes_per_rank"] > 3 * 50_000, doc["state_bytes_per_rank"]
    assert list(doc["cases"]) == ["local/every1/nice=0/record"]


def _bench():  # the bench's own module, in-process: a usage error needs no interpreter of its own
    import importlib.util

    spec = importlib.util.spec_from_file_location("interference_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, names", [
    (["--world", "1", "--tiers", "local,peer"], "--world 1"),
    (["--device", "cuda"], "no CUDA GPU"),
    (["--switch-intervals", "0.005,0"], "--switch-intervals"),
    (["--switch-intervals", "fast"], "--switch-intervals"),
    (["--step", "launch", "--launch-ops", "0"], "--launch-ops"),
    (["--pin", "--world", "2"] if (os.cpu_count() or 1) <= 2 else ["--step", "gpu"], "--"),
])
def test_bad_shapes_are_usage_errors(extra: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "cuda" in extra and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: --device cuda is no error here")
    with pytest.raises(SystemExit) as e:
        _bench().parse_args([*TINY, *extra])
    assert e.value.code == 2 and names in capsys.readouterr().err
