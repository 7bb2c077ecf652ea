"""The scenario table against every shipped policy file, through a real SupervisorCore."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from resilient.supervisor.policy import load_policy
from resilient.supervisor.scenarios import SCENARIOS, check, run_scenario

POLICY_FILES = sorted((Path(__file__).resolve().parents[2] / "policies").glob("*.py"))


def test_every_shipped_policy_is_found() -> None:
    assert {p.stem for p in POLICY_FILES} >= {"default", "hot_swap_first", "scale_down_first", "evict_stragglers"}


def test_overrides_name_shipped_policies() -> None:
    names = {p.stem for p in POLICY_FILES}
    for sc in SCENARIOS:
        assert set(sc.overrides) <= names, sc.name


@pytest.mark.parametrize("policy_file", POLICY_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenario(policy_file: Path, scenario) -> None:
    out = run_scenario(scenario, load_policy(policy_file))
    problems = check(out, policy_file.stem)
    assert not problems, "\n".join(problems + [f"got: {d.action!r} fallback={d.fallback!r:.120}" for d in out.actions])


def test_fallback_keeps_the_traceback() -> None:
    sc = next(s for s in SCENARIOS if s.name == "policy_raises")
    out = run_scenario(sc, None)
    fb = out.actions[0].fallback
    assert fb is not None and "Traceback" in fb and "RuntimeError: policy bug on worker_exit" in fb


def test_hung_policy_thread_is_abandoned_then_released() -> None:
    sc = next(s for s in SCENARIOS if s.name == "policy_hangs")
    out = run_scenario(sc, None)
    assert "did not decide within 0.2 s" in out.actions[0].fallback
    # the runner releases the hung policy when the scenario ends: no thread outlives it for long
    for t in [t for t in threading.enumerate() if t.name == "resilient-policy"]:
        t.join(timeout=10)
        assert not t.is_alive()


def test_a_scenario_can_fail() -> None:
    """The checker is not vacuous: the default policy does not meet the straggler eviction expectation."""
    sc = next(s for s in SCENARIOS if s.name == "straggler_eviction")
    out = run_scenario(sc, load_policy(next(p for p in POLICY_FILES if p.stem == "default")))
    assert check(out, "evict_stragglers")
