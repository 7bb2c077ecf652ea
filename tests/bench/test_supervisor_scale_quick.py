"""bench/supervisor_scale.py end to end at the smallest size: a real ``resilient supervisor`` and one fake fleet
process over the real transport, a steady phase and a short failure storm; the curve's JSON holds both phases, the
last agent's read of each plan, and the keys of earlier versions."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "supervisor_scale.py"


@pytest.mark.timeout(300)
def test_one_small_size_gives_both_phases_and_every_agents_read(tmp_path):
    out = tmp_path / "scale.json"
    p = subprocess.run([sys.executable, str(BENCH), "--sizes", "4", "--spares", "1", "--nproc", "2", "--procs", "1",
                        "--steady-seconds", "1", "--seconds", "5", "--fault-rate", "2", "--poll", "0.2",
                        "--core-seconds", "0", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["sizes"] == [4] and len(d["curve"]) == 1
    r = d["curve"][0]
    assert d["transport"] == r  # the one size is also under the key of earlier versions
    assert set(r["phases"]) == {"steady", "storm"}
    assert r["phases"]["steady"]["faults_pushed"] == 0 and r["phases"]["steady"]["plans"] == 0
    storm = r["phases"]["storm"]
    assert storm["faults_pushed"] >= 1 and r["decision_ms"]["n"] >= 1, storm
    read = r["decision_all_read_ms"]
    # every plan that answered a fault was read by all 5 agents, or superseded before they all read it
    assert read["n"] + read["superseded_unread"] == r["decision_ms"]["n"] and read["n"] >= 1, read
    assert r["fleet"]["agents"] == 5 and r["fleet"]["schedule_lateness_ms"]["max"] >= 0
    for key in ("cpu_share_of_one_core", "steady_cpu_share_of_one_core", "decided_ms", "store", "supervisor",
                "load_average"):
        assert key in r, key


def test_bad_sizes_exit_2():
    p = subprocess.run([sys.executable, str(BENCH), "--sizes", "256,zero"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "--sizes takes comma-separated integers" in p.stderr, p.stderr
