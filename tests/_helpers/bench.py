"""The benchmark scripts under bench/, loaded as modules for tests that drive their pieces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def goodput_bench() -> ModuleType:
    """``bench/goodput.py``, loaded once per process."""
    name = "goodput_bench"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "goodput.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod
