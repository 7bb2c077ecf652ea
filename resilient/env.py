"""Every ``RESILIENT_*`` environment variable (a public contract: the names never change), and
:class:`WorkerEnv`, the one codec of what ``resilient-run`` hands its workers: the launcher writes it
(:meth:`WorkerEnv.to_env`), workers read it (:meth:`WorkerEnv.from_env`).

No other module spells a ``RESILIENT_*`` name; each refers to the constant here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

RUN_DIR = "RESILIENT_RUN_DIR"  # the run's directory: ledger, logs
RUN_ID = "RESILIENT_RUN_ID"
NODE = "RESILIENT_NODE"  # this node's name in events
NODE_RANK = "RESILIENT_NODE_RANK"
AGENT_SOCKET = "RESILIENT_AGENT_SOCKET"  # the node agent's local socket for heartbeats/steps
CKPT_LOCAL = "RESILIENT_CKPT_LOCAL"  # this node's local checkpoint directory
CKPT_PERSISTENT = "RESILIENT_CKPT_PERSISTENT"  # fsspec URL of the persistent tier
CKPT_INTERVAL = "RESILIENT_CKPT_INTERVAL"  # "N" steps or "auto"
CKPT_PERSISTENT_EVERY = "RESILIENT_CKPT_PERSISTENT_EVERY"  # every M-th local save is uploaded
CKPT_COMPRESS = "RESILIENT_CKPT_COMPRESS"  # auto | none | bgzstd | zstd: compression of persistent uploads
UPLOAD_GRACE = "RESILIENT_UPLOAD_GRACE"  # seconds pending uploads get at exit before they are abandoned
# consecutive saves that reach no tier before the job stops (0: train on without checkpoints); also the default
# of resilient-run --ckpt-max-failed-saves
CKPT_MAX_FAILED_SAVES = "RESILIENT_CKPT_MAX_FAILED_SAVES"
# snapshots in node memory: "auto", N steps or "0" (resilient-run --ckpt-snapshot), and the node's directory for them
CKPT_SNAPSHOT = "RESILIENT_CKPT_SNAPSHOT"
CKPT_SNAPSHOT_DIR = "RESILIENT_CKPT_SNAPSHOT_DIR"
# "on" | "off": persistent uploads' bytes sent from a process of their own (resilient-run --ckpt-upload-process)
CKPT_UPLOAD_PROCESS = "RESILIENT_CKPT_UPLOAD_PROCESS"
HEARTBEAT_TIMEOUT = "RESILIENT_HEARTBEAT_TIMEOUT"  # seconds
POLICY = "RESILIENT_POLICY"
SPARE_NODES = "RESILIENT_SPARE_NODES"
JOB_SECRET = "RESILIENT_JOB_SECRET"  # per-job secret signing agent <-> supervisor messages (never logged)
# the data-parallel layout (resilient.topology()): the number of data-parallel replicas and this rank's replica
DP_SIZE = "RESILIENT_DP_SIZE"
DP_RANK = "RESILIENT_DP_RANK"
NUMA_BINDING = "RESILIENT_NUMA_BINDING"  # "MODE:GPU": bind this worker to the CPUs of GPU's NUMA node (--numa-binding)
ROUND_REASON = "RESILIENT_ROUND_REASON"  # the reason of the supervisor's action that started this round (on_scale)

# read by resilient itself (set by users or recipes, not by the launcher)
LOG_LEVEL = "RESILIENT_LOG_LEVEL"  # log level of agents, supervisor and workers' resilient loggers
WORKER_LAUNCH = "RESILIENT_WORKER_LAUNCH"  # default of --worker-launch
PRELOAD = "RESILIENT_PRELOAD"  # default of --preload
SPARE_WAIT = "RESILIENT_SPARE_WAIT"  # default of --spare-wait (seconds)
REPLACEMENT_WAIT = "RESILIENT_REPLACEMENT_WAIT"  # default of --replacement-wait (seconds)
SUPERVISOR_TIMEOUT = "RESILIENT_SUPERVISOR_TIMEOUT"  # default of resilient-run --supervisor-timeout (seconds)
PREEMPT_URL = "RESILIENT_PREEMPT_URL"  # an HTTP preemption-notice endpoint the agent polls
COMPILE_CACHE = "RESILIENT_COMPILE_CACHE"  # "0" turns the torch.compile cache off
# "0": processes of resilient-run (its workers started by the fork server, and the launcher itself) end through the
# interpreter's full finalisation instead of os._exit once their exit hooks ran and their threads are joined
FAST_EXIT = "RESILIENT_FAST_EXIT"
FAULTS = "RESILIENT_FAULTS"  # a drill's in-worker faults (--inject), carried out by resilient.steps()
CKPT_MAX_OBJECT_MB = "RESILIENT_CKPT_MAX_OBJECT_MB"  # largest object of a persistent upload, in MB
CKPT_PRIOR_MTBF = "RESILIENT_CKPT_PRIOR_MTBF"  # the interval tuner's prior mean time between failures
# default of --nodes-per-replica (nodes per data-parallel replica); also set in a worker's environment when given
NODES_PER_REPLICA = "RESILIENT_NODES_PER_REPLICA"
# a node's failure domain (e.g. its rack): a rank's peer copy is kept on a node of another domain
FAILURE_DOMAIN = "RESILIENT_FAILURE_DOMAIN"

# set for a NeMo-Run job's torchrun shim (resilient.integrations.nemo)
RUN_ARGS = "RESILIENT_RUN_ARGS"  # resilient-run's flags, given by the shim before torchrun's arguments
PYTHON = "RESILIENT_PYTHON"  # the interpreter whose resilient-run the shim prefers
RDZV_ID = "PET_RDZV_ID"  # torchrun's variable for --rdzv-id; also the default of `resilient supervisor --rdzv-id`


def _text(name: str, raw: str) -> str:
    return raw


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number") from None


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None


def upload_grace_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """``resilient-run --upload-grace`` as a worker sees it; None when not set."""
    raw = environ.get(UPLOAD_GRACE, "").strip()
    return _float(UPLOAD_GRACE, raw) if raw else None


NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torchrun's --numa-binding (torch.numa.binding)


@dataclass(frozen=True)
class WorkerEnv:
    """What ``resilient-run`` tells each worker, beside torchrun's own variables (``RANK``, ``WORLD_SIZE``, …).

    ``to_env`` gives the variables (a field left None is not set); ``from_env`` reads them back, equal to what
    was written, and returns None outside ``resilient-run`` (no run directory). A malformed value is an error
    naming the variable."""

    run_dir: str
    run_id: str
    node: str
    node_rank: int
    agent_socket: str | None = None  # None: no node monitor (heartbeats go nowhere)
    ckpt_local: str | None = None
    ckpt_persistent: str | None = None
    ckpt_interval: str | None = None  # "N" steps or "auto"
    ckpt_persistent_every: int | None = None
    ckpt_compress: str | None = None
    upload_grace: float | None = None
    ckpt_max_failed_saves: int | None = None
    ckpt_snapshot: str | None = None  # "auto", "N" steps or "0"
    ckpt_snapshot_dir: str | None = None  # the node's snapshot directory (in memory), made by the agent
    ckpt_upload_process: str | None = None  # "auto" | "on" | "off"; None: auto
    heartbeat_timeout: float | None = None
    policy: str | None = None
    spare_nodes: int | None = None
    faults: str | None = None  # a drill's plan (resilient.drill.spec.plan_env)
    dp_size: int | None = None  # data-parallel replicas (WORLD_SIZE without --nodes-per-replica)
    dp_rank: int | None = None  # this rank's replica: RANK // (nodes_per_replica x nproc_per_node)
    nodes_per_replica: int | None = None  # None: every rank is a replica
    round_reason: str | None = None
    numa_binding: str | None = None  # "MODE:GPU": torch's NUMA binding of this worker to that GPU's CPUs

    def __post_init__(self) -> None:
        for f in ("run_dir", "run_id", "node"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ValueError(f"WorkerEnv.{f} must be a non-empty string, got {getattr(self, f)!r}")
        if self.node_rank < 0:
            raise ValueError(f"WorkerEnv.node_rank must be >= 0, got {self.node_rank}")
        for f in ("ckpt_persistent_every", "ckpt_max_failed_saves", "spare_nodes"):
            v = getattr(self, f)
            if v is not None and v < 0:
                raise ValueError(f"WorkerEnv.{f} must be >= 0, got {v}")
        for f in ("upload_grace", "heartbeat_timeout"):
            v = getattr(self, f)
            if v is not None and not (0 <= v < float("inf")):
                raise ValueError(f"WorkerEnv.{f} must be finite seconds >= 0, got {v}")
        for f in ("dp_size", "nodes_per_replica"):
            v = getattr(self, f)
            if v is not None and v < 1:
                raise ValueError(f"WorkerEnv.{f} must be >= 1, got {v}")
        if (self.dp_size is None) != (self.dp_rank is None):
            raise ValueError(f"WorkerEnv.dp_size and dp_rank are set together, got {self.dp_size} and {self.dp_rank}")
        if self.dp_size is not None and not (0 <= self.dp_rank < self.dp_size):  # type: ignore[operator]
            raise ValueError(f"WorkerEnv.dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}")
        if self.numa_binding is not None:
            mode, _, gpu = self.numa_binding.partition(":")
            if mode not in NUMA_MODES or not gpu.isdigit():
                raise ValueError(f"WorkerEnv.numa_binding must be MODE:GPU with MODE one of {', '.join(NUMA_MODES)}, "
                                 f"got {self.numa_binding!r}")
        if self.ckpt_interval is not None and self.ckpt_interval != "auto" and not (
                self.ckpt_interval.isdigit() and int(self.ckpt_interval) > 0):
            raise ValueError(f"WorkerEnv.ckpt_interval must be a step count > 0 or 'auto', got {self.ckpt_interval!r}")

    def to_env(self) -> dict[str, str]:
        """The variables to set in a worker's environment."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[_VARS[f.name][0]] = str(v)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerEnv | None:
        """What the launcher wrote into ``environ``; None when not started by ``resilient-run``."""
        if not environ.get(RUN_DIR):
            return None
        kw = {}
        for name, (var, parse) in _VARS.items():
            raw = environ.get(var)
            if raw is not None:
                kw[name] = parse(var, raw)
        missing = [_VARS[f][0] for f in ("run_id", "node", "node_rank") if f not in kw]
        if missing:
            raise ValueError(f"{RUN_DIR} is set but {', '.join(missing)} is not: not a resilient-run worker's "
                             "environment")
        return cls(**kw)


_VARS = {
    "run_dir": (RUN_DIR, _text), "run_id": (RUN_ID, _text), "node": (NODE, _text), "node_rank": (NODE_RANK, _int),
    "agent_socket": (AGENT_SOCKET, _text), "ckpt_local": (CKPT_LOCAL, _text),
    "ckpt_persistent": (CKPT_PERSISTENT, _text), "ckpt_interval": (CKPT_INTERVAL, _text),
    "ckpt_persistent_every": (CKPT_PERSISTENT_EVERY, _int), "ckpt_compress": (CKPT_COMPRESS, _text),
    "upload_grace": (UPLOAD_GRACE, _float), "ckpt_max_failed_saves": (CKPT_MAX_FAILED_SAVES, _int),
    "ckpt_snapshot": (CKPT_SNAPSHOT, _text), "ckpt_snapshot_dir": (CKPT_SNAPSHOT_DIR, _text),
    "ckpt_upload_process": (CKPT_UPLOAD_PROCESS, _text),
    "heartbeat_timeout": (HEARTBEAT_TIMEOUT, _float), "policy": (POLICY, _text),
    "spare_nodes": (SPARE_NODES, _int), "faults": (FAULTS, _text),
    "dp_size": (DP_SIZE, _int), "dp_rank": (DP_RANK, _int), "nodes_per_replica": (NODES_PER_REPLICA, _int),
    "round_reason": (ROUND_REASON, _text), "numa_binding": (NUMA_BINDING, _text),
}
