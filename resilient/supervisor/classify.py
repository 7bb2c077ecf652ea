"""Why a failure happened, as one stable class: a pure function of an event's kind and details.

The agent writes what it knows about a failure into the event (the error file's exception type, message and
frame; the kernel's OOM kill counter; the signal), the checkpointer what it knows about a restore that found
nothing usable; :func:`classify` turns those facts into a :class:`FailureClass` the policy reads
(``JobView.failure_class``). Nothing here reads a file or a clock, so the table of cases in the tests is the
whole specification.

==========================  ===================================================================================
class                       facts
==========================  ===================================================================================
``state_unrecoverable``     the worker raised ``NoRestorableStepError``/``StateUndefinedError`` (or the event
                            says ``state_undefined``): no restart can restore the state
``resource``                the kernel's OOM killer (SIGKILL and ``memory.events`` oom_kill grew), or an
                            out-of-memory exception (``OutOfMemoryError``, ``MemoryError``); a host check failing
``hardware``                a GPU health event (ECC, Xid, remapped rows), or an exception naming an uncorrectable
                            GPU error
``preemption``              a preemption notice
``transient``               a collective that failed because a peer died (``consequence``: the blame stays with
                            the first failure), a rank killed from outside (SIGKILL, SIGTERM) with no OOM kill
``software``                any other Python exception the error file names: a bug, the same on every attempt
``unknown``                 an exit code or a crash signal with no error file, a hang, a lost node
==========================  ===================================================================================
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from resilient.events.api import EventKind


class FailureClass(str, enum.Enum):
    TRANSIENT = "transient"  # a restart fixes it
    SOFTWARE = "software"  # the script raised: a restart repeats it unless the cause was outside
    STATE_UNRECOVERABLE = "state_unrecoverable"  # no checkpoint can be restored: restarts cannot help
    RESOURCE = "resource"  # out of memory (kernel OOM kill or an allocation failing), a host check
    HARDWARE = "hardware"  # the node's hardware: replace the node
    PREEMPTION = "preemption"  # the scheduler takes the node back
    UNKNOWN = "unknown"


# exception type names (the error file has the name, not the class): the last dotted part is matched
STATE_ERRORS = frozenset({"NoRestorableStepError", "StateUndefinedError"})
OOM_ERRORS = frozenset({"OutOfMemoryError", "MemoryError"})
# a collective whose peer is gone: the first failure is elsewhere (torch's names, and gloo's and NCCL's texts)
PEER_ERRORS = frozenset({"DistNetworkError"})
PEER_TEXTS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "nccl communicator was aborted", "remote process exited", "ncclremoteerror",
              "socket timeout", "read error", "connectfullmesh failed")
GPU_TEXTS = ("uncorrectable ecc", "ecc error", "xid", "illegal memory access was encountered by the hardware",
             "gpu is lost", "fallen off the bus", "cuda error: unknown error", "nvlink")
KILL_SIGNALS = frozenset({"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"})

_BY_NAME = {c.value: c for c in FailureClass}


def _short_type(name: Any) -> str:
    return str(name).rsplit(".", 1)[-1] if name else ""


def peer_consequence(exc_type: Any, message: Any) -> bool:
    """Whether an exception says a collective failed because a peer went away (the failure is elsewhere)."""
    t = _short_type(exc_type)
    m = str(message or "").lower()
    return t in PEER_ERRORS or any(s in m for s in PEER_TEXTS)


def classify(kind: EventKind | str, details: Mapping[str, Any] | None) -> FailureClass:
    """The failure class of an event of ``kind`` with ``details`` (the ledger's keys). A ``failure_class`` the
    event already carries wins when it names a class (the agent that saw the failure knew more)."""
    d = details if isinstance(details, Mapping) else {}
    given = d.get("failure_class")
    if isinstance(given, str) and given in _BY_NAME:
        return _BY_NAME[given]
    try:
        k = EventKind(kind)
    except ValueError:
        return FailureClass.UNKNOWN
    if k is EventKind.PREEMPTION_NOTICE:
        return FailureClass.PREEMPTION
    if k is EventKind.GPU_UNHEALTHY:
        return FailureClass.HARDWARE
    if k is EventKind.HOST_UNHEALTHY:
        return FailureClass.RESOURCE
    if k in (EventKind.HANG, EventKind.AGENT_LOST):
        return FailureClass.UNKNOWN
    if d.get("state_undefined") is True:
        return FailureClass.STATE_UNRECOVERABLE
    if k is not EventKind.WORKER_EXIT:
        return FailureClass.UNKNOWN
    if d.get("preempted") is True:
        return FailureClass.PREEMPTION
    sig = d.get("signal")
    oom = d.get("oom_kill")
    if oom is True:
        return FailureClass.RESOURCE
    exc = _short_type(d.get("exc_type"))
    msg = str(d.get("message") or "").lower()
    if exc in STATE_ERRORS:
        return FailureClass.STATE_UNRECOVERABLE
    if exc in OOM_ERRORS or "out of memory" in msg:
        return FailureClass.RESOURCE
    if exc and any(s in msg for s in GPU_TEXTS):
        return FailureClass.HARDWARE
    if d.get("consequence") is True or (exc and peer_consequence(exc, msg)):
        return FailureClass.TRANSIENT
    if exc:
        return FailureClass.SOFTWARE
    if isinstance(sig, str) and sig in KILL_SIGNALS:
        return FailureClass.TRANSIENT
    return FailureClass.UNKNOWN
