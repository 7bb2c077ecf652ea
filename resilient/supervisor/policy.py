"""Loading a policy file (``--policy FILE``, ``resilient policy check FILE``).

A policy file is plain Python. The loader looks, in this order, for:

1. a module-level ``policy`` object with a ``decide`` method (``policy = MyPolicy(k=5)``): used as is;
2. a module-level function ``decide(event, view)``: used as is;
3. exactly one class defined in the file with a ``decide`` method: instantiated without arguments
   (``__init__`` may take none, or only arguments with defaults); it may keep state between calls.

Policy files import what they need from :mod:`resilient.supervisor.api` (actions, ``JobView``,
``NodeState``) and :mod:`resilient.events.api` (``EventKind``); to extend the default behaviour, subclass
:class:`resilient.supervisor.default_policy.DefaultPolicy`. A file that cannot be compiled or run, or
that offers no ``decide``, raises :class:`PolicyError` naming the file and line.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

from resilient.supervisor.api import Policy, PolicyError
from resilient.supervisor.default_policy import DefaultPolicy

logger = logging.getLogger(__name__)


class _FunctionPolicy:
    def __init__(self, fn: Any, name: str) -> None:
        self._fn = fn
        self.name = name

    def decide(self, event: Any, view: Any) -> Any:
        return self._fn(event, view)

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def default_policy() -> Policy:
    return DefaultPolicy()


def _where(path: Path, exc: BaseException) -> str:
    """``file:line`` of the innermost frame inside the policy file (or of the syntax error)."""
    if isinstance(exc, SyntaxError):
        return f"{path}:{exc.lineno}"
    line = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(fr.filename) == os.path.abspath(path):
            line = fr.lineno
    return f"{path}:{line}" if line is not None else str(path)


def load_policy(path: str | os.PathLike[str]) -> Policy:
    p = Path(path)
    if not p.is_file():
        raise PolicyError(f"policy file {p} does not exist (pass a Python file defining decide(event, view))")
    try:
        source = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"policy file {p} cannot be read: {e}") from None
    try:
        code = compile(source, str(p), "exec")
    except SyntaxError as e:
        raise PolicyError(f"{_where(p, e)}: syntax error in the policy: {e.msg}") from None
    name = f"resilient_policy_{p.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(p))
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = str(p)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    try:
        exec(code, mod.__dict__)
    except Exception as e:  # noqa: BLE001 - whatever a policy's import does wrong, refuse it clearly
        sys.modules.pop(name, None)
        raise PolicyError(f"{_where(p, e)}: the policy failed while loading: {type(e).__name__}: {e}") from None
    obj = mod.__dict__.get("policy")
    if obj is not None and callable(getattr(obj, "decide", None)) and not inspect.isclass(obj):
        return obj
    fn = mod.__dict__.get("decide")
    if callable(fn) and not inspect.isclass(fn):
        return _FunctionPolicy(fn, p.name)
    classes = [v for v in mod.__dict__.values() if inspect.isclass(v) and v.__module__ == name
               and callable(getattr(v, "decide", None))]
    if len(classes) == 1:
        try:
            return classes[0]()
        except Exception as e:  # noqa: BLE001
            where = _where(p, e)
            code = getattr(classes[0].__init__, "__code__", None)
            if where == str(p) and code is not None and os.path.abspath(code.co_filename) == os.path.abspath(p):
                where = f"{p}:{code.co_firstlineno}"  # the signature is what is wrong
            raise PolicyError(f"{where}: the policy class {classes[0].__name__} cannot be created "
                              f"without arguments ({type(e).__name__}: {e}); or set policy = "
                              f"{classes[0].__name__}(...)") from None
    if len(classes) > 1:
        raise PolicyError(f"{p}: several policy classes ({', '.join(c.__name__ for c in classes)}); say which "
                          "with a module-level `policy = TheClass()`")
    raise PolicyError(f"{p}:1: no decide(event, view) in the policy: define a function decide, a class with a "
                      "decide method, or `policy = ...`")
