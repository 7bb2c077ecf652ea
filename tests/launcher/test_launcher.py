"""resilient-run on real worker processes: environment parity with torchrun, restarts, exits, signals."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from resilient.events import EventKind, read_events
from tests.launcher.conftest import launcher_cmd, leftovers, run_launcher, wait_for
from tests._helpers.gcs import free_port as _free_port

TORCHRUN_ENV = [
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE",
]
SAME_VALUE = ["RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
              "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
              "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
              "TORCHELASTIC_SIGNALS_TO_HANDLE"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", ["fork-server", "spawn"])
def test_workers_see_what_torchrun_gives_them(tmp_path, scripts, launch):
    a, b = tmp_path / "torchrun", tmp_path / "resilient"
    a.mkdir(), b.mkdir()
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", *flags, str(scripts / "dump_env.py"), str(a), "x"]
    r = subprocess.run(torchrun, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    r = run_launcher([*flags, "--worker-launch", launch, "--run-dir", str(tmp_path / "run"),
                      str(scripts / "dump_env.py"), str(b), "x"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        ta = json.loads((a / f"env_{rank}.json").read_text())
        tb = json.loads((b / f"env_{rank}.json").read_text())
        for k in TORCHRUN_ENV:
            assert (k in ta["env"]) == (k in tb["env"]), k
        for k in SAME_VALUE:
            assert ta["env"].get(k) == tb["env"].get(k), k
        assert tb["sum"] == ta["sum"] == 2.0
        assert tb["main"] == ta["main"] == "__main__"
        assert tb["argv"][2:] == ta["argv"][2:] == ["x"] and tb["argv"][0] == ta["argv"][0]
        assert tb["env"]["RESILIENT_RUN_DIR"] == str((tmp_path / "run").resolve())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rep", range(3))
def test_crash_restart_gloo_always_works(tmp_path, scripts, rep):
    out = tmp_path / "out"
    out.mkdir()
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", str(tmp_path / "run"),
                      str(scripts / "crash_once.py"), str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert json.loads((out / f"a1_r{rank}.json").read_text())["sum"] == 2.0
    kinds = [e.kind for e in read_events(tmp_path / "run")]
    assert kinds.count(EventKind.ATTEMPT_START) == 2
    exits = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.WORKER_EXIT]
    assert exits[0].rank == 1 and exits[0].details["signal"] == "SIGKILL"
    assert EventKind.RESTART in kinds and kinds[-1] == EventKind.RUN_END
    # the terminal names the failure as torchrun does: rank, pid, signal. The killed rank comes first; rank 0 may
    # be named after it when its barrier broke on the dead peer before the agent stopped it (seen under load)
    line = next(ln for ln in r.stderr.splitlines() if "restarting workers" in ln)
    assert re.search(r"WARNING resilient\.launcher\.agent: rank 1 \(local_rank: 1, pid: \d+\) failed \(signal: SIGKILL\)"
                     r"(; rank 0 \(local_rank: 0, pid: \d+\) failed \(exitcode: 1\): .*)?; restarting workers", line), line
    assert not leftovers(str(tmp_path))


@pytest.mark.timeout(120)
def test_restarts_exhausted_fail_like_torchrun(tmp_path, scripts):
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", str(tmp_path / "run"),
                      str(scripts / "exit_code.py"), "1"], cwd=tmp_path)
    assert r.returncode == 1
    assert "exit_code.py FAILED" in r.stderr and "ValueError: boom from rank 1" in r.stderr
    starts = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.ATTEMPT_START]
    # the same exception at the same frame twice in a row is a crash loop: the job stops before the budget is spent
    assert [e.attempt for e in starts] == [0, 1]
    assert "the same failure in attempts 0 and 1: ValueError: boom from rank 1" in r.stderr, r.stderr[-3000:]
    err = tmp_path / "run" / "logs" / "attempt_1" / "1" / "error.json"
    assert "boom from rank 1" in json.loads(err.read_text())["message"]["message"]
    assert not leftovers(str(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, needle", [
    (["--no-such-flag", "x.py"], "unrecognized arguments"),
    (["--nnodes", "0", "SCRIPT"], "--nnodes"),
    (["missing.py"], "missing.py' does not exist"),
    (["--policy", "nope.py", "SCRIPT"], "--policy 'nope.py' does not exist"),
    (["--run-dir", "/proc/forbidden/run", "SCRIPT"], "--run-dir"),
    (["--ckpt-interval", "often", "SCRIPT"], "--ckpt-interval"),
    (["-m", "no.such.module_xyz"], "module 'no.such.module_xyz' not found"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, scripts, argv, needle):
    argv = [str(scripts / "dump_env.py") if a == "SCRIPT" else a for a in argv]
    r = run_launcher(argv, cwd=tmp_path, timeout=50)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["obey", "ignore"])
def test_sigterm_is_forwarded_then_sigkill_after_term_timeout(tmp_path, scripts, mode):
    out = tmp_path / "out"
    out.mkdir()
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    p = subprocess.Popen(launcher_cmd("--standalone", "--nproc-per-node", "2", "--term-timeout", "1",
                                      "--run-dir", str(tmp_path / "run"), str(scripts / "wait_term.py"), str(out), mode),
                         cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all((out / f"ready_{r}").exists() for r in (0, 1)), 60, "workers ready")
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 1, err
    for r in (0, 1):
        assert (out / f"got_{r}").read_text() == "SIGTERM"
    kinds = [e.kind for e in read_events(tmp_path / "run")]
    assert EventKind.PREEMPTION_NOTICE in kinds
    assert not leftovers(str(tmp_path))


@pytest.mark.timeout(120)
def test_module_tee_and_local_ranks_filter(tmp_path, scripts):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hello.py").write_text("import os, sys\nprint('hello from', os.environ['RANK'])\nprint('err', os.environ['RANK'], file=sys.stderr)\n")
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "1",
                      "--run-dir", str(tmp_path / "run"), "-m", "mypkg.hello"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[default1]:hello from 1" in r.stdout and "hello from 0" not in r.stdout
    assert "[default1]:err 1" in r.stderr
    logs = tmp_path / "run" / "logs" / "attempt_0"
    assert (logs / "0" / "stdout.log").read_text() == "hello from 0\n"
    assert (logs / "1" / "stderr.log").read_text() == "err 1\n"


@pytest.mark.timeout(90)
def test_no_python_and_redirects(tmp_path):
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--no-python", "--redirects", "1",
                      "--run-dir", str(tmp_path / "run"), "sh", "-c", "echo rank=$RANK world=$WORLD_SIZE"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert (tmp_path / "run" / "logs" / "attempt_0" / str(rank) / "stdout.log").read_text() == f"rank={rank} world=2\n"


@pytest.mark.timeout(120)
def test_fork_server_refuses_unsafe_preload_and_falls_back(tmp_path, scripts):
    (tmp_path / "threaded.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    out = tmp_path / "out"
    out.mkdir()
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--preload", "threaded", "--max-restarts", "1",
                      "--run-dir", str(tmp_path / "run"), str(scripts / "crash_once.py"), str(out)], cwd=tmp_path,
                     env={"PYTHONPATH": str(tmp_path), "RESILIENT_LOG_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr
    assert "threads after imports" in r.stderr
    starts = [e for e in read_events(tmp_path / "run") if e.kind == EventKind.ATTEMPT_START]
    assert {e.details["method"] for e in starts} == {"SpawnStarter"}
    assert json.loads((out / "a1_r1.json").read_text())["sum"] == 2.0



@pytest.mark.timeout(180)
def test_two_agents_on_one_rendezvous_restart_together(tmp_path, scripts):
    """Two node agents of two workers each over loopback (c10d rendezvous); a worker on one node dies, both nodes
    restart."""
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    agents = [subprocess.Popen(launcher_cmd("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                                            "--max-restarts", "1", "--local-addr", "127.0.0.1",
                                            "--run-dir", str(tmp_path / "run"),
                                            str(scripts / "crash_once.py"), str(out)),
                               cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        results = [a.communicate(timeout=160) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], results
    for rank in range(4):
        assert json.loads((out / f"a1_r{rank}.json").read_text())["sum"] == 4.0
    evs = list(read_events(tmp_path / "run"))
    restarts = [e for e in evs if e.kind == EventKind.RESTART]
    assert len(restarts) == 2 and {e.node for e in restarts} == {e.node for e in evs if e.kind == EventKind.RUN_START}
    # the killed rank's node restarts for its own failure; the other for the plan, or for its own worker's failure
    # when that worker's barrier broke on the dead peer before the plan arrived (a race the agents cannot order)
    killed = next(e for e in evs if e.kind == EventKind.WORKER_EXIT and e.details.get("signal") == "SIGKILL")
    causes = {e.node: e.details["cause"] for e in restarts}
    assert causes.pop(killed.node) == "failed" and set(causes.values()) <= {"failed", "peer_failed"}, causes
    assert not leftovers(str(tmp_path))


@pytest.mark.timeout(90)
def test_sigkilled_agent_takes_its_workers_along(tmp_path, scripts):
    """A dead agent must not leave orphans: the fork server and its workers die with it."""
    out = tmp_path / "out"
    out.mkdir()
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    p = subprocess.Popen(launcher_cmd("--standalone", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                                      str(scripts / "wait_term.py"), str(out), "obey"),
                         cwd=tmp_path, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: all((out / f"ready_{r}").exists() for r in (0, 1)), 60, "workers ready")
        worker_pids = [int((out / f"ready_{r}").read_text()) for r in (0, 1)]
        p.kill()
        p.wait(10)
    finally:
        p.kill()
    import psutil

    def gone() -> bool:
        return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in worker_pids)

    wait_for(gone, 20, "workers to die with their agent")
    wait_for(lambda: not leftovers(str(tmp_path)), 20, "the fork server to exit")


@pytest.mark.timeout(120)
def test_nemo_run_argv_and_torchrun_shim(tmp_path):
    """The exact argv NeMo-Run's run.Torchrun gives torchrun, through the recipe's PATH shim."""
    from pathlib import Path

    pkg = tmp_path / "fakerunner"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fdl_runner.py").write_text(
        "import os, sys\nprint('runner', os.environ['RANK'], os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    shim_dir = Path(__file__).resolve().parents[2] / "recipes" / "nemo"
    env = {"PATH": f"{shim_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "RESILIENT_RUN_ARGS": f"--run-dir {tmp_path / 'run'} --max-restarts 1"}
    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "1234", "--nnodes", "1",
            "--nproc_per_node", "2", "--node-rank", "0", "--tee", "3", "-m", "fakerunner.fdl_runner", "-n", "job",
            "cfg.yaml"]
    e = dict(os.environ, **env)
    e.pop("OMP_NUM_THREADS", None)
    r = subprocess.run(["torchrun", *argv], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"[default{rank}]:runner {rank} 2 ['-n', 'job', 'cfg.yaml']" in r.stdout
    assert any(e.kind == EventKind.RUN_START for e in read_events(tmp_path / "run"))


@pytest.mark.timeout(120)
def test_gcs_emulator_switch_is_set_before_the_fork_server_imports_gcsfs(tmp_path, scripts):
    """gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT at import; the fork server imports it ahead of the workers."""
    out = tmp_path / "out"
    out.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys, gcsfs\n"
                     "json.dump({'var': os.environ.get('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'),\n"
                     "           'cls': gcsfs.GCSFileSystem.__module__}, open(sys.argv[1], 'w'))\n")
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    env["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"  # never contacted: only the import matters
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run(launcher_cmd("--standalone", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                                    "--ckpt-persistent", "gs://bucket/run", str(probe), str(out / "p.json")),
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((out / "p.json").read_text())
    assert got == {"var": "false", "cls": "gcsfs.core"}, got
