"""``resilient.env`` is the one place that spells a ``RESILIENT_*`` name, and ``WorkerEnv`` is the one codec of
what the launcher hands its workers: what it writes, a worker reads back unchanged."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from resilient import env
from resilient.env import WorkerEnv

PKG = Path(env.__file__).resolve().parent
_NAME = re.compile(r"RESILIENT_[A-Z0-9_]+")

# Modules that still spell a name; each entry must still do so (a mended module leaves the list), so the list
# only shrinks. Empty: every name is env's.
_PENDING: set[str] = set()


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _raw_names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == "env.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                names = _NAME.findall(node.value)
                if names:
                    found.setdefault(rel, []).extend(f"{n} (line {node.lineno})" for n in names)
    return found


def test_no_module_but_env_spells_a_resilient_variable():
    found = _raw_names()
    new = {f: v for f, v in found.items() if f not in _PENDING}
    assert not new, f"use the constants of resilient.env instead: {new}"
    stale = sorted(f for f in _PENDING if f not in found)
    assert not stale, f"no raw names left in {stale}: take them off _PENDING"


def test_every_constant_is_a_distinct_resilient_or_torchrun_name():
    values = {k: v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}
    assert len(set(values.values())) == len(values), "two constants name one variable"
    odd = {k: v for k, v in values.items() if not (v.startswith("RESILIENT_") or v.startswith("PET_"))}
    assert not odd


def test_worker_env_round_trips_and_leaves_unset_fields_out():
    w = WorkerEnv(run_dir="/runs/a", run_id="job-1", node="host-3", node_rank=2, agent_socket="@sock",
                  ckpt_interval="auto", ckpt_persistent_every=4, upload_grace=30.0, ckpt_max_failed_saves=3,
                  heartbeat_timeout=12.5, spare_nodes=1, faults="kill:rank=1:step=3:attempt=0")
    vars_ = w.to_env()
    assert vars_[env.NODE_RANK] == "2" and vars_[env.UPLOAD_GRACE] == "30.0"
    assert env.CKPT_LOCAL not in vars_ and env.POLICY not in vars_
    assert WorkerEnv.from_env(vars_) == w
    assert WorkerEnv.from_env({}) is None  # not under resilient-run


@pytest.mark.parametrize("bad, what", [
    ({env.NODE_RANK: "two"}, env.NODE_RANK),
    ({env.UPLOAD_GRACE: "soon"}, env.UPLOAD_GRACE),
    ({env.CKPT_INTERVAL: "0"}, "ckpt_interval"),
    ({env.NODE: ""}, "node"),
])
def test_a_malformed_variable_is_named(bad, what):
    base = WorkerEnv(run_dir="/r", run_id="j", node="n", node_rank=0).to_env()
    with pytest.raises(ValueError, match=what):
        WorkerEnv.from_env({**base, **bad})


def test_a_partial_environment_is_refused_naming_what_is_missing():
    with pytest.raises(ValueError, match=env.RUN_ID):
        WorkerEnv.from_env({env.RUN_DIR: "/r", env.NODE: "n", env.NODE_RANK: "0"})


def test_a_worker_process_reads_what_the_launcher_wrote(tmp_path):
    w = WorkerEnv(run_dir=str(tmp_path), run_id="job", node="n0", node_rank=1, ckpt_local=str(tmp_path / "ck"))
    code = "from resilient.env import WorkerEnv\nprint(repr(WorkerEnv.from_env()))\n"
    out = subprocess.run([sys.executable, "-c", code], env={**w.to_env(), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, cwd=str(PKG.parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(w)
