"""The process a user's policy runs in (``python -m resilient.supervisor.policy_host FD FILE``).

Started once per job by :class:`resilient.supervisor.policy.IsolatedPolicy`, it limits itself (address space,
CPU time, no core files), loads the policy file with the in-process loader, says whether that worked, then
answers one request at a time: an event and the read-only view in, an action (or why there is none) out, as
JSON over the socket whose descriptor it was given. Nothing the policy does here can reach the supervisor: a
crash, an ``os._exit``, an endless loop or a huge allocation ends or stalls this process only, and the
supervisor's side kills and restarts it.

A fork is refused after the fact: the child of any ``os.fork`` made by the policy exits at once (before any
policy code runs in it), and the decision during which it happened is reported as a failure, so a policy
cannot leave copies of itself (or of the host's socket) behind.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from typing import Any

# exit codes of the host itself (the parent tells them apart from the policy's own os._exit codes by the
# "load" / "bye" messages it got first, so these only need to be distinct from 0)
EXIT_BAD_ARGS = 64
EXIT_FORK_CHILD = 70

MAX_MESSAGE = 1 << 20  # a request or an answer larger than this is refused (a reason string is text for people)

_forks = 0
_host_pid = os.getpid()


def _in_child() -> None:
    # the child of a fork made by the policy: it must not run the policy's code, nor answer on our socket
    os._exit(EXIT_FORK_CHILD)


def _in_parent() -> None:
    global _forks
    if os.getpid() == _host_pid:
        _forks += 1


def set_limits(memory_bytes: int, cpu_seconds: int) -> None:
    """Address space and CPU time of this process; a limit the system does not allow lowering to is left
    as is (the parent reports what it asked for)."""
    for res, soft, hard in ((resource.RLIMIT_AS, memory_bytes, memory_bytes),
                            (resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),  # SIGXCPU, then SIGKILL
                            (resource.RLIMIT_CORE, 0, 0)):
        try:
            cur_soft, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            pass


def _view_from_json(d: dict[str, Any]) -> Any:
    from resilient.events.api import Event
    from resilient.supervisor.api import JobView, NodeState, NodeView

    nodes = {n: NodeView(**{**v, "state": NodeState(v["state"])}) for n, v in d["nodes"].items()}
    return JobView(nodes=nodes, min_nodes=d["min_nodes"], max_nodes=d["max_nodes"],
                   nproc_per_node=d["nproc_per_node"], restarts_left=d["restarts_left"], attempt=d["attempt"],
                   ckpt_steps=d["ckpt_steps"], recent=tuple(Event.from_json(e) for e in d["recent"]),
                   failure_window=d["failure_window"], now=d["now"], pending_scale_up=tuple(d["pending_scale_up"]),
                   joining=tuple(d.get("joining", ())), nodes_per_replica=d.get("nodes_per_replica"),
                   replacement_wait_left=float(d.get("replacement_wait_left", 0.0)))


def _send(conn: Any, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, default=str).encode()
    if len(data) > MAX_MESSAGE:
        data = json.dumps({"id": msg.get("id"), "nonsense": f"an answer of {len(data):,} bytes (over the "
                                                             f"{MAX_MESSAGE:,}-byte limit)"}).encode()
    conn.send_bytes(data)


def _decide(policy: Any, req: dict[str, Any]) -> dict[str, Any]:
    from resilient.events.api import Event
    from resilient.supervisor.api import Action
    from resilient.supervisor.policy import out_of_memory

    global _forks
    out: dict[str, Any] = {"id": req["id"]}
    event = Event.from_json(req["event"])
    view = _view_from_json(req["view"])
    _forks = 0
    try:
        action = policy.decide(event, view)
    except BaseException as e:  # noqa: BLE001 - whatever the policy raises (SystemExit too) is its failure
        out["memory" if out_of_memory(e) else "raised"] = traceback.format_exc()
        return out
    if _forks:
        out["forked"] = _forks
    elif not isinstance(action, Action) or type(action) is Action:
        out["nonsense"] = f"{action!r:.200}"
    else:
        out["action"] = action.to_json()
    return out


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    if len(argv) != 4:
        print("usage: python -m resilient.supervisor.policy_host FD FILE MEMORY_BYTES CPU_SECONDS", file=sys.stderr)
        return EXIT_BAD_ARGS
    fd, path, memory, cpu = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    conn = Connection(fd)
    set_limits(memory, cpu)
    os.register_at_fork(after_in_child=_in_child, after_in_parent=_in_parent)

    from resilient.supervisor.api import PolicyError
    from resilient.supervisor.policy import load_policy

    try:
        policy = load_policy(path, isolated=False)
    except PolicyError as e:
        _send(conn, {"load": "error", "error": str(e)})
        return 0
    except MemoryError:
        _send(conn, {"load": "memory"})
        return 0
    if _forks:
        _send(conn, {"load": "forked"})
        return 0
    _send(conn, {"load": "ok", "name": repr(policy)[:200]})
    while True:
        try:
            data = conn.recv_bytes(MAX_MESSAGE)
        except (EOFError, OSError):
            return 0  # the supervisor closed its end (or died): nothing left to decide for
        req = json.loads(data)
        if req.get("bye"):
            return 0
        _send(conn, _decide(policy, req))


if __name__ == "__main__":
    # os._exit: a thread the policy started must not keep this process alive once the supervisor is gone
    os._exit(main(sys.argv[1:]))
