"""Malformed ledger lines of any shape are skipped and counted: by ``resilient goodput``, by the report, and by
the metrics endpoint, which keeps answering. A file that is no ledger at all gets one line and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.goodput.api import GoodputError
from resilient.goodput.calculator import compute_report, report_for_run
from resilient.goodput.metrics import MetricsServer
from resilient.events.follow import parse_line, read_ledger

pytestmark = pytest.mark.timeout(180)

MISTYPED = [
    b'{"kind":"step","node":"n0","rank":0,"attempt":0,"details":{"step":3,"seconds":0.1},"wall":"x","mono":0}',
    b'{"kind":"restart","node":"n0","attempt":1,"details":null,"wall":1700000000.0,"mono":0}',
    b'{"kind":"step","node":"n0","rank":0,"attempt":[1],"details":{"step":3},"wall":1700000000.0,"mono":0}',
    b'{"kind":"no_such_kind","wall":1700000000.0}',
    b'{"kind":"step","wall":1e999}',
    b'{"kind":"step","wall":true}',
    b'[1, 2, 3]',
    b'"just a string"',
    b'{"kind": "step", "wall": 1700000000.0, "node": 7}',
    b'\xff\xfe not even utf-8',
    b'{' * 5000 + b'}' * 5000,
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", *args], capture_output=True, text=True,
                          timeout=120)


def corrupted_copy(src, dst, bad_lines):
    shutil.copytree(src, dst)
    path = dst / "events.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    step = max(1, len(lines) // (len(bad_lines) + 1))
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i % step == 0 and bad_lines:
            out.append(bad_lines.pop() + b"\n")
    out += [b + b"\n" for b in bad_lines]
    path.write_bytes(b"".join(out))
    return dst


def test_mistyped_lines_are_skipped_and_counted(crashed_run, tmp_path):
    clean = json.loads(run_cli(str(crashed_run), "--json", "--now", "0").stdout)
    bad = corrupted_copy(crashed_run, tmp_path / "bad", list(MISTYPED))
    res = run_cli(str(bad), "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["skipped_lines"] == len(MISTYPED)
    assert d["goodput"] == clean["goodput"] and d["restarts"] == clean["restarts"] == 1
    table = run_cli(str(bad))
    assert table.returncode == 0 and f"{len(MISTYPED)} malformed ledger line(s) skipped" in table.stdout


@pytest.mark.parametrize("content", [b"", b"hello\nworld\n", bytes(range(256)) * 64 + b"\n",
                                     b'{"a": 1}\n[1]\n', b"\n".join(MISTYPED) + b"\n"])
def test_a_file_that_is_no_ledger_is_one_line_and_exit_2(tmp_path, content):
    (tmp_path / "events.jsonl").write_bytes(content)
    res = run_cli(str(tmp_path))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("resilient goodput:"), res.stderr
    with pytest.raises(GoodputError):
        report_for_run(tmp_path)


def test_a_directory_without_a_ledger_and_an_unreadable_ledger(tmp_path):
    res = run_cli(str(tmp_path / "missing"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    (tmp_path / "events.jsonl").mkdir()
    res = run_cli(str(tmp_path))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
KEYS = ["kind", "node", "rank", "attempt", "details", "wall", "mono", "schema"]
KINDS = ["step", "restart", "attempt_start", "attempt_end", "worker_exit", "hang", "ckpt_save", "ckpt_restore",
         "run_start", "run_end", "scale", "action", "ckpt_tier_done", "straggler"]
DETAIL_KEYS = ["step", "seconds", "attempt", "world_size", "new_world_size", "exit_code", "signal", "cause",
               "detect_seconds", "last_heartbeat_age", "blocking_seconds", "action", "tier"]


@st.composite
def shaped_event(draw):
    """Mostly well-formed envelopes with hostile values: what gets past the shape check must not crash."""
    d = {"kind": draw(st.sampled_from(KINDS)), "wall": draw(st.floats(1.7e9, 1.7e9 + 1e4)),
         "details": draw(st.dictionaries(st.sampled_from(DETAIL_KEYS), json_values, max_size=4))}
    for k in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        d[k] = draw(json_values)
    return json.dumps(d, allow_nan=True).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(shaped_event() | st.binary(max_size=40), max_size=12))
def test_any_shape_of_line_never_crashes_the_report(crashed_run, lines):
    base = read_ledger(crashed_run).events
    extra = [ev for ev in (parse_line(raw) for raw in lines) if ev is not None]
    for now in (None, 1.7e9 + 2e4):
        rep = compute_report(base + extra, now=now)
        assert 0.0 <= rep.goodput <= 1.0
        json.dumps(rep.to_json(timeline=True))


def test_metrics_keep_answering_over_malformed_lines(crashed_run, tmp_path):
    bad = corrupted_copy(crashed_run, tmp_path / "bad", list(MISTYPED))
    with MetricsServer(0, str(bad)) as srv:
        for _ in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
                assert r.status == 200
                text = r.read().decode()
        assert f"resilient_ledger_skipped_lines_total {float(len(MISTYPED))}" in text
        assert "resilient_goodput_ratio" in text
