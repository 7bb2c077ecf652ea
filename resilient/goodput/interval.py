"""Moved to :mod:`resilient.checkpoint.interval` (checkpoint policy); kept importable here."""

from resilient.checkpoint.interval import (  # noqa: F401
    IntervalTuner,
    SaveCosts,
    background_spans,
    save_costs,
)

__all__ = ["IntervalTuner", "SaveCosts", "background_spans", "save_costs"]
