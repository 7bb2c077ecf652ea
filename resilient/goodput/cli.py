"""``resilient goodput RUN_DIR [RUN_DIR ...] [--json] [--plot FILE.png] [--tensorboard DIR]``: the goodput report
of a run (several directories: one job whose nodes each kept a run directory of their own)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from resilient.goodput.api import CATEGORIES, GoodputError, GoodputReport
from resilient.goodput.calculator import compute_report
from resilient.goodput.checkpoints import checkpoint_summary, fleet_lines
from resilient.goodput.columns import ReportInputs
from resilient.events.follow import ledger_path, read_ledgers

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient goodput", description="Goodput and badput of a run, from its ledger.")
    p.add_argument("run_dir", nargs="+",
                   help="the run directory (holds its ledger: events.jsonl and events.*.jsonl); a job whose nodes "
                        "each had a --run-dir of their own: every node's directory and the supervisor's, read as one")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw the run's timeline into this image")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write goodput, badput by category and step time as TensorBoard scalars into DIR "
                        "(needs: pip install 'resilient[tensorboard]')")
    p.add_argument("--timeline", action="store_true", help="with --json: include the categorised time segments")
    p.add_argument("--now", type=float, default=None,
                   help="end of a run still in progress, as Unix time (default: the current time)")
    return p


def _fmt_s(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def badput_table(title: str, wall: float, productive: float, badput: dict[str, float]) -> Any:
    """Productive time and every badput category, largest first, with its share of ``wall`` (a rich Table;
    the planner prints its prediction with the same one)."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("category")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    w = wall or 1.0
    t.add_row("[green]productive[/green]", _fmt_s(productive), f"{productive / w:.1%}")
    for c in sorted(CATEGORIES, key=lambda c: -badput.get(c, 0.0)):
        t.add_row(c, _fmt_s(badput.get(c, 0.0)), f"{badput.get(c, 0.0) / w:.1%}")
    return t


def print_table(rep: GoodputReport) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not con.is_terminal:
        con = Console(width=140)  # pipes and logs: rich's 80 columns would wrap the attempts table
    state = "in progress" if rep.in_progress else "ended"
    if rep.ledger_incomplete is not None:
        state = f"ledger incomplete: {'end not recorded' if rep.in_progress else 'events missing'}"
    con.print(f"[bold]goodput {rep.goodput:.1%}[/bold] of {_fmt_s(rep.wall_seconds)} wall ({state}) · "
              f"{rep.disruptions} disruption(s) · {rep.restarts} restart(s) · last step {rep.last_step} · "
              f"{rep.steps_redone} of {rep.steps_recorded} step records redone")
    con.print(badput_table("where the time went", rep.wall_seconds, rep.productive_seconds, rep.badput_seconds))
    a_t = Table(title="attempts")
    cols = ("session", "attempt", "start", "duration", "world", "steps", "clean step", "productive", "largest badput",
            "end")
    if rep.sessions == 1:
        cols = cols[1:]
    for col in cols:
        a_t.add_column(col, justify="right" if col not in ("largest badput", "end") else "left",
                       no_wrap=col == "end", min_width=20 if col == "end" else None)
    for a in rep.attempts:
        top = max(a.badput_seconds.items(), key=lambda kv: kv[1], default=("", 0.0))
        steps = f"{a.first_step}–{a.last_step}" if a.steps else "–"
        if a.steps_redone:
            steps += f" ({a.steps_redone} redone)"
        row = [str(a.session)] if rep.sessions > 1 else []
        a_t.add_row(*row, str(a.attempt), f"+{a.start - rep.start_wall:.1f} s", _fmt_s(a.wall_seconds),
                    str(a.world_size or "?"), steps,
                    (f"{a.clean_step_seconds * 1000:.1f} ms" if a.clean_step_seconds < 1 else _fmt_s(a.clean_step_seconds))
                    if a.clean_step_seconds is not None else "–",
                    _fmt_s(a.productive_seconds),
                    f"{top[0]} {_fmt_s(top[1])}" if top[1] > 0 else "–", a.end_reason)
    con.print(a_t)
    if rep.skipped_lines:
        con.print(f"[yellow]{rep.skipped_lines} malformed ledger line(s) skipped[/yellow]: they are not counted above")
    if rep.ledger_incomplete is not None:
        con.print(f"[red]{rep.ledger_incomplete}[/red]: the figures above cover only what was recorded")


def _run_dir_of(filename: str | None, given: list[str]) -> str:
    """Which of the directories given has no ledger (the error names its ``events.jsonl``)."""
    if filename:
        for d in given:
            if Path(filename) in (Path(d), ledger_path(d)):
                return d
    return " ".join(given)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tensorboard:
        import importlib.util

        from resilient.goodput.tensorboard import INSTALL_HINT

        if importlib.util.find_spec("tensorboard") is None:
            print(f"resilient goodput: --tensorboard needs the tensorboard package, which is not installed; "
                  f"install it with: {INSTALL_HINT}", file=sys.stderr)
            return 2
        if os.path.exists(args.tensorboard) and not os.path.isdir(args.tensorboard):
            print(f"resilient goodput: --tensorboard {args.tensorboard} is a file; give a directory for the "
                  "event files", file=sys.stderr)
            return 2
    named = " ".join(args.run_dir)
    # rank 0's step lines read into columns (~45 bytes a step, no event each): the report, the plot and the
    # TensorBoard export all take them so
    inputs = ReportInputs()
    try:
        read = read_ledgers(args.run_dir, into=inputs)
    except FileNotFoundError as e:
        where = _run_dir_of(e.filename, args.run_dir)
        print(f"resilient goodput: no ledger in {where} (expected events.jsonl and its writers' "
              "events.*.jsonl there); "
              "pass the run directory the job was launched with", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"resilient goodput: cannot read the ledger in {named}: {e.strerror or e}", file=sys.stderr)
        return 2
    if not len(inputs) and read.skipped:
        print(f"resilient goodput: {read.path} is not a ledger: none of its {read.lines} line(s) is an event; "
              "pass the run directory the job was launched with", file=sys.stderr)
        return 2
    try:
        # the segments (two a step) only for what lists them; the figure draws from the arrays
        rep = compute_report(inputs, now=args.now,
                             timeline=True if args.tensorboard or args.timeline else "arrays" if args.plot else False)
    except GoodputError as e:
        print(f"resilient goodput: {e}", file=sys.stderr)
        return 2
    rep.skipped_lines = read.skipped
    rep.ledger_incomplete = read.incomplete
    if rep.steps_recorded == 0 and not rep.in_progress:
        # without step records every second counts as badput: "goodput 0.0%" would blame the job, not the script
        print(f"resilient goodput: the run in {named} has no step records, so its goodput cannot be told; "
              "wrap the training loop in resilient.steps() (for step in resilient.steps(start, total): ...)",
              file=sys.stderr)
        return 2
    if args.plot:
        from resilient.goodput.plot import plot_timeline

        plot_timeline(inputs, rep, args.plot)
    if args.tensorboard:
        from resilient.goodput.tensorboard import TensorBoardUnavailable, export

        try:
            export(inputs, rep, args.tensorboard)
        except TensorBoardUnavailable as e:
            print(f"resilient goodput: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"resilient goodput: cannot write TensorBoard files to {args.tensorboard}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    ckpt = checkpoint_summary(inputs.others)  # which steps were saved where, which saves failed
    if args.json:
        print(json.dumps(dict(rep.to_json(timeline=args.timeline), checkpoints=ckpt.to_json()), indent=2))
    else:
        print_table(rep)
        for line in ckpt.lines() + fleet_lines(inputs.others):
            print(line)
        if args.plot:
            print(f"timeline written to {args.plot}")
        if args.tensorboard:
            print(f"TensorBoard scalars written to {args.tensorboard}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
