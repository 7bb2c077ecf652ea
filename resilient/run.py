"""``resilient-run``: a drop-in replacement for ``torchrun``.

    resilient-run [torchrun flags] [--run-dir D --ckpt-local D --ckpt-persistent URL ...] SCRIPT [ARGS]
"""

from __future__ import annotations

import os
import sys
import warnings

from resilient import env as renv
from resilient.launcher.api import LaunchError


def _setup_logging(run_dir: str) -> None:
    """JSON lines to RUN_DIR/logs/agent.jsonl for machines, readable lines on stderr for people."""
    from resilient.logs import setup_logging

    level = os.environ.get(renv.LOG_LEVEL, os.environ.get("LOGLEVEL", "WARNING")).upper()
    setup_logging("agent", run_dir=run_dir, level=level)


def main(argv: list[str] | None = None) -> int:
    # nvidia-resiliency-ext pulls in the deprecated pynvml wrapper; torch warns about it on import
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    from resilient.launcher.args import parse

    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse(argv)
    except LaunchError as e:
        print(f"resilient-run: error: {e}", file=sys.stderr)
        return 2
    _setup_logging(cfg.run_dir)
    from pathlib import Path

    from resilient.launcher.preload import first_starter

    # the fork server first: its import of torch is on the way to the first step, the agent's own imports are not
    starter = first_starter(cfg, Path(cfg.run_dir))
    from resilient.launcher.agent import Agent

    return Agent(cfg, starter=starter).run()


def cli() -> None:
    code = main()
    from resilient.worker import exit_safety

    if exit_safety.fast_exit_enabled():
        # the run is over and its ledger closed: the interpreter's finalisation (seconds with torch imported)
        # would only delay the scheduler's view of the exit
        exit_safety.finish(code, flush_files=False)
    sys.exit(code)


if __name__ == "__main__":
    cli()
