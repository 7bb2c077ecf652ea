"""The checkpoint package's layers, read from its source (every import, those inside functions too):
``api`` ← ``format`` ← ``storage`` ← ``replicate``, ``upload``, ``snapshot`` ← ``restore`` ← ``save`` ← the top modules.
A module imports only from layers below its own or from its own sub-package, and no modules import each
other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "resilient" / "checkpoint"
NAME = "resilient.checkpoint"

LAYER = {"api": 0, "format": 1, "storage": 2, "replicate": 3, "upload": 3, "snapshot": 3, "restore": 4, "save": 5}
TOP = 6  # cli, the manager alias: may import anything below


def _module(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([NAME, *parts])


def _unit(module: str) -> str:
    """The sub-package (or top module) a module of the package belongs to."""
    rest = module[len(NAME) + 1:].split(".") if module != NAME else [""]
    return rest[0]


def _layer(module: str) -> int:
    return LAYER.get(_unit(module), TOP)


def _edges() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in modules and t != mod:
                    edges[mod].add(t)
    return edges


def test_the_package_has_modules_in_every_layer() -> None:
    units = {_unit(m) for m in _edges()}
    assert set(LAYER) <= units, set(LAYER) - units


def test_imports_go_down_the_layers_only() -> None:
    wrong = []
    for mod, targets in _edges().items():
        for t in targets:
            same_unit = _unit(t) == _unit(mod) and _unit(mod) in LAYER
            if not same_unit and _layer(t) >= _layer(mod) and not mod.endswith("__init__"):
                wrong.append(f"{mod} -> {t}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circles() -> None:
    edges = _edges()
    state: dict[str, int] = {}
    path: list[str] = []
    circles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("broken", ["up", "circle"])
def test_the_checks_see_a_wrong_edge(broken: str) -> None:
    """The walk above is not vacuous: an upward edge and a circle, added to the real graph, are found."""
    edges = _edges()
    low, high = f"{NAME}.format.layout", f"{NAME}.save.manager"
    assert low in edges and high in edges
    if broken == "up":
        assert _layer(high) > _layer(low)
    else:
        edges[low].add(high)
        seen, todo = set(), [high]
        while todo:  # high reaches low through the real graph: adding low -> high closes a circle
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(edges[m])
        assert low in seen


def _trees() -> dict[str, ast.AST]:
    return {_module(p): ast.parse(p.read_text(), str(p)) for p in PKG.rglob("*.py")}


def test_the_commit_marker_has_one_writer() -> None:
    """Every tier's commit marker is written by one function (its body is the format restore trusts)."""
    writers = []
    for mod, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "write_bytes" \
                    and any(isinstance(a, ast.Name) and a.id == "COMMIT_MARKER" for a in node.args):
                writers.append(f"{mod}:{node.lineno}")
    assert len(writers) == 1, writers


def test_components_are_called_through_their_public_methods() -> None:
    """``self.<component>._<private>(...)``: a façade that reaches into a part's private methods."""
    reaching = []
    for mod, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f, v = node.func, node.func.value
                if f.attr.startswith("_") and not f.attr.startswith("__") and isinstance(v, ast.Attribute) \
                        and isinstance(v.value, ast.Name) and v.value.id == "self":
                    reaching.append(f"{mod}:{node.lineno} self.{v.attr}.{f.attr}")
    assert not reaching, reaching


def test_layers_import_each_other_at_the_top_of_a_module() -> None:
    """An import inside a function is how a circle hides; the layers need none (the package's ``__init__``
    and the command line import lazily so that ``import resilient`` and ``resilient ckpt ls`` stay fast)."""
    hidden = []
    for mod, tree in _trees().items():
        if _unit(mod) not in LAYER or mod.endswith("__init__"):
            continue
        top = {id(n) for n in tree.body}  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in top and (node.module or "").startswith(NAME):
                hidden.append(f"{mod}:{node.lineno} {node.module}")
    assert not hidden, hidden


def test_no_state_is_kept_in_another_objects_dict() -> None:
    """``obj.__dict__[...]``: state hidden in an object that does not declare it (its owner cannot see it)."""
    hidden = []
    for mod, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "__dict__":
                hidden.append(f"{mod}:{node.lineno}")
    assert not hidden, hidden


def test_components_read_the_context_without_copies_of_it() -> None:
    """A part of the manager reads ``self.ctx``; a property per field of the context is a second name for it."""
    tree = _trees()[f"{NAME}.storage.context"]
    component = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Component")
    properties = [f.name for f in component.body if isinstance(f, ast.FunctionDef)
                  and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)]
    assert not properties, properties
