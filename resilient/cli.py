"""``resilient`` command: one sub-command per subsystem, each a thin module of its own."""

from __future__ import annotations

import importlib
import sys

# sub-command → module with ``main(argv: list[str]) -> int``
COMMANDS = {
    "run": ("resilient.run", "launch a training script (same as resilient-run)"),
    "ckpt": ("resilient.checkpoint.cli", "list and verify checkpoints: ckpt ls|verify URL_OR_DIR"),
    "supervisor": ("resilient.supervisor.standalone", "run the supervisor on its own host: supervisor "
                   "--rdzv-endpoint H:P --nnodes MIN:MAX --run-dir D"),
    "goodput": ("resilient.goodput.cli", "goodput report of a run: goodput RUN_DIR [RUN_DIR ...] [--json] [--plot F]"),
    "policy": ("resilient.supervisor.cli", "check a supervisor policy offline: policy check FILE [--ledger EVENTS]"),
    "plan": ("resilient.plan.cli", "plan goodput, time and cost under failures: plan [RUN_DIR] [--sweep] [--json]"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: resilient COMMAND [ARGS...]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"resilient: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[name][0])
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
