"""The package's layering, read from the source with ``ast``: no import circle inside ``resilient/``, and no
import across a forbidden edge.

Every ``import`` and ``from ... import`` counts, at module level or inside a function, class or
``if TYPE_CHECKING`` block: a circle through a function-level import is still two modules that each need the
other. Relative imports are resolved against the importing module; ``from a import b`` is an edge to ``a.b``
where that is a module, else to ``a``. Importing ``a.b`` is not counted as an import of the package ``a``
(``__init__``), or every sub-module would sit in a circle with a package that re-exports it.

The rules are data (the tables below). An edge that breaks a rule but is known, because the code that has it
is still being moved, is listed in ``KNOWN`` with the reason; any other violation fails, and so does a
``KNOWN`` entry whose edge is gone (so the list only shrinks).
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (importer, imported, why): a module at or under ``importer`` may not import one at or under ``imported``
# (imports inside ``imported`` itself are its own business).
FORBIDDEN: list[tuple[str, str, str]] = [
    ("resilient", "tests", "the package never imports the test suite"),
    ("resilient", "pytest", "test-only"),
    ("resilient", "_pytest", "test-only"),
    ("resilient", "hypothesis", "test-only"),
    ("resilient", "resilient.testing", "test-only helpers live in tests/_helpers"),
    ("resilient", "nvidia_resiliency_ext", "an extra ([nvrx]): only the benchmarks compare against it"),
    ("resilient.supervisor", "resilient.launcher", "the supervisor never imports the launcher"),
    ("resilient.worker", "resilient.launcher", "the worker runtime runs in the workers, not in the agent"),
    ("resilient.signals", "resilient.worker", "the agent side does not import the worker runtime"),
    ("resilient.worker", "resilient.drill", "drills plug into the worker runtime, never the other way"),
    ("resilient.worker", "resilient.supervisor", "a worker talks to its agent, not to the supervisor"),
    ("resilient.events", "resilient.supervisor", "the event vocabulary is below every user of it"),
    ("resilient.events", "resilient.launcher", "the event vocabulary is below every user of it"),
    ("resilient.events", "resilient.checkpoint", "the event vocabulary is below every user of it"),
    *[("resilient.checkpoint", f"resilient.{up}", "the checkpointer is a library under the launcher and the drills")
      for up in ("launcher", "supervisor", "drill", "goodput", "plan")],
    *[("resilient.goodput", f"resilient.{up}", "goodput reads ledgers; it never reaches into what wrote them")
      for up in ("checkpoint", "launcher", "supervisor", "worker")],
    # checkpoint layers, one way: format <- storage <- {save, replicate, upload, restore}
    *[("resilient.checkpoint.format", f"resilient.checkpoint.{up}", "format is the bottom layer")
      for up in ("storage", "save", "replicate", "upload", "restore")],
    *[("resilient.checkpoint.storage", f"resilient.checkpoint.{up}", "storage sits under save, replicate, "
       "upload and restore") for up in ("save", "replicate", "upload", "restore")],
]

# Runtime dependencies (pyproject's project.dependencies) imported under another name than their own (dashes
# as underscores); None: loaded by another dependency. One that nothing in resilient/ uses belongs in an extra.
IMPORTED_AS: dict[str, str | None] = {
    "nvidia-ml-py": "pynvml",
    "gcsfs": None,  # fsspec loads it for gs:// URLs
}

# A policy (policies/*.py) sees the policy contract and the event vocabulary, nothing else of resilient.
POLICY_DIR = "policies"
POLICY_MAY_IMPORT = {"resilient.supervisor.api", "resilient.events.api"}

# Known violations, (importer, imported), each with why it is still there. Empty it as the code moves.
KNOWN: set[tuple[str, str]] = {
    # policies build on the default policy's rules; it is not yet part of the policy contract
    ("policies.default", "resilient.supervisor.default_policy"),
    ("policies.evict_stragglers", "resilient.supervisor.default_policy"),
    ("policies.hot_swap_first", "resilient.supervisor.default_policy"),
    ("policies.scale_down_first", "resilient.supervisor.default_policy"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def modules(top: str) -> dict[str, Path]:
    base = ROOT / top
    return {module_name(p): p for p in sorted(base.rglob("*.py")) if "__pycache__" not in p.parts}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(name: str, path: Path, known_modules: set[str]) -> set[str]:
    """Every module ``name`` (at ``path``) imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if is_package(path) else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                if node.level - 1 > len(base_parts):
                    raise AssertionError(f"{name}: relative import beyond the top level")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                mod = f"{base}.{node.module}" if node.module and base else (node.module or base)
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in known_modules else mod)
    out.discard(name)
    return out


def graph(tops: tuple[str, ...] = ("resilient", POLICY_DIR)) -> dict[str, set[str]]:
    found: dict[str, Path] = {}
    for top in tops:
        found.update(modules(top))
    names = set(found)
    return {n: imports(n, p, names) for n, p in found.items()}


def violations(g: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    bad = set()
    for src, targets in g.items():
        for dst in targets:
            for importer, imported, why in FORBIDDEN:
                if under(src, importer) and under(dst, imported) and not under(src, imported):
                    bad.add((src, dst, why))
            if under(src, POLICY_DIR) and (under(dst, "resilient") and dst not in POLICY_MAY_IMPORT):
                bad.add((src, dst, f"a policy imports only {sorted(POLICY_MAY_IMPORT)}"))
    return bad


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan, iterative)."""
    g = {n: {d for d in ds if d in g} for n, ds in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(comp)
    return [_cycle_in(g, comp) for comp in comps]


def _cycle_in(g: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first, inside the component)."""
    first = min(comp)
    prev: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & comp):
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(prev[path[-1]])
                    return [*reversed(path), first]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in component {sorted(comp)}")


def without_known(g: dict[str, set[str]]) -> dict[str, set[str]]:
    return {n: {d for d in ds if (n, d) not in KNOWN} for n, ds in g.items()}


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return graph()


def test_no_import_circle(edges):
    found = circles(without_known(edges))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_forbidden_import(edges):
    bad = sorted(v for v in violations(edges) if v[:2] not in KNOWN)
    assert not bad, "forbidden imports:\n" + "\n".join(f"{s} -> {d} ({why})" for s, d, why in bad)


def test_known_exceptions_still_exist(edges):
    gone = sorted(e for e in KNOWN if e[1] not in edges.get(e[0], set()))
    assert not gone, f"KNOWN lists edges that no longer exist (remove them): {gone}"


def test_every_runtime_dependency_is_used_by_the_package(edges):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    imported = {d.split(".")[0] for src, ds in edges.items() if under(src, "resilient") for d in ds}
    modules = {n: IMPORTED_AS.get(n, n.replace("-", "_")) for n in names}
    unused = sorted(n for n, m in modules.items() if m is not None and m not in imported)
    assert not unused, f"runtime dependencies nothing in resilient/ imports (make them an extra): {unused}"


def test_the_walk_sees_what_it_must(tmp_path, monkeypatch):
    """The walker on a small package of its own: relative and function-level imports, a circle, a forbidden
    edge; so a green run above means no such thing, not a walker that saw nothing."""
    pkg = tmp_path / "resilient"
    (pkg / "supervisor").mkdir(parents=True)
    (pkg / "launcher").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "supervisor" / "__init__.py").write_text("")
    (pkg / "launcher" / "__init__.py").write_text("")
    (pkg / "supervisor" / "core.py").write_text("def f():\n    from ..launcher import agent\n")
    (pkg / "launcher" / "agent.py").write_text("from . import control\n")
    (pkg / "launcher" / "control.py").write_text("import resilient.launcher.agent\nfrom tests import x\n")
    (tmp_path / POLICY_DIR).mkdir()
    (tmp_path / POLICY_DIR / "p.py").write_text("from resilient.supervisor.api import Ignore\n"
                                                 "from resilient.supervisor import core\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    g = graph()
    assert g["resilient.supervisor.core"] == {"resilient.launcher.agent"}
    assert g["resilient.launcher.agent"] == {"resilient.launcher.control"}
    assert circles(g) == [["resilient.launcher.agent", "resilient.launcher.control", "resilient.launcher.agent"]]
    assert {v[:2] for v in violations(g)} == {
        ("resilient.supervisor.core", "resilient.launcher.agent"), ("resilient.launcher.control", "tests"),
        (f"{POLICY_DIR}.p", "resilient.supervisor.core")}
