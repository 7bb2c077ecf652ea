"""The agent's exit rules, as pure functions: torchrun's codes, the preemption requeue code and the checkpoint
codes, each from what happened."""

from __future__ import annotations

import signal

import pytest

from resilient.launcher.api import (
    CKPT_FAILED_EXIT_CODE, NOT_DURABLE_EXIT_CODE, PREEMPTED_EXIT_CODE, Outcome, WorkerExit,
)
from resilient.launcher.exit import Ending, checkpoint_exit, exit_code, failure_summary, preempted_cleanly


def test_preempted_cleanly_needs_every_worker_and_at_least_one():
    assert preempted_cleanly({0: True, 1: True})
    assert not preempted_cleanly({0: True, 1: False})
    assert not preempted_cleanly({})


@pytest.mark.parametrize("sig,preempted,want", [
    (signal.SIGTERM, True, Ending(PREEMPTED_EXIT_CODE, "preempted")),
    (signal.SIGTERM, False, Ending(1, "signal SIGTERM")),
    (signal.SIGINT, True, Ending(1, "signal SIGINT")),  # only the scheduler's notice is a preemption
    (None, False, Ending(1, "signal SIGTERM")),
])
def test_a_signal_ends_like_torchrun_unless_the_workers_stopped_for_a_preemption(sig, preempted, want):
    assert exit_code(Outcome.STOPPED, None, signum=sig, preempted=preempted) == want


@pytest.mark.parametrize("plan,preempted,want", [
    ({"final": True}, False, Ending(0, "succeeded")),
    ({"final": True, "preempted": True}, False, Ending(PREEMPTED_EXIT_CODE, "preempted")),
    ({"final": True}, True, Ending(PREEMPTED_EXIT_CODE, "preempted")),
    ({"final": True, "stop": "restarts exhausted"}, True, Ending(1, "stopped by the supervisor: restarts exhausted")),
])
def test_the_final_plan_decides(plan, preempted, want):
    assert exit_code(Outcome.SUCCEEDED, plan, preempted=preempted) == want


def test_an_ending_that_is_no_signal_needs_the_final_plan():
    with pytest.raises(ValueError):
        exit_code(Outcome.SUCCEEDED, None)


def test_failed_saves_turn_a_success_into_74_and_nothing_else():
    new, line = checkpoint_exit(Ending(0, "succeeded"), ckpt_stop="disk full", not_durable=None, persistent=None)
    assert new == Ending(CKPT_FAILED_EXIT_CODE, "checkpoint saves failed: disk full") and "disk full" in line
    failed = Ending(1, "stopped by the supervisor: x")
    assert checkpoint_exit(failed, ckpt_stop="disk full", not_durable=(5, 3), persistent="gs://b") == (failed, None)


def test_a_step_not_on_the_persistent_tier_is_73_after_success_and_keeps_75_after_preemption():
    new, line = checkpoint_exit(Ending(0, "succeeded"), ckpt_stop=None, not_durable=(8, None), persistent="gs://b/r")
    assert new == Ending(NOT_DURABLE_EXIT_CODE, "succeeded, but step 8 is not durable")
    assert "newest there: none" in line and f"exit {NOT_DURABLE_EXIT_CODE}" in line
    new, line = checkpoint_exit(Ending(PREEMPTED_EXIT_CODE, "preempted"), ckpt_stop=None, not_durable=(8, 6),
                                persistent="gs://b/r")
    assert new == Ending(PREEMPTED_EXIT_CODE, "preempted; step 8 is not durable") and "newest there: 6" in line
    ok = Ending(0, "succeeded")
    assert checkpoint_exit(ok, ckpt_stop=None, not_durable=None, persistent="gs://b/r") == (ok, None)
    assert checkpoint_exit(ok, ckpt_stop=None, not_durable=(8, 6), persistent=None) == (ok, None)


def test_failure_summary_names_every_failed_rank_of_the_last_attempt():
    f = [WorkerExit(0, 0, 10, 1, 1.0, None, 0), WorkerExit(0, 0, 11, -9, 2.0, None, 1),
         WorkerExit(1, 1, 12, 3, 2.0, None, 1)]
    text = failure_summary("train.py", f)
    assert "train.py FAILED" in text
    assert "(pid: 11)" in text and "(pid: 12)" in text and "(pid: 10)" not in text  # attempt 0 was told already
    assert failure_summary("train.py", []) == "train.py FAILED (no worker failure recorded)"
