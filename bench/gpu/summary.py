"""The device check's reader and summary (run by ``bench/gpu/check.sh``).

``--env FILE``: the machine as the check saw it (card, driver, CUDA and torch versions), read through NVML and
torch, never nvidia-smi. ``--merge DIR --out OUT``: every part's JSON (``DIR/<part>.json``), its status
(``DIR/<part>.status``, written by check.sh) and its test results (``DIR/<part>.xml``) merged into
``OUT/gpu-<card>.json``; prints one table. Exits 1 when a part failed or ran out of its time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

PARTS = ("health", "staging", "pytest", "restart", "interference", "titan")


def read_env() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["card"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 — the summary still names what it could read
        env["torch_error"] = repr(e)
    try:
        import pynvml

        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        env.setdefault("card", pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
        pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 — no NVML (a CPU machine, a dry run)
        env["nvml"] = f"unavailable: {e}"
    env.setdefault("card", "cpu")
    return env


def slug(card: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-") or "unknown"


def _junit(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out: dict[str, Any] = {"tests": [], "passed": 0, "failed": 0, "skipped": 0}
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            verdict, why = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    verdict, why = "failed", (child.get("message") or "")[:300]
                elif child.tag == "skipped":
                    verdict, why = "skipped", (child.get("message") or "")[:300]
            out[verdict] += 1
            out["tests"].append({"name": name, "verdict": verdict, **({"why": why} if why else {})})
    return out


def merge(work: Path, out: Path) -> tuple[dict[str, Any], Path]:
    env = json.loads((work / "env.json").read_text()) if (work / "env.json").exists() else read_env()
    doc: dict[str, Any] = {"env": env, "parts": {}}
    for name in PARTS:
        entry: dict[str, Any] = {}
        st = work / f"{name}.status"
        entry.update(json.loads(st.read_text()) if st.exists() else {"status": "not run"})
        fig = work / f"{name}.json"
        if fig.exists():
            try:
                entry["figures"] = json.loads(fig.read_text())
            except ValueError as e:
                entry["figures_error"] = f"{fig.name} unreadable: {e}"
        xml = work / f"{name}.xml"
        if xml.exists():
            try:
                entry["tests"] = _junit(xml)
            except ET.ParseError as e:
                entry["tests_error"] = f"{xml.name} unreadable: {e}"
        doc["parts"][name] = entry
    dest = out / f"gpu-{slug(env.get('card', 'cpu'))}.json"
    dest.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc, dest


def _flat(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        rows: list[tuple[str, Any]] = []
        for k, v in d.items():
            rows += _flat(v, f"{prefix}{k}.")
        return rows
    return [(prefix[:-1], d)] if isinstance(d, (int, float, str, bool)) or d is None else []


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def table(doc: dict[str, Any]) -> str:
    env = doc["env"]
    lines = [f"card: {env.get('card')}  driver: {env.get('driver', '-')}  torch: {env.get('torch')}  "
             f"cuda: {env.get('cuda')}  python: {env.get('python')}", ""]
    for name, entry in doc["parts"].items():
        head = f"{name:8s} {entry.get('status')}"
        if "seconds" in entry:
            head += f" ({entry['seconds']} s)"
        if entry.get("reason"):
            head += f": {entry['reason']}"
        if "tests" in entry:
            t = entry["tests"]
            head += f"  tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"
        lines.append(head)
        for key, v in _flat(entry.get("figures", {})):
            if isinstance(v, str) and len(v) > 100:
                continue
            lines.append(f"    {key:58s} {_fmt(v)}")
        for t in entry.get("tests", {}).get("tests", []):
            if t["verdict"] != "passed":
                lines.append(f"    {t['verdict']}: {t['name']} {t.get('why', '')[:160]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", type=Path, help="write the machine's description to this JSON file")
    ap.add_argument("--merge", type=Path, help="the directory of the parts' JSON and status files")
    ap.add_argument("--out", type=Path, help="where gpu-<card>.json goes (with --merge)")
    ap.add_argument("--log", type=Path, help="check.sh's log (named in the JSON)")
    args = ap.parse_args()
    if args.env:
        args.env.write_text(json.dumps(read_env(), indent=2) + "\n")
        return 0
    if not args.merge or not args.out:
        ap.error("--merge DIR and --out DIR go together (or --env FILE)")
    doc, dest = merge(args.merge, args.out)
    print(table(doc))
    print(f"\nwritten: {dest.name}")
    bad = [n for n, e in doc["parts"].items() if e.get("status") in ("failed", "timeout")]
    if bad:
        print(f"parts that failed or ran out of time: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
