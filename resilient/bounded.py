"""The one way to bound a call that cannot be cancelled: run it on a daemon thread, wait at most a timeout.

A remote store that is down can hold one call for minutes (gcsfs retries a refused connection with backoff),
and a policy can loop forever; the caller must get its answer in time. Python cannot cancel a thread, so a
call that overruns is abandoned: it runs on in a daemon thread that never delays exit. Abandoned threads are
counted per :class:`BoundedCaller`; once ``max_abandoned`` of them are still running, further calls fail at
once instead of starting yet another thread against the same dead service. With ``serial=True`` a call is
refused while an earlier one still runs (a stateful callee, such as a policy, must never see two calls at
once).

A service that comes back does not wake the calls it left behind at once (gcsfs sleeps up to 32 s between its
retries), so a plain cap refuses every call for as long as a minute after an outage. With ``probe=True`` a call
beyond the cap is still made while no other such call is in flight, up to twice the cap in threads: a probe that
answers shows the service is back, and from then on calls go through as before the outage while the stragglers
finish; a probe that overruns is abandoned like any call.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class CallBusy(TimeoutError):
    """Refused without calling: earlier calls overran and still run (``serial``, or ``max_abandoned`` reached)."""


class BoundedCaller:
    """Bounded calls with a cap on the threads left behind by calls that overran."""

    def __init__(self, name: str, max_abandoned: int = 4, serial: bool = False, probe: bool = False):
        if max_abandoned < 1:
            raise ValueError(f"max_abandoned={max_abandoned} must be at least 1")
        if serial and probe:
            raise ValueError("serial=True refuses any call beside a running one: it cannot probe")
        self.name, self.max_abandoned, self.serial, self.probe = name, max_abandoned, serial, probe
        self._lock = threading.Lock()
        self._running: set[threading.Thread] = set()
        self._probing = False  # a call beyond the cap is in flight
        # the newest overrun and the newest answer (a result or an exception within the bound), as counters
        self._events = 0
        self._abandoned_at = 0
        self._answered_at = 0

    def abandoned(self) -> int:
        """Calls that overran their bound and have not returned yet."""
        with self._lock:
            self._running = {t for t in self._running if t.is_alive()}
            return len(self._running)

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """``fn()``'s result or exception; ``TimeoutError`` if it has not returned after ``timeout_s``."""
        n = self.abandoned()
        probing = False
        if (self.serial and n) or n >= self.max_abandoned:
            with self._lock:
                answered = self._answered_at > self._abandoned_at  # the service answered since the last overrun
                if not self.probe or n >= 2 * self.max_abandoned or (not answered and self._probing):
                    raise CallBusy(f"{what}: not called, {n} earlier call(s) of {self.name} still running after "
                                   f"overrunning their time limit")
                if not answered:
                    self._probing = probing = True
        try:
            return self._call(fn, timeout_s, what)
        finally:
            if probing:
                with self._lock:
                    self._probing = False

    def _call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        box: list[tuple[bool, object]] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            finally:
                done.set()

        t = threading.Thread(target=run, name=f"resilient-{self.name}", daemon=True)
        t.start()
        if not done.wait(timeout_s):
            with self._lock:
                self._running.add(t)
                self._events += 1
                self._abandoned_at = self._events
            raise TimeoutError(f"{what}: no answer within {timeout_s:.1f} s")
        with self._lock:
            self._events += 1
            self._answered_at = self._events
        ok, value = box[0]
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]
