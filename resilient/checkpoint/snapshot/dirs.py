"""The node's snapshot directory, owned by the node agent (standard library only: the agent imports it before torch).

The agent makes one directory under ``/dev/shm`` when it starts (``resilient-snap-<run>-<pid>``, mode 0700) and hands
it to its workers; their snapshots outlive them there, so a restarted worker finds them. The agent removes it at its
end. An agent that was killed cannot: the next agent on the host removes directories whose owner is gone (its pid and
its start time, so a reused pid does not keep a dead agent's memory).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
PREFIX = "resilient-snap-"
OWNER = "owner"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def _owner_alive(d: Path) -> bool:
    try:
        pid_s, start, ns = ((d / OWNER).read_text().split() + ["?"])[:3]
        pid = int(pid_s)
    except (OSError, ValueError):
        # no owner record: a directory being made this instant (an agent writes its record right after mkdir), or
        # not an agent's at all; left alone unless untouched for an hour (then an empty one of a crashed agent)
        try:
            import time

            return time.time() - d.stat().st_mtime < 3600
        except OSError:
            return False
    if ns != _pid_namespace():
        return True  # another container's agent sharing this /dev/shm: its pids mean nothing here
    return _start_time(pid) == start


def sweep(root: str | os.PathLike[str] = DEFAULT_ROOT) -> list[str]:
    """Remove the snapshot directories under ``root`` whose agent is gone; returns what was removed."""
    removed = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.name.startswith(PREFIX) or not d.is_dir() or d.is_symlink():
            continue
        try:
            if d.stat().st_uid != os.getuid():
                continue  # another user's job
        except OSError:
            continue
        if not _owner_alive(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    if removed:
        logger.info("removed %d snapshot director%s of agents that are gone: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def make_dir(run_id: str, root: str | os.PathLike[str] = DEFAULT_ROOT) -> str | None:
    """This agent's snapshot directory (made now), or None when ``root`` is unusable (the snapshot tier is then off,
    and the message says why)."""
    if not os.path.isdir(root):
        logger.info("snapshot tier off: %s does not exist on this host", root)
        return None
    sweep(root)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64] or "run"
    d = Path(root) / f"{PREFIX}{safe}-{os.getpid()}"
    try:
        shutil.rmtree(d, ignore_errors=True)  # an earlier process of this pid (a reused pid): not ours to keep
        d.mkdir(mode=0o700)
        start = _start_time(os.getpid())
        (d / OWNER).write_text(f"{os.getpid()} {start} {_pid_namespace()}\n")
    except OSError as e:
        logger.warning("snapshot tier off: cannot make %s (%s)", d, e)
        shutil.rmtree(d, ignore_errors=True)
        return None
    return str(d)


def remove_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
