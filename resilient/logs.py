"""Structured logging for agents, the supervisor and tools: JSON lines in the run directory, rich on a terminal.

Only ``main()`` functions call :func:`setup_logging`; library modules just use
``logging.getLogger(__name__)``. Each record becomes one JSON object a line in ``RUN_DIR/logs/<role>.jsonl``
with the run id, node, rank, attempt, role, pid, logger, level and message (plus an ``exc`` traceback and
any ``extra=`` fields), written with one ``os.write`` on an ``O_APPEND`` descriptor so that several
processes can share a file without interleaving lines.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

from resilient import env as renv

__all__ = ["setup_logging", "JsonFormatter", "AppendHandler"]

_MARK = "_resilient_handler"
# attributes every LogRecord has; anything else came from ``extra=`` and is kept
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, context: dict[str, Any]):
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "wall": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.context,
            "pid": record.process,
        }
        if record.exc_info:
            d["exc"] = "".join(traceback.format_exception(*record.exc_info))
        for k, v in vars(record).items():
            if k not in _STANDARD and k not in d and not k.startswith("_"):
                d[k] = v
        return json.dumps(d, default=str, separators=(",", ":"))


class AppendHandler(logging.Handler):
    """One ``os.write`` per record on an ``O_APPEND`` file: lines from many processes never interleave."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
            if self._fd is not None:
                os.write(self._fd, line)
        except Exception:  # noqa: BLE001 - logging must never take the process down
            self.handleError(record)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        super().close()


class _StreamJsonHandler(logging.StreamHandler):
    pass


def _int_or_none(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def setup_logging(role: str, *, run_dir: str | os.PathLike[str] | None = None, node: str | None = None,
                  rank: int | None = None, attempt: int | None = None, json_stream: IO[str] | None = None,
                  level: int | str | None = None, console: bool | None = None) -> Path | None:
    """Configure the root logger for a process of the given ``role`` ("agent", "supervisor", "worker", ...).

    * ``RUN_DIR/logs/<role>.jsonl`` gets JSON lines when ``run_dir`` (or ``$RESILIENT_RUN_DIR``) is known.
    * ``json_stream`` (e.g. ``sys.stdout`` in a container whose log collector wants JSON) gets them too.
    * stderr gets human-readable lines: rich when it is a terminal, plain text otherwise;
      ``console=False`` turns that off.
    * Unknown context comes from the launcher's environment (run id, node, RANK, restart count).
    * Level: ``level``, else ``$RESILIENT_LOG_LEVEL``, else INFO. Calling again replaces what an earlier
      call installed. Returns the JSON log file's path, or None.
    """
    if not role or "/" in role or role.startswith("."):
        raise ValueError(f"role must be a plain name such as 'agent' (it names the log file), got {role!r}")
    run_dir = run_dir if run_dir is not None else os.environ.get(renv.RUN_DIR)
    ctx: dict[str, Any] = {
        "run_id": os.environ.get(renv.RUN_ID) or (Path(run_dir).name if run_dir else None),
        "role": role,
        "node": node if node is not None else os.environ.get(renv.NODE, socket.gethostname()),
        "rank": rank if rank is not None else _int_or_none(os.environ.get("RANK")),
        "attempt": attempt if attempt is not None else _int_or_none(os.environ.get("TORCHELASTIC_RESTART_COUNT")),
    }
    lvl = level if level is not None else os.environ.get("RESILIENT_LOG_LEVEL", "INFO")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _MARK, False):
            root.removeHandler(h)
            h.close()
    root.setLevel(lvl.upper() if isinstance(lvl, str) else lvl)
    fmt = JsonFormatter(ctx)
    handlers: list[logging.Handler] = []
    path: Path | None = None
    if run_dir:
        path = Path(run_dir) / "logs" / f"{role}.jsonl"
        try:
            h = AppendHandler(path)
            h.setFormatter(fmt)
            handlers.append(h)
        except OSError as e:
            print(f"[{role}] cannot write logs to {path}: {e}; logging to the terminal only", file=sys.stderr)
            path = None
    if json_stream is not None:
        sh = _StreamJsonHandler(json_stream)
        sh.setFormatter(fmt)
        handlers.append(sh)
    if console is None:
        console = json_stream is not sys.stderr
    if console:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.logging import RichHandler

            ch: logging.Handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False,
                                              log_time_format="%H:%M:%S")
            where = f"{ctx['node']}" + (f" r{ctx['rank']}" if ctx["rank"] is not None else "")
            ch.setFormatter(logging.Formatter(f"[{role} {where}] %(name)s: %(message)s"))
        else:
            ch = logging.StreamHandler(sys.stderr)
            ch.setFormatter(logging.Formatter(f"[{role}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(ch)
    for h in handlers:
        setattr(h, _MARK, True)
        root.addHandler(h)
    logging.captureWarnings(True)
    return path
