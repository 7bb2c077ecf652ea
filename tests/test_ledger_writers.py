"""One ledger file per writing process, one time line for every reader.

On a shared volume ``O_APPEND`` is not atomic across clients, so no two processes may append to one file: each
real process here claims its own file, and ``read_events``/``read_ledger``/``LedgerTail`` merge them on wall
time; a run directory of the old layout (every writer in ``events.jsonl``) still reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.events import EventKind, Ledger, read_events
from resilient.events.follow import LedgerTail, ledger_files, read_ledger
from tests.goodput.conftest import finish, kill_group, launch

WRITERS, EACH = 4, 150


def _fork_writers(run_dir: Path, n: int, each: int) -> None:
    """``n`` real processes that open their ledgers, wait for one go, then all write at once."""
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pids = []
    for w in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(go_w)
                led = Ledger(run_dir, node=f"w{w}")
                os.write(ready_w, b"r")
                os.read(go_r, 1)  # the parent closes its end: every writer starts at once
                for i in range(each):
                    led.emit(EventKind.LOG, message="x" * 300, i=i)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(ready_w)
    os.close(go_r)
    got = b""
    while len(got) < n:
        chunk = os.read(ready_r, n)
        assert chunk, "a writer died before it was ready"
        got += chunk
    os.close(go_w)  # go: every reader of go_r sees end of file now
    os.close(ready_r)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.timeout(60)
def test_processes_writing_at_once_each_get_their_own_file_and_one_merged_time_line(tmp_path):
    _fork_writers(tmp_path, WRITERS, EACH)
    files = ledger_files(tmp_path)
    assert len(files) == WRITERS, files
    assert files[0].name == "events.jsonl"  # the first writer keeps the name users know
    for f in files:  # never two writers in one file
        nodes = {json.loads(line)["node"] for line in f.read_text().splitlines()}
        assert len(nodes) == 1, (f.name, nodes)
    evs = list(read_events(tmp_path))
    assert len(evs) == WRITERS * EACH
    assert {(e.node, e.details["i"]) for e in evs} == {(f"w{w}", i) for w in range(WRITERS) for i in range(EACH)}
    walls = [e.wall for e in evs]
    assert walls == sorted(walls)
    # a path to events.jsonl stands for the whole run (``--ledger RUN_DIR/events.jsonl``)
    assert len(list(read_events(tmp_path / "events.jsonl"))) == WRITERS * EACH


@pytest.mark.timeout(60)
def test_a_process_forked_with_a_ledger_open_writes_to_a_file_of_its_own(tmp_path):
    led = Ledger(tmp_path, node="parent")
    led.emit(EventKind.LOG, message="before")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            led.emit(EventKind.LOG, message="child")
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    led.emit(EventKind.LOG, message="after")
    led.close()
    by_file = {f.name: [json.loads(x)["details"]["message"] for x in f.read_text().splitlines()]
               for f in ledger_files(tmp_path)}
    assert sorted(by_file.values()) == [["before", "after"], ["child"]], by_file
    assert [e.details["message"] for e in read_events(tmp_path)] == ["before", "child", "after"]


def test_a_run_directory_of_the_old_layout_still_reads(tmp_path):
    # every writer in one events.jsonl, lines of two nodes interleaved, and the old lost-events marker
    lines = [{"kind": "run_start", "wall": 10.0, "node": "a", "details": {}},
             {"kind": "step", "wall": 11.0, "node": "a", "rank": 0, "details": {"step": 0, "seconds": 1.0}},
             {"kind": "run_start", "wall": 10.5, "node": "b", "details": {}},
             {"kind": "run_end", "wall": 12.0, "node": "a", "details": {"exit_code": 0}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    (tmp_path / "events.jsonl.incomplete").write_text(json.dumps({"wall": 11.5, "who": "b", "kind": "step",
                                                                   "error": "No space left on device"}) + "\n")
    read = read_ledger(tmp_path)
    assert [(e.kind.value, e.node) for e in read.events] == [(d["kind"], d["node"]) for d in lines]
    assert read.files == [tmp_path / "events.jsonl"] and read.skipped == 0
    assert read.incomplete is not None and "No space left" in read.incomplete


def test_a_torn_last_line_in_one_writers_file_hides_no_other(tmp_path):
    _fork_writers(tmp_path, 3, 5)
    files = ledger_files(tmp_path)
    with open(files[1], "ab") as f:  # that writer killed mid-line
        f.write(b'{"kind":"log","wall":')
    read = read_ledger(tmp_path)
    assert len(read.events) == 15 and read.cut_last_line and read.skipped == 0
    # and the writers' lost-events markers count wherever they are
    assert read.incomplete is None
    (files[2].with_name(files[2].name + ".incomplete")).write_text("")
    assert read_ledger(tmp_path).incomplete is not None


def test_a_tail_follows_every_writer_and_writers_that_come_later(tmp_path):
    _fork_writers(tmp_path, 2, 3)
    tail = LedgerTail(tmp_path)
    assert len(tail.read_new()) == 6
    with open(ledger_files(tmp_path)[0], "ab") as f:
        f.write(b'{"kind":"log","details":{},"wall":')  # a line still being written waits for its newline
    _fork_writers(tmp_path, 2, 4)  # two more writers, files the tail has never seen
    new = tail.read_new()
    assert len(new) == 8 and [e.wall for e in new] == sorted(e.wall for e in new)
    with open(ledger_files(tmp_path)[0], "ab") as f:
        f.write(b'99.0}\n')
    (late,) = tail.read_new()
    assert late.wall == 99.0 and tail.read_new() == []


@pytest.mark.timeout(180)
def test_a_real_job_leaves_one_file_per_writer_and_goodput_reports_as_from_one_file(tmp_path):
    """The real launcher, 2 workers, rank 1 SIGKILLed once: the agent, rank 0 of each attempt and rank 1, each wrote a
    file of its own; ``resilient goodput`` on it reports what it reports on the same events in one file."""
    run = tmp_path / "run"
    proc = launch(run, steps=12, save_every=4, crash_at=6)
    try:
        out = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    files = ledger_files(run)
    kinds = {f.name: {json.loads(x)["kind"] for x in f.read_text().splitlines()} for f in files}
    assert "run_start" in kinds["events.jsonl"] and "step" not in kinds["events.jsonl"], kinds
    steps_by_file = [{json.loads(x)["attempt"] for x in f.read_text().splitlines() if '"step"' in x}
                     for f in files[1:]]
    # rank 0 of each attempt a file of its own; rank 1 (which recorded its injected fault) another
    assert sorted(sorted(s) for s in steps_by_file if s) == [[0], [1]], kinds
    assert sum("fault_injected" in k for k in kinds.values()) == 1 and len(files) == 4, kinds
    # the same events as the one file every writer shared before, in the order they were written
    old = tmp_path / "old"
    old.mkdir()
    lines = [x for f in files for x in f.read_text().splitlines(keepends=True)]
    (old / "events.jsonl").write_text("".join(sorted(lines, key=lambda x: json.loads(x)["wall"])))

    def goodput(d: Path) -> dict:
        r = subprocess.run([sys.executable, "-m", "resilient.cli", "goodput", str(d), "--json"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    now, before = goodput(run), goodput(old)
    assert now == before
    assert now["restarts"] == 1 and not now["in_progress"]
