"""``resilient-run``: a drop-in replacement for ``torchrun``.

    resilient-run [torchrun flags] [--run-dir D --ckpt-local D --ckpt-persistent URL ...] SCRIPT [ARGS]
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from resilient.launcher.api import LaunchError


def _setup_logging() -> None:
    level = os.environ.get("RESILIENT_LOG_LEVEL", os.environ.get("LOGLEVEL", "WARNING")).upper()
    try:
        from resilient.logs import setup_logging  # structured logs, when available
    except ImportError:
        logging.basicConfig(level=level, format="[resilient-run] %(levelname)s %(name)s: %(message)s")
        return
    setup_logging("agent", level=level)


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
    _setup_logging()
    from resilient.launcher.agent import Agent

    return Agent(cfg).run()


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
