"""``resilient plan`` as a user runs it: from a real run directory, from flags alone, and on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.plan.cli import main
from tests.goodput.conftest import crashed_run as real_run  # noqa: F401 - the same real run, as a fixture here

REPO = Path(__file__).resolve().parents[2]


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(120)
def test_json_from_a_real_run_directory(real_run: Path, capsys) -> None:
    out = _json(capsys, [str(real_run), "--rate-from-run", "--json", "--trials", "50"])
    fig, res, meas = out["figures"], out["result"], out["measured"]
    src = fig["source"]
    for name in ("step_s", "save_stall_s", "launch_s", "startup_s", "restore_s[local]", "detect_s[worker_exit]",
                 "recovery_s[restart]"):
        assert src[name] == "ledger", (name, src)
    assert src["detect_s[hang]"] == "default"
    assert out["cluster"]["nodes"] == 1 and out["cluster"]["gpus_per_node"] == 2
    assert out["cluster"]["ckpt_interval"] == 5 and out["cluster"]["steps"] == 40
    assert meas["faults"] == {"worker_exit": 1}
    assert set(res["badput_seconds"]) >= {"startup", "detection", "recovery", "wasted_progress"}
    # the run's own rate and figures: the plan lands near what the run measured
    assert abs(res["goodput"] - meas["goodput"]) < 0.05, (res["goodput"], meas["goodput"])
    # a flag overrides a measured figure
    out2 = _json(capsys, [str(real_run), "--json", "--trials", "2", "--step-s", "2.5", "--days", "1"])
    assert out2["figures"]["step_s"] == 2.5 and out2["figures"]["source"]["step_s"] == "flag"


def test_flags_alone_with_a_sweep(capsys) -> None:
    out = _json(capsys, ["--nodes", "16", "--mtbf-hours", "6", "--save-stall-s", "4", "--step-s", "2",
                         "--days", "4", "--trials", "1", "--sweep", "--max-spares", "2", "--json"])
    sw = out["sweep"]
    assert sw["best_spares"] in (0, 1, 2) and sw["best_interval"] >= 1
    assert sw["young_daly_steps"] == pytest.approx((2 * 4 * 6 * 3600) ** 0.5 / 2)
    assert 0 < out["result"]["goodput"] < 1 and out["cluster"]["mtbf_hours"] == pytest.approx(6)


def test_table_output(capsys) -> None:
    assert main(["--nodes", "16", "--days", "2", "--trials", "1"]) == 0
    text = capsys.readouterr().out
    assert "expected goodput" in text and "restore_s[peer]" in text and "waiting_for_spares" in text


@pytest.mark.parametrize("argv,what", [
    (["--failures-per-node-day", "-1"], "failure rate"),
    (["--nodes", "0"], "nodes"),
    (["--mtbf-hours", "0"], "--mtbf-hours"),
    (["--ckpt-interval", "soon"], "--ckpt-interval"),
    (["--restore-s", "ssd=3"], "--restore-s"),
    (["--tiers", "local,tape"], "tiers"),
    (["--policy", "no_such_policy.py"], "does not exist"),
    (["NO_SUCH_RUN_DIR"], "does not exist"),
    (["--rate-from-run"], "--rate-from-run"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], what: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert what in err and len(err.splitlines()) == 1, err


def test_garbage_ledger_and_empty_run_dir(tmp_path: Path, capsys) -> None:
    (tmp_path / "events.jsonl").write_text("not json\n{\"kind\": 3}\n")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a usable ledger" in err and len(err.splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "no ledger" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_registered_as_a_subcommand(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "resilient.cli", "plan", "--nodes", "-3"], cwd=REPO,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nodes" in r.stderr, r.stderr
