"""The exit wait for finished backward passes (``drain_backward_state``) on real threads: it ends as soon as the
last outside reference goes, and it never counts its own references as outside ones."""
from __future__ import annotations

import contextvars
import threading
import time
import types

import pytest

from resilient.worker import exit_safety as client


def test_drain_ends_when_a_thread_lets_go_of_a_context_it_held(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = contextvars.copy_context()
    holder = [ctx]  # the thread's reference, as gloo's work object holds the backward's context
    client._backward_contexts[:] = [ctx]
    del ctx
    polled = threading.Event()  # the drain found the context held and waits to look again
    released = threading.Event()

    def sleep(s: float) -> None:
        polled.set()
        time.sleep(s)

    monkeypatch.setattr(client, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))

    def release() -> None:
        if polled.wait(30):
            holder.clear()
            released.set()

    t = threading.Thread(target=release)
    t.start()
    try:
        # with a list of the held contexts kept from one poll to the next, that list was itself a reference,
        # so a context found held once looked held until the timeout: the wait must not see its own references
        assert client.drain_backward_state(timeout=30.0) is True
        assert released.is_set()
        assert client._backward_contexts == []
    finally:
        t.join(10)
        client._backward_contexts.clear()


def test_drain_reports_a_context_held_past_the_timeout() -> None:
    ctx = contextvars.copy_context()
    keep = [ctx]
    client._backward_contexts[:] = [ctx]
    del ctx
    try:
        assert client.drain_backward_state(timeout=0.1) is False
        assert len(client._backward_contexts) == 1  # kept: the atexit drain may try again
    finally:
        client._backward_contexts.clear()
        keep.clear()


def test_every_backward_context_a_thread_still_holds_is_kept_until_released() -> None:
    """A starved gloo thread may destroy a work (and so release its backward's context) several backward passes
    late; keeping only the newest contexts let such an exit abort (caught in a core dump). Real contexts,
    stashed where torch's backward puts them; released ones are dropped, held ones kept whatever their age."""
    import torch

    client._backward_contexts.clear()
    held_by_thread: list[object] = []
    try:
        for i in range(5):
            ctx = contextvars.copy_context()
            if i == 0:
                held_by_thread.append(ctx)  # the oldest backward's work not yet destroyed
            torch._C._stash_obj_in_tls("context", ctx)
            client._remember_context(torch)
            client._remember_context(torch)  # seen twice in one backward: one entry
            torch._C._remove_obj_from_tls("context")
            del ctx
        kept = list(client._backward_contexts)
        assert len(kept) == 2 and kept[0] is held_by_thread[0], kept  # the held oldest one and the newest
        del kept
        assert client.drain_backward_state(timeout=0.1) is False  # the oldest is still held
        held_by_thread.clear()
        assert client.drain_backward_state(timeout=30.0) is True
    finally:
        client._backward_contexts.clear()
