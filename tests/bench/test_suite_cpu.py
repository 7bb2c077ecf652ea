"""bench/suite_cpu.py counts a command's CPU by kind of process, its children included."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_a_busy_child_is_counted_and_the_exit_status_passed_on(tmp_path):
    busy = tmp_path / "busy.py"
    # a grandchild that spends 2 s of CPU (counted however slowly the machine runs it), then fails
    busy.write_text("import subprocess, sys\n"
                    "subprocess.run([sys.executable, '-c', 'import time\\nwhile time.process_time() < 2.0: pass'])\n"
                    "sys.exit(3)\n")
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "suite_cpu.py"), "--out", str(out), "--",
                        sys.executable, str(busy)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 1, r.stdout + r.stderr  # the command failed: so does the measurement
    got = json.loads(out.read_text())
    assert got["exit"] == 3 and got["command"][-1] == str(busy)
    # the busy loop's process: most of its 2 s seen (the last read is at most a period before it ends)
    assert got["by_kind"]["other"]["cpu_s"] > 1.0, got
    assert "kind of process" in r.stdout and "this sampler" in got["by_kind"]
    # no command: refused with a message
    r = subprocess.run([sys.executable, str(REPO / "bench" / "suite_cpu.py")], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "give the command" in r.stderr
