"""Command-line parsing: torchrun's flags in both spellings, PET_* variables, script flags passed through."""
import os

import pytest

from resilient.launcher.api import LaunchError, WorkerLaunchMethod
from resilient.launcher.args import parse
from tests.launcher.conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "dump_env.py")


def test_script_flags_pass_through_even_when_they_look_like_ours(tmp_path):
    cfg = parse(["--standalone", "--run-dir", str(tmp_path / "r"), SCRIPT, "--worker", "x", "--run-dir", "y", "-m"])
    assert cfg.command.args == ("--worker", "x", "--run-dir", "y", "-m")
    assert cfg.run_dir == str(tmp_path / "r")


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node"])
def test_both_spellings(tmp_path, spelling):
    cfg = parse([spelling, "3", "--max_restarts", "2", "--run_dir", str(tmp_path / "r"), "--ckpt_interval", "auto",
                 SCRIPT])
    assert (cfg.nproc_per_node, cfg.supervisor.max_restarts, cfg.ckpt_interval) == (3, 2, "auto")


def test_pet_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    cfg = parse(["--run-dir", str(tmp_path / "r"), SCRIPT])
    assert (cfg.nproc_per_node, cfg.supervisor.max_restarts) == (4, 7)


def test_elastic_nnodes_and_rendezvous(tmp_path):
    cfg = parse(["--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29500", "--rdzv-id", "job7",
                 "--rdzv-conf", "join_timeout=30,read_timeout=60", "--run-dir", str(tmp_path / "r"), SCRIPT])
    assert (cfg.supervisor.min_nodes, cfg.supervisor.max_nodes, cfg.rdzv_endpoint, cfg.run_id) == (2, 4, "head:29500", "job7")
    assert cfg.rdzv_configs == {"join_timeout": "30", "read_timeout": "60"}


def test_standalone_defaults(tmp_path):
    cfg = parse(["--standalone", "--run-dir", str(tmp_path / "r"), SCRIPT])
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("c10d", "localhost:0")
    assert cfg.launch_method == WorkerLaunchMethod.FORK_SERVER


@pytest.mark.parametrize("argv, needle", [
    (["--nnodes", "3:2", SCRIPT], "--nnodes"),
    (["--nnodes", "x", SCRIPT], "--nnodes"),
    (["--heartbeat-timeout", "0", SCRIPT], "--heartbeat-timeout"),
    (["--startup-timeout", "0", SCRIPT], "--startup-timeout"),
    (["--startup-timeout", "inf", SCRIPT], "--startup-timeout"),
    (["--startup-timeout", "nan", SCRIPT], "--startup-timeout"),
    (["--ckpt-persistent-every", "0", SCRIPT], "--ckpt-persistent-every"),
    (["--rdzv-conf", "novalue", SCRIPT], "--rdzv-conf"),
    (["--no-python", "-m", "x"], "--no-python and -m"),
    ([], "no training script"),
])
def test_rejections_name_the_problem(tmp_path, argv, needle):
    with pytest.raises(LaunchError, match=needle.replace("-", r"\-")):
        parse(["--run-dir", str(tmp_path / "r"), *argv])
    assert not (tmp_path / "r").exists()


def test_virtual_local_rank_env_like_torchrun(tmp_path, monkeypatch):
    """--virtual-local-rank: LOCAL_RANK=0 and one visible device per worker (no GPU needed to check the env)."""
    from resilient.launcher.api import NodeRole, NodeRound
    from resilient.launcher.workers import worker_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    cfg = parse(["--nproc-per-node", "2", "--virtual-local-rank", "--run-dir", str(tmp_path / "r"), SCRIPT])
    nr = NodeRound(round=0, role=NodeRole.ACTIVE, base_rank=0, world_size=2, group_rank=0, group_world_size=1)
    envs = [worker_env(cfg, nr, lr, 0, ("127.0.0.1", 1234), run_dir=tmp_path / "r", node="n", ckpt_local=None,
                       monitor_socket=None, drill_env={}) for lr in (0, 1)]
    assert [(e["LOCAL_RANK"], e["RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "0", "4"), ("0", "1", "5")]


def test_ckpt_compress_reaches_the_workers_through_the_config_not_the_agents_environment(tmp_path, monkeypatch):
    from resilient import env as renv
    from resilient.launcher.api import NodeRole, NodeRound
    from resilient.launcher.workers import worker_env

    monkeypatch.delenv(renv.CKPT_COMPRESS, raising=False)
    cfg = parse(["--nproc-per-node", "1", "--ckpt-compress", "bgzstd", "--run-dir", str(tmp_path / "r"), SCRIPT])
    assert cfg.ckpt_compress == "bgzstd" and renv.CKPT_COMPRESS not in os.environ
    nr = NodeRound(round=0, role=NodeRole.ACTIVE, world_size=1)
    env = worker_env(cfg, nr, 0, 0, ("127.0.0.1", 1234), run_dir=tmp_path / "r", node="n", ckpt_local=None,
                     monitor_socket=None, drill_env={})
    assert renv.WorkerEnv.from_env(env).ckpt_compress == "bgzstd"
    cfg = parse(["--nproc-per-node", "1", "--run-dir", str(tmp_path / "r"), SCRIPT])
    assert cfg.ckpt_compress is None


def test_ckpt_upload_process_reaches_the_workers_manager(tmp_path, monkeypatch):
    from resilient import env as renv
    from resilient.checkpoint.save.manager import CheckpointManager
    from resilient.launcher.api import NodeRole, NodeRound
    from resilient.launcher.workers import worker_env

    nr = NodeRound(round=0, role=NodeRole.ACTIVE, world_size=1)
    for flag, expect in ((["--ckpt-upload-process", "off"], False), (["--ckpt-upload-process", "on"], True),
                         ([], "auto")):
        cfg = parse(["--nproc-per-node", "1", *flag, "--run-dir", str(tmp_path / "r"), SCRIPT])
        env = worker_env(cfg, nr, 0, 0, ("127.0.0.1", 1234), run_dir=tmp_path / "r", node="n", ckpt_local=None,
                         monitor_socket=None, drill_env={})
        assert renv.WorkerEnv.from_env(env).ckpt_upload_process == (flag[1] if flag else "auto")
        monkeypatch.setenv(renv.CKPT_UPLOAD_PROCESS, env[renv.CKPT_UPLOAD_PROCESS])
        ck = CheckpointManager.from_env(local=str(tmp_path / "ck"))
        try:
            assert ck.config.upload_process == expect and type(ck.config.upload_process) is type(expect)
        finally:
            ck.close()
    with pytest.raises(LaunchError, match="--ckpt-upload-process.*invalid choice: 'maybe'"):
        parse(["--nproc-per-node", "1", "--ckpt-upload-process", "maybe", "--run-dir", str(tmp_path / "r"), SCRIPT])
    monkeypatch.setenv(renv.CKPT_UPLOAD_PROCESS, "maybe")
    with pytest.raises(ValueError, match="upload_process='maybe'.*--ckpt-upload-process auto\\|on\\|off"):
        CheckpointManager.from_env(local=str(tmp_path / "ck"))


@pytest.mark.parametrize("nnodes", ["x", "1:2:3", "2:1", "0"])
def test_both_commands_refuse_a_bad_nnodes_in_the_same_words(tmp_path, nnodes):
    from resilient.supervisor import standalone as S

    with pytest.raises(LaunchError) as agent:
        parse(["--nnodes", nnodes, "--run-dir", str(tmp_path / "r"), SCRIPT])
    with pytest.raises(Exception) as sup:
        S.parse(["--rdzv-endpoint", "127.0.0.1:29999", "--nnodes", nnodes, "--run-dir", str(tmp_path / "s")])
    assert str(agent.value) == str(sup.value) and str(agent.value).startswith("--nnodes must be N or MIN:MAX")


def test_numa_binding_reaches_each_worker_as_its_own_gpu(tmp_path, monkeypatch):
    """--numa-binding MODE: each worker is told MODE and its GPU, its own local rank (also under
    --virtual-local-rank, which renames LOCAL_RANK 0), as torchrun binds it; bad values are refused."""
    from resilient import env as renv
    from resilient.launcher import args as A
    from resilient.launcher.api import NodeRole, NodeRound
    from resilient.launcher.workers import worker_env

    monkeypatch.setattr(A, "_numa_binding_of", lambda mode: mode)  # this machine's torch is a CPU build
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg = parse(["--nproc-per-node", "2", "--numa-binding", "socket", "--virtual-local-rank",
                 "--run-dir", str(tmp_path / "r"), SCRIPT])
    nr = NodeRound(round=0, role=NodeRole.ACTIVE, base_rank=0, world_size=2, group_rank=0, group_world_size=1)
    envs = [worker_env(cfg, nr, lr, 0, ("127.0.0.1", 1234), run_dir=tmp_path / "r", node="n", ckpt_local=None,
                       monitor_socket=None, drill_env={}) for lr in (0, 1)]
    assert [renv.WorkerEnv.from_env(e).numa_binding for e in envs] == ["socket:0", "socket:1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
    cfg = parse(["--nproc-per-node", "1", "--run-dir", str(tmp_path / "r"), SCRIPT])
    env = worker_env(cfg, nr, 0, 0, ("127.0.0.1", 1234), run_dir=tmp_path / "r", node="n", ckpt_local=None,
                     monitor_socket=None, drill_env={})
    assert renv.NUMA_BINDING not in env
    for bad in ("nodes:0", "node:x", "node"):
        with pytest.raises(ValueError, match="numa_binding must be MODE:GPU"):
            renv.WorkerEnv(run_dir="r", run_id="i", node="n", node_rank=0, numa_binding=bad)


def test_numa_binding_on_a_cpu_build_of_torch_is_refused_before_anything_starts(tmp_path):
    """torch's NUMA binding finds each GPU's node through torch.cuda: with a CPU build of torch (this machine's)
    resilient-run refuses the flag at once, naming it and what to do (torchrun fails in its agent with a traceback);
    a mode torchrun does not know is refused by the parser."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--numa-binding", "node", "--run-dir", str(tmp_path / "r"), SCRIPT],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--numa-binding node" in r.stderr and "CPU build" in r.stderr and "Drop the flag" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--numa-binding", "nodes", SCRIPT],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--numa-binding" in r.stderr and "invalid choice" in r.stderr, r.stderr


def test_a_worker_that_cannot_be_bound_fails_naming_the_flag(tmp_path):
    """The worker side of --numa-binding (what a forked or spawned worker runs before the program): where torch's
    binding fails (here: no GPU), the worker ends at once with an error naming the flag and the GPU, and the program
    never runs."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    script = tmp_path / "prog.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {**os.environ, "RESILIENT_NUMA_BINDING": "node:0"}
    r = subprocess.run([sys.executable, "-m", "resilient.launcher.zygote", "--run", "script", str(script)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "resilient-run --numa-binding node: binding this worker to the CPUs of GPU 0 failed" in r.stderr, r.stderr
    assert not marker.exists()
