"""GPU health through NVML (``nvidia-ml-py``'s ``pynvml``), read by the node monitor's health thread.

Each round reads, for every GPU of this node's workers, a set of typed checks (:class:`GpuCheck`, whose values
are the stable names in a ``gpu_unhealthy`` event's ``check``): present (``reachable``), answering within a
bound (``responsive``), uncorrectable ECC errors since the driver loaded, row-remapping failure or pending
remap, critical Xid events, temperature, clock-event reasons that mean hardware trouble, and the driver's
recovery action. :class:`~resilient.signals.health.HostChecks` turns the readings into transitions.

Every NVML call runs through :class:`~resilient.bounded.BoundedCaller`: a wedged driver turns into a
``responsive`` reading instead of a stuck health thread; while a GPU's earlier call still hangs, no new one is
started against it. A check NVML does not support on this GPU is skipped from then on, said once. Without
``pynvml`` or a driver the whole of it is skipped (said once). ``nvidia-smi`` is never run.

Which GPUs: those in ``CUDA_VISIBLE_DEVICES`` when it restricts them (indices, ``GPU-`` UUIDs or unique UUID
prefixes, ``MIG-`` UUIDs meaning their parent GPU), else every GPU of the node. An index there is CUDA's
order, NVML's is PCI bus order; they agree on nodes of one GPU model (CUDA orders the fastest first and breaks
ties by bus id), and UUIDs agree everywhere.

nvidia-resiliency-ext's ``GPUHealthCheck`` reads the same recovery-action field (driver r570+); it is not called
here because it runs ``nvmlInit``/``nvmlShutdown`` around every check under a process-wide lock without a bound,
looks at every GPU of the node, and answers one bool (the GPU and the action only go to its log), while an event
must name the GPU and the action. Its field query and reading of the answer are what :func:`_recovery_action`
does; nvidia-resiliency-ext stays optional.
"""

from __future__ import annotations

import enum
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient.bounded import BoundedCaller

logger = logging.getLogger(__name__)


class GpuCheck(str, enum.Enum):
    REACHABLE = "reachable"  # NVML finds the GPU (not fallen off the bus, not "GPU is lost")
    RESPONSIVE = "responsive"  # the GPU's round of NVML calls returned within the bound
    ECC_UNCORRECTED = "ecc_uncorrected"  # volatile uncorrectable ECC errors (since the driver loaded)
    REMAPPED_ROWS = "remapped_rows"  # a row remap failed, or one waits for a GPU reset
    XID = "xid"  # a critical Xid event since the last round
    TEMPERATURE = "temperature"
    THROTTLE = "throttle"  # clocks lowered by hardware slowdown, HW thermal slowdown or the power brake
    RECOVERY_ACTION = "recovery_action"  # the driver says the GPU needs a reset, a reboot or a drain


# Xid numbers, from NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, "Analyzing Xid Errors with the Xid
# Catalog", the "Resolution Bucket (Immediate Action)" column, and the A100/H100 memory error management guide).
# Application faults (immediate action RESTART_APP): the worker that caused them fails and is restarted; the GPU
# is fine. Reported into the ledger, never unhealthy.
XID_APPLICATION = frozenset({
    8,  # GPU stopped processing
    11,  # invalid or corrupted push buffer stream
    13,  # graphics engine exception (an illegal instruction or address in a kernel)
    31,  # GPU memory page fault (an illegal address)
    43,  # GPU stopped processing (a channel aborted after the application's error)
    45,  # preemptive cleanup (a channel torn down when its process exited or was killed)
})
# Hardware or firmware faults: the GPU needs a reset, a reboot or a replacement.
XID_CRITICAL = frozenset({
    48,  # double-bit (uncorrectable) ECC error
    62,  # internal micro-controller halt
    63,  # row-remapping (or page-retirement) recording event: takes effect only after a GPU reset
    64,  # row-remapping (or page-retirement) recording failure
    74,  # NVLink error
    79,  # GPU has fallen off the bus
    92,  # high single-bit ECC error rate
    94,  # contained ECC error (the GPU needs a reset to remap the row)
    95,  # uncontained ECC error
    119,  # GSP RPC timeout
    120,  # GSP error
    140,  # unrecovered ECC error
})
# Any other Xid (e.g. 154, "recovery action changed", which the recovery-action check reads itself) is reported
# and not acted on: a GPU that keeps failing its workers is swapped by the policy's failure counting anyway.

# clock-event reason bits (nvmlClocksEventReason*; the same values as the older nvmlClocksThrottleReason*)
_CLOCK_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
HW_CLOCK_REASONS = 0x8 | 0x40 | 0x80  # hardware trouble; idle, application clocks and power caps are not

_RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset",
                     5: "recover_imex_domain", 6: "bus_reset", 7: "system_reboot"}
_FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, for bindings that predate its name
_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED
_FUNCTION_NOT_FOUND = 13  # NVML_ERROR_FUNCTION_NOT_FOUND: a driver older than the binding
_TIMEOUT = 10  # NVML_ERROR_TIMEOUT: nvmlEventSetWait found no event
_GPU_IS_LOST = 15  # NVML_ERROR_GPU_IS_LOST
_XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
_MAX_XIDS_PER_ROUND = 64  # a storm of events is drained over several rounds, never in one unbounded loop


@dataclass(frozen=True)
class GpuHealthConfig:
    """``call_timeout``: seconds one GPU's round of NVML calls may take before it counts as unresponsive (a
    healthy round takes milliseconds; without persistence mode a query of an idle GPU can take about a second).
    ``throttle_rounds``: consecutive rounds a hardware clock slowdown must last before it counts (it can flicker
    for a moment on a power excursion). ``visible_devices``: ``CUDA_VISIBLE_DEVICES`` as the workers get it
    (None: every GPU of the node)."""

    temperature_threshold: float = 90.0
    call_timeout: float = 10.0
    throttle_rounds: int = 2
    xid_wait_ms: int = 0
    visible_devices: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.temperature_threshold < 200:
            raise ValueError(f"GPU temperature threshold must be in (0, 200) °C, got {self.temperature_threshold}")
        if not 0 < self.call_timeout < float("inf"):
            raise ValueError(f"NVML call timeout must be > 0 seconds, got {self.call_timeout}")
        if isinstance(self.throttle_rounds, bool) or not isinstance(self.throttle_rounds, int) \
                or self.throttle_rounds < 1:
            raise ValueError(f"throttle_rounds must be a whole number >= 1, got {self.throttle_rounds!r}")
        if isinstance(self.xid_wait_ms, bool) or not isinstance(self.xid_wait_ms, int) \
                or not 0 <= self.xid_wait_ms <= 1000:
            raise ValueError(f"xid_wait_ms must be a whole number of milliseconds in [0, 1000], got {self.xid_wait_ms!r}")


@dataclass(frozen=True)
class GpuReading:
    """One check's answer for one GPU: ``bad`` says unhealthy; ``extra`` goes into the event beside the value."""

    index: int | None  # NVML index; None: NVML itself (the node's driver), not one GPU
    uuid: str | None
    check: GpuCheck
    value: Any
    bad: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"gpu{'' if self.index is None else self.index}:{self.check.value}"


@dataclass(frozen=True)
class XidNote:
    """An Xid that is not unhealthy (an application fault, or one not in the tables): reported, not acted on."""

    index: int
    uuid: str | None
    xid: int
    kind: str  # "application" | "unknown"


@dataclass
class _Gpu:
    index: int
    uuid: str | None
    handle: Any
    events: Any = None  # the event set its Xids arrive on; None: not supported
    unsupported: set[GpuCheck] = field(default_factory=set)
    hw_slow_rounds: int = 0
    caller: BoundedCaller | None = None


def _code(e: BaseException) -> int | None:
    v = getattr(e, "value", None)
    return v if isinstance(v, int) else None


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def select_devices(visible: str | None, uuids: list[str | None]) -> list[int]:
    """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` names (CUDA's rules: the list ends at the first entry that
    names no GPU); every index when it is None. ``MIG-`` entries are resolved by the caller."""
    if visible is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            i = int(entry)
            if not 0 <= i < len(uuids):
                break
            found = [i]
        else:
            found = [i for i, u in enumerate(uuids) if u is not None and u.startswith(entry)]
            if len(found) != 1:
                break  # no GPU, or an ambiguous prefix: CUDA stops here too
        if found[0] not in out:
            out.append(found[0])
    return out


class GpuHealth:
    """The NVML side of the host checks. First use (on the health thread) loads NVML; ``round()`` gives this
    round's readings and the Xids to report; ``close()`` frees the event sets and shuts NVML down."""

    def __init__(self, config: GpuHealthConfig, nvml: Any = None) -> None:
        self.config = config
        self.nvml: Any = nvml  # a pynvml module (the tests hand one in); None: imported on first use
        self.gpus: list[_Gpu] = []
        self.state = "new"  # new → ready | absent; "pending" while a timed-out nvmlInit may still run
        self.rounds = 0  # rounds completed with NVML loaded (a bench waits for the first)
        self.last: list[GpuReading] = []
        self._init_caller = BoundedCaller("nvml-init", max_abandoned=1, serial=True)
        self._said: set[tuple[int | None, str]] = set()

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        """Import pynvml, nvmlInit, find this node's workers' GPUs and register their Xid events (one bounded call)."""
        nv = self.nvml
        if nv is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the pynvml wrapper package warns about itself on import
                import pynvml as nv
        nv.nvmlInit()
        count = nv.nvmlDeviceGetCount()
        handles: list[Any] = []
        uuids: list[str | None] = []
        for i in range(count):
            try:
                handles.append(nv.nvmlDeviceGetHandleByIndex(i))
            except Exception as e:  # noqa: BLE001 — a lost GPU is watched all the same: its rounds say unreachable
                logger.warning("GPU health: GPU %d has no NVML handle (%s)", i, e)
                handles.append(None)
            try:
                uuids.append(_text(nv.nvmlDeviceGetUUID(handles[-1])) if handles[-1] is not None else None)
            except Exception:  # noqa: BLE001 — a GPU without a readable UUID can still be picked by index
                uuids.append(None)
        visible = self.config.visible_devices
        chosen = select_devices(self._resolve_mig(nv, visible, uuids), uuids)
        gpus = []
        for i in chosen:
            g = _Gpu(i, uuids[i], handles[i], caller=BoundedCaller(f"nvml-gpu{i}", max_abandoned=1, serial=True))
            if g.handle is not None:
                g.events = self._register_xids(nv, g)
            gpus.append(g)
        self.nvml, self.gpus = nv, gpus
        logger.info("GPU health: NVML loaded; watching GPU(s) %s of %d%s", [g.index for g in gpus], count,
                    "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible})")

    def _resolve_mig(self, nv: Any, visible: str | None, uuids: list[str | None]) -> str | None:
        """``MIG-`` entries replaced by their parent GPU's UUID (a MIG slice's health is its GPU's)."""
        if visible is None or "MIG-" not in visible:
            return visible
        out = []
        for entry in visible.split(","):
            entry = entry.strip()
            if entry.startswith("MIG-"):
                try:
                    mig = nv.nvmlDeviceGetHandleByUUID(entry)
                    parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
                    entry = _text(nv.nvmlDeviceGetUUID(parent))
                except Exception as e:  # noqa: BLE001 — an unknown MIG id ends the list, as in CUDA
                    logger.warning("GPU health: %s names no MIG device NVML knows (%s)", entry, e)
                    break
            out.append(entry)
        return ",".join(out)

    def _register_xids(self, nv: Any, g: _Gpu) -> Any:
        try:
            s = nv.nvmlEventSetCreate()
            try:
                nv.nvmlDeviceRegisterEvents(g.handle, _XID_CRITICAL_ERROR, s)
            except Exception:
                nv.nvmlEventSetFree(s)
                raise
            return s
        except Exception as e:  # noqa: BLE001 — NotSupported on some GPUs and in some containers
            self._once(g.index, "xid-register", logging.INFO,
                       "GPU %s: Xid events not readable (%s): the xid check is skipped", g.index, e)
            g.unsupported.add(GpuCheck.XID)
            return None

    def _ensure_loaded(self) -> list[GpuReading]:
        """Readings about NVML itself: none once loaded; ``responsive`` bad while nvmlInit hangs."""
        if self.state in ("ready", "absent"):
            return []
        try:
            self._init_caller.call(self._load, self.config.call_timeout, "nvmlInit")
            self.state = "ready"
            return []
        except TimeoutError as e:
            if self.state != "pending":
                logger.warning("GPU health: NVML did not load within %.1f s: %s", self.config.call_timeout, e)
            self.state = "pending"
            return [GpuReading(None, None, GpuCheck.RESPONSIVE, str(e), True)]
        except ImportError:
            logger.info("pynvml is not installed: GPU health checks skipped")
        except Exception as e:  # noqa: BLE001 — NVMLError subclasses vary by version; any means "no GPU"
            logger.info("NVML unavailable (%s): GPU health checks skipped", e)
        self.state = "absent"
        self.nvml = None
        return []

    # ------------------------------------------------------------------ a round
    def round(self) -> tuple[list[GpuReading], list[XidNote]]:
        before = self.state
        out = self._ensure_loaded()
        if before == "pending" and self.state != "pending":
            out = [GpuReading(None, None, GpuCheck.RESPONSIVE, True, False)]  # NVML answers again: re-armed
        if self.state != "ready":
            return out, []
        notes: list[XidNote] = []
        for g in self.gpus:
            try:
                assert g.caller is not None
                got, xids = g.caller.call(lambda g=g: self._read(g), self.config.call_timeout,
                                          f"NVML queries of GPU {g.index}")
            except TimeoutError as e:
                out.append(GpuReading(g.index, g.uuid, GpuCheck.RESPONSIVE, str(e), True,
                                      {"timeout": self.config.call_timeout}))
                continue
            out += got
            notes += xids
        self.rounds += 1
        self.last = out
        return out, notes

    def _read(self, g: _Gpu) -> tuple[list[GpuReading], list[XidNote]]:
        nv = self.nvml
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(g.index)
        except Exception as e:  # noqa: BLE001 — a GPU that fell off the bus fails right here
            return [GpuReading(g.index, g.uuid, GpuCheck.REACHABLE, _text(e), True),
                    GpuReading(g.index, g.uuid, GpuCheck.RESPONSIVE, True, False)], []
        if g.handle is None:  # lost when NVML loaded, back now
            g.handle = handle
            if GpuCheck.XID not in g.unsupported:
                g.events = self._register_xids(nv, g)
        out = [GpuReading(g.index, g.uuid, GpuCheck.REACHABLE, True, False),
               GpuReading(g.index, g.uuid, GpuCheck.RESPONSIVE, True, False)]
        notes: list[XidNote] = []
        for check, read in self._CHECKS:
            if check in g.unsupported:
                continue
            try:
                r = read(self, nv, g)
            except Exception as e:  # noqa: BLE001
                code = _code(e)
                if code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND) or isinstance(e, (AttributeError, NotImplementedError)):
                    g.unsupported.add(check)
                    self._once(g.index, check.value, logging.INFO,
                               "GPU %s: %s not supported (%s): skipped", g.index, check.value, e)
                elif code == _GPU_IS_LOST:
                    out[0] = GpuReading(g.index, g.uuid, GpuCheck.REACHABLE, _text(e), True)
                    break
                else:
                    self._once(g.index, f"{check.value}-error", logging.WARNING,
                               "GPU %s: reading %s failed (%s); it is retried each round", g.index, check.value, e)
                continue
            if check is GpuCheck.XID:
                reading, found = r
                notes += found
                out.append(reading)
            else:
                out.append(r)
        return out, notes

    def _temperature(self, nv: Any, g: _Gpu) -> GpuReading:
        t = nv.nvmlDeviceGetTemperature(g.handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        thr = self.config.temperature_threshold
        return GpuReading(g.index, g.uuid, GpuCheck.TEMPERATURE, t, t >= thr, {"threshold": thr})

    def _ecc(self, nv: Any, g: _Gpu) -> GpuReading:
        n = nv.nvmlDeviceGetTotalEccErrors(g.handle, getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                           getattr(nv, "NVML_VOLATILE_ECC", 0))
        return GpuReading(g.index, g.uuid, GpuCheck.ECC_UNCORRECTED, int(n), n > 0, {"threshold": 0})

    def _remapped(self, nv: Any, g: _Gpu) -> GpuReading:
        corr, unc, pending, failure = nv.nvmlDeviceGetRemappedRows(g.handle)
        value = {"correctable": int(corr), "uncorrectable": int(unc), "pending": bool(pending),
                 "failure": bool(failure)}
        return GpuReading(g.index, g.uuid, GpuCheck.REMAPPED_ROWS, value, bool(pending) or bool(failure))

    def _throttle(self, nv: Any, g: _Gpu) -> GpuReading:
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        bits = int(fn(g.handle))
        names = [n for b, n in _CLOCK_REASONS.items() if bits & b]
        g.hw_slow_rounds = g.hw_slow_rounds + 1 if bits & HW_CLOCK_REASONS else 0
        bad = g.hw_slow_rounds >= self.config.throttle_rounds
        return GpuReading(g.index, g.uuid, GpuCheck.THROTTLE, names, bad,
                          {"reasons_mask": bits, "rounds": g.hw_slow_rounds})

    def _recovery_action(self, nv: Any, g: _Gpu) -> GpuReading:
        fid = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", _FI_GPU_RECOVERY_ACTION)
        fv = nv.nvmlDeviceGetFieldValues(g.handle, [fid])[0]
        if fv.nvmlReturn != 0:
            raise nv.NVMLError(fv.nvmlReturn)
        action = int(fv.value.uiVal)
        return GpuReading(g.index, g.uuid, GpuCheck.RECOVERY_ACTION, _RECOVERY_ACTIONS.get(action, str(action)),
                          action != 0)

    def _xids(self, nv: Any, g: _Gpu) -> tuple[GpuReading, list[XidNote]]:
        critical: list[int] = []
        notes: list[XidNote] = []
        for _ in range(_MAX_XIDS_PER_ROUND):
            try:
                data = nv.nvmlEventSetWait_v2(g.events, self.config.xid_wait_ms)
            except Exception as e:  # noqa: BLE001
                if _code(e) == _TIMEOUT:
                    break  # no more events
                raise
            xid = int(data.eventData)
            if xid in XID_CRITICAL:
                critical.append(xid)
            else:
                kind = "application" if xid in XID_APPLICATION else "unknown"
                notes.append(XidNote(g.index, g.uuid, xid, kind))
        return GpuReading(g.index, g.uuid, GpuCheck.XID, critical, bool(critical)), notes

    _CHECKS: tuple[tuple[GpuCheck, Callable[..., Any]], ...] = (
        (GpuCheck.XID, _xids),
        (GpuCheck.ECC_UNCORRECTED, _ecc),
        (GpuCheck.REMAPPED_ROWS, _remapped),
        (GpuCheck.RECOVERY_ACTION, _recovery_action),
        (GpuCheck.TEMPERATURE, _temperature),
        (GpuCheck.THROTTLE, _throttle),
    )

    # ------------------------------------------------------------------ the rest
    def _once(self, index: int | None, what: str, level: int, msg: str, *args: Any) -> None:
        if (index, what) not in self._said:
            self._said.add((index, what))
            logger.log(level, msg, *args)

    def close(self) -> None:
        """Free the event sets and shut NVML down, bounded: a wedged driver must not hold the agent's exit."""
        nv, gpus = self.nvml, self.gpus
        if self.state != "ready" or nv is None:
            return

        def shut() -> None:
            for g in gpus:
                if g.events is not None:
                    try:
                        nv.nvmlEventSetFree(g.events)
                    except Exception:  # noqa: BLE001
                        pass
            nv.nvmlShutdown()

        self.state = "absent"
        try:
            BoundedCaller("nvml-close").call(shut, min(2.0, self.config.call_timeout), "nvmlShutdown")
        except Exception as e:  # noqa: BLE001
            logger.debug("NVML shutdown: %s", e)
