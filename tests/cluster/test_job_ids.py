"""``--rdzv-id`` names the job (torchrun's meaning): an agent of another id at a job's endpoint is refused, with
one line naming both ids on both sides, and exits instead of joining; two jobs on one machine, on one endpoint
one after the other or on two endpoints side by side, never see each other's store keys, ledgers or checkpoints,
and each ends with its own weights. Real agents, real workers, real gloo groups, one endpoint over loopback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from resilient.events.api import EventKind
from resilient.events.ledger import read_events
from resilient.supervisor import transport as T

from .conftest import wait_for
from .test_node_loss import GATE_STEP, STEPS, _start_job, assert_same, final, node_name, reference  # noqa: F401


def _started_from_scratch(out: Path) -> None:
    """The job restored nothing: it never read another job's checkpoint."""
    for r in (0, 1):
        d = torch.load(out / f"rank{r}.pt", weights_only=False)
        assert d["start"] == 0 and (d["restore"] or {}).get("step") is None, d["restore"]


def _job_nodes(run_dir: Path) -> set[str]:
    return {e.node for e in read_events(run_dir) if e.kind == EventKind.RUN_START}


@pytest.mark.timeout(420)
def test_an_agent_of_another_id_is_refused_and_each_job_ends_with_its_own_weights(cluster_factory, tmp_path: Path,
                                                                                 reference) -> None:
    # ranks wait at the gate while the other job's agent starts: no step, no heartbeat, and no hang either
    x = cluster_factory("2", flags=["--max-restarts", "2", "--heartbeat-timeout", "600"])  # --rdzv-id cluster
    gate, out = tmp_path / "gate", tmp_path / "out-x"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]
    a, b = _start_job(x, args)
    wait_for(lambda: (gate / "at-0").exists() and (gate / "at-1").exists(), 90, "both ranks at the gate")
    # job Y's agent, its own id, run directory, output and script arguments, at job X's endpoint
    y_run, y_out = tmp_path / "run-y0", tmp_path / "out-y0"
    y = x.start("y", ["--steps", "3", "--out", str(y_out)], extra=["--rdzv-id", "joby", "--run-dir", str(y_run)])
    wait_for(lambda: y.proc.poll() is not None, 120, "the agent of the other job to be refused")
    assert y.proc.returncode == 2, y.output()
    line = f"refused node {node_name(y)} of job 'joby': 127.0.0.1:{x.port} serves job 'cluster'"
    assert line in y.text(), y.output()
    y_end = [e for e in read_events(y_run) if e.kind == EventKind.RUN_END]
    assert y_end and y_end[0].details["exit_code"] == 2 and line in y_end[0].details["reason"]
    assert not any(e.kind == EventKind.ATTEMPT_START for e in read_events(y_run)) and not y_out.exists()
    # the serving side: one line naming both ids, and the job's ledger
    served = f"refused node {node_name(y)} of job 'joby': this endpoint serves job 'cluster'"
    wait_for(lambda: served in a.text() + b.text(), 30, "the refusal on the serving side")
    wait_for(lambda: any(e.kind == EventKind.LOG and e.details.get("refused_job") == "joby" for e in x.events()),
             30, "the refusal in job X's ledger")
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 150, "job X to end")
    assert [a.proc.returncode, b.proc.returncode] == [0, 0], a.output() + b.output()
    assert [e.details["action"] for e in x.events() if e.kind == EventKind.ACTION] == ["start"]
    assert _job_nodes(x.run_dir) == {node_name(a), node_name(b)}
    assert_same(reference, final(out, 2))
    wait_for(lambda: not x.leftovers(), 20, "no process of job X left")
    # job Y again on the same endpoint, now free: it trains its own run from step 0 and ends with its own weights
    yj = cluster_factory("2", flags=["--rdzv-id", "joby"], port=x.port)
    y_out = tmp_path / "out-y"
    c, d = _start_job(yj, ["--steps", str(STEPS), "--out", str(y_out)], names=("c", "d"))
    wait_for(lambda: c.proc.poll() is not None and d.proc.poll() is not None, 150, "job Y to end")
    assert [c.proc.returncode, d.proc.returncode] == [0, 0], c.output() + d.output()
    assert _job_nodes(yj.run_dir) == {node_name(c), node_name(d)}
    assert {e.details["run_id"] for e in read_events(yj.run_dir) if e.kind == EventKind.RUN_START} == {"joby"}
    _started_from_scratch(y_out)
    assert_same(reference, final(y_out, 2))
    wait_for(lambda: not yj.leftovers(), 20, "no process of job Y left")


@pytest.mark.timeout(420)
def test_two_jobs_side_by_side_share_nothing(cluster_factory, tmp_path: Path, reference) -> None:
    x = cluster_factory("2", flags=["--max-restarts", "2", "--heartbeat-timeout", "600"])
    y = cluster_factory("2", flags=["--max-restarts", "2", "--heartbeat-timeout", "600", "--rdzv-id", "joby"])
    gx, gy, ox, oy = tmp_path / "gate-x", tmp_path / "gate-y", tmp_path / "out-x", tmp_path / "out-y"
    gx.mkdir()
    gy.mkdir()

    def args(gate: Path, out: Path) -> list[str]:
        return ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]

    a, b = _start_job(x, args(gx, ox))
    c, d = _start_job(y, args(gy, oy), names=("c", "d"))
    wait_for(lambda: all((g / f"at-{r}").exists() for g in (gx, gy) for r in (0, 1)), 120, "both jobs at their gate")
    # each endpoint's store holds its own job's keys only
    for port, mine, other in ((x.port, "cluster", "joby"), (y.port, "joby", "cluster")):
        s = T.connect_store("127.0.0.1", port, 10.0)
        assert s.get(T.JOB_KEY).decode() == mine
        for key in ("presence", "term", "latest"):
            assert s.check([getattr(T.Keys(mine), key)]), key
            assert not s.check([getattr(T.Keys(other), key)]), key
        assert not s.check(["resilient/sv/presence"])  # no key outside a job's prefix
    (gx / "go").touch()
    (gy / "go").touch()
    wait_for(lambda: all(n.proc.poll() is not None for n in (a, b, c, d)), 180, "both jobs to end")
    assert [n.proc.returncode for n in (a, b, c, d)] == [0, 0, 0, 0], a.output() + c.output()
    # ledgers: each names its own nodes and id only
    assert _job_nodes(x.run_dir) == {node_name(a), node_name(b)}
    assert _job_nodes(y.run_dir) == {node_name(c), node_name(d)}
    for run_dir, rid in ((x.run_dir, "cluster"), (y.run_dir, "joby")):
        assert {e.details["run_id"] for e in read_events(run_dir) if e.kind == EventKind.RUN_START} == {rid}
    # checkpoints: each node's tier holds its own job's steps, and each job ends with its own weights
    for n in (a, b, c, d):
        assert sorted(p.name for p in n.local.iterdir() if p.name.startswith("step_")), n.name
    _started_from_scratch(ox)
    _started_from_scratch(oy)
    assert_same(reference, final(ox, 2))
    assert_same(reference, final(oy, 2))
    wait_for(lambda: not x.leftovers() and not y.leftovers(), 20, "no process of either job left")


def test_default_run_and_checkpoint_directories_are_keyed_by_the_job_id(tmp_path: Path, monkeypatch) -> None:
    """Without --run-dir and --ckpt-local, two ids on one machine get apart directories (runs/<id>/, and the
    local tier under it)."""
    from resilient.launcher.agent import Agent
    from resilient.launcher.args import parse

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    dirs = []
    for rid in ("jobx", "joby"):
        cfg = parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999",
                     "--rdzv-id", rid, str(script)])
        assert Path(cfg.run_dir) == Path("runs") / rid
        ag = Agent(cfg)
        try:
            local = Path(ag._default_ckpt_local())
        finally:
            ag.ledger.close()
        assert local.is_relative_to((tmp_path / "runs" / rid).resolve())
        dirs.append(local)
    assert dirs[0] != dirs[1] and socket.gethostname() in dirs[0].parts


def test_standalone_supervisor_rdzv_id_flag_and_its_environment_twin(monkeypatch) -> None:
    from resilient.supervisor import standalone as S

    base = ["--rdzv-endpoint", "127.0.0.1:29999", "--nnodes", "2", "--run-dir", "run"]
    monkeypatch.delenv("PET_RDZV_ID", raising=False)
    assert S.parse(base).rdzv_id is None  # the first agent's id is served
    assert S.parse(base + ["--rdzv-id", "job7"]).rdzv_id == "job7"
    monkeypatch.setenv("PET_RDZV_ID", "job8")
    assert S.parse(base).rdzv_id == "job8"
    assert S.parse(base + ["--rdzv-id", "job7"]).rdzv_id == "job7"
    assert S.main(base + ["--rdzv-id", "*"]) == S.EXIT_BAD_INPUT
