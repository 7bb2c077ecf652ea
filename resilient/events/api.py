"""The event contract shared by launcher, signals, checkpointer, supervisor and goodput.

Every observation and every action is an :class:`Event`: a kind from :class:`EventKind`, wall and
monotonic timestamps, and where it happened (node, rank, attempt). ``details`` carries the
kind-specific fields listed beside each kind; readers must ignore fields they do not know.
"""

from __future__ import annotations

import enum
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient import env as renv

SCHEMA_VERSION = 1


class EventKind(str, enum.Enum):
    # launcher / agent lifecycle
    RUN_START = "run_start"  # details: argv, nnodes, nproc_per_node, run_id
    RUN_END = "run_end"  # details: exit_code, reason, plan_looks (the agent's reads of the store for a plan, by why)
    RENDEZVOUS_DONE = "rendezvous_done"  # details: group_rank, group_world_size, seconds
    ATTEMPT_START = "attempt_start"  # workers spawned; details: world_size, local_world_size, method
    ATTEMPT_END = "attempt_end"  # workers stopped; details: reason
    WORKERS_READY = "workers_ready"  # first step of an attempt seen by the agent

    # faults (signals)
    # details: pid, exit_code, signal (name or None), local_rank, failure_class; where known: exc_type, message
    # (first line), frame ("file:line in function"), oom_kill (bool), consequence (a peer's death caused it),
    # restore (a failed restore's details)
    WORKER_EXIT = "worker_exit"
    HANG = "hang"  # details: last_heartbeat_age, timeout, local_rank
    STRAGGLER = "straggler"  # details: score, threshold, reference
    HOST_UNHEALTHY = "host_unhealthy"  # details: check, value, threshold
    # details: index (NVML's; None: NVML itself), uuid, check (resilient.signals.gpu.GpuCheck), value, and per check
    # threshold / timeout / rounds / reasons_mask
    GPU_UNHEALTHY = "gpu_unhealthy"
    PREEMPTION_NOTICE = "preemption_notice"  # details: deadline (wall seconds), source
    AGENT_LOST = "agent_lost"  # node lost (event.node): details: reason ("timeout" | "disconnected"), last_seen_age
    NODE_JOINED = "node_joined"  # an agent joined (event.node); details: nproc, spare (bool)
    # the supervisor: a spare's agent is gone (event.node); details: cause ("disconnected": its connection closed,
    # the agent died; "timeout": silent for --node-timeout; "left"), last_seen_age (seconds, where known)
    SPARE_LOST = "spare_lost"
    # the supervisor: an agent connected and is warming up (event.node), a joining spare once the job runs
    NODE_ARRIVING = "node_arriving"
    # the supervisor: a healthy node of a replica dropped by a scale-down (--nodes-per-replica) is a warm spare at
    # once (event.node); details: node, replica (its index in the assignment it left), replica_nodes, reason
    NODE_BENCHED = "node_benched"
    FAULT_INJECTED = "fault_injected"  # a drill's fault (--inject); details: fault, target, at

    # actions (agent built-in reaction, later the supervisor's policy)
    # details: action ("restart", "stop", "hot_swap", ...), cause (event kind), reason, failure_class (the cause's)
    ACTION = "action"
    RESTART = "restart"  # the event's attempt is the new one; details: cause, detect_seconds, action
    SCALE = "scale"  # details: old_world_size, new_world_size, old_dp, new_dp, old_dp_size, new_dp_size, reason

    # worker progress (written by global rank 0 only unless stated)
    STEP = "step"  # details: step, seconds (wall time of the step), compute_seconds (optional)
    SECTION = "section"  # details: name, seconds

    # checkpointing (written by the rank that did the work; tier in details)
    CKPT_SAVE = "ckpt_save"  # details: step, blocking_seconds, bytes, mode
    CKPT_TIER_DONE = "ckpt_tier_done"  # details: step, tier, seconds, bytes
    CKPT_TIER_FAILED = "ckpt_tier_failed"  # details: step, tier, error
    # details: step, tier, seconds, bytes, sources; covered_by_snapshot (a disk tier's restore: every rank also held a
    # snapshot within a snapshot interval of that step, so node memory alone would have lost little more; what the
    # auto interval's count of interruptions that needed a disk tier leaves out)
    CKPT_RESTORE = "ckpt_restore"
    CKPT_INTERVAL = "ckpt_interval"  # details: interval, persistent_every, inputs
    # rank 0: a save that reached no tier; details: step, tier, error, consecutive, max_failed_saves
    CKPT_SAVE_FAILED = "ckpt_save_failed"
    # rank 0: training stops after max_failed_saves consecutive failed saves; details: steps, tier, error,
    # max_failed_saves, message
    CKPT_STOP = "ckpt_stop"
    # rank 0: restore found no checkpoint although this run saved before; details: attempted_steps, tiers
    # (tier -> where it was supposed to be), done (tier -> steps recorded there), failed_steps
    CKPT_RESTORE_MISSING = "ckpt_restore_missing"
    # the launcher at exit: the run's newest saved step is not on the persistent tier; details: step,
    # persistent_step (newest there, or None), exit_code
    CKPT_NOT_DURABLE = "ckpt_not_durable"
    # rank 0, per upload unless --ckpt-compress none; details: step, tier, mode, codec, decision ("compress" |
    # "plain"), reason, link_mbps, codec_mbps, ratio (as measured before this transfer; None until measured)
    CKPT_COMPRESS = "ckpt_compress"
    # rank 0, each time the snapshot tier's cadence (``--ckpt-snapshot auto``) is agreed or carried over a restart;
    # details: every (steps between snapshots; 0: off because a rank has no snapshot tier), from_step (the first
    # step it applies to), source ("agreed": from every rank's measured cost, at a disk save or every few dozen
    # save() calls; "resumed": at a restore, the slowest rank's recorded cadence), proposals (agreed: each rank's k;
    # 0 where a rank has no tier)
    CKPT_SNAPSHOT_CADENCE = "ckpt_snapshot_cadence"
    # the rank whose upload process failed (``--ckpt-upload-process``): nothing is lost by it (the upload thread sends
    # the step itself), but it costs the training process the interpreter lock the process was there to spare;
    # details: state ("died": that upload went from the thread, the next starts a new process; "off": the thread sends
    # for the rest of the run), step (the step being uploaded, or None between uploads), error
    CKPT_UPLOAD_PROCESS = "ckpt_upload_process"

    LOG = "log"  # anything else worth keeping; details: message (a GPU's benign Xid: index, uuid, check, xid, xid_kind)


def _node_name() -> str:
    return os.environ.get(renv.NODE, socket.gethostname())


@dataclass(frozen=True)
class Event:
    kind: EventKind
    node: str = field(default_factory=_node_name)
    rank: int | None = None  # global rank of the worker concerned, None for node/job events
    attempt: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    wall: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EventKind):
            object.__setattr__(self, "kind", EventKind(self.kind))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Event":
        known = {k: d[k] for k in ("node", "rank", "attempt", "details", "wall", "mono", "schema") if k in d}
        return cls(kind=EventKind(d["kind"]), **known)
