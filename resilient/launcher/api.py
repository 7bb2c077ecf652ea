"""Contract of the launcher: its configuration, states and errors."""

from __future__ import annotations

import enum
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resilient.env import NUMA_MODES
from resilient.supervisor.config import SupervisorConfig


# Exit code of an agent whose workers stopped for a preemption notice (SIGTERM) after saving their last
# step: sysexits' EX_TEMPFAIL, "try again later". Slurm (--requeue) and Kubernetes (podFailurePolicy
# onExitCodes) recipes requeue on it; rerunning the same command resumes right after that step.
PREEMPTED_EXIT_CODE = 75
# Exit code of an agent that gave up because the job's infrastructure went away (the store and supervisor stayed
# unreachable for --rendezvous-timeout while this node had nothing to run): sysexits' EX_UNAVAILABLE. Nothing
# is wrong with the training; schedulers requeue on it like on a preemption.
INFRASTRUCTURE_EXIT_CODE = 69
# Exit code of a job that stopped because --ckpt-max-failed-saves checkpoint saves in a row reached no tier (a full or
# broken disk, a dead store): sysexits' EX_IOERR. Requeueing would fail the same way: fix the tier, then rerun.
CKPT_FAILED_EXIT_CODE = 74
# Exit code of a run that finished its training but whose last saved step could not be put on the persistent tier
# (--ckpt-persistent) within --upload-grace: sysexits' EX_CANTCREAT. The trained state is on node-local tiers only.
# A preempted run keeps PREEMPTED_EXIT_CODE (its requeue must still happen) and says so in a line and the ledger.
NOT_DURABLE_EXIT_CODE = 73


class LaunchError(Exception):
    """Bad input found before any worker starts: one line for the user, exit code 2."""


def check_seconds(flag: str, v: float | None) -> None:
    """A watchdog's seconds: nan compares false with everything and inf never expires, both would switch it off
    silently."""
    if v is not None and not (isinstance(v, (int, float)) and 0 < v < float("inf")):
        raise LaunchError(f"{flag} must be a positive, finite number of seconds, got {v}")


class WorkerLaunchMethod(str, enum.Enum):
    FORK_SERVER = "fork-server"  # fork from a process that already imported torch (fast restarts)
    SPAWN = "spawn"  # a fresh interpreter per worker, as torchrun does


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a local worker exited non-zero or was signalled
    HUNG = "hung"  # a detector reported a hang
    PEER_FAILED = "peer_failed"  # another node asked for a restart
    STOPPED = "stopped"  # the agent was told to stop (signal)


class NodeRole(str, enum.Enum):
    JOINING = "joining"  # in no round yet
    ACTIVE = "active"  # holds a group rank in the current round: runs workers
    SPARE = "spare"  # warm (fork server ready), no workers


@dataclass(frozen=True)
class NodeRound:
    """This node's part of the supervisor's current round, in one record (as torch elastic's WorkerGroup):
    replaced as a whole when a new plan arrives, never edited field by field."""

    round: int = -1
    role: NodeRole = NodeRole.JOINING
    group_rank: int = 0
    group_world_size: int = 1
    base_rank: int = 0  # global rank of this node's local rank 0
    world_size: int = 1
    max_restarts: int = 0  # the job's restart budget: the supervisor's, whatever this agent's --max-restarts says
    nodes_per_replica: int | None = None  # --nodes-per-replica as the plan says; None: every rank is a replica
    previous_dp_size: int | None = None  # the previous round's data-parallel size (on_scale), None at start
    reason: str | None = None  # why the supervisor started this round (its action's reason)

    @property
    def active(self) -> bool:
        return self.role == NodeRole.ACTIVE

    def dp_layout(self, nproc_per_node: int) -> tuple[int, int]:
        """(ranks per replica, data-parallel size) of this round with ``nproc_per_node`` workers per node."""
        rpr = self.nodes_per_replica * nproc_per_node if self.nodes_per_replica else 1
        if self.world_size % rpr:
            raise ValueError(f"a world of {self.world_size} ranks is not a whole number of replicas of "
                             f"{self.nodes_per_replica} node(s) x {nproc_per_node} workers")
        return rpr, self.world_size // rpr

    @classmethod
    def active_in(cls, a: Any, plan: Mapping[str, Any], node: str, max_restarts: int) -> NodeRound:
        """This node's round as a member of the plan's assignment ``a`` (``resilient.supervisor.core.Assignment``;
        ``max_restarts``: the budget when the plan names none)."""
        k = getattr(a, "nodes_per_replica", None) or plan["assignment"].get("nodes_per_replica")
        prev_world = a.previous_world_size
        prev_dp = getattr(a, "previous_dp_size", None) or plan["assignment"].get("previous_dp_size")
        if prev_dp is None and prev_world is not None:
            prev_dp = prev_world // (k * a.nproc[node]) if k else prev_world
        action = plan.get("action")
        return cls(round=a.round, role=NodeRole.ACTIVE, group_rank=a.members.index(node),
                   group_world_size=len(a.members), base_rank=a.base_rank(node), world_size=a.world_size,
                   max_restarts=plan.get("max_restarts", max_restarts), nodes_per_replica=k, previous_dp_size=prev_dp,
                   reason=(action.get("reason") or None) if isinstance(action, Mapping) else None)


@dataclass(frozen=True)
class WorkerExit:
    local_rank: int
    rank: int
    pid: int
    exit_code: int  # negative: killed by that signal
    wall: float
    error_file: str | None = None
    attempt: int = 0

    @property
    def signal_name(self) -> str | None:
        if self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code).name
            except ValueError:
                return f"signal {-self.exit_code}"
        return None

    def describe(self) -> str:
        """One phrase naming the rank, pid and how it ended, as torchrun's agent prints it."""
        how = f"exitcode: {self.exit_code}" if self.exit_code >= 0 else f"signal: {self.signal_name}"
        return f"rank {self.rank} (local_rank: {self.local_rank}, pid: {self.pid}) failed ({how})"


@dataclass(frozen=True)
class WorkerCommand:
    """What each worker runs: ``python -u SCRIPT ARGS``, ``python -u -m MODULE ARGS`` or ``BINARY ARGS``."""

    target: str
    args: tuple[str, ...] = ()
    kind: str = "script"  # "script" | "module" | "exec"

    def __post_init__(self) -> None:
        if self.kind not in ("script", "module", "exec"):
            raise ValueError(f"worker command kind must be script, module or exec, got {self.kind!r}")


@dataclass
class AgentConfig:
    """Everything the node agent needs; built from the command line by :mod:`resilient.launcher.args`."""

    command: WorkerCommand
    nproc_per_node: int
    # the job's supervisor as this agent hosts it (when it hosts the job's store): --nnodes, --max-restarts,
    # --node-timeout, --policy-timeout; under `resilient supervisor` that one's decides
    supervisor: SupervisorConfig
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_id: str = "none"
    rdzv_configs: dict[str, object] = field(default_factory=dict)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    standalone: bool = False
    role: str = "default"
    monitor_interval: float = 0.1
    term_timeout: float = 30.0
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: set[int] | None = None
    run_id: str = ""
    run_dir: str = ""
    launch_method: WorkerLaunchMethod = WorkerLaunchMethod.FORK_SERVER
    preload: tuple[str, ...] = ()
    # resilience flags, exported to the workers and used by later parts
    policy: str | None = None
    ckpt_local: str | None = None
    ckpt_persistent: str | None = None
    ckpt_interval: str | None = None
    ckpt_persistent_every: int | None = None
    ckpt_compress: str | None = None  # codec of persistent uploads (workers: RESILIENT_CKPT_COMPRESS); None: auto
    upload_grace: float = 60.0  # seconds pending uploads get at exit (workers: RESILIENT_UPLOAD_GRACE)
    ckpt_max_failed_saves: int = 3  # failed saves in a row before the job stops; 0: train on (RESILIENT_CKPT_MAX_FAILED_SAVES)
    # snapshots in node memory (workers: RESILIENT_CKPT_SNAPSHOT): "auto", "N" steps, or "off"; the agent makes the
    # node's directory for them unless off
    ckpt_snapshot: str = "auto"
    # persistent uploads' bytes from a process of their own (workers: RESILIENT_CKPT_UPLOAD_PROCESS): "auto" (where
    # the node has cores to spare), "on" or "off"
    ckpt_upload_process: str = "auto"
    heartbeat_timeout: float | None = None
    # --startup-timeout: spawn → first message, and each of the first warm-up steps (MonitorConfig.initial_timeout)
    startup_timeout: float = 600.0
    health_interval: float = 5.0  # seconds between host and GPU health rounds (the node monitor's thread)
    spare_nodes: int = 0
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"  # loopback: the endpoint tells anyone who can reach it about the run
    rendezvous_timeout: float = 900.0
    virtual_local_rank: bool = False  # torchrun's --virtual-local-rank: LOCAL_RANK=0, one GPU visible each
    # torchrun's --numa-binding: each worker bound to the CPUs near its GPU (torch.numa.binding), GPU = local rank
    numa_binding: str | None = None
    # drills: faults the agent carries out (time-based) or hands to the workers (step-based, via resilient.steps)
    inject: tuple = ()  # resilient.drill.spec.FaultSpec values, parsed from --inject
    job_secret_file: str | None = None  # file holding the per-job secret (else RESILIENT_JOB_SECRET, else generated)
    # --supervisor-timeout: how long an agent that needs a decision waits for an unreachable supervisor before it
    # exits for a requeue; None: the default of :attr:`supervisor_bound`
    supervisor_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.supervisor.nproc_per_node != self.nproc_per_node:
            raise LaunchError(f"the supervisor's nproc_per_node ({self.supervisor.nproc_per_node}) is not this node's "
                              f"--nproc-per-node ({self.nproc_per_node})")
        for flag, v in (("--monitor-interval", self.monitor_interval), ("--term-timeout", self.term_timeout),
                        ("--heartbeat-timeout", self.heartbeat_timeout),
                        ("--startup-timeout", self.startup_timeout), ("--rendezvous-timeout", self.rendezvous_timeout),
                        ("--health-interval", self.health_interval),
                        ("--node-timeout", self.supervisor.node_timeout),
                        ("--policy-timeout", self.supervisor.policy_timeout),
                        ("--supervisor-timeout", self.supervisor_timeout)):
            check_seconds(flag, v)
        if self.numa_binding is not None and self.numa_binding not in NUMA_MODES:
            raise LaunchError(f"--numa-binding must be one of {', '.join(NUMA_MODES)}, got {self.numa_binding!r}")
        if self.spare_nodes < 0:
            raise LaunchError(f"--spare-nodes must be >= 0, got {self.spare_nodes}")
        if not (isinstance(self.upload_grace, (int, float)) and 0 <= self.upload_grace < float("inf")):
            raise LaunchError(f"--upload-grace must be a finite number of seconds >= 0, got {self.upload_grace}")
        if isinstance(self.ckpt_max_failed_saves, bool) or not isinstance(self.ckpt_max_failed_saves, int) \
                or self.ckpt_max_failed_saves < 0:
            raise LaunchError(f"--ckpt-max-failed-saves must be a whole number >= 0 (0 trains on without checkpoints), "
                              f"got {self.ckpt_max_failed_saves!r}")
        if self.ckpt_upload_process not in ("auto", "on", "off"):
            raise LaunchError(f"--ckpt-upload-process must be auto, on or off, got {self.ckpt_upload_process!r}")
        if not (self.ckpt_snapshot in ("auto", "off") or (self.ckpt_snapshot.isdigit() and int(self.ckpt_snapshot) > 0)):
            raise LaunchError(f"--ckpt-snapshot must be auto, a number of steps >= 1, or off, got {self.ckpt_snapshot!r}")
        if self.ckpt_persistent_every is not None and self.ckpt_persistent_every < 1:
            raise LaunchError(f"--ckpt-persistent-every must be >= 1, got {self.ckpt_persistent_every}")
        if self.ckpt_interval is not None and self.ckpt_interval != "auto":
            if not self.ckpt_interval.isdigit() or int(self.ckpt_interval) < 1:
                raise LaunchError(f"--ckpt-interval must be a positive number of steps or 'auto', got {self.ckpt_interval!r}")
        if self.metrics_port is not None and not (0 <= self.metrics_port < 65536):
            raise LaunchError(f"--metrics-port must be a TCP port number, got {self.metrics_port}")
        if not self.metrics_addr or any(ch.isspace() or ch in "/[]" for ch in self.metrics_addr):
            raise LaunchError(f"--metrics-addr must be an IP address or host name (0.0.0.0 for every interface), "
                              f"got {self.metrics_addr!r}")

    @property
    def supervisor_bound(self) -> float:
        """Seconds an agent that needs a decision waits for an unreachable supervisor (--supervisor-timeout).

        Default: 3 × --node-timeout, at least 30 s, at most --rendezvous-timeout. Noticing that the supervisor is
        away costs up to one node timeout (a store call gives up after that long), a supervisor restarted or
        woken gives every node one node timeout before it judges, and one more covers agents reconnecting to it
        under load; past that, waiting only keeps a requeue from starting."""
        if self.supervisor_timeout is not None:
            return float(self.supervisor_timeout)
        return min(self.rendezvous_timeout, max(30.0, 3 * self.supervisor.node_timeout))

    @property
    def single_node(self) -> bool:
        """One node and no spare: no other agent can ever join (a spare with ``--nnodes 1`` is a second agent,
        which needs a name of its own)."""
        return self.supervisor.max_nodes == 1 and not self.spare_nodes

    @property
    def script_name(self) -> str:
        return os.path.basename(self.command.target)
