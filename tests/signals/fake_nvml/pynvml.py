"""A stand-in for ``pynvml`` (nvidia-ml-py) where no GPU exists: the answers come from a state the test sets.

Only the calls :mod:`resilient.signals.gpu` makes, with NVML's error codes. The state is the dict ``STATE`` (tests
in the same process set it), or else the JSON file named by ``FAKE_NVML_STATE``, read again on every call (a test
drives an agent process that has this directory on its ``PYTHONPATH``). Its form::

    {"init": "ok" | "fail" | "block",
     "devices": [{"uuid": "GPU-…", "temperature": 40, "ecc": 0, "remapped": [corr, unc, pending, failure],
                  "clocks": 0, "recovery_action": 0, "xids": [79, …], "lost": false, "block": false,
                  "unsupported": ["remapped_rows", "xid", …]}]}

``xids`` lists every Xid so far: each arrives once on the event set registered for its GPU. ``block`` makes every
call on that GPU (``init``: nvmlInit) wait until the state stops saying so (at most 60 s). Every call is counted
in ``CALLS`` (name → count).
"""
from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

STATE: dict | None = None
CALLS: dict[str, int] = {}
_LOCK = threading.Lock()
_DELIVERED: dict[int, int] = {}  # device index → Xids delivered

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
nvmlEventTypeXidCriticalError = 0x8


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded", 10: "Timeout", 15: "GPU is lost"}.get(
            self.value, f"NVML error {self.value}")


def _state() -> dict:
    if STATE is not None:
        return STATE
    with open(os.environ["FAKE_NVML_STATE"]) as f:
        return json.load(f)


def _count(name: str) -> None:
    with _LOCK:
        CALLS[name] = CALLS.get(name, 0) + 1


def _wait_unblocked(pred) -> None:
    deadline = time.monotonic() + 60
    while pred(_state()) and time.monotonic() < deadline:
        time.sleep(0.02)


def _dev(handle: int, check: str | None = None) -> dict:
    _wait_unblocked(lambda s: s["devices"][handle].get("block"))
    d = _state()["devices"][handle]
    if d.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if check is not None and check in d.get("unsupported", ()):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return d


def nvmlInit() -> None:
    _count("nvmlInit")
    _wait_unblocked(lambda s: s.get("init") == "block")
    if _state().get("init") == "fail":
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)


def nvmlShutdown() -> None:
    _count("nvmlShutdown")


def nvmlDeviceGetCount() -> int:
    _count("nvmlDeviceGetCount")
    return len(_state()["devices"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    _count("nvmlDeviceGetHandleByIndex")
    _dev(i)
    return i


def nvmlDeviceGetUUID(h: int) -> str:
    _count("nvmlDeviceGetUUID")
    return _state()["devices"][h]["uuid"]


def nvmlDeviceGetTemperature(h: int, sensor: int) -> int:
    _count("nvmlDeviceGetTemperature")
    return _dev(h, "temperature").get("temperature", 40)


def nvmlDeviceGetTotalEccErrors(h: int, error_type: int, counter: int) -> int:
    _count("nvmlDeviceGetTotalEccErrors")
    return _dev(h, "ecc_uncorrected").get("ecc", 0)


def nvmlDeviceGetRemappedRows(h: int) -> tuple[int, int, int, int]:
    _count("nvmlDeviceGetRemappedRows")
    return tuple(_dev(h, "remapped_rows").get("remapped", [0, 0, 0, 0]))


def nvmlDeviceGetCurrentClocksEventReasons(h: int) -> int:
    _count("nvmlDeviceGetCurrentClocksEventReasons")
    return _dev(h, "throttle").get("clocks", 0)


def nvmlDeviceGetFieldValues(h: int, field_ids: list[int]) -> list:
    _count("nvmlDeviceGetFieldValues")
    d = _dev(h)
    ret = NVML_ERROR_NOT_SUPPORTED if "recovery_action" in d.get("unsupported", ()) else NVML_SUCCESS
    return [SimpleNamespace(fieldId=f, nvmlReturn=ret, value=SimpleNamespace(uiVal=d.get("recovery_action", 0)))
            for f in field_ids]


def nvmlEventSetCreate() -> dict:
    _count("nvmlEventSetCreate")
    return {"devices": []}


def nvmlDeviceRegisterEvents(h: int, event_types: int, event_set: dict) -> None:
    _count("nvmlDeviceRegisterEvents")
    _dev(h, "xid")
    event_set["devices"].append(h)
    with _LOCK:
        _DELIVERED[h] = len(_state()["devices"][h].get("xids", []))  # only Xids after registration arrive


def nvmlEventSetWait_v2(event_set: dict, timeout_ms: int) -> SimpleNamespace:
    _count("nvmlEventSetWait_v2")
    for h in event_set["devices"]:
        xids = _dev(h).get("xids", [])
        with _LOCK:
            n = _DELIVERED.get(h, 0)
            if n < len(xids):
                _DELIVERED[h] = n + 1
                return SimpleNamespace(device=h, eventType=nvmlEventTypeXidCriticalError, eventData=xids[n])
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(event_set: dict) -> None:
    _count("nvmlEventSetFree")


def reset() -> None:
    """Forget calls and delivered Xids (between tests in one process)."""
    with _LOCK:
        CALLS.clear()
        _DELIVERED.clear()
