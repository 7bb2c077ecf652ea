"""load_policy on real files: every accepted form, and a clear refusal naming file and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import PolicyError, Restart, Stop
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore
from resilient.supervisor.policy import default_policy, load_policy

HEADER = "from resilient.supervisor.api import Restart, Stop\n"


def write(tmp_path: Path, body: str, name: str = "p.py") -> Path:
    p = tmp_path / name
    p.write_text(HEADER + textwrap.dedent(body))
    return p


def crash() -> Event:
    return Event(kind=EventKind.WORKER_EXIT, node="a", attempt=0, details={"exit_code": 1})


def decide(policy) -> object:
    core = SupervisorCore(SupervisorConfig(min_nodes=1, max_nodes=1, nproc_per_node=1), policy)
    core.join("a", 1, 0.0)
    core.form(0.0)
    (d,) = core.handle(crash(), 1.0)
    assert d.fallback is None, d.fallback
    return d.action


def test_function(tmp_path: Path) -> None:
    p = write(tmp_path, "def decide(event, view):\n    return Stop(reason='fn ' + event.node)\n")
    assert decide(load_policy(p)) == Stop(reason="fn a")


def test_class_is_instantiated_and_keeps_state(tmp_path: Path) -> None:
    p = write(tmp_path, """
        class Counting:
            def __init__(self):
                self.calls = 0
            def decide(self, event, view):
                self.calls += 1
                return Restart(reason=str(self.calls))
        """)
    pol = load_policy(p, isolated=False)
    assert decide(pol) == Restart(reason="1") and pol.calls == 1


def test_isolated_class_keeps_state_between_calls(tmp_path: Path) -> None:
    """A policy file runs in one long-lived process: its state survives from one decision to the next."""
    p = write(tmp_path, """
        class Counting:
            def __init__(self):
                self.calls = 0
            def decide(self, event, view):
                self.calls += 1
                return Restart(reason=str(self.calls))
        """)
    with load_policy(p) as pol:
        assert [decide(pol) for _ in range(3)] == [Restart(reason=str(i)) for i in (1, 2, 3)]


def test_module_level_policy_object_wins(tmp_path: Path) -> None:
    p = write(tmp_path, """
        class A:
            def __init__(self, k):
                self.k = k
            def decide(self, event, view):
                return Stop(reason=f"k={self.k}")
        class B(A):
            pass
        policy = B(7)
        """)
    assert decide(load_policy(p)) == Stop(reason="k=7")


def test_shipped_default_is_the_default() -> None:
    root = Path(__file__).resolve().parents[2]
    assert type(load_policy(root / "policies" / "default.py", isolated=False)) is type(default_policy())


@pytest.mark.parametrize("body,line,words", [
    ("def decide(event, view):\n    return Restart()\n\nx = = 1\n", 5, "syntax error"),
    ("x = 1\n", 1, "no decide"),
    ("import no_such_module_here\n", 2, "ModuleNotFoundError"),
    ("class P:\n    def __init__(self, k):\n        pass\n    def decide(self, e, v):\n        pass\n", 3,
     "cannot be created"),
])
def test_refused_with_file_and_line(tmp_path: Path, body: str, line: int, words: str) -> None:
    p = write(tmp_path, body)
    with pytest.raises(PolicyError) as ei:
        load_policy(p)
    msg = str(ei.value)
    assert f"{p}:{line}" in msg and words in msg and "\n" not in msg


def test_several_classes_need_a_choice(tmp_path: Path) -> None:
    p = write(tmp_path, "class A:\n    def decide(s, e, v): pass\nclass B:\n    def decide(s, e, v): pass\n")
    with pytest.raises(PolicyError, match="policy = TheClass"):
        load_policy(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.py")
