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
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from resilient import env as renv

__all__ = ["setup_logging", "JsonFormatter", "OnceTracebackFormatter", "AppendHandler", "RateLimitedLog", "ScrubFilter", "is_secret_name",
           "scrub_argv", "scrub_env", "scrub_text", "REDACTED"]

_MARK = "_resilient_handler"
# attributes every LogRecord has; anything else came from ``extra=`` and is kept
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


REDACTED = "***"

# Name parts (split on - _ . and case) that mark a flag or variable as holding a secret. Whole parts, so that
# ``--tokenizer`` or ``--max-tokens`` keep their values while ``--hf-token`` or ``AWS_SECRET_ACCESS_KEY`` lose them.
_SECRET_PARTS = frozenset({"secret", "secrets", "token", "password", "passwd", "pwd", "passphrase", "key", "apikey",
                           "credential", "credentials", "auth", "cookie", "sas", "signature"})
_SECRET_SUFFIXES = ("secret", "token", "password", "apikey")  # hftoken, dbpassword, ...
_NAME = r"[A-Za-z][A-Za-z0-9_.-]*"
# --flag=value, --flag value, NAME=value inside free text (log messages, argv joined by a shell)
_FLAG_RE = re.compile(r"(?P<name>--?" + _NAME + r")(?P<sep>=|\s+)(?P<value>\"[^\"]*\"|'[^']*'|[^\s'\",]+)")
_ASSIGN_RE = re.compile(r"(?<![-\w])(?P<name>" + _NAME + r")(?P<sep>=)(?P<value>\"[^\"]*\"|'[^']*'|[^\s'\",]+)")
_URL_CRED_RE = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
_BEARER_RE = re.compile(r"(?i)\b(?P<kind>bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")


def is_secret_name(name: str) -> bool:
    """True for flag or variable names that hold secrets: ``--api-key``, ``HF_TOKEN``, ``db_password``..."""
    bare = name.lstrip("-")
    parts = [p for p in re.split(r"[-_.]|(?<=[a-z0-9])(?=[A-Z])", bare) if p]
    for p in parts:
        low = p.lower()
        if low in _SECRET_PARTS or low.endswith(_SECRET_SUFFIXES):
            return True
    return False


def _scrub_value(value: str) -> str:
    """Credentials embedded in a value itself (``https://user:pw@host``)."""
    return _URL_CRED_RE.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value)


def scrub_argv(argv: Iterable[str]) -> list[str]:
    """A command line with the values of secret-looking flags (``--x-token V``, ``--x-token=V``) and
    assignments (``API_KEY=V``) replaced by ``***``; credentials inside URLs go too."""
    out: list[str] = []
    hide_next = False
    for item in argv:
        item = str(item)
        if hide_next:
            hide_next = False
            if not item.startswith("-"):
                out.append(REDACTED)
                continue
        if item.startswith("-") and len(item) > 1:
            name, eq, _value = item.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{name}={REDACTED}")
                else:
                    out.append(item)
                    hide_next = True
                continue
        elif "=" in item and not item.startswith("="):
            name, _, _value = item.partition("=")
            if re.fullmatch(_NAME, name) and is_secret_name(name):
                out.append(f"{name}={REDACTED}")
                continue
        out.append(_scrub_value(item))
    return out


def scrub_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of an environment with the values of secret-looking variables replaced by ``***``."""
    return {k: (REDACTED if is_secret_name(k) else _scrub_value(str(v))) for k, v in env.items()}


def scrub_text(text: str) -> str:
    """Free text (a log message) with secret-looking ``--flag value``, ``NAME=value``, URL credentials and
    ``Bearer``/``Basic`` tokens replaced by ``***``. Values of other names are left alone."""
    if not text:
        return text

    def flag(m: re.Match[str]) -> str:
        return f"{m['name']}{m['sep']}{REDACTED}" if is_secret_name(m["name"]) else m[0]

    text = _FLAG_RE.sub(flag, text)
    text = _ASSIGN_RE.sub(flag, text)
    text = _BEARER_RE.sub(lambda m: f"{m['kind']} {REDACTED}", text)
    return _scrub_value(text)


class ScrubFilter(logging.Filter):
    """Scrubs every record's message (and traceback) before any handler formats it (see :func:`scrub_text`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the handler's to report
            return True
        clean = scrub_text(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub_text("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        return True


class RateLimitedLog:
    """At most one record per ``interval`` seconds (per ``key``) through ``logger``; the records held back are
    counted, and the next one that goes out (or :meth:`flush`) says how many there were. For messages an
    outside party can trigger at will (refused connections, malformed input), so that they cannot flood the log.
    Thread-safe."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval > 0:
            raise ValueError(f"RateLimitedLog interval must be > 0 seconds, got {interval}")
        self.logger = logger
        self.interval = float(interval)
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[object, float] = {}
        self._held: dict[object, tuple[int, int, str, tuple[Any, ...]]] = {}  # key → (count, level, msg, args)
        self.total = 0  # every call, emitted or not

    def log(self, level: int, msg: str, *args: Any, key: object = None) -> bool:
        """Log now if this key's interval has passed, else count it; True when a line was written."""
        key = msg if key is None else key
        now = self._clock()
        with self._lock:
            self.total += 1
            if now < self._next.get(key, -float("inf")):
                n = self._held.get(key, (0,))[0]
                self._held[key] = (n + 1, level, msg, args)
                return False
            self._next[key] = now + self.interval
            held = self._held.pop(key, None)
        if held is not None:
            self.logger.log(level, msg + " (and %d more like it in the last %.0f s)", *args, held[0], self.interval)
        else:
            self.logger.log(level, msg, *args)
        return True

    def warning(self, msg: str, *args: Any, key: object = None) -> bool:
        return self.log(logging.WARNING, msg, *args, key=key)

    def flush(self, *, force: bool = False) -> None:
        """Write the count of records held back for keys whose interval has passed (all keys if ``force``)."""
        now = self._clock()
        with self._lock:
            due = [k for k in self._held if force or now >= self._next.get(k, 0.0)]
            items = [(k, self._held.pop(k)) for k in due]
            for k in due:
                self._next[k] = now + self.interval
        for _k, (n, level, msg, args) in items:
            self.logger.log(level, "%d more like this in the last %.0f s; last: " + msg, n, self.interval, *args)


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
            d["exc"] = record.exc_text or "".join(traceback.format_exception(*record.exc_info))
        for k, v in vars(record).items():
            if k not in _STANDARD and k not in d and not k.startswith("_"):
                d[k] = v
        return json.dumps(d, default=str, separators=(",", ":"))


class AppendHandler(logging.Handler):
    """One ``os.write`` per record on an ``O_APPEND`` file: lines from many processes never interleave.

    A write the filesystem refuses (a full disk, a quota, a vanished mount) is said once on stderr, in one
    line, and the records after it are counted in ``lost``: logging's own "--- Logging error ---" traceback
    for every record would bury the terminal and tell nothing more."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lost = 0  # records the file did not take

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
            if self._fd is not None:
                n = os.write(self._fd, line)
                if n != len(line):  # a full disk took part of the line
                    raise OSError(f"only {n} of {len(line)} bytes written")
        except OSError as e:
            self.lost += 1
            if self.lost == 1:
                try:
                    sys.stderr.write(f"resilient: cannot write the log file {self.path}: {e.strerror or e}; "
                                     "log records from now on go to the terminal only\n")
                except Exception:  # noqa: BLE001 - no stderr either: nothing left to tell
                    pass
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


class OnceTracebackFormatter(logging.Formatter):
    """For people: a failure that repeats shows its traceback the first time only; later ones are one line
    (the message and the exception), with a pointer to the first. The JSON log file keeps every traceback."""

    def __init__(self, fmt: str | None = None, *, limit: int = 256) -> None:
        super().__init__(fmt)
        self._seen: set[tuple[object, ...]] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info
        if not exc or exc[0] is None:
            return super().format(record)
        tb = exc[2]
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else None
        key = (record.name, str(record.msg), exc[0], where)
        with self._lock:
            first = key not in self._seen
            if first and len(self._seen) < self._limit:
                self._seen.add(key)
        if first:
            return super().format(record)
        short = logging.makeLogRecord(dict(vars(record), exc_info=None, exc_text=None, stack_info=None))
        return f"{super().format(short)} [{exc[0].__name__}: {str(exc[1]).splitlines()[0] if str(exc[1]) else ''}; " \
               "same failure as above, traceback shown once]"


def _int_or_none(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def forget_setup() -> None:
    """Undo :func:`setup_logging` in a process forked from one that called it (the agent's fork server): its
    handlers are the parent's (their files and terminal state), and the process must log as a fresh interpreter
    does until it sets up its own."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _MARK, False):
            root.removeHandler(h)  # not closed: its descriptor is no longer the file's (see zygote.serve_inherited)
    root.setLevel(logging.WARNING)
    logging.captureWarnings(False)


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
    lvl = level if level is not None else os.environ.get(renv.LOG_LEVEL, "INFO")
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
            ch.setFormatter(OnceTracebackFormatter(f"[{role} {where}] %(name)s: %(message)s"))
        else:
            ch = logging.StreamHandler(sys.stderr)
            ch.setFormatter(OnceTracebackFormatter(f"[{role}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(ch)
    scrub = ScrubFilter()
    for h in handlers:
        setattr(h, _MARK, True)
        h.addFilter(scrub)  # secrets never reach a log file or a terminal
        root.addHandler(h)
    logging.captureWarnings(True)
    return path
