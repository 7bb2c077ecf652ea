"""Replicas as the unit of elasticity, end to end: the GPT recipe in a 2-D configuration (FSDP2 over the
replicas, tensor parallelism over the 4 ranks of a replica of 2 nodes x 2 workers, gloo on CPU, fp32) on 4 real
agents, each its own session and local tier, ``--nodes-per-replica 2 --nnodes 2:4``, no spare. A node is lost
(SIGKILL of its session, its local tier deleted): its replica is dropped, its healthy partner benched as a spare,
and the job goes on at data-parallel size 1 with the same global batch; a fresh agent for the lost node makes a
replica again with the benched one and the job grows back to 2 replicas at a checkpoint boundary. Compared with
the same job never interrupted: the loss at every step within 1e-5 (relative), every sample of the epoch once.

The scenario is ``bench/replicas.py``'s, run through the bench's own ``main`` (its full scenario, with
``--node-timeout 20``): this test holds the scenario to the goal and checks that the bench reports every figure
the README quotes, in its JSON and its table."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from bench import replicas
from bench.replicas import Scenario


@pytest.mark.timeout(600)
def test_replica_lost_scales_down_and_back_with_same_losses_and_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # --node-timeout bounds detection only (a SIGKILLed agent's connection closes at once); 20 s as in the other
    # cluster tests, so that load on a 2-core machine (12 workers and 5 agents of this test alone) cannot reach it
    sc = Scenario(node_timeout=20.0)
    out = tmp_path / "replicas.json"
    # the bench's main in this process, not a child: a test stopped by its timeout still ends every agent the bench
    # started (their sessions are the bench's to close, in its finally)
    monkeypatch.setattr(sys, "argv", ["replicas.py", "--node-timeout", "20", "--out", str(out)])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    replicas.main()
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["mode"] == "full" and doc["scenario"] == {**doc["scenario"], "nproc": 2, "nodes": 4,
                                                         "nodes_per_replica": 2, "node_timeout": 20.0}, doc["scenario"]
    ref, run = doc["reference"], doc["run"]
    assert ref["ok"], ref.get("error") or ref.get("log_tail")
    tails = "\n".join(f"== {k}\n{v}" for k, v in (run.get("log_tail") or {}).items())
    assert run["ok"], f"{run.get('error')} exit codes {run.get('exit_codes')}\n{tails}"
    acts = run["actions"]
    assert acts.count("scale_down") == 1 and "scale_up" in acts, acts
    # 2 replicas, then 1, then 2 again (the recipe's per-step records, in the order written)
    assert run["dp_sizes"] == [2, 1, 2], run["dp_sizes"]
    # the broken replica's healthy node was benched, and on_scale was told the sizes and why
    assert len(run["benched"]) == 1 and run["benched"][0]["reason"], run["benched"]
    scales = {(d["old_dp_size"], d["new_dp_size"]) for d in run["scale_events"]}
    assert scales == {(2, 1), (1, 2)}, run["scale_events"]
    assert all(d.get("reason") for d in run["scale_events"]), run["scale_events"]
    assert 0 < run["loss_to_first_step_s"] <= sc.node_timeout + 2.0, run["loss_to_first_step_s"]
    # the same global batch at every size, every sample of the epoch exactly once
    s = run["samples"]
    assert s["expected"] == sc.samples and s["step_batches"] == [sc.global_batch], s
    assert (s["seen"], s["duplicates"], s["missing"]) == (sc.samples, 0, 0), s
    assert ref["samples"]["seen"] == sc.samples
    assert set(run["losses"]) == set(ref["losses"]) and len(ref["losses"]) == sc.steps
    dev = doc["max_rel_loss_deviation"]
    assert dev is not None and dev <= 1e-5, (dev, run["losses"], ref["losses"])
    assert run["left_behind"] == 0
    # the figures the README quotes: the restore at the new size against a raw read of the same bytes
    assert run["restore"]["seconds"] > 0 and run["restore"]["bytes"] > 0, run["restore"]
    assert 0 < run["raw_read"]["bytes"] <= run["restore"]["bytes"], run["raw_read"]
    assert isinstance(doc["restore_vs_raw"], float) and doc["restore_vs_raw"] > 0, doc["restore_vs_raw"]
    for row in ("node loss -> first step", "restore / raw read", "max relative deviation", "samples per epoch"):
        assert row in printed, printed
