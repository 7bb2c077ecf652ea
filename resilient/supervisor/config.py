"""What the supervisor decides with: one :class:`SupervisorConfig`, and the one argparse group of the flags that
set it, shared by ``resilient-run`` (whose agent may host the supervisor) and ``resilient supervisor``.

``--nnodes``, ``--nproc-per-node`` and ``--max-restarts`` are not in the group: ``resilient-run`` takes them from
torchrun's own parser (same spellings, ``PET_*`` twins), ``resilient supervisor`` adds them itself.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from resilient import env

# what a policy file's process may use by default (PolicyLimits below): its address space
# (a runaway allocation fails there, not in the agent) and its CPU time over the process's life (a spinning thread
# ends; the process is then started afresh, its state lost). A process that has imported torch takes about 630 MiB
# of address space; a policy that keeps large tables may need more: --policy-memory-mb
POLICY_MEMORY_MB = 2048
POLICY_CPU_SECONDS = 300


@dataclass(frozen=True)
class PolicyLimits:
    """What a policy's process may use. ``timeout`` is ``--policy-timeout``."""

    timeout: float = 1.0  # seconds one decision may take; past it the process is killed and restarted
    memory_mb: int = POLICY_MEMORY_MB  # address space (RLIMIT_AS), --policy-memory-mb
    cpu_seconds: int = POLICY_CPU_SECONDS  # CPU time over one process's life (RLIMIT_CPU), --policy-cpu-seconds
    load_timeout: float = 10.0  # seconds to start the process, import the file and create the policy
    max_failures: int = 3  # the process dies, overruns, hits a limit or forks this often in a row: not asked again

    def __post_init__(self) -> None:
        for name in ("timeout", "load_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"PolicyLimits.{name} must be a finite number of seconds > 0, got {v!r}")
        for name in ("memory_mb", "cpu_seconds", "max_failures"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PolicyLimits.{name} must be an integer >= 1, got {v!r}")


@dataclass
class SupervisorConfig:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int = 3  # the budget: every Restart/HotSwap/ScaleDown/ScaleUp spends one
    node_timeout: float = 10.0  # seconds without a report before a node is lost
    failure_window: float = 3600.0
    policy_timeout: float = 1.0
    scale_up_wait: float = 60.0  # how long a ScaleUp waits for a checkpoint boundary before it goes anyway
    # how long a decision on a node's preemption notice waits for the job's agreed step to be saved (every other
    # member done, the preempted node gone) before it is carried out anyway
    preempt_wait: float = 120.0
    recent_events: int = 64
    # how long a lost member with no spare and no room to shrink waits for a spare whose agent connected but is
    # still warming up (a joining spare), before the job stops: a cold start here (import torch, the fork server)
    # took about 20 s on a loaded node, and a stop costs a requeue and a full restart, so a minute is cheap
    spare_wait: float = 60.0
    # how long a lost member with no spare (ready or joining) and no room to shrink waits for a node to join in
    # its place, counted from the loss, before the job stops: torchrun's agents wait up to the rendezvous join
    # timeout for a replacement (a pod rescheduled by Kubernetes, a node requeued by Slurm); 0: stop at once
    replacement_wait: float = 0.0
    # nodes per data-parallel replica (--nodes-per-replica): with it, a replica of this many consecutive nodes is the
    # unit the job grows and shrinks by, and --nnodes MIN and MAX must be multiples of it; None: every rank is a
    # replica
    nodes_per_replica: int | None = None
    # limits of a policy file's process (--policy-memory-mb, --policy-cpu-seconds): see POLICY_MEMORY_MB
    policy_memory_mb: int = POLICY_MEMORY_MB
    policy_cpu_seconds: int = POLICY_CPU_SECONDS

    def __post_init__(self) -> None:
        for name in ("min_nodes", "max_nodes", "nproc_per_node", "recent_events", "policy_memory_mb",
                     "policy_cpu_seconds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SupervisorConfig.{name} must be an integer >= 1, got {v!r}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"SupervisorConfig.max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})")
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise ValueError(f"SupervisorConfig.max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        k = self.nodes_per_replica
        if k is not None:
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"--nodes-per-replica must be a whole number >= 1, got {k!r}")
            bad = [f"{what} {n}" for what, n in (("MIN", self.min_nodes), ("MAX", self.max_nodes)) if n % k]
            if bad:
                verb = "is" if len(bad) == 1 else "are"
                raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: {' and '.join(bad)} {verb} not a "
                                 f"multiple of --nodes-per-replica {k} (a replica is {k} nodes; the job grows and "
                                 "shrinks by whole replicas)")
        for name in ("node_timeout", "failure_window", "policy_timeout", "scale_up_wait", "preempt_wait",
                     "spare_wait"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SupervisorConfig.{name} must be a number of seconds > 0, got {v!r}")
        v = self.replacement_wait
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"SupervisorConfig.replacement_wait must be a finite number of seconds >= 0, got {v!r}")

    def policy_limits(self) -> PolicyLimits:
        """The limits a policy file's process runs under in this job (its decision time is ``policy_timeout``)."""
        return PolicyLimits(timeout=self.policy_timeout, memory_mb=self.policy_memory_mb,
                            cpu_seconds=self.policy_cpu_seconds)


def parse_nnodes(v: str) -> tuple[int, int]:
    """``--nnodes`` of either command: N or MIN:MAX, with 0 < MIN <= MAX; ValueError naming the flag."""
    try:
        parts = [int(x) for x in v.split(":")]
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {v!r}") from None
    if len(parts) not in (1, 2):
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {v!r}")
    lo, hi = parts[0], parts[-1]
    if not (0 < lo <= hi):
        raise ValueError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got {v!r}")
    return lo, hi


def nodes_per_replica(v: str) -> int:
    """``--nodes-per-replica`` (or its environment twin): a whole number >= 1."""
    try:
        k = int(v)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a whole number of nodes >= 1, got {v!r} (flag or "
                                         f"{env.NODES_PER_REPLICA})") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of nodes >= 1, got {k} (flag or "
                                         f"{env.NODES_PER_REPLICA})")
    return k


def policy_limit(unit: str) -> "Callable[[str], int]":
    """argparse type of a policy process limit: a whole number of ``unit`` >= 1 (argparse names the flag)."""
    def parse(v: str) -> int:
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be a whole number of {unit} >= 1, got {v!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number of {unit} >= 1, got {n}")
        return n
    return parse


def add_policy_limit_arguments(g: argparse._ActionsContainer) -> None:
    """The limits of a policy file's process: flags of ``resilient-run``, ``resilient supervisor`` and
    ``resilient policy check`` (which tries a policy under a job's limits)."""
    g.add_argument("--policy-memory-mb", "--policy_memory_mb", type=policy_limit("MiB"),
                   default=POLICY_MEMORY_MB, metavar="MIB",
                   help="address space a --policy file's process may use, in MiB; an allocation past it fails in that "
                        "process and the default policy decides instead (default %(default)s)")
    g.add_argument("--policy-cpu-seconds", "--policy_cpu_seconds", type=policy_limit("seconds"),
                   default=POLICY_CPU_SECONDS, metavar="S",
                   help="CPU seconds a --policy file's process may use over its life; past it the process is killed "
                        "(SIGXCPU) and started afresh, its state lost (default %(default)s)")


def add_supervisor_arguments(g: argparse._ActionsContainer) -> None:
    """The supervisor's flags both commands take, with one meaning and one default each."""
    g.add_argument("--policy", default=None,
                   help="Python policy file for the supervisor (default: the escalating default policy)")
    g.add_argument("--spare-nodes", "--spare_nodes", type=int, default=0, help="hot spare nodes kept ready")
    g.add_argument("--node-timeout", "--node_timeout", type=float, default=10.0,
                   help="seconds without a report from a node's agent before the supervisor counts it lost")
    g.add_argument("--spare-wait", "--spare_wait", type=float, default=os.environ.get(env.SPARE_WAIT, "60"),
                   help="seconds a lost node with no ready spare waits for a spare still warming up (joining) "
                        f"before the job stops (default 60, or {env.SPARE_WAIT}; argparse parses either)")
    g.add_argument("--replacement-wait", "--replacement_wait", type=float,
                   default=os.environ.get(env.REPLACEMENT_WAIT, "0"),
                   help="seconds a lost node with no spare, when --nnodes MIN forbids shrinking, waits for a new "
                        "node to join in its place (counted from the loss) before the job stops, as torchrun's "
                        "agents wait for a replacement up to the rendezvous join timeout: a rescheduled pod or a "
                        f"requeued node started with the same flags joins as a spare and is swapped in (default 0: "
                        f"stop at once, or {env.REPLACEMENT_WAIT})")
    g.add_argument("--scale-up-wait", "--scale_up_wait", type=float, default=60.0,
                   help="seconds a decided scale-up waits for the next checkpoint boundary (so that nothing is "
                        "redone) before the spares are added anyway (default 60)")
    g.add_argument("--preempt-wait", "--preempt_wait", type=float, default=120.0,
                   help="seconds the decision on a node's preemption notice waits for the job's agreed step to be "
                        "saved and the node to leave before it is carried out anyway (default 120)")
    g.add_argument("--nodes-per-replica", "--nodes_per_replica", type=nodes_per_replica,
                   default=os.environ.get(env.NODES_PER_REPLICA) or None, metavar="K",
                   help="nodes per data-parallel replica: K consecutive nodes hold one replica (tensor or pipeline "
                        "parallelism inside it), and the job grows and shrinks by whole replicas; --nnodes MIN:MAX "
                        f"and --spare-nodes still count nodes, MIN and MAX multiples of K (default: {env.NODES_PER_REPLICA}; "
                        "unset: every rank is a replica)")
    g.add_argument("--policy-timeout", "--policy_timeout", type=float, default=1.0,
                   help="seconds a policy's decide() may take before the default policy decides instead")
    add_policy_limit_arguments(g)
    g.add_argument("--job-secret-file", "--job_secret_file", default=None,
                   help="file with the per-job secret that signs agent/supervisor messages (else the "
                        f"{env.JOB_SECRET} variable; else one is generated and shared through the store)")


# the group's flags of seconds, each with the config field it sets and whether 0 is allowed (it turns a wait off)
_SECONDS_FLAGS = (("--node-timeout", "node_timeout", False), ("--policy-timeout", "policy_timeout", False),
                  ("--spare-wait", "spare_wait", False), ("--scale-up-wait", "scale_up_wait", False),
                  ("--preempt-wait", "preempt_wait", False), ("--replacement-wait", "replacement_wait", True))


def supervisor_config(a: argparse.Namespace, *, min_nodes: int, max_nodes: int, nproc_per_node: int,
                      max_restarts: int) -> SupervisorConfig:
    """The :class:`SupervisorConfig` of :func:`add_supervisor_arguments`' flags in ``a`` and the command's own
    bounds: the one place both commands turn those flags into a config. ValueError names the flag."""
    for flag, name, zero_ok in _SECONDS_FLAGS:
        v = getattr(a, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v if zero_ok else 0 < v) \
                or not v < float("inf"):
            raise ValueError(f"{flag} must be a {'' if zero_ok else 'positive, '}finite number of seconds"
                             f"{' >= 0' if zero_ok else ''}, got {v!r}")
    return SupervisorConfig(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node,
                            max_restarts=max_restarts, node_timeout=a.node_timeout, policy_timeout=a.policy_timeout,
                            spare_wait=a.spare_wait, scale_up_wait=a.scale_up_wait, preempt_wait=a.preempt_wait,
                            replacement_wait=a.replacement_wait,
                            nodes_per_replica=a.nodes_per_replica, policy_memory_mb=a.policy_memory_mb,
                            policy_cpu_seconds=a.policy_cpu_seconds)
