"""Overlapped staging (copy behind the next forward/backward) and interval='auto'.

To make the race certain rather than likely, staging is slowed down by a delay injected before each
tensor copy (the copy itself is the real one): without the guard hooks, the optimizer step that
follows ``save`` would land in the checkpoint.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.save import stage
from resilient.checkpoint.save.manager import CheckpointManager
from resilient.events.api import EventKind
from resilient.events.ledger import read_events

from .conftest import TRAIN, Workers, ok


def model_and_optim(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    return m, torch.optim.SGD(m.parameters(), lr=0.5)


def one_step(m, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    m.train()
    loss = m(torch.randn(16, 64, generator=g)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture
def slow_staging(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Staging thread sleeps 0.3 s before copying; the event is set once the first copy started."""
    started = threading.Event()
    orig = stage.Stager._stage_tensor

    def slow(self, fqn, t):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            started.set()
            time.sleep(0.3)
        return orig(self, fqn, t)

    monkeypatch.setattr(stage.Stager, "_stage_tensor", slow)
    return started


def snapshot(m) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def restore_into_fresh(path: Path, m: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    m = m if m is not None else model_and_optim(seed=9)[0]
    CheckpointManager(local=path, interval=1).restore({"model": m})
    return m.state_dict()


@pytest.mark.timeout(60)
def test_optimizer_step_and_bn_forward_after_save_do_not_leak(tmp_path: Path, slow_staging) -> None:
    m, opt = model_and_optim()
    one_step(m, opt, 0)
    before = snapshot(m)
    ck = CheckpointManager(local=tmp_path, interval=1, overlap=True)
    t0 = time.perf_counter()
    ck.save(0, {"model": m, "optim": opt})
    returned_after = time.perf_counter() - t0
    one_step(m, opt, 1)  # BN forward and optimizer step wait for staging, nothing else does
    ck.close()
    assert returned_after < 0.3  # save() did not do the (delayed) copy itself
    got = restore_into_fresh(tmp_path)
    for k in before:
        assert torch.equal(got[k], before[k]), f"{k} changed after save() leaked into the checkpoint"
    assert ck._guard.waited_s > 0


@pytest.mark.timeout(60)
def test_without_the_guard_the_mutation_would_leak(tmp_path: Path, slow_staging, monkeypatch) -> None:
    """Control: the test above is able to see a leak."""
    monkeypatch.setattr(stage.MutationGuard, "arm", lambda self: self._staged.clear())
    m, opt = model_and_optim()
    one_step(m, opt, 0)
    before = snapshot(m)
    ck = CheckpointManager(local=tmp_path, interval=1, overlap=True)
    ck.save(0, {"model": m, "optim": opt})
    one_step(m, opt, 1)
    ck.close()
    got = restore_into_fresh(tmp_path)
    assert any(not torch.equal(got[k], before[k]) for k in before)


@pytest.mark.timeout(60)
def test_forward_without_buffers_runs_during_staging(tmp_path: Path, slow_staging) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = snapshot(m)
    ck = CheckpointManager(local=tmp_path, interval=1, overlap=True)
    ck.save(0, {"model": m, "optim": opt})
    assert slow_staging.wait(10)
    loss = m(torch.randn(16, 64)).pow(2).sum()  # forward + backward: no buffers, no waiting
    loss.backward()
    waited_before_step = ck._guard.waited_s
    opt.step()  # this one waits
    ck.close()
    assert waited_before_step == 0 and ck._guard.waited_s > 0
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    got = restore_into_fresh(tmp_path, fresh)
    assert all(torch.equal(got[k], v) for k, v in before.items())


@pytest.mark.timeout(60)
def test_auto_interval_follows_the_tuner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RUN_DIR", str(tmp_path / "run"))
    ck = CheckpointManager(local=tmp_path / "ckpt", interval="auto", tuner_options={"prior_mtbf_s": 1.0})
    saved = []
    for s in range(60):
        time.sleep(0.002)
        if ck.save(s, {"t": torch.ones(1000)}):
            saved.append(s)
    ck.close()
    assert len(saved) >= 2
    evs = list(read_events(tmp_path / "run"))
    intervals = [e.details for e in evs if e.kind == EventKind.CKPT_INTERVAL]
    assert intervals and all(d["interval"] >= 1 and "inputs" in d for d in intervals)
    assert {e.details["step"] for e in evs if e.kind == EventKind.CKPT_SAVE} == set(saved)


@pytest.mark.timeout(120)
def test_two_ranks_auto_interval_and_overlap_resume(tmp_path: Path, workers: Workers) -> None:
    """Ranks with different step timings still save on the same steps (rank 0 decides, all follow)."""
    env = {"RESILIENT_RUN_DIR": str(tmp_path / "run")}
    args = ["--steps", "30", "--interval", "auto", "--overlap", "--local", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "out")]
    ok(workers.run(TRAIN, args, 2, env=env))
    ok(workers.run(TRAIN, [*args[:1], "34", *args[2:]], 2, env=env))
    r = [torch.load(tmp_path / "out" / f"rank{i}.pt", weights_only=False) for i in range(2)]
    assert r[0]["restore"]["step"] is not None
    assert r[0]["restore"]["step"] == r[1]["restore"]["step"] and r[0]["start"] == r[1]["start"]
