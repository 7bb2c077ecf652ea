"""Retention: which steps of a tier to keep. The choice is a pure function (``to_delete``); ``retain``
applies it to a tier and never raises (a failed clean-up is logged; training goes on)."""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

logger = logging.getLogger(__name__)


def to_delete(steps: dict[int, bool], keep: int, pinned_from: int | None = None,
              drop_newer_partial: bool = False) -> list[int]:
    """Steps to delete from a tier holding ``steps`` (step -> committed): all but the newest ``keep``
    committed steps and abandoned partial steps.

    Partial steps newer than the newest committed one stay (they may be being written right now) unless
    ``drop_newer_partial`` (at restore, nothing is writing); ``pinned_from``: steps >= this are still to
    be uploaded by some rank and stay.
    """
    committed = sorted(s for s, c in steps.items() if c)
    if not committed:
        return sorted(steps) if drop_newer_partial else []
    keep_set = set(committed[-keep:])
    newest = committed[-1]
    out = []
    for s in sorted(steps):
        if s in keep_set or (s >= newest and not (drop_newer_partial and not steps[s])):
            continue
        if pinned_from is not None and s >= pinned_from:
            continue
        out.append(s)
    return out


def retain(tier: Any, keep: int, pinned_from: int | None = None, drop_newer_partial: bool = False) -> None:
    """Keep the newest ``keep`` committed steps of ``tier``; drop older ones and abandoned partial steps."""
    try:
        for s in to_delete(tier.steps(), keep, pinned_from, drop_newer_partial):
            tier.delete_step(s)
    except (Exception, CheckpointException) as e:
        logger.warning("retention on %s failed: %s", tier, e)
