"""Goodput accounting: ledger → report (:func:`report_for_run`), checkpoint-interval tuning
(:class:`IntervalTuner`), live Prometheus metrics (:class:`MetricsServer`). Parts load on first use."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Badput": "resilient.goodput.api",
    "GoodputReport": "resilient.goodput.api",
    "AttemptReport": "resilient.goodput.api",
    "GoodputError": "resilient.goodput.api",
    "compute_report": "resilient.goodput.calculator",
    "report_for_run": "resilient.goodput.calculator",
    "IntervalTuner": "resilient.checkpoint.save.interval",
    "MetricsServer": "resilient.goodput.metrics",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'resilient.goodput' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
