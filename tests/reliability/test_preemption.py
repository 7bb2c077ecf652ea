"""Preemption: SIGTERM to the agent saves the current step whatever the interval, the agent exits 75
(PREEMPTED_EXIT_CODE), and the same command resumes right after that step, bit-exact."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.launcher.api import PREEMPTED_EXIT_CODE
from tests._helpers.wait import wait_for

SCRIPT = Path(__file__).with_name("scripts") / "train.py"
REPO = Path(__file__).resolve().parents[2]
STEPS = 40


def launch(tmp_path: Path, name: str, launch_mode: str) -> subprocess.Popen:
    out = tmp_path / name / "out"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--worker-launch", launch_mode,
           "--term-timeout", "30", "--run-dir", str(tmp_path / name / "run"), "--ckpt-local", str(tmp_path / name / "local"),
           "--ckpt-interval", "1000", str(SCRIPT), str(out), "wait", str(STEPS)]
    err = open(tmp_path / name / "launcher.err", "a")
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def steps_in(run: Path) -> list[int]:
    """Steps recorded (completed) since the last run start."""
    evs = list(read_events(run))
    starts = [i for i, e in enumerate(evs) if e.kind == EventKind.RUN_START]
    if not starts:  # the ledger exists before its first line is written
        return []
    return [e.details["step"] for e in evs[starts[-1]:] if e.kind == EventKind.STEP]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The parameters of the job run to its end without a preemption, once for the launch modes: the script's
    result depends on its steps alone, so both modes' resumed runs must equal it (a mode-dependent result would
    fail them)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    ref = launch(d, "ref", "fork-server")
    assert ref.wait(timeout=200) == 0, (d / "ref" / "launcher.err").read_text()[-3000:]
    return torch.load(d / "ref" / "out" / "final.pt")


@pytest.mark.timeout(300)
# "group": SIGTERM to the launcher's whole process group, as a terminal's Ctrl-C or a scheduler signalling every
# process of the job does; the fork server is in that group and must outlive it, or its workers die with it unsaved
@pytest.mark.parametrize("launch_mode,target", [("fork-server", "agent"), ("spawn", "agent"), ("fork-server", "group")])
def test_sigterm_saves_the_current_step_and_the_rerun_resumes_bit_exact(tmp_path, launch_mode, target, uninterrupted):
    expected = uninterrupted

    run = tmp_path / "job" / "run"
    p = launch(tmp_path, "job", launch_mode)
    try:
        wait_for(lambda: (run / "events.jsonl").exists() and any(s >= 12 for s in steps_in(run)), 120, "step 12 in the ledger")
        if target == "group":
            os.killpg(p.pid, signal.SIGTERM)  # started in a session of its own: its group is the launcher's
        else:
            p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=60)  # within --term-timeout (30 s) plus the agent's own exit
    finally:
        p.kill()
    err = (tmp_path / "job" / "launcher.err").read_text()
    assert code == PREEMPTED_EXIT_CODE, err[-3000:]
    marks = sorted((run / "preempted").iterdir())
    stopped = {int(m.read_text()) for m in marks}
    assert len(marks) == 2 and len(stopped) == 1, marks
    (last,) = stopped
    assert 12 <= last < STEPS - 1
    assert (tmp_path / "job" / "local").exists() and any(str(last) in p.name for p in (tmp_path / "job" / "local").iterdir())

    again = launch(tmp_path, "job", launch_mode)
    assert again.wait(timeout=200) == 0, (tmp_path / "job" / "launcher.err").read_text()[-3000:]
    resumed = steps_in(run)
    assert resumed[0] == last + 1, resumed[:5]  # nothing redone, nothing skipped
    got = torch.load(tmp_path / "job" / "out" / "final.pt")
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


@pytest.mark.timeout(120)
def test_script_without_resilient_is_stopped_as_under_torchrun(tmp_path):
    """No marks (the script never imports resilient): SIGTERM forwarded, SIGKILL after --term-timeout, exit 1."""
    script = tmp_path / "plain.py"
    script.write_text("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "open(os.path.join(os.environ['OUT'], 'ready' + os.environ['RANK']), 'w').close()\n"
                      "time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OUT=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                          "--term-timeout", "1", "--run-dir", str(tmp_path / "run"), str(script)],
                         cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), 60, "workers ready")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 1
    finally:
        p.kill()


@pytest.mark.timeout(200)
def test_notice_file_ends_the_loop_after_a_saved_step_and_a_stale_one_is_ignored(tmp_path):
    run = tmp_path / "job" / "run"
    run.mkdir(parents=True)
    stale = run / "preempt"
    stale.write_text("")
    os.utime(stale, (1, 1))  # from long before this run: ignored
    p = launch(tmp_path, "job", "fork-server")
    try:
        wait_for(lambda: (run / "events.jsonl").exists() and any(s >= 8 for s in steps_in(run)), 120, "step 8")
        assert not (run / "preempted").exists()
        stale.unlink()
        (run / ".preempt").write_text("")
        os.replace(run / ".preempt", run / "preempt")  # a fresh notice
        p.wait(timeout=60)
    finally:
        p.kill()
    (mark,) = {int(m.read_text()) for m in (run / "preempted").iterdir()}
    assert 8 <= mark < STEPS - 1
    assert max(steps_in(run)) == mark  # the loop ended right after the agreed step
    saved = [e.details["step"] for e in read_events(run) if e.kind == EventKind.CKPT_SAVE]
    assert saved == [mark]  # saved whatever the interval (1000)
    assert p.returncode == 75  # preempted: the scheduler requeues
