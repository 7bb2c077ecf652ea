"""Succession in the default set-up (every node's resilient-run on one --rdzv-endpoint, no standalone supervisor):
the node hosting the job's store and supervisor is lost (agent, fork server, workers SIGKILLed, its local tier
deleted), another node takes both over from the plan every agent holds, the spare takes the lost node's place, and
the run ends bit-exact; with real agents, real SIGKILL, real stores."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from .conftest import wait_for
from .test_node_loss import GATE_STEP, NPROC, STEPS, WORLD, _listening, assert_same, at_gate, final, node_name
from .test_node_loss import reference_world  # noqa: F401 - the fixture

LATE_GATE = 7
# INFO: an agent's line naming the succession it read is how the test knows the spare is a candidate before the kill
ENV = {"RESILIENT_LOG_LEVEL": "INFO"}


def _knows(node, *names: str) -> bool:
    return any("succession: " in line and all(n in line for n in names) for line in node.text().splitlines())


def _start(c, args: list[str]):
    """The host (it binds the endpoint first), node b, and the spare once both train."""
    host = c.start("host", args, env=ENV)
    wait_for(lambda: _listening(c.port) or host.proc.poll() is not None, 60, "the first agent to host the store")
    b = c.start("b", args, env=ENV)
    wait_for(lambda: len({e.node for e in c.events() if e.kind == EventKind.ATTEMPT_START}) == 2
             or host.proc.poll() is not None or b.proc.poll() is not None, 90, "every node's workers to start")
    return host, b, c.start("spare", args, env=ENV)


def _first_step_after(evs: list, attempt: int) -> float | None:
    """Wall time the first step of ``attempt`` ended (rank 0 writes the steps; each ends in an all-reduce, so every
    rank has stepped by then)."""
    walls = [e.wall for e in evs if e.kind == EventKind.STEP and e.attempt == attempt]
    return min(walls) if walls else None


@pytest.mark.timeout(420, func_only=True)
def test_hosting_node_lost_successor_takes_over_bit_exact(cluster_factory, tmp_path: Path, reference_world) -> None:  # noqa: F811
    node_timeout = 20.0  # not what detects the loss (closed connections do): a bound on a loaded machine's silences
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", str(node_timeout),
                                    "--heartbeat-timeout", "300"], nproc=NPROC)
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    # a second gate holds the job after the swap, for a node that joins after the succession to find it running
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP),
            str(LATE_GATE)]
    host, b, spare = _start(c, args)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 150,
             "the spare to join")
    # b takes over (first in the order): it must know the spare before the loss, to adopt it as the job's spare
    wait_for(lambda: _knows(b, node_name(b), node_name(spare)), 30, "node b to read a succession naming the spare")
    t_kill = time.time()
    host.kill()  # the hosting node: agent (with the supervisor and the store), fork server, workers, local disk
    wait_for(lambda: any(e.kind == EventKind.AGENT_LOST and e.node == node_name(host) for e in c.events())
             or b.proc.poll() is not None, 60, "the successor to decide on the lost host")
    (gate / "go").touch()
    wait_for(lambda: at_gate(gate, WORLD, f"-{LATE_GATE}") or b.proc.poll() is not None, 120,
             "the job to train on after the swap")
    # a brand-new node knows only --rdzv-endpoint, whose host is gone: the successor serves a pointer there (it can
    # bind that address: one machine here), and the node joins the job where it is now, as a spare
    late = c.start("late", args, env=ENV)
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(late) for e in c.events())
             or late.proc.poll() is not None, 150, "the late node to join the job")
    (gate / f"go-{LATE_GATE}").touch()
    wait_for(lambda: all(n.proc.poll() is not None for n in (b, spare, late)), 240, "the job to end")
    assert b.proc.returncode == 0, b.output()
    assert spare.proc.returncode == 0, spare.output()
    assert late.proc.returncode == 0, late.output()
    assert "the job moved to" in late.text(), late.output()
    evs = c.events()
    taken = [e for e in evs if e.kind == EventKind.LOG and "succession" in e.details]
    assert len(taken) == 1, [e.details for e in taken]
    assert taken[0].details["succession"]["from"] == node_name(host)
    assert taken[0].details["succession"]["to"] == node_name(b)
    swaps = [e for e in evs if e.kind == EventKind.ACTION and e.details.get("action") == "hot_swap"]
    assert len(swaps) == 1, [e.details for e in evs if e.kind == EventKind.ACTION]
    assert swaps[0].details["action_args"] == {**swaps[0].details["action_args"], "node": node_name(host),
                                               "spare": node_name(spare)}
    assert not [e for e in evs if e.kind == EventKind.ACTION and e.details.get("action") in ("restart", "stop")]
    # the spare got the lost host's ranks and restored its shards from a surviving tier
    spare_starts = [e for e in evs if e.kind == EventKind.ATTEMPT_START and e.node == node_name(spare)]
    host_ranks = {r for e in evs if e.kind == EventKind.ATTEMPT_START and e.node == node_name(host)
                  for r in e.details["pids"]}
    assert len(host_ranks) == NPROC and spare_starts and set(spare_starts[0].details["pids"]) == host_ranks
    restores = [e for e in evs if e.kind == EventKind.CKPT_RESTORE and e.node == node_name(spare)]
    assert restores and restores[-1].details["step"] == GATE_STEP
    assert_same(reference_world, final(out, WORLD))
    # node loss -> the first step after (the gate held the survivors until the loss was decided: the figure
    # counts the decision, the new round's start and its restore, not a training step's length)
    first = _first_step_after(evs, spare_starts[0].attempt if spare_starts[0].attempt is not None
                              else spare_starts[0].details["attempt"])
    assert first is not None, [e for e in evs if e.kind == EventKind.STEP][-8:]
    print(f"\nnode loss -> first step after: {first - t_kill:.2f} s (goal <= --node-timeout + 2 = "
          f"{node_timeout + 2:g} s)")
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")


@pytest.mark.timeout(420, func_only=True)
def test_successor_takes_over_though_the_files_the_job_started_with_changed(
        cluster_factory, tmp_path: Path, reference_world) -> None:  # noqa: F811
    """The policy file and the job's secret file were read when every agent started; before the hosting node is
    lost, the policy is edited into a syntax error and the secret file removed (a Secret remounted, say). The
    successor takes the job over all the same: the secret it holds signs on, the default policy decides in place of
    the one it cannot load (a hot swap to the spare), the ``action`` event's ``fallback`` says why, and the run ends
    bit-exact."""
    policy, secret = tmp_path / "policy.py", tmp_path / "secret"
    policy.write_text((Path(__file__).resolve().parents[2] / "policies" / "hot_swap_first.py").read_text())
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    c = cluster_factory("2", flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout", "20",
                                    "--heartbeat-timeout", "300", "--policy", str(policy),
                                    "--job-secret-file", str(secret)], nproc=NPROC)
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP)]
    host, b, spare = _start(c, args)
    wait_for(lambda: at_gate(gate, WORLD), 90, "every rank at the gate")
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events()), 150,
             "the spare to join")
    wait_for(lambda: _knows(b, node_name(b), node_name(spare)), 30, "node b to read a succession naming the spare")
    policy.write_text("def decide(event, view)\n    return None\n")  # edited while the job runs: no longer loads
    secret.unlink()
    host.kill()
    wait_for(lambda: any(e.kind == EventKind.ACTION and e.details.get("action") == "hot_swap" for e in c.events())
             or b.proc.poll() is not None, 90, "the successor to decide on the lost host")
    (gate / "go").touch()
    wait_for(lambda: all(n.proc.poll() is not None for n in (b, spare)), 240, "the job to end")
    assert b.proc.returncode == 0, b.output()
    assert spare.proc.returncode == 0, spare.output()
    evs = c.events()
    swaps = [e.details for e in evs if e.kind == EventKind.ACTION and e.details.get("action") == "hot_swap"]
    assert len(swaps) == 1, [e.details for e in evs if e.kind == EventKind.ACTION]
    fallback = str(swaps[0].get("fallback"))
    assert "could not be loaded when this supervisor started" in fallback and "syntax error" in fallback, swaps[0]
    assert f"{policy}:1" in fallback, swaps[0]  # names the file and the line
    assert "cannot be loaded by this supervisor" in b.text(), b.output()
    assert_same(reference_world, final(out, WORLD))
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
