"""``resilient ckpt ls|verify URL_OR_DIR``: what a tier holds, and whether its files still match their checksums.
``resilient ckpt export URL_OR_DIR [URL_OR_DIR ...] DIR``: a plain, uncompressed DCP copy of a step
(``dcp.load`` reads it without this package), with every rank's files, from a step whose items may have
been compressed for transfer.

``URL_OR_DIR`` is a tier root (a local directory, ``gs://bucket/run``, ``file://...``) or one step
directory in it (``.../step_00000120``). A local root's ``peer/`` replica area is listed and used too.
A node's local tier holds only its own ranks' files (and its partner's in ``peer/``): ``ls`` says which
ranks each tier holds and whether it can restore the step alone; ``export`` takes every rank's files
from the sources given, first source first, and refuses (exit 2, nothing written) when a rank is in
none of them, naming the ranks and where else to look.
Exit status of ``verify``: 0 when every checked file is intact, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from resilient.checkpoint.api import DCP_METADATA, Manifest, PEER_SUBDIR, StepInfo
from resilient.checkpoint.format.layout import parse_step
from resilient.checkpoint.storage.tiers import DirTier, make_tier, step_info, verify_step


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


def _span(ranks: Any) -> str:
    """0,1,2,5 -> "0-2,5"."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out) or "none"


def _ranks(ranks: Any) -> str:
    """"rank 0", "ranks 0-3"."""
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {_span(rs)}"


def _missing(info: StepInfo) -> list[int]:
    """Ranks of a committed step whose manifests this tier lacks (it cannot restore the step alone)."""
    if not info.committed or info.world_size is None:
        return []
    return sorted(set(range(info.world_size)) - set(info.ranks))


def _status(info: StepInfo, elsewhere: set[int]) -> str:
    """What this tier alone can restore of the step; ``elsewhere``: ranks the rest of the listing holds."""
    if not info.committed:
        return "partial: no commit marker (a save cut short, or still being written)"
    miss = _missing(info)
    of = f"{_ranks(info.ranks)} of {info.world_size or '?'}"
    if not miss:
        return f"complete: {of}"
    where = ("found in the other tiers listed" if set(miss) <= elsewhere else
             "needs another node's local tier or the persistent tier")
    return f"partial: {of}; {_ranks(miss)} {where}"


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
    held: dict[int, set[int]] = {}  # step -> ranks held by any listed tier's committed copy
    for _, i in rows:
        if i.committed:
            held.setdefault(i.step, set()).update(i.ranks)
    if args.json:
        # "complete": this tier alone holds every rank of a committed step (restorable from it alone);
        # "committed": its commit marker is there (on a node's local tier: that node's ranks are)
        print(json.dumps([{"tier": t, "step": i.step, "complete": i.committed and not _missing(i),
                           "committed": i.committed, "ranks": list(i.ranks), "missing_ranks": _missing(i),
                           "world_size": i.world_size, "bytes": i.bytes} for t, i in rows], indent=2))
        return 0
    if not rows:
        print(f"no checkpoint steps under {args.target}")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoints in {args.target}")
    for col in ("tier", "step", "restorable from this tier alone", "size"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for t, i in rows:
        text = _status(i, held.get(i.step, set()))
        table.add_row(t, str(i.step), text if text.startswith("complete") else f"[yellow]{text}[/yellow]",
                      _human(i.bytes))
    Console(width=None if sys.stdout.isatty() else 1000).print(table)  # piped: one line per row, for grep
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
            status = "ok" if not n_bad else f"{n_bad} bad file(s)" + (f", {n_unsafe} UNSAFE (would run code, "
                                                                       "escape the step directory or decode "
                                                                       "past an item's size)"
                                                                       if n_unsafe else "")
            print(f"{r['tier']} step {r['step']}: {len(r['files'])} files, {status}")
        for r, n, v in bad:
            print(f"  {r['tier']} step {r['step']} {n}: {v}")
    return 1 if bad else 0


@dataclass
class _Holding:
    """What one tier holds of a step: the ranks whose manifest and files are all there."""

    tier: Any
    world_size: int | None
    manifests: dict[int, Manifest]


def _holding(tier: Any, step: int) -> _Holding | None:
    """The ranks ``tier`` holds whole of committed ``step`` (None: not committed there)."""
    from resilient.checkpoint.api import COMMIT_MARKER
    from resilient.checkpoint.storage.tiers import manifest_ranks, read_commit, read_manifest

    files = tier.list_files(step)
    if COMMIT_MARKER not in files:
        return None
    try:
        world: int | None = int(read_commit(tier, step)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        world = None
    got: dict[int, Manifest] = {}
    for r in manifest_ranks(files):
        try:
            m = read_manifest(tier, step, r)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an unreadable manifest: this rank is not held here
        if all(n in files for n in m.all_files()):
            got[r] = m
            world = world if world is not None else m.world_size
    return _Holding(tier, world, got)


def _sources(targets: list[str]) -> tuple[list[Any], int | None]:
    """Every tier the targets name, in order (a local root's ``peer/`` area right after it), and the step
    the targets name (None: the newest step they can export whole)."""
    tiers: list[Any] = []
    steps: set[int] = set()
    for t in targets:
        root, step = _split(t)
        if step is not None:
            steps.add(step)
        problem = _missing_root(root)
        if problem:
            raise _Refusal(f"{t}: {problem}")
        tiers += _tiers(root)
    if len(steps) > 1:
        raise _Refusal(f"the sources name different steps ({', '.join(map(str, sorted(steps)))}); give tier roots "
                       "or step directories of one step")
    return tiers, (steps.pop() if steps else None)


class _Refusal(Exception):
    """Why an export cannot be done: one line for the user, exit 2."""


def _plan(tiers: list[Any], step: int | None) -> tuple[int, dict[int, _Holding], int]:
    """(step, rank -> the holding its files are taken from, world size): the first source that holds a
    rank whole serves it. Refuses, naming the missing ranks, when some rank is in no source."""
    candidates = sorted({s for t in tiers for s, c in t.steps().items() if c}, reverse=True)
    if step is not None:
        candidates = [step]
    if not candidates:
        raise _Refusal("no complete checkpoint step there")
    newest_whole = None
    first_problem: str | None = None
    for s in candidates:
        holdings = [h for h in (_holding(t, s) for t in tiers) if h is not None]
        worlds = {h.world_size for h in holdings if h.world_size is not None}
        if not holdings or not worlds:
            problem = f"step {s} is not complete in any source (no commit marker)"
        elif len(worlds) > 1:
            problem = f"step {s}: the sources disagree on its world size ({sorted(worlds)}); give one job's tiers"
        else:
            world = worlds.pop()
            serve: dict[int, _Holding] = {}
            for h in holdings:
                for r in h.manifests:
                    serve.setdefault(r, h)
            missing = sorted(set(range(world)) - set(serve))
            if not missing:
                if first_problem is None:
                    return s, serve, world
                newest_whole = s
                break
            problem = (f"step {s} has {_ranks(serve)} of {world} in these sources; the files of "
                       f"{_ranks(missing)} are in none of them: give the local tier of the node that held "
                       "them, or the persistent tier, as another source")
        first_problem = first_problem or problem
    assert first_problem is not None
    if newest_whole is not None:
        first_problem += f" (step {newest_whole} is whole in them: export it by its step directory)"
    raise _Refusal(first_problem)


def _export(args: argparse.Namespace) -> int:
    import pickle
    from pathlib import Path

    from resilient.checkpoint.api import CorruptFileError, UnsafeCheckpointError
    from resilient.checkpoint.format.codec import CompressError
    from resilient.checkpoint.upload.transcode import export_step
    from resilient.checkpoint.format.safe import load_metadata
    from resilient.checkpoint.format.digests import verify_bytes

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        print(f"resilient ckpt export: {out} {what}; give a new or empty directory", file=sys.stderr)
        return 2
    label = " ".join(args.target)
    try:
        tiers, want = _sources(args.target)
        step, serve, world = _plan(tiers, want)
    except _Refusal as e:
        print(f"resilient ckpt export: {e}; nothing was written", file=sys.stderr)
        return 2

    def read(h: _Holding, name: str, entry: Any) -> bytes:
        data = h.tier.read_bytes(step, name)
        verify_bytes(data, entry, what=f"{h.tier.url(step)}/{name}")  # never decode an unverified copy
        return data

    existed = out.exists()
    try:
        # one .metadata for the copy: each rank's items as the tier serving that rank lays them out (a
        # node's plain local copy and a compressed persistent copy name other files for the same items)
        base: Any = None
        storage: dict[Any, Any] = {}
        owner: dict[str, tuple[_Holding, Any]] = {}
        mds: dict[int, Any] = {}
        for r in range(world):
            h = serve[r]
            m = h.manifests[r]
            key = id(h)
            if key not in mds:
                mds[key] = load_metadata(read(h, DCP_METADATA, m.metadata), what=f"{h.tier.url(step)}/{DCP_METADATA}")
            md = mds[key]
            base = base if base is not None else md
            for n, fe in m.files.items():
                owner[n] = (h, fe)
            storage.update({i: info for i, info in md.storage_data.items() if info.relative_path in m.files})
        lost = [i.fqn for i in base.storage_data if i not in storage]
        if lost:
            raise CompressError(f"step {step}: items {', '.join(sorted(set(lost))[:5])} are in no rank's files")
        merged = pickle.loads(pickle.dumps(base))
        merged.storage_data = storage
        n = export_step(lambda name: read(owner[name][0], name, owner[name][1]), sorted(owner), out,
                        metadata=merged)
    except UnsafeCheckpointError as e:
        _discard(out, existed)
        print(f"resilient ckpt export: {label}: step {step}: {e}; nothing was written", file=sys.stderr)
        return 2
    except (CorruptFileError, CompressError) as e:
        _discard(out, existed)
        print(f"resilient ckpt export: {label}: {e}; nothing was written", file=sys.stderr)
        return 1
    except BaseException:
        _discard(out, existed)
        raise
    used = sorted({serve[r].tier.url() for r in range(world)})
    print(f"exported step {step} (ranks {_span(range(world))} of {world}, from {', '.join(used)}) to {out} "
          f"({n} items decoded): plain DCP, dcp.load reads it")
    return 0


def _discard(out: Any, existed: bool) -> None:
    """Nothing left behind: the directory as it was (absent, or empty)."""
    import shutil

    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in list(out.iterdir()) if out.is_dir() else []:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


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
    p = sub.add_parser("export", help="write a plain uncompressed DCP copy of a step, every rank's files (the "
                                      "newest step the sources hold whole, or the step directory given)")
    p.add_argument("target", metavar="URL_OR_DIR", nargs="+",
                   help="tier roots or step directories to take the ranks' files from, first first: a node's "
                        "local tier (with its peer/ area), other nodes' local tiers, the persistent tier")
    p.add_argument("out", metavar="DIR", help="a new or empty directory")
    p.set_defaults(fn=_export)
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except (OSError, ValueError) as e:
        target = " ".join(args.target) if isinstance(args.target, list) else args.target
        print(f"resilient ckpt {args.cmd}: {target}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
