"""``resilient ckpt ls|verify URL_OR_DIR``: what a tier holds, and whether its files still match their checksums.
``resilient ckpt export URL_OR_DIR DIR``: a plain, uncompressed DCP copy of a step (``dcp.load`` reads it
without this package), from a step whose items were compressed for transfer.

``URL_OR_DIR`` is a tier root (a local directory, ``gs://bucket/run``, ``file://...``) or one step
directory in it (``.../step_00000120``). A local root's ``peer/`` replica area is listed too.
Exit status of ``verify``: 0 when every checked file is intact, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

from resilient.checkpoint.api import PEER_SUBDIR, StepInfo
from resilient.checkpoint.tiers import DirTier, make_tier, parse_step, step_info, verify_step


def _split(target: str) -> tuple[str, int | None]:
    """A step directory given directly → (its tier root, the step)."""
    t = target.rstrip("/")
    head, _, last = t.rpartition("/")
    s = parse_step(last)
    if s is not None and head:
        return head, s
    return t, None


def _tiers(root: str) -> list[Any]:
    tiers = [make_tier(root, "tier")]
    if isinstance(tiers[0], DirTier) and (tiers[0].root / PEER_SUBDIR).is_dir():
        tiers.append(DirTier(tiers[0].root / PEER_SUBDIR, name=PEER_SUBDIR))
    return tiers


def _missing_root(root: str) -> str | None:
    """Why ``root`` cannot hold checkpoints at all (a missing bucket or directory), or None."""
    tier = make_tier(root, "tier")
    if isinstance(tier, DirTier):
        if not tier.root.is_dir():
            return "no such directory; check the path"
        return None
    fs, path = tier.fs, tier.root  # type: ignore[attr-defined]
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if protocol in ("file", "local"):
        return None if fs.isdir(path) else "no such directory; check the path"
    bucket = path.split("/", 1)[0]
    try:
        if not fs.exists(bucket):
            return f"bucket {bucket!r} does not exist (or these credentials may not see it); check the URL"
    except (OSError, ValueError) as e:
        return f"cannot reach bucket {bucket!r}: {e}"
    return None


def _human(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return str(n)


def _ls(args: argparse.Namespace) -> int:
    root, only = _split(args.target)
    rows: list[tuple[str, StepInfo]] = []
    for tier in _tiers(root):
        steps = tier.steps()
        for s in sorted(steps):
            if only is None or s == only:
                rows.append((tier.url(), step_info(tier, s, steps[s])))
    problem = None if rows else _missing_root(root)
    if problem:
        print(f"resilient ckpt ls: {args.target}: {problem}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"tier": t, "step": i.step, "complete": i.committed, "ranks": list(i.ranks),
                           "world_size": i.world_size, "bytes": i.bytes} for t, i in rows], indent=2))
        return 0
    if not rows:
        print(f"no checkpoint steps under {args.target}")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoints in {args.target}")
    for col in ("tier", "step", "complete", "ranks", "world", "size"):
        table.add_column(col, justify="right" if col in ("step", "world", "size") else "left")
    for t, i in rows:
        ranks = ",".join(map(str, i.ranks)) if len(i.ranks) <= 8 else f"{len(i.ranks)} ranks"
        table.add_row(t, str(i.step), "yes" if i.committed else "[yellow]partial[/yellow]", ranks,
                      str(i.world_size or "-"), _human(i.bytes))
    Console().print(table)
    return 0


def _verify(args: argparse.Namespace) -> int:
    root, only = _split(args.target)
    jobs = []
    for tier in _tiers(root):
        steps = tier.steps()
        for s in sorted(steps):
            if (only is None or s == only) and (steps[s] or args.partial):
                jobs.append((tier, s))
    if not jobs:
        print(f"no complete checkpoint steps under {args.target}", file=sys.stderr)
        return 1
    total = sum(step_info(t, s, True).bytes for t, s in jobs)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resilient-verify-") as scratch:
        progress_ctx = None
        if sys.stderr.isatty() and not args.json:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            progress_ctx = Progress(TextColumn("verify"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                    TimeRemainingColumn(), transient=True)
        if progress_ctx is not None:
            with progress_ctx as progress:
                task = progress.add_task("verify", total=total)
                for tier, s in jobs:
                    res = verify_step(tier, s, scratch, progress=lambda n: progress.advance(task, n))
                    results.append({"tier": tier.url(), "step": s, "files": res})
        else:
            for tier, s in jobs:
                results.append({"tier": tier.url(), "step": s, "files": verify_step(tier, s, scratch)})
    bad = [(r, n, v) for r in results for n, v in r["files"].items() if v != "ok"]
    if args.json:
        print(json.dumps({"ok": not bad, "steps": results}, indent=2))
    else:
        for r in results:
            n_bad = sum(v != "ok" for v in r["files"].values())
            n_unsafe = sum(v.startswith("unsafe") for v in r["files"].values())
            status = "ok" if not n_bad else f"{n_bad} bad file(s)" + (f", {n_unsafe} UNSAFE (would run code or "
                                                                       "escape the step directory)"
                                                                       if n_unsafe else "")
            print(f"{r['tier']} step {r['step']}: {len(r['files'])} files, {status}")
        for r, n, v in bad:
            print(f"  {r['tier']} step {r['step']} {n}: {v}")
    return 1 if bad else 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from resilient.checkpoint.api import COMMIT_MARKER, DCP_METADATA, CorruptFileError
    from resilient.checkpoint.compress import CompressError, export_step
    from resilient.checkpoint.tiers import manifest_ranks, read_manifest, verify_bytes

    root, step = _split(args.target)
    tier = make_tier(root, "tier")
    if step is None:
        done = [s for s, c in tier.steps().items() if c]
        if not done:
            problem = _missing_root(root) or "no complete checkpoint step there"
            print(f"resilient ckpt export: {args.target}: {problem}", file=sys.stderr)
            return 2
        step = max(done)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"resilient ckpt export: {out} is not empty; give a new or empty directory", file=sys.stderr)
        return 2
    files = tier.list_files(step)
    if COMMIT_MARKER not in files:
        print(f"resilient ckpt export: step {step} in {root} is not complete (no {COMMIT_MARKER}); "
              "export a complete step", file=sys.stderr)
        return 2
    expected: dict[str, Any] = {}
    for r in manifest_ranks(files):
        m = read_manifest(tier, step, r)
        expected.update(m.all_files())

    def read(name: str) -> bytes:
        data = tier.read_bytes(step, name)
        if name in expected:  # never decode a copy that does not match its manifest
            verify_bytes(data, expected[name], what=f"{name} of step {step}")
        return data

    try:
        n = export_step(read, [n for n in expected if n != DCP_METADATA], out)
    except (CorruptFileError, CompressError) as e:
        print(f"resilient ckpt export: {args.target}: {e}; nothing usable was written to {out}", file=sys.stderr)
        return 1
    print(f"exported step {step} of {root} to {out} ({n} items decoded): plain DCP, dcp.load reads it")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="resilient ckpt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ls", help="steps, tiers, completeness, sizes")
    p.add_argument("target", metavar="URL_OR_DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_ls)
    p = sub.add_parser("verify", help="re-check sizes and crc32c of every file against the manifests")
    p.add_argument("target", metavar="URL_OR_DIR")
    p.add_argument("--json", action="store_true")
    p.add_argument("--partial", action="store_true", help="also check steps without a commit marker")
    p.set_defaults(fn=_verify)
    p = sub.add_parser("export", help="write a plain uncompressed DCP copy of a step (the newest complete one "
                                      "of a tier root, or the step directory given)")
    p.add_argument("target", metavar="URL_OR_DIR")
    p.add_argument("out", metavar="DIR", help="a new or empty directory")
    p.set_defaults(fn=_export)
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except (OSError, ValueError) as e:
        print(f"resilient ckpt {args.cmd}: {args.target}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
