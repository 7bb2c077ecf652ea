"""The fetch plan and the gather helper, without processes."""

from __future__ import annotations

import pytest

from resilient.checkpoint.storage.collective import Ranks, RanksFailedError
from resilient.checkpoint.restore.plan import plan_fetch
from resilient.checkpoint.replicate.transfer import Transfer

SIZES = {"a": 1, "b": 2, "c": 3, "d": 4, ".metadata": 5}


def test_own_copies_are_read_in_place() -> None:
    p = plan_fetch([["a", ".metadata"], ["b", ".metadata"]], [["a", ".metadata"], ["b", ".metadata"]], SIZES, True)
    assert p.transfers == [] and p.downloads == {} and p.feasible


def test_a_lost_node_gets_its_files_from_the_partner_holding_them() -> None:
    # rank 1 lost its disk; rank 0's node holds rank 1's replica
    p = plan_fetch([["a"], ["b", ".metadata"]], [["a", "b", ".metadata"], []], SIZES, in_persistent=True)
    assert p.transfers == [Transfer(0, 1, ".metadata", 5), Transfer(0, 1, "b", 2)] and p.downloads == {}


def test_senders_are_balanced_and_ties_go_to_the_lowest_rank() -> None:
    p = plan_fetch([[], [], ["a", "b", "c", "d"]], [["a", "b", "c", "d"], ["a", "b", "c", "d"], []], SIZES, False)
    assert [t.src for t in p.transfers] == [0, 1, 0, 1]


def test_persistent_tier_fills_what_no_rank_holds_else_the_step_is_not_feasible() -> None:
    needs, have = [["a"], ["c"]], [["a"], []]
    assert plan_fetch(needs, have, SIZES, True).downloads == {1: ["c"]}
    p = plan_fetch(needs, have, SIZES, False)
    assert not p.feasible and p.missing == [(1, "c")]


def test_all_gather_raises_with_the_failure_on_the_failing_rank() -> None:
    ranks = Ranks(None, 0, 1, distributed=False)
    assert ranks.all_gather("x", lambda: 3) == [3]

    def boom() -> int:
        raise ValueError("disk on fire")

    with pytest.raises(ValueError, match="disk on fire"):
        ranks.all_gather("loading step 4", boom)


def test_run_keeps_the_result_on_this_rank() -> None:
    big = object()  # not picklable across ranks: only the outcome travels
    assert Ranks(None, 0, 1, distributed=False).run("x", lambda: big) is big


def test_retention_choice() -> None:
    from resilient.checkpoint.storage.retention import to_delete

    steps = {1: True, 2: False, 3: True, 4: True, 5: False}
    assert to_delete(steps, keep=2) == [1, 2]  # 5 may be being written
    assert to_delete(steps, keep=2, pinned_from=1) == []  # still to be uploaded
    assert to_delete(steps, keep=2, drop_newer_partial=True) == [1, 2, 5]
    assert to_delete({7: False}, keep=1) == [] and to_delete({7: False}, keep=1, drop_newer_partial=True) == [7]
