"""Where a command's CPU goes, by kind of process: run it while reading ``/proc`` four times a second, and add up
each process's CPU (user + system) by what it is (an agent, a fork server, a worker, a CLI call, a kernel thread).
Made for the test suite, which is CPU-bound on two cores: it shows which processes a cut would have to touch.

    python bench/suite_cpu.py -- .venv/bin/python -m pytest -q -n 2 --dist loadfile tests
    python bench/suite_cpu.py --out /tmp/cpu.json -- .venv/bin/python -m pytest -q tests/launcher

Every process on the machine is counted (the kernel's threads too: a reclaim thread can take a sixth of it), not
only the command's. A process that lives less than a sampling period is missed (its CPU is at most that period).
Prints a table and writes JSON (default bench/results/suite_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")

# (kind, pattern on the command line), first match wins; forked processes keep their parent's command line
KINDS = (
    ("pytest workers", r"exec\(eval\(sys\.stdin"),
    ("fork servers (exec'd)", r"resilient\.launcher\.zygote"),
    ("agents, their fork servers and workers", r"resilient\.run|resilient-run"),
    ("supervisor (resilient supervisor)", r"resilient\.cli supervisor|resilient supervisor"),
    ("checkpoint CLI (resilient ckpt)", r"resilient\.cli ckpt|resilient\.checkpoint\.cli"),
    ("other resilient CLI", r"resilient\.cli|bin/resilient "),
    ("policy processes", r"policy_host"),
    ("tests' own fork server (multiprocessing)", r"multiprocessing\.forkserver"),
    ("benchmarks", r"bench/"),
    ("torchrun", r"torch\.distributed\.run|torchrun"),
    ("fake GCS server", r"fake-gcs"),
    ("test scripts", r"tests/"),
)


def _sample(seen: dict[str, list]) -> None:
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            rest = stat[stat.rindex(")") + 2:].split()
            ticks = int(rest[11]) + int(rest[12])
            key = f"{p}:{rest[19]}"  # pid and start time: a reused pid is another process
            row = seen.get(key)
            if row is None:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                if not cmd:  # a kernel thread (or a zombie): its name
                    cmd = "[" + stat[stat.index("(") + 1:stat.rindex(")")] + "]"
                row = seen[key] = [cmd, ticks]
            row[1] = max(row[1], ticks)
        except (OSError, ValueError, IndexError):
            pass  # it ended while being read


def kind_of(cmd: str) -> str:
    if cmd.startswith("["):
        return "kernel " + re.sub(r"[/:].*", "", cmd.strip("[]"))
    for kind, pat in KINDS:
        if re.search(pat, cmd):
            return kind
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--period", type=float, default=0.25, help="seconds between two reads of /proc (default 0.25)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds before the command is killed")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "suite_cpu.json")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to measure after --")
    seen: dict[str, list] = {}
    _sample(seen)
    before = {k: v[1] for k, v in seen.items()}  # what ran before the command is counted from now on only
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        if time.monotonic() - t0 > a.timeout:
            proc.kill()
            break
        _sample(seen)
        time.sleep(a.period)
    _sample(seen)
    wall = time.monotonic() - t0
    by_kind: dict[str, list[float]] = {}
    me = f"{os.getpid()}:"
    for key, (c, ticks) in seen.items():
        used = (ticks - before.get(key, 0)) / TICK
        if used <= 0:
            continue
        row = by_kind.setdefault("this sampler" if key.startswith(me) else kind_of(c), [0.0, 0])
        row[0] += used
        row[1] += 1
    total = sum(v[0] for v in by_kind.values())
    cores = os.cpu_count() or 1
    print(f"{' '.join(cmd)[:100]}\nexit {proc.returncode}, {wall:.0f} s wall, {total:.0f} CPU-seconds counted "
          f"({total / (wall * cores):.0%} of {cores} cores)")
    print(f"{'kind of process':44}{'CPU s':>10}{'share':>8}{'processes':>11}")
    for kind, (cpu, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{kind[:44]:44}{cpu:10.1f}{cpu / total:8.1%}{n:11d}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": cmd, "exit": proc.returncode, "wall_s": wall, "cores": cores,
                                 "cpu_s": total, "period_s": a.period,
                                 "by_kind": {k: {"cpu_s": v[0], "processes": v[1]} for k, v in by_kind.items()}},
                                indent=1))
    print(f"wrote {a.out}")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
