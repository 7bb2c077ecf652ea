"""Names of a step at rest: the step directory (``step_00000042``) and each rank's manifest file."""

from __future__ import annotations

import logging

from resilient.checkpoint.api import MANIFEST_FMT, STEP_PREFIX


logger = logging.getLogger(__name__)


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
        return int(name[len(STEP_PREFIX):])
    return None


def manifest_name(rank: int) -> str:
    return MANIFEST_FMT.format(rank=rank)
