import os

from resilient.events import Event, EventKind, Ledger, read_events


def test_ledger_round_trip_and_truncated_tail(tmp_path):
    with Ledger(tmp_path, node="n0", attempt=2) as led:
        led.emit(EventKind.STEP, rank=0, step=1, seconds=0.5)
        led.emit(EventKind.WORKER_EXIT, rank=1, exit_code=-9, signal="SIGKILL")
    # a crash mid-write leaves a partial last line
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"kind":"step","det')
    evs = list(read_events(tmp_path))
    assert [e.kind for e in evs] == [EventKind.STEP, EventKind.WORKER_EXIT]
    assert evs[0].details == {"step": 1, "seconds": 0.5} and evs[0].attempt == 2 and evs[0].node == "n0"


def test_ledger_lines_from_many_processes_do_not_interleave(tmp_path):
    n = 200
    pids = []
    for w in range(4):
        pid = os.fork()
        if pid == 0:
            led = Ledger(tmp_path, node=f"w{w}")
            for i in range(n):
                led.emit(EventKind.LOG, message="x" * 500, i=i)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    evs = list(read_events(tmp_path))
    assert len(evs) == 4 * n
    assert all(isinstance(e, Event) for e in evs)


def test_unknown_kind_line_is_skipped(tmp_path):
    # every reader applies the same rules: a line without a wall time is not an event (the accounting needs it)
    (tmp_path / "events.jsonl").write_text('{"kind":"nope","wall":1.0}\n{"kind":"log","details":{}}\n'
                                           '{"kind":"log","details":{},"wall":2.0}\n')
    assert [(e.kind, e.wall) for e in read_events(tmp_path)] == [(EventKind.LOG, 2.0)]
