"""TensorBoard export of a run's goodput (``resilient goodput RUN_DIR --tensorboard DIR``), as Google's
ml-goodput-measurement offers: users already look there.

Scalars written (one event file per export, under ``DIR``):

* ``goodput/goodput``: goodput of the run up to each instant; ``goodput/productive_seconds`` and
  ``badput/<category>`` (every :class:`~resilient.goodput.api.Badput` value): seconds so far. The x axis
  (TensorBoard's step) is whole seconds since the run's first event, at most ``max_points`` of them.
* ``step/seconds``: each step record's wall time, at its training step number.
* ``summary/goodput`` and ``summary/badput_share/<category>``: the final figures, at the last step.

Needs the ``tensorboard`` package (``pip install 'resilient[tensorboard]'``); it is optional, so it is
imported only here, on use.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path

from resilient.events.api import Event
from resilient.goodput.api import CATEGORIES, PRODUCTIVE, GoodputReport
from resilient.goodput.columns import ReportInputs, StepPoints

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'resilient[tensorboard]'"


class TensorBoardUnavailable(RuntimeError):
    """The ``tensorboard`` package is not installed."""


def _writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises ImportError naming tensorboard when it is missing
        raise TensorBoardUnavailable(f"TensorBoard export needs the tensorboard package ({e}); "
                                     f"install it with: {INSTALL_HINT}") from None
    return SummaryWriter


def _sample_times(rep: GoodputReport, max_points: int) -> list[int]:
    """Whole seconds since the start at which the cumulative figures are written (the end always)."""
    total = max(0.0, rep.wall_seconds)
    last = max(1, math.ceil(total))
    stride = max(1, math.ceil(last / max(1, max_points - 1)))
    xs = list(range(0, last, stride))
    if not xs or xs[-1] != last:
        xs.append(last)
    return xs


def export(events: "Iterable[Event] | ReportInputs", rep: GoodputReport, logdir: str | os.PathLike[str], *,
           max_points: int = 500) -> Path:
    """Write the scalars of ``rep`` (computed from ``events``, or a
    :class:`~resilient.goodput.columns.ReportInputs` of them) to a new event file under ``logdir``."""
    SummaryWriter = _writer_class()
    out = Path(logdir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file; give a directory for the TensorBoard event files")
    t0 = rep.start_wall
    cats = (PRODUCTIVE, *CATEGORIES)
    segs = sorted(rep.timeline, key=lambda s: s.start)
    w = SummaryWriter(log_dir=os.fspath(out))
    try:
        acc = dict.fromkeys(cats, 0.0)
        j = 0
        partial: dict[str, float] = {}
        for x in _sample_times(rep, max_points):
            t = min(t0 + x, rep.end_wall)
            # whole segments before t, plus the part of the one t falls in (kept apart: it grows next time)
            while j < len(segs) and segs[j].end <= t:
                acc[segs[j].category] = acc.get(segs[j].category, 0.0) + segs[j].seconds
                j += 1
            partial = dict.fromkeys(cats, 0.0)
            if j < len(segs) and segs[j].start < t:
                partial[segs[j].category] = partial.get(segs[j].category, 0.0) + (t - segs[j].start)
            elapsed = t - t0
            prod = acc[PRODUCTIVE] + partial[PRODUCTIVE]
            w.add_scalar("goodput/goodput", prod / elapsed if elapsed > 0 else 0.0, x, walltime=t)
            w.add_scalar("goodput/productive_seconds", prod, x, walltime=t)
            for c in CATEGORIES:
                w.add_scalar(f"badput/{c}", acc.get(c, 0.0) + partial.get(c, 0.0), x, walltime=t)
        last_step = 0
        pts = StepPoints.of(events)
        for n, secs, wall in zip(pts.step.tolist(), pts.seconds.tolist(), pts.wall.tolist()):
            if math.isfinite(n):  # a record whose step is not a number is on no step axis
                w.add_scalar("step/seconds", secs, int(n), walltime=wall)
                last_step = max(last_step, int(n))
        w.add_scalar("summary/goodput", rep.goodput, last_step, walltime=rep.end_wall)
        wall = rep.wall_seconds or 1.0
        for c in CATEGORIES:
            w.add_scalar(f"summary/badput_share/{c}", rep.badput_seconds[c] / wall, last_step, walltime=rep.end_wall)
        w.flush()
    finally:
        w.close()
    logger.debug("TensorBoard scalars of the run written to %s", out)
    return out
