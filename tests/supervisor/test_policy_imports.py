"""A policy sees only the policy contract: ``resilient.supervisor.api`` and ``resilient.events.api``, plus
``resilient.supervisor.default_policy`` (itself built on those two) to extend the default."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = {"resilient.supervisor.api", "resilient.events.api"}
ALLOWED = CONTRACT | {"resilient.supervisor.default_policy"}


def package_imports(path: Path) -> set[str]:
    """Every ``resilient`` module a file imports, at any depth of its code."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return {m for m in out if m == "resilient" or m.startswith("resilient.")}


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.py")), ids=lambda p: p.stem)
def test_a_shipped_policy_imports_only_the_contract(path: Path) -> None:
    assert package_imports(path) <= ALLOWED, package_imports(path) - ALLOWED


def test_the_default_policy_is_built_on_the_contract_alone() -> None:
    path = ROOT / "resilient" / "supervisor" / "default_policy.py"
    assert package_imports(path) <= CONTRACT, package_imports(path) - CONTRACT


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "p.py"
    bad.write_text("def decide(event, view):\n    from resilient.supervisor.core import SupervisorCore\n")
    assert package_imports(bad) - ALLOWED == {"resilient.supervisor.core"}
