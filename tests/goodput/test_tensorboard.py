"""``resilient goodput RUN_DIR --tensorboard DIR``: the scalars read back with TensorBoard's own reader."""

from __future__ import annotations

import subprocess
import sys

import pytest

from resilient.events import Ledger
from resilient.goodput.api import CATEGORIES
from resilient.goodput.calculator import report_for_run
from resilient.goodput.cli import main
from tests.goodput.test_interference import saving_run


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    with Ledger(d) as led:
        for e in saving_run():
            led.write(e)
    return d


def test_scalars_read_back(run_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    assert main([str(run_dir), "--tensorboard", str(out)]) == 0
    acc = EventAccumulator(str(out))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"goodput/goodput", "goodput/productive_seconds", "step/seconds", "summary/goodput"} <= tags
    assert {f"badput/{c}" for c in CATEGORIES} <= tags
    rep = report_for_run(run_dir)
    gp = acc.Scalars("goodput/goodput")
    assert [s.step for s in gp] == list(range(12))  # whole seconds of an 11 s run
    assert gp[-1].value == pytest.approx(rep.goodput, rel=1e-6)
    assert acc.Scalars("summary/goodput")[-1].value == pytest.approx(rep.goodput, rel=1e-6)
    interference = acc.Scalars("badput/checkpoint_interference")
    assert interference[-1].value == pytest.approx(0.8, rel=1e-6)
    assert [s.value for s in interference][:6] == [0.0] * 6  # nothing before the write slowed step 3
    steps = acc.Scalars("step/seconds")
    assert [(s.step, round(s.value, 6)) for s in steps] == [(0, 2.0), (1, 1.0), (2, 1.2), (3, 1.5), (4, 1.2),
                                                             (5, 1.0), (6, 1.3)]


def test_without_tensorboard_one_clear_line_and_exit_2(run_dir, tmp_path):
    # a fresh interpreter where the tensorboard package cannot be found
    code = ("import sys, importlib.util as u; f = u.find_spec; "
            "u.find_spec = lambda n, *a: None if n == 'tensorboard' else f(n, *a); "
            "from resilient.goodput.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, str(run_dir), "--tensorboard", str(tmp_path / "tb")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "pip install 'resilient[tensorboard]'" in res.stderr
    assert not (tmp_path / "tb").exists()


def test_tensorboard_dir_that_is_a_file(run_dir, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main([str(run_dir), "--tensorboard", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err
