"""Rebuild corpus.txt: English prose from the docstrings of Python's standard library.

Reproducible offline: it imports pure-Python standard modules in sorted order and keeps
each docstring that reads as prose. Run it with the interpreter whose docs you want:

    python recipes/pytorch/data/make_corpus.py            # writes corpus.txt beside this file
    python recipes/pytorch/data/make_corpus.py --max-kb 400
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys
import warnings

# Modules whose import has side effects (opens a window, starts a browser, prints) or is platform-bound.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "msilib", "winreg",
        "winsound", "_winapi", "nturl2path", "ntpath", "lib2to3", "ensurepip", "venv", "pydoc_data"}


def _prose(doc: str) -> str | None:
    doc = inspect.cleandoc(doc)
    # keep paragraphs of running text; drop code samples, tables and argument lists
    keep = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if any(ln.startswith((">>>", "    ", "\t", "-", "*", "|", "=", "+")) for ln in lines):
            continue
        text = " ".join(ln.strip() for ln in lines)
        words = text.split()
        if len(words) < 8 or not text.endswith((".", ":", "?")):
            continue
        letters = sum(c.isalpha() or c == " " for c in text)
        if letters < 0.85 * len(text) or not text.isascii():
            continue
        keep.append(text)
    return "\n".join(keep) if keep else None


def collect(max_bytes: int) -> str:
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP)
    seen: set[str] = set()
    out: list[str] = []
    size = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - platform-specific modules are simply absent
                continue
            objs = [mod] + [obj for _, obj in sorted(vars(mod).items())
                            if (inspect.isclass(obj) or inspect.isfunction(obj))
                            and getattr(obj, "__module__", None) == name]
            for obj in objs:
                text = _prose(obj.__doc__ or "") if isinstance(obj.__doc__, str) else None
                if not text or text in seen:
                    continue
                seen.add(text)
                out.append(text)
                size += len(text) + 2
                if size >= max_bytes:
                    return "\n\n".join(out) + "\n"
    return "\n\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-kb", type=int, default=400)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).with_name("corpus.txt"))
    args = ap.parse_args()
    text = collect(args.max_kb * 1024)
    args.out.write_text(text, encoding="ascii")
    print(f"{args.out}: {len(text)} bytes")


if __name__ == "__main__":
    main()
