"""What a user reads: one line per repeated failure, no dict reprs, no probabilities for a deterministic crash."""

from __future__ import annotations

import io
import logging

from resilient.events.api import Event, EventKind
from resilient.launcher.report import describe as _describe
from resilient.logs import OnceTracebackFormatter
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import SupervisorCore


def _crash(core: SupervisorCore, node: str, rank: int, code: int, at: float):
    ev = Event(EventKind.WORKER_EXIT, node=node, rank=rank, attempt=core.assignment.attempt,
               details={"exit_code": code, "signal": None}, mono=at, wall=1.7e9 + at)
    return core.handle(ev, at)


def test_same_rank_failing_the_same_way_is_counted_not_called_bad_luck() -> None:
    core = SupervisorCore(SupervisorConfig(min_nodes=2, max_nodes=2, nproc_per_node=2, max_restarts=10))
    for n in ("a", "b"):
        core.join(n, 2, 0.0)
    core.form(0.0)
    reasons = [_crash(core, "b", 3, 3, 5.0 + i)[0].action.reason for i in range(3)]
    assert "same way" not in reasons[0] and "bad luck" in reasons[0], reasons[0]
    assert "rank 3 failed the same way (exit code 3) 2 times in a row" in reasons[1], reasons[1]
    assert "rank 3 failed the same way (exit code 3) 3 times in a row" in reasons[2], reasons[2]
    assert all("bad luck" not in r and "%" not in r for r in reasons[1:]), reasons
    # another way of failing starts the count again, and the chance is quoted again
    r = _crash(core, "b", 3, 1, 9.0)[0].action.reason
    assert "same way" not in r and "bad luck" in r, r


def test_restart_line_names_fields_without_a_dict_repr() -> None:
    line = _describe({"action": "hot_swap", "node": "h:1", "spare": "h:2", "cool_down": None,
                      "reason": "node h:1 lost: spare h:2 takes its place"})
    assert line == "hot_swap node=h:1 spare=h:2: node h:1 lost: spare h:2 takes its place"
    assert "{" not in _describe({"action": "scale_down", "nodes": ["a", "b"], "reason": "r"})
    assert _describe({"action": "scale_down", "nodes": ["a", "b"]}) == "scale_down nodes=a,b"


def test_a_repeated_failure_shows_its_traceback_once() -> None:
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(OnceTracebackFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("resilient.test_noise")
    log.addHandler(h)
    log.propagate = False
    try:
        for i in range(3):
            try:
                raise OSError(f"store unreachable {i}")
            except OSError:
                log.exception("supervisor pass failed; going on")
        try:
            raise ValueError("another")
        except ValueError:
            log.exception("supervisor pass failed; going on")
    finally:
        log.removeHandler(h)
        log.propagate = True
    out = buf.getvalue()
    assert out.count("Traceback (most recent call last)") == 2, out  # the OSError once, the ValueError once
    assert "ERROR supervisor pass failed; going on [OSError: store unreachable 2; same failure as above" in out, out
