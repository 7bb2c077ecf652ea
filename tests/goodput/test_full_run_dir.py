"""A run directory that fills up: training finishes, the loss of the ledger is said (once per writer, and in the
launcher's last lines), and ``resilient goodput`` reports the ledger as incomplete instead of a run "in
progress". Real ``resilient-run``, real workers, the run directory on a real 100 KB tmpfs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import finish, kill_group, launch


@pytest.fixture
def small_run_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "run"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(d)], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)


@pytest.mark.timeout(300)
def test_full_run_dir_is_said_and_the_report_says_the_ledger_is_incomplete(small_run_dir: Path) -> None:
    run_dir = small_run_dir
    # 100 KB hold about 450 step records: 800 steps fill the run directory well before the end
    proc = launch(run_dir, steps=800, save_every=100000)
    try:
        out = finish(proc, timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]  # training finished: a full run dir is no reason to stop it
    assert "--- Logging error ---" not in out and "Traceback" not in out, out[-4000:]
    said = [ln for ln in out.splitlines() if "cannot write the ledger" in ln]
    assert 1 <= len(said) <= 3, said  # once per writer (the agent, two ranks), not once per event
    final = [ln for ln in out.splitlines() if ln.startswith("resilient-run: the ledger is incomplete")]
    assert len(final) == 1, out[-4000:]

    r = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(run_dir), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["ledger_incomplete"] is True and "incomplete" in rep["ledger_incomplete_reason"], rep
    r = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(run_dir)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ledger incomplete" in r.stdout and "(in progress)" not in r.stdout, r.stdout
    assert "the ledger is incomplete" in r.stdout, r.stdout
