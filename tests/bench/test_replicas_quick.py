"""bench/replicas.py's command line refuses a scenario it cannot run. The scenario itself runs through the same
command line in ``tests/cluster/test_replicas_2d.py`` (4 agents of 2 workers: its goals, and every figure the
README quotes); a second run of it here at 1 worker per node would prove nothing more."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "replicas.py"


def test_bad_arguments_exit_2_with_one_line():
    p = subprocess.run([sys.executable, str(BENCH), "--steps", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "kill_after" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
