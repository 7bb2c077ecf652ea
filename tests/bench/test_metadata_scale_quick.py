"""bench/metadata_scale.py --quick: rank 0 of an FSDP2 job of 4 and 16 ranks plans its restore from the job's global
``.metadata`` (every tensor planned straight into its DTensor target), and the bench reports every figure the README
quotes. No timing is asserted: load decides them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "metadata_scale.py"


@pytest.mark.timeout(300)
def test_quick_mode_reports_both_sides_per_world_size(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "quick" and [w["world"] for w in doc["worlds"]] == [4, 16]
    for w in doc["worlds"]:
        assert w["chunks"] == w["world"] * doc["tensors"] and w["planned_straight"] == doc["tensors"]
        assert set(w["seconds"]) == {"dcp_unpickle", "dcp_plan", "metadata", "plan_load", "direct_plan", "manifests",
                                     "index", "metadata_verify"}
        assert w["metadata_verify_before_s"] > 0
        # rank 0's own entries: the same size whatever the world (its chunks only), planned to the same places
        assert w["index_bytes"] > 0 and w["index_over_dcp"] > 0 and w["index_build_s"] >= 0
        # the save side: the other nodes get a save's ids (their places and bytes), not its .metadata
        sp = w["spread"]
        assert 0 < sp["offer_bytes"] < 1000 and sp["sent_before_bytes"] == w["metadata_bytes"] * (w["world"] - 1)
        assert sp["rank0_before_s"] >= 0 and sp["rank0_now_s"] >= 0 and sp["leader_make_s"] >= 0
        assert sp["manifest_hash_before_s"] >= 0
        assert w["manifests_received_bytes"] > 0
        assert w["ours_over_dcp"] > 0 and w["metadata_bytes"] > 0 and w["parsed_rss_mb"] >= 0
    assert "ours/DCP" in p.stdout and "index/DCP" in p.stdout and "indexed restart verified it" in p.stdout
    assert doc["worlds"][0]["index_bytes"] == doc["worlds"][1]["index_bytes"]


@pytest.mark.timeout(60)
def test_bad_world_sizes_are_refused_naming_the_flag() -> None:
    p = subprocess.run([sys.executable, str(BENCH), "--worlds", "8,x"], cwd=ROOT, capture_output=True, text=True,
                       timeout=50)
    assert p.returncode == 2 and "--worlds" in p.stderr and "8,x" in p.stderr
