"""``resilient plan`` is bounded: sizes beyond what the simulation can do, and a rate that keeps no progress, are
refused at once with one line and exit 2; a plan for a fleet simulates a horizon that means something and says
what it simulated.

The tool runs as a user runs it (a subprocess), under a 2 GiB address-space limit so that a plan that would
grow without bound fails here instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.plan.api import ClusterConfig, Figures, PlanInputError
from resilient.plan.cli import main
from resilient.plan.sim import check_bounds
from tests.goodput.conftest import crashed_run as real_run  # noqa: F401 - the same real run, as a fixture here

REPO = Path(__file__).resolve().parents[2]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def plan(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resilient.cli", "plan", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=50, preexec_fn=_limited)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,words", [
    (["--nodes", "1000000000"], "plan at most about"),
    (["--spares", "1000000000"], "fewer --spares"),
    (["--trials", "100000000"], "--trials"),
    (["--mtbf-hours", "1e-12"], "makes no progress"),
    (["--failures-per-node-day", "1e9"], "makes no progress"),
    (["--days", "1e9"], "--days"),
    (["--steps", "1000000000000"], "--steps"),
    (["--sweep", "--max-spares", "1000000000"], "fewer --spares"),
], ids=["nodes", "spares", "trials", "mtbf", "rate", "days", "steps", "sweep_spares"])
def test_beyond_the_bounds_is_one_line_and_exit_2(argv: list[str], words: str) -> None:
    r = plan(*argv)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and words in err, err


def test_the_advised_size_fits_and_one_more_does_not() -> None:
    with pytest.raises(PlanInputError) as ei:
        check_bounds(ClusterConfig(nodes=4096), Figures(), 8)
    n = int(re.search(r"at most about ([\d,]+) nodes", str(ei.value)).group(1).replace(",", ""))
    assert 100 < n < 4096
    check_bounds(ClusterConfig(nodes=n), Figures(), 8)
    with pytest.raises(PlanInputError):
        check_bounds(ClusterConfig(nodes=n + 1), Figures(), 8)


@pytest.mark.timeout(60)
def test_a_plan_within_the_bounds_says_what_it_simulated() -> None:
    r = plan("--nodes", "64", "--trials", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("simulated:"))
    assert "30.00 d of wall time" in line and "64 nodes" in line and "failures expected per trial" in line


@pytest.mark.timeout(120)
def test_a_fleet_plan_from_a_run_simulates_days_not_the_runs_steps(real_run: Path, capsys) -> None:  # noqa: F811
    assert main([str(real_run), "--nodes", "512", "--trials", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sim = out["simulated"]
    assert out["cluster"]["steps"] is None and sim["steps"] is None and sim["horizon_s"] == 30 * 86400.0
    assert sim["nodes"] == 512 and sim["expected_failures"] > 10 and sim["simulated_failures"] > 10
    # without --nodes the plan is the run's own job: its steps
    assert main([str(real_run), "--trials", "1", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["cluster"]["steps"] == own["simulated"]["steps"] == 40
