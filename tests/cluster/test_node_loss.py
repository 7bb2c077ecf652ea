"""A node lost for good, handled by the supervisor's policy: hot swap to a warm spare, or scale down; with the
real launcher, real agents (each in its own session), real SIGKILL of a whole node and its local disk."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient.events.api import EventKind
from .conftest import REPO, TRAIN, child_env, wait_for

STEPS = 10
GATE_STEP = 4


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def final(out: Path, world: int) -> list[dict]:
    """Each rank's model and optimizer at the end (what must be bit-exact)."""
    out_ = []
    for r in range(world):
        d = torch.load(out / f"rank{r}.pt", weights_only=False)
        out_.append({"model": d["model"], "optim": d["optim"]})
    return out_


def assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"keys differ at {where}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"lengths differ at {where}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{a!r} != {b!r} at {where}"


NPROC = 2  # workers per node in the cluster tests (8 on a real node)
WORLD = 2 * NPROC  # the two-node jobs' world


def _reference(tmp_path_factory: pytest.TempPathFactory, world: int, extra: tuple[str, ...] = ()) -> list[dict]:
    base = tmp_path_factory.mktemp(f"ref{world}")
    # not a test of hang detection: a save stretched past the learned 1 s by a loaded machine must not stop it
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", str(world),
                        "--heartbeat-timeout", "300",
                        "--run-dir", str(base / "run"), "--ckpt-local", str(base / "ckpt"), str(TRAIN),
                        "--steps", str(STEPS), "--out", str(base / "out"), *extra],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return final(base / "out", world)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same job, two ranks, never interrupted."""
    return _reference(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def reference_world(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same job, ``WORLD`` ranks (two nodes of ``NPROC`` workers), never interrupted: one run for every
    module that imports it, bounded on its own (the tests that use it time their calls only)."""
    return _reference(tmp_path_factory, WORLD)


def at_gate(gate: Path, world: int, tag: str = "") -> bool:
    """Every rank waits at the gate (``tag``: ``-S`` for a later gate step S)."""
    return all((gate / f"at{tag}-{r}").exists() for r in range(world))


def _start_job(c, args: list[str], names=("a", "b")):
    first = c.start(names[0], args)
    wait_for(lambda: _listening(c.port) or first.proc.poll() is not None, 60, "the first agent to host the store")
    nodes = [first] + [c.start(n, args) for n in names[1:]]
    wait_for(lambda: len({e.node for e in c.events() if e.kind == EventKind.ATTEMPT_START}) == len(names)
             or any(n.proc.poll() is not None for n in nodes), 90, "every node's workers to start")
    return nodes


def node_name(n) -> str:
    return f"{socket.gethostname()}:{n.proc.pid}"


@pytest.mark.timeout(240, func_only=True)
def test_node_lost_hot_swap_to_warm_spare_is_bit_exact(cluster_factory, tmp_path: Path, reference_world) -> None:
    hot_swap_is_bit_exact(cluster_factory, tmp_path, reference_world, NPROC)


@pytest.fixture(scope="module")
def reference_eight(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same job on two nodes' worth of ranks with 8 workers a node (16), never interrupted."""
    return _reference(tmp_path_factory, 16)


@pytest.mark.timeout(480, func_only=True)
def test_nodes_of_eight_workers_hot_swap_is_bit_exact(cluster_factory, tmp_path: Path, reference_eight) -> None:
    """A GPU node's shape: 8 workers a node, a node of them lost, its 8 ranks restored on a spare from the
    partner's replica (each local rank's own shard, none mixed up), bit-exact."""
    hot_swap_is_bit_exact(cluster_factory, tmp_path, reference_eight, 8)


@pytest.fixture(scope="module")
def reference_fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same job sharded by FSDP2 over ``WORLD`` ranks, never interrupted."""
    return _reference(tmp_path_factory, WORLD, ("--fsdp",))


@pytest.mark.timeout(240, func_only=True)
def test_fsdp_node_lost_hot_swap_plans_from_the_rank_index_and_is_bit_exact(cluster_factory, tmp_path: Path,
                                                                           reference_fsdp) -> None:
    """The job users run: FSDP2 (every parameter and moment a ``Shard(0)`` DTensor), 2 workers a node, a node lost
    with its disk. The spare's ranks restore the lost node's shards from the partner's copy, planned from their own
    entries of ``.metadata`` (the rank index the partner's ranks hand them: the spare holds no manifest) without
    fetching the file, bit-exact."""
    hot_swap_is_bit_exact(cluster_factory, tmp_path, reference_fsdp, NPROC, ("--fsdp",))
    for r in range(WORLD):  # every rank restored the layout it saved: none parsed the whole .metadata, nor
        # fetched it (the spare holds none) or read it at all
        res = torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)["restore"]
        assert "index" in res["phases"] and "metadata" not in res["phases"], (r, res["phases"])
        assert ".metadata" not in res["sources"], (r, res["sources"])


def hot_swap_is_bit_exact(cluster_factory, tmp_path: Path, reference: list[dict], nproc: int,
                          extra: tuple[str, ...] = ()) -> None:
    world = 2 * nproc
    # the gate is a pause, not a hang: with the learned hang timeout (10 s) the wait for the spare's start-up
    # under load was taken for a hang, and a restart came before the swap
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "20",
                                    "--heartbeat-timeout", "300"], nproc=nproc)
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP), *extra]
    a, b = _start_job(c, args)
    spare = c.start("spare", args)  # joins mid-run: must not disturb the job
    wait_for(lambda: at_gate(gate, world), 60 + 10 * nproc, "every rank at the gate")
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 60,
             "the spare to join")
    b.kill()  # the whole node: agent, fork server, workers, local disk
    # the survivors stay at the gate until the loss is known: released earlier, a's next collective fails and
    # its report can reach the supervisor before the closed connection does (a restart, then the swap)
    wait_for(lambda: any(e.kind == EventKind.AGENT_LOST and e.node == node_name(b) for e in c.events()), 60,
             "the supervisor to see node b lost")
    (gate / "go").touch()
    wait_for(lambda: a.proc.poll() is not None and spare.proc.poll() is not None, 150, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert spare.proc.returncode == 0, spare.output()
    evs = c.events()
    swaps = [e for e in evs if e.kind == EventKind.ACTION and e.details.get("action") == "hot_swap"]
    assert len(swaps) == 1, [e.details for e in evs if e.kind == EventKind.ACTION]
    assert swaps[0].details["action_args"]["node"] == node_name(b)
    assert swaps[0].details["action_args"]["spare"] == node_name(spare)
    # no round started before the lost node was replaced: the loss was seen at once (connection closed)
    assert not [e for e in evs if e.kind == EventKind.ACTION and e.details.get("action") == "restart"]
    lost = [e for e in evs if e.kind == EventKind.AGENT_LOST]
    assert lost and lost[0].node == node_name(b) and lost[0].details["reason"] == "disconnected"
    # the spare's workers got the lost node's ranks and restored its shards from a surviving tier
    spare_starts = [e for e in evs if e.kind == EventKind.ATTEMPT_START and e.node == node_name(spare)]
    b_ranks = {r for e in evs if e.kind == EventKind.ATTEMPT_START and e.node == node_name(b) for r in e.details["pids"]}
    assert len(b_ranks) == nproc and spare_starts and set(spare_starts[0].details["pids"]) == b_ranks
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(spare)]
    assert restores and restores[-1].details["step"] == GATE_STEP and restores[-1].details["tier"] in ("peer", "persistent")
    # each of the lost node's ranks restored the gate's step on the spare, none from the spare's own (empty) disk
    assert {str(e.rank) for e in restores} == {str(r) for r in b_ranks}, [(e.rank, e.details) for e in restores]
    assert all(e.details["step"] == GATE_STEP and "local" not in e.details.get("sources", ()) for e in restores)
    assert_same(reference, final(out, world))
    # every node measured its clock against the supervisor's host when it joined (one host here: ~0)
    joined = [e for e in evs if e.kind == EventKind.RENDEZVOUS_DONE]
    assert {e.node for e in joined} == {node_name(a), node_name(b), node_name(spare)}
    assert all(abs(e.details["clock_offset"]) <= e.details["clock_rtt"] / 2 + 0.05 for e in joined), joined
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


def consumed_rows(out: Path) -> list[int]:
    """The samples the job trained on: for every step, those of the last attempt that ran it."""
    import json

    by_step: dict[int, tuple[int, list[int]]] = {}
    lines = [json.loads(x) for f in out.glob("rows-*.jsonl") for x in f.read_text().splitlines()]
    for d in sorted(lines, key=lambda d: d["attempt"]):
        att, idx = by_step.get(d["step"], (-1, []))
        if d["attempt"] > att:
            idx = []
        by_step[d["step"]] = (d["attempt"], idx + d["idx"])
    return [i for s in sorted(by_step) for i in by_step[s][1]]


@pytest.mark.timeout(420)
def test_scale_down_then_back_up_with_on_scale_and_exact_samples(cluster_factory, tmp_path: Path) -> None:
    """2 nodes of 2 workers → a node lost, no spare: continue on 1 (on_scale 4→2) → a repaired node joins: grow
    back to 2 nodes at the next checkpoint (on_scale 2→4); the sampler consumes every sample once, none skipped, none repeated."""
    import json

    from resilient.data import ResumableSampler

    # The gates are pauses this test makes, not hangs: with the hang timeout learned (10 s at least), a wait at a
    # gate under load (the repaired node's start-up) was taken for a hang; the restart restored past the gate and
    # the job ran to its end before the scale-up was carried out (attempt worlds [2, 2, 1, 1]). So: a fixed
    # heartbeat timeout longer than any gate, a restored attempt waits at its gate again, and a third gate holds
    # the job until the scale-up is carried out (it waits for a checkpoint boundary, which the job then reaches).
    # And the job starts on both nodes: under load the second agent's start-up outlasted the default last call
    # (30 s) and the job formed on one node (attempt worlds [1, 2, ...]); at MAX joined it forms at once anyway.
    c = cluster_factory("1:2", flags=["--max-restarts", "4", "--node-timeout", "20", "--heartbeat-timeout", "300",
                                      "--rdzv-conf", "last_call_timeout=300"], nproc=NPROC)
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    steps = 16
    args = ["--steps", str(steps), "--out", str(out), "--gate", str(gate), "--gate-step", "4", "8", "12",
            "--gate-on-resume", "--step-sleep", "0.05"]
    a, b = _start_job(c, args)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    b.kill()
    (gate / "go").touch()
    wait_for(lambda: at_gate(gate, NPROC, "-8") or a.proc.poll() is not None, 90, "the job to go on alone")
    evs = c.events()
    acts = [e.details["action"] for e in evs if e.kind == EventKind.ACTION]
    assert "scale_down" in acts, acts
    assert a.proc.poll() is None, f"node a exited ({a.proc.returncode}) instead of going on alone: {a.output()}"
    repaired = c.start("repaired", args)
    joined = lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(repaired) for e in c.events())  # noqa: E731
    wait_for(lambda: joined() or a.proc.poll() is not None or repaired.proc.poll() is not None, 90,
             "the repaired node to join")
    assert joined(), f"no join: node a {a.proc.poll()}, repaired {repaired.proc.poll()} (exit statuses; None: running)"
    (gate / "go-8").touch()
    wait_for(lambda: any(e.kind == EventKind.ACTION and e.details.get("action") == "scale_up"
                         and e.details.get("assignment") for e in c.events()) or a.proc.poll() is not None, 150,
             "the scale-up to be carried out")
    (gate / "go-12").touch()
    wait_for(lambda: a.proc.poll() is not None and repaired.proc.poll() is not None, 150, "the job to end")
    assert a.proc.returncode == 0, a.output()
    assert repaired.proc.returncode == 0, repaired.output()
    evs = c.events()
    acts = [e.details for e in evs if e.kind == EventKind.ACTION]
    kinds = [d["action"] for d in acts]
    assert kinds.count("scale_down") == 1 and "scale_up" in kinds, kinds
    # carried out at the boundary, which rank 0's node (a, hosting the supervisor) forwards from its ledger files
    # (the supervisor reads no ledger), not after --scale-up-wait
    ups = [d for d in acts if d["action"] == "scale_up" and d.get("assignment")]
    assert ups and "checkpoint boundary" in str(ups[-1].get("reason")), ups
    worlds = [e.details["world_size"] for e in evs if e.kind == EventKind.ATTEMPT_START]
    assert worlds[0] == WORLD and NPROC in worlds and worlds[-1] == WORLD, worlds
    scale = [json.loads(x) for x in (out / "scale.jsonl").read_text().splitlines()]
    assert {(d["old"], d["new"]) for d in scale} == {(WORLD, NPROC), (NPROC, WORLD)}, scale
    assert {d["rank"] for d in scale if (d["old"], d["new"]) == (NPROC, WORLD)} == set(range(WORLD))
    rows = consumed_rows(out)
    assert len(rows) == len(set(rows)), "a sample was trained on twice"
    perm = ResumableSampler(4096, 1, 0, shuffle=True, seed=3).permutation()
    assert rows and sorted(rows) == sorted(perm[: len(rows)]), "a sample was skipped"
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
