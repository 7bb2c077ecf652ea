"""What a new user sees first, on real worker processes: failures named like torchrun names them, every failed
rank in the summary, whole lines under --tee 3, torchrun's MASTER_ADDR, a default checkpoint tier, and a
goodput report that says when a run has no step records."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests._helpers.load import cpu_burners
from tests.launcher.conftest import run_launcher, wait_for


@pytest.mark.timeout(120)
def test_summary_names_every_failed_rank_and_the_terminal_names_rank_pid_signal(tmp_path, scripts):
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"),
                      str(scripts / "both_fail.py")], cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    # the line a user sees when a worker dies: rank, local rank, pid and the signal
    assert re.search(r"rank [01] \(local_rank: [01], pid: \d+\) failed \(signal: SIGUSR[12]\)", r.stderr), r.stderr
    summary = r.stderr[r.stderr.index("both_fail.py FAILED"):]
    assert "<NO_OTHER_FAILURES>" not in summary, summary
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)", summary) and re.search(r"rank\s+: 1 \(local_rank: 1\)", summary), summary
    assert "Signal 10 (SIGUSR1)" in summary and "Signal 12 (SIGUSR2)" in summary, summary


@pytest.mark.timeout(120)
def test_tee_keeps_every_line_whole(tmp_path, scripts):
    n = 400
    # spawn: the script needs no torch, so no fork server warming up
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--tee", "3", "--worker-launch", "spawn",
                      "--run-dir", str(tmp_path / "run"),
                      str(scripts / "chatty.py"), str(n)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[default")]
    bad = [ln for ln in lines if not re.fullmatch(r"\[default([01])\]:r\1 line \d+ x+ end", ln)]
    assert not bad, bad[:5]
    assert len(lines) == 2 * n
    # the per-rank log files keep the bytes exactly as written
    log = (tmp_path / "run" / "logs" / "attempt_0" / "1" / "stdout.log").read_text()
    assert log.count(" end\n") == n


@pytest.mark.timeout(150)
def test_default_local_tier_master_addr_and_no_step_records(tmp_path, scripts):
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    r = run_launcher(["--standalone", "--nproc-per-node", "1", "--run-dir", str(run), str(scripts / "default_ckpt.py"),
                      str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    seen = json.loads((out / "seen.json").read_text())
    assert seen["MASTER_ADDR"] == "localhost"  # as torchrun --standalone
    local = run.resolve() / "ckpt" / "local"
    assert seen["local"] == str(local)
    assert "no --ckpt-local/--ckpt-persistent given" in r.stderr and str(local) in r.stderr
    kept = sorted(p.name for p in local.iterdir() if p.is_dir())
    assert 1 <= len(kept) <= 2 and kept[-1].endswith("3"), kept  # retention bounded: newest steps only
    g = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(run)], capture_output=True, text=True,
                       timeout=60)
    assert g.returncode == 2, (g.stdout, g.stderr)
    assert "no step records" in g.stderr and "resilient.steps()" in g.stderr
    assert len(g.stderr.strip().splitlines()) == 1, g.stderr


@pytest.mark.timeout(280)
def test_automatic_preload_learns_imports_and_drops_a_module_that_starts_threads(tmp_path, scripts):
    # two modules installed in a user site (a real install location; the user's own code is never preloaded)
    user_base = tmp_path / "userbase"
    site_dir = user_base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_dir.mkdir(parents=True)
    (site_dir / "calm.py").write_text("VALUE = 1\n")
    (site_dir / "thready.py").write_text("import threading\nthreading.Thread(target=threading.Event().wait, "
                                         "daemon=True).start()\n")
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    # under CPU contention: warming must neither be raced by the restart nor slow it down (rank 1 dies only once
    # the agent logged that the warmed fork server is ready; a warming copy costs only the learned imports)
    with cpu_burners(2, max_seconds=260):
        r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", str(run),
                          str(scripts / "learn_imports.py"), str(out)], cwd=tmp_path, timeout=250,
                         env={"PYTHONUSERBASE": str(user_base), "PYTHONPATH": str(site_dir),
                              "RESILIENT_LOG_LEVEL": "INFO"})
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert json.loads((out / f"a0_r{rank}.json").read_text()) == {"calm": False, "thready": False}
        # the restarted workers found calm imported already; thready (a thread at import) was dropped
        assert json.loads((out / f"a1_r{rank}.json").read_text()) == {"calm": True, "thready": False}
    assert "thready" in (run / "preload" / "denied.txt").read_text().split()
    assert "thready is never preloaded again" in r.stderr


WARM_COPY_AGENT = r'''
import os, sys, time
from resilient.launcher.api import WorkerCommand
from resilient.launcher.starters import ForkServer, WorkerProc

out, marker = sys.argv[1], sys.argv[2]
fs = ForkServer((), tag=marker)
fs.wait_ready()
copy = fs.fork()
copy.preload_more(["calm"])
deadline = time.monotonic() + 60
while not copy.poll_ready():
    assert time.monotonic() < deadline, "the copy never got warm"
    time.sleep(0.01)
copy.adopt(fs)  # as the agent does when the copy takes over at a restart
w = WorkerProc(local_rank=0, rank=0, env=dict(os.environ))
copy.start(WorkerCommand(target=os.path.join(out, "worker.py"), args=(out,)), [w], out)
with open(os.path.join(out, "pids.tmp"), "w") as f:
    f.write(f"{fs.proc.pid} {copy.proc.pid} {w.pid}")
os.rename(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
time.sleep(600)
'''

WARM_COPY_WORKER = r'''
import os, sys
with open(os.path.join(sys.argv[1], "seen.tmp"), "w") as f:
    f.write("calm" if "calm" in sys.modules else "-")
os.rename(os.path.join(sys.argv[1], "seen.tmp"), os.path.join(sys.argv[1], "seen"))
import time
time.sleep(600)
'''


@pytest.mark.timeout(120)
def test_a_warmed_copy_of_the_fork_server_and_its_workers_die_with_the_agent(tmp_path):
    """The copy that took over stays the child of the fork server it was forked from (kept idle): a SIGKILLed
    agent must still take the whole chain along."""
    import psutil

    user_base = tmp_path / "userbase"  # an install location: only installed modules are preloaded
    site_dir = user_base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_dir.mkdir(parents=True)
    (site_dir / "calm.py").write_text("VALUE = 1\n")
    (tmp_path / "worker.py").write_text(WARM_COPY_WORKER)
    agent = subprocess.Popen([sys.executable, "-c", WARM_COPY_AGENT, str(tmp_path), f"mark={tmp_path}"],
                             env={**os.environ, "PYTHONUSERBASE": str(user_base), "PYTHONPATH": str(site_dir)},
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "pids").exists() and (tmp_path / "seen").exists(), 90,
                 "a worker started by the warmed copy", agent)
    finally:
        agent.kill()
        agent.wait(10)
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    assert (tmp_path / "seen").read_text() == "calm"  # imported by the copy, not by the worker

    def gone() -> bool:
        return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)

    wait_for(gone, 20, "fork server, its copy and the worker to die with the agent")
