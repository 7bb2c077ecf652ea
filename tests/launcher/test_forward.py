"""The agent's forwarder of checkpoint boundaries (resilient.launcher.forward): real ledger files written by real
Ledger writers (one of them in another process), read by the forwarder's own tail."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from resilient.events import Event, EventKind, Ledger
from resilient.launcher.forward import ForwardConfig, Forwarder
from tests._helpers.wait import wait_for

NODE = "host:1"


def _done(step: int, node: str = NODE, tier: str = "local") -> Event:
    return Event(EventKind.CKPT_TIER_DONE, node=node, rank=0, details={"step": step, "tier": tier})


def _sent(f: Forwarder) -> list[tuple[str, object]]:
    got: list[Event] = []
    f.pump(got.append)
    return [(e.node, e.details.get("step")) for e in got]


def _worker_writes(run_dir: str, steps: list[int]) -> None:
    """A worker process: a ledger file of its own (events.<host>-<pid>.jsonl)."""
    led = Ledger(run_dir)
    for s in steps:
        led.write(_done(s))
        led.emit(EventKind.STEP, rank=0, step=s)
    led.close()


def test_only_this_nodes_events_of_the_kinds_and_not_the_past(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    agent.write(_done(1))  # a past run's boundary in the same directory: not news
    f = Forwarder(ForwardConfig(tmp_path, NODE))
    f._tail.skip_to_end()  # what start() does first, without the thread: this test polls itself
    agent.write(_done(2))
    agent.emit(EventKind.STEP, step=2)  # not a kind the supervisor reads from ledgers
    agent.write(Event(EventKind.CKPT_TIER_FAILED, node=NODE, details={"step": 2, "tier": "peer"}))
    agent.write(_done(3, node="host:2"))  # another node's, in a shared run directory: that node forwards it
    p = multiprocessing.get_context("fork").Process(target=_worker_writes, args=(str(tmp_path), [4, 5]))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert len(list(tmp_path.glob("events*.jsonl"))) == 2  # the agent's and the worker's
    assert f.poll() == 3
    assert _sent(f) == [(NODE, 2), (NODE, 4), (NODE, 5)]
    assert f.poll() == 0 and _sent(f) == []


def test_a_torn_line_waits_for_its_end_and_one_being_written_at_start_is_passed_over(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    whole = (json.dumps(_done(7).to_json()) + "\n").encode()
    with open(path, "wb") as fh:
        fh.write(json.dumps(_done(6).to_json()).encode()[:5])  # a writer at work when the agent starts
        fh.flush()
        f = Forwarder(ForwardConfig(tmp_path, NODE))
        f._tail.skip_to_end()
        fh.write(json.dumps(_done(6).to_json()).encode()[5:] + b"\n")  # its rest names the kind, and is no event
        fh.write(whole[:25])  # torn: the rest comes later
        fh.flush()
        assert f.poll() == 0
        fh.write(whole[25:])
        fh.write(b'{"kind": "ckpt_tier_done", "node": "' + NODE.encode() + b'", "wall": "x"}\n')  # malformed
        fh.flush()
        assert f.poll() == 1
    assert _sent(f) == [(NODE, 7)]
    assert f._tail.skipped == 1


def test_nothing_is_forwarded_twice_when_a_file_is_read_again(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    f = Forwarder(ForwardConfig(tmp_path, NODE))
    f._tail.skip_to_end()
    agent.write(_done(1))
    assert f.poll() == 1
    # the file replaced under the tail (copied back by a sync tool, say): the tail reads it again from its start
    data = agent.path.read_bytes()
    agent.close()
    tmp = tmp_path / "copy.tmp"
    tmp.write_bytes(data + (json.dumps(_done(2).to_json()) + "\n").encode())
    os.replace(tmp, agent.path)  # a new inode: both files existed at once
    assert f.poll() == 1
    assert _sent(f) == [(NODE, 1), (NODE, 2)]


def test_the_thread_forwards_and_stop_returns_without_waiting_out_the_interval(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    agent.write(_done(0))  # before the start: the past
    f = Forwarder(ForwardConfig(tmp_path, NODE, interval=0.05)).start()
    agent.write(_done(1))
    got: list[Event] = []
    wait_for(lambda: f.pump(got.append) > 0 or bool(got), 10, "the boundary to be queued by the thread")
    f.poll()
    f.pump(got.append)
    assert [e.details["step"] for e in got] == [1]
    f.stop(timeout=5)
    assert not f._thread.is_alive()
    # an interval far longer than stop()'s bound: the thread wakes for the stop, it does not sleep the interval out
    slow = Forwarder(ForwardConfig(tmp_path, NODE, interval=60)).start()
    slow.stop(timeout=5)
    assert not slow._thread.is_alive()


def test_a_full_queue_drops_the_oldest(tmp_path: Path) -> None:
    agent = Ledger(tmp_path, node=NODE)
    f = Forwarder(ForwardConfig(tmp_path, NODE, max_queued=2))
    f._tail.skip_to_end()
    for s in range(5):
        agent.write(_done(s))
    assert f.poll() == 5
    assert _sent(f) == [(NODE, 3), (NODE, 4)] and f.dropped == 3


@pytest.mark.parametrize("kw", [{"interval": 0}, {"interval": float("nan")}, {"interval": True}, {"kinds": ()},
                                {"kinds": ("ckpt_tier_done",)}, {"node": ""}, {"max_queued": 0}, {"rescan": 0}])
def test_config_is_checked(tmp_path: Path, kw: dict) -> None:
    with pytest.raises(ValueError):
        ForwardConfig(**{"run_dir": tmp_path, "node": NODE, **kw})


def test_the_tail_lists_the_directory_only_when_it_changed_or_the_rescan_is_due(tmp_path: Path) -> None:
    from resilient.events.follow import LedgerTail

    agent = Ledger(tmp_path, node=NODE)
    agent.write(_done(1))
    old = 1_000_000_000 * 10**9  # 2001: far older than the coarse clock's tick
    os.utime(tmp_path, ns=(old, old))
    tail = LedgerTail(tmp_path, rescan=3600)
    assert [e.details["step"] for e in tail.read_new()] == [1]
    # a new file whose creation left the directory's time as it was (as a change within one tick of the coarse
    # clock can): not listed before the rescan is due...
    hidden = tmp_path / "events.other-1.jsonl"
    hidden.write_text(json.dumps(_done(2).to_json()) + "\n")
    os.utime(tmp_path, ns=(old, old))
    assert tail.read_new() == []
    # ...but a change of the directory's time is seen at once
    (tmp_path / "events.other-2.jsonl").write_text(json.dumps(_done(3).to_json()) + "\n")
    assert sorted(e.details["step"] for e in tail.read_new()) == [2, 3]
    # and without a change the rescan comes when it is due
    due = LedgerTail(tmp_path, rescan=0.05)
    due.read_new()
    os.utime(tmp_path, ns=(old, old))
    due.read_new()  # listed: the directory's time is old now, so this listing is the one kept
    (tmp_path / "events.other-3.jsonl").write_text(json.dumps(_done(4).to_json()) + "\n")
    os.utime(tmp_path, ns=(old, old))
    got: list[Event] = []
    wait_for(lambda: got.extend(due.read_new()) or got, 10, "the rescan to find the new file")
    assert [e.details["step"] for e in got] == [4]
