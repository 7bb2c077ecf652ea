"""The planner's seeded discrete-event simulation: a job's wall time under failures, decided by a real policy.

The clock jumps from event to event (a failure, a node back from repair, a checkpoint boundary for a pending
scale-up, the end); between events the job runs steps at a fixed pace, with a save stall after every
``ckpt_interval`` steps, so one event costs a few arithmetic operations whatever the cluster size.

Every failure is an :class:`~resilient.events.api.Event` handed to a real
:class:`~resilient.supervisor.core.SupervisorCore` running the policy file through ``decide(event, view)``: the
budget, the validation and the fallback to the default policy are the supervisor's own. What the decision
costs comes from :class:`~resilient.plan.api.Figures`:

* restart in place: detection + recovery + start-up + restore from the local tier (else peer, else
  persistent), progress since that checkpoint redone;
* hot swap or scale down: the new or remaining nodes restore from the peer tier, else the persistent one
  (the lost node's local disk is gone); the node taken out comes back after ``repair_hours`` as a new spare;
* scale up: at the next local checkpoint (or after the core's ``scale_up_wait``), nothing redone;
* stop: the job waits (``waiting_for_spares``) until ``min_nodes`` nodes are available again, then is
  launched again (``launch_s``) with a fresh restart budget.

With ``nodes_per_replica`` (``--nodes-per-replica``) the core drops and adds whole replicas: a replica dropped for a
lost node leaves its healthy nodes idle as spares until a repaired node makes a replica with them again. While the
job trains on fewer nodes than planned, the idle share of each step's time is lost capacity, counted as
``waiting_for_spares`` (not productive); ``PlanResult.dp_size_seconds`` says how long it trained at each size.

Assumptions, said once: failures arrive only while the job runs (a fault during recovery merges with the
disruption in progress), each active node at the same rate; spares do not fail while idle; a step at a
smaller world does ``world/nodes`` of a full step's work; uploads to the persistent tier finish before the
next failure.

This file is longer than 700 lines on purpose: the trial's event loop and the cost of each decision it carries
out are one model, read together.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from resilient.events.api import Event, EventKind
from resilient.goodput.api import CATEGORIES, PRODUCTIVE, Badput
from resilient.plan.api import ClusterConfig, Figures, PlannedFault, PlanInputError, PlanResult, SweepResult
from resilient.supervisor.api import JobView, NodeState, NodeView, Policy, PolicyError
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.core import Decision, SupervisorCore
from resilient.supervisor.default_policy import DefaultPolicy
from resilient.supervisor.policy import load_policy

logger = logging.getLogger(__name__)

DAY = 86400.0
_MAX_TARGET_DAYS = 3650.0
MAX_FAILURES_PER_TRIAL = 200_000  # a plan that has not finished after ten years never will
# The simulation keeps every node (a supervisor core's view of it) and pays O(nodes + spares) for every launch and
# every failure: work grows as trials × nodes × failures, and failures grow with nodes. This caps that product
# ("node-decisions"), measured at about 40 µs of CPU each (1,024 nodes, 30 days, 1 trial: about 133,000 in 5.4 s):
# a 2,048-node (16,384-GPU) month with 8 trials is about 4.2 million, the cap about 3.5 minutes of CPU. Beyond it
# the planner refuses at once, saying how many nodes it can simulate at the settings given, instead of growing
# for minutes or hours with no output.
MAX_NODE_DECISIONS = 5_000_000
_P, _STARTUP, _SAVE, _RESTORE, _WASTED, _DETECT, _RECOVERY, _WAIT, _OTHER = (
    PRODUCTIVE, Badput.STARTUP.value, Badput.CHECKPOINT_SAVE_STALL.value, Badput.CHECKPOINT_RESTORE.value,
    Badput.WASTED_PROGRESS.value, Badput.DETECTION.value, Badput.RECOVERY.value, Badput.WAITING_FOR_SPARES.value,
    Badput.OTHER.value)


@dataclass(frozen=True)
class _View(JobView):
    """A :class:`JobView` whose derived tuples are computed once: policies and the core's validation ask for
    ``members`` several times per decision, each an O(nodes) sort. Same functions, same values; ``members`` is
    read off the assignment by the planner's core (its order is the group rank) instead of sorted."""

    ranked: tuple[str, ...] = field(default=(), kw_only=True)

    @property
    def members(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.ranked

    active = functools.cached_property(JobView.active.fget)  # type: ignore[assignment]
    spares = functools.cached_property(JobView.spares.fget)  # type: ignore[assignment]
    world_size = functools.cached_property(JobView.world_size.fget)  # type: ignore[assignment]


class _Inline:
    """Calls a policy inline: a plan has no deadline, and a thread per call would cost more than the rest of a
    decision."""

    def call(self, fn, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
        return fn()


class _FastCore(SupervisorCore):
    """The supervisor's core, whose view rebuilds only the :class:`NodeView` s of nodes that an event, an
    action or the clock (failures leaving the window) may have changed: a 2,048-node view costs what a
    handful of nodes cost. The view is equal to the core's own (tests compare them)."""

    def __init__(self, cfg: SupervisorConfig, policy: Policy | None) -> None:
        super().__init__(cfg, policy, policy_calls=_Inline())
        self._vc: dict[str, NodeView] = {}
        self._vc_members: tuple[str, ...] = ()
        self._vc_gr: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._counted: set[str] = set()  # nodes with failures or stragglers in the window: pruned at each view

    def _touch(self, decisions: list[Decision]) -> list[Decision]:
        """The nodes each decision's action names may have changed state (a cordon names its swap or scale-down
        as the action)."""
        for d in decisions:
            for x in (d.action, getattr(d.action, "inner", d.action)):
                for f in ("node", "spare", "nodes", "spares"):
                    n = getattr(x, f, None)
                    if isinstance(n, str):
                        self._dirty.add(n)
                    elif isinstance(n, (tuple, list)):
                        self._dirty.update(y for y in n if isinstance(y, str))
        return decisions

    def join(self, node: str, nproc: int, now: float) -> list[Decision]:
        self._dirty.add(node)
        return self._touch(super().join(node, nproc, now))

    def handle(self, event: Event, now: float) -> list[Decision]:
        self._dirty.add(event.node)
        out = self._touch(super().handle(event, now))
        n = self._nodes.get(event.node)
        if n is not None and (n.failures or n.stragglers):
            self._counted.add(event.node)
        return out

    def tick(self, now: float) -> list[Decision]:
        self._dirty.update(self._nodes)  # rare in the planner (pending scale-ups only): no shortcut
        return super().tick(now)

    def form(self, now: float):  # type: ignore[no-untyped-def]
        self._dirty.update(self._nodes)
        return super().form(now)

    def view(self, now: float) -> JobView:
        a = self._assignment
        members = a.members if a is not None else ()
        dirty = self._dirty
        if members != self._vc_members:
            old = self._vc_members
            if len(old) == len(members):
                dirty.update(m for m, o in zip(members, old) if m != o)
                dirty.update(o for m, o in zip(members, old) if m != o)
            else:  # ranks shift: every node's group rank may have changed
                dirty.update(self._nodes)
            self._vc_members = members
            self._vc_gr = {n: i for i, n in enumerate(members)}
        for n in list(self._counted):
            node = self._nodes[n]
            self._prune(node, now)
            dirty.add(n)
            if not (node.failures or node.stragglers):
                self._counted.discard(n)
        gr, cache = self._vc_gr, self._vc
        for n in dirty:
            node = self._nodes.get(n)
            if node is None:
                continue
            state = node.state if node.state is not None else NodeState.SPARE
            rank = gr.get(n) if state in (NodeState.ACTIVE, NodeState.LOST) else None
            cache[n] = NodeView(name=n, state=state, group_rank=rank, nproc=node.nproc, healthy=node.healthy,
                                failures=len(node.failures), stragglers=len(node.stragglers),
                                last_seen=node.last_seen)
        dirty.clear()
        nodes = {n: cache[n] for n in self._nodes}  # the core's join order
        # what JobView.members sorts out of every node, read off the assignment (its order is the group rank)
        ranked = (NodeState.ACTIVE, NodeState.LOST)
        return _View(nodes=nodes, min_nodes=self.cfg.min_nodes, max_nodes=self.cfg.max_nodes,
                     nproc_per_node=self.cfg.nproc_per_node, restarts_left=self.restarts_left,
                     attempt=a.attempt if a else 0, ckpt_steps=self._ckpt_steps, recent=tuple(self._recent),
                     failure_window=self.cfg.failure_window, now=now,
                     pending_scale_up=tuple(self._pending.spares) if self._pending else (),
                     nodes_per_replica=self.cfg.nodes_per_replica,
                     ranked=tuple(m for m in members if cache[m].state in ranked and cache[m].group_rank is not None))


@dataclass
class _Ckpt:
    step: int  # steps completed when it was taken (training resumes at this step)
    work: float  # full-size step equivalents done by then


def _policy_loader(policy: str | Path | None):
    """A function giving a fresh policy object per trial (a policy may keep state between calls)."""
    if policy is None:
        return DefaultPolicy
    path = Path(policy)
    # refuse a broken or harmful file once, in a process of its own under the supervisor's limits (an os._exit
    # or a runaway allocation at import ends that process, not the planner); trials then run it in-process,
    # where thousands of decisions cost microseconds each
    load_policy(path).close()  # type: ignore[attr-defined]
    return lambda: load_policy(path, isolated=False)


def policy_name(policy: str | Path | None) -> str:
    return "default" if policy is None else Path(policy).stem


class _Trial:
    def __init__(self, c: ClusterConfig, f: Figures, make_policy, rng: random.Random,
                 faults: Sequence[PlannedFault] | None) -> None:
        self.c, self.f, self.make_policy, self.rng = c, f, make_policy, rng
        self.planned = sorted(faults, key=lambda x: x.at) if faults is not None else None
        self.lam = c.failures_per_node_day / DAY  # per node-second
        self.acc: dict[str, float] = defaultdict(float)
        self.actions: dict[str, int] = defaultdict(int)
        self.failures = 0
        self.stops = 0
        self.t = 0.0
        self.step = 0
        self.work = 0.0
        self.ck_local: _Ckpt | None = None
        self.ck_persist: _Ckpt | None = None
        self.repairs: list[tuple[float, int, str]] = []  # (time back, seq, name)
        self._seq = 0
        self.pending_at: float | None = None
        self.finished_at: float | None = None
        self.extra = sum(f.step_extra_s.values())
        self.u = f.step_s + f.step_gap_s + self.extra  # one step, start to start
        self.k = c.ckpt_interval
        self.stall = f.save_stall_s if self.k else 0.0
        self.cycle = self.k * self.u + self.stall if self.k else math.inf
        self.pe = c.persistent_every if ("local" in c.tiers or "peer" in c.tiers) else 1
        self.core: _FastCore | None = None
        self._out: set[str] = set()  # nodes taken out of the job whose replacement is on its way
        self._members_before: list[str] = []
        self.node_decisions = 0.0  # what this trial has cost so far, in the unit of MAX_NODE_DECISIONS
        self.budget = math.inf  # set by the caller: past it the trial stops with a PlanInputError
        self.dp_time: dict[int, float] = defaultdict(float)  # data-parallel size → seconds trained at it
        self.cap = 1.0  # with replicas: the share of the planned nodes the last run trained on

    # ------------------------------------------------------------------------------------------ helpers
    def _name(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}{self._seq}"

    def _launch(self, names: list[str]) -> None:
        c = self.c
        cfg = SupervisorConfig(min_nodes=c.min_nodes, max_nodes=c.nodes, nproc_per_node=c.gpus_per_node,
                               max_restarts=c.max_restarts, node_timeout=1e15, failure_window=c.failure_window,
                               policy_timeout=60.0,  # never abandon a policy because the machine is busy
                               nodes_per_replica=c.nodes_per_replica)
        self.core = core = _FastCore(cfg, self.make_policy())
        for n in names:
            core.join(n, c.gpus_per_node, self.t)
        core.form(self.t)
        self.pending_at = None
        self.acc[_STARTUP] += self.f.launch_s
        self.t += self.f.launch_s

    def _members(self) -> tuple[str, ...]:
        assert self.core is not None and self.core.assignment is not None
        return self.core.assignment.members

    def _restore(self, replacement: bool) -> None:
        """Roll back to the newest checkpoint the restoring nodes can read, and pay for reading it."""
        tiers = self.c.tiers
        order = ("peer", "persistent") if replacement else ("local", "peer", "persistent")
        tier = next((t for t in order if t in tiers), None)
        ck = None
        if tier in ("local", "peer"):
            ck = self.ck_local
        elif tier == "persistent":
            ck = self.ck_persist
        if ck is None and tier != "persistent" and "persistent" in tiers and self.ck_persist is not None:
            tier, ck = "persistent", self.ck_persist
        back_step, back_work = (ck.step, ck.work) if ck is not None else (0, 0.0)
        redo = self.step - back_step
        if redo > 0:  # those steps were counted productive when they ran; they are redone now
            per = self.f.step_s + self.extra
            self.acc[_P] -= redo * self.f.step_s * self.cap
            self.acc[_WAIT] -= redo * self.f.step_s * (1.0 - self.cap)
            for cat, x in self.f.step_extra_s.items():
                self.acc[cat] -= redo * x
            self.acc[_WASTED] += redo * per
        self.step, self.work = back_step, back_work
        if ck is not None and tier is not None:
            self.acc[_RESTORE] += self.f.restore_s[tier]
            self.t += self.f.restore_s[tier]
        # checkpoints newer than the one restored are gone with it (a lost local tier, or never taken)
        if self.ck_local is not None and self.ck_local.step > back_step:
            self.ck_local = ck if ck is not None else None
        if self.ck_persist is not None and self.ck_persist.step > back_step:
            self.ck_persist = None

    def _run(self, e: float, fct: float) -> None:
        """The job ran ``e`` seconds from a cycle boundary at ``self.t``: steps, saves, a partial step."""
        k, u, f = self.k, self.u, self.f
        if k:
            ncyc = int(e // self.cycle)
            rem = e - ncyc * self.cycle
            j = min(k, int(rem // u))
            partial = rem - j * u
            in_stall = j == k
            n, saves = ncyc * k + j, ncyc
        else:
            n = int(e // u)
            partial, in_stall, saves = e - n * u, False, 0
        # with replicas, the planned nodes a dropped replica left idle are lost capacity, not productive time
        self.cap = fct if self.c.nodes_per_replica else 1.0
        self.acc[_P] += n * f.step_s * self.cap
        self.acc[_WAIT] += n * f.step_s * (1.0 - self.cap)
        a = self.core.assignment if self.core is not None else None
        if a is not None and e > 0:
            self.dp_time[a.dp_size] += e
        self.acc[_OTHER] += n * f.step_gap_s
        for cat, x in f.step_extra_s.items():
            self.acc[cat] += n * x
        self.acc[_SAVE] += saves * self.stall + (partial if in_stall else 0.0)
        if not in_stall:
            self.acc[_WASTED] += partial  # the step in flight is lost with the fault
        s0, w0 = self.step, self.work
        if saves:
            g0 = s0 // k  # saves before this run
            last = _Ckpt(s0 + saves * k, w0 + saves * k * fct)
            if "local" in self.c.tiers or "peer" in self.c.tiers:
                self.ck_local = last
            gp = ((g0 + saves) // self.pe) * self.pe
            if "persistent" in self.c.tiers and gp > g0:
                self.ck_persist = _Ckpt(gp * k, w0 + (gp * k - s0) * fct)
        self.step, self.work = s0 + n, w0 + n * fct
        self.t += e

    def _to_finish(self, fct: float) -> float:
        """Seconds from a cycle boundary to the last step of ``steps`` (inf without a target)."""
        if self.c.steps is None:
            return math.inf
        r = max(0, math.ceil((self.c.steps - self.work) / fct - 1e-9))
        if not self.k:
            return r * self.u
        return r * self.u + (r // self.k) * self.stall

    def _schedule_out(self, before: tuple[str, ...], after: tuple[str, ...]) -> None:
        """Nodes that left the job lost or cordoned come back, as new spares, after repair."""
        assert self.core is not None
        kept = set(after)
        for n in before:
            if n not in kept and n not in self._out:
                node = self.core._nodes.get(n)
                if node is not None and node.state in (NodeState.LOST, NodeState.CORDONED):
                    self._out.add(n)
                    self._back_after_repair()

    def _back_after_repair(self) -> None:
        if math.isfinite(self.c.repair_hours):
            heapq.heappush(self.repairs, (self.t + self.c.repair_hours * 3600.0, self._seq, self._name("r")))

    # ------------------------------------------------------------------------------------------ decisions
    def _carry_out(self, ds: list[Decision], cause: str | None) -> str:
        """Apply the core's decisions; returns "changed", "stopped" or "same"."""
        assert self.core is not None
        out = "same"
        for d in ds:
            kind = d.action.kind
            if d.pending:
                self.actions["scale_up_decided"] += 1
                if self.pending_at is None:
                    self.pending_at = self.t
                continue
            if kind == "ignore" and cause is None:
                continue  # a node back from repair waiting as a spare: not worth counting
            self.actions[kind] += 1
            if kind == "stop":
                return "stopped"
            if d.assignment is not None:
                before = tuple(self._members_before)
                after = d.assignment.members
                self._schedule_out(before, after)
                if kind == "scale_up":
                    self.pending_at = None
                self.acc[_RECOVERY] += self.f.recovery_s.get(kind, self.f.recovery_s["restart"])
                self.t += self.f.recovery_s.get(kind, self.f.recovery_s["restart"])
                self.acc[_STARTUP] += self.f.startup_s
                self.t += self.f.startup_s
                # nodes new to the job have no local copy: they read the peer or persistent tier
                self._restore(replacement=kind in ("hot_swap", "scale_down", "scale_up"))
                self._members_before = list(after)
                out = "changed"
        if out == "same" and cause is not None:
            # a failure the policy left alone (ignore, cordon of a spare...): the workers died all the same and
            # the agents start them again in place
            self.acc[_RECOVERY] += self.f.recovery_s["restart"]
            self.acc[_STARTUP] += self.f.startup_s
            self.t += self.f.recovery_s["restart"] + self.f.startup_s
            self._restore(replacement=cause == EventKind.AGENT_LOST.value)
            out = "changed"
        return out

    def _fail(self, kind: str, node: str) -> str:
        assert self.core is not None and self.core.assignment is not None
        self.failures += 1
        self.acc[_DETECT] += self.f.detect_s[kind]
        self.t += self.f.detect_s[kind]
        attempt = None if kind == EventKind.AGENT_LOST.value else self.core.assignment.attempt
        details: dict = {"reason": "planned"} if kind == EventKind.AGENT_LOST.value else {}
        if kind == EventKind.WORKER_EXIT.value:
            details = {"exit_code": 1, "signal": None}
        ev = Event(kind=EventKind(kind), node=node, rank=None if attempt is None else 0, attempt=attempt,
                   details=details, wall=self.t, mono=self.t)
        self._members_before = list(self.core.assignment.members)
        return self._carry_out(self.core.handle(ev, self.t), kind)

    def _stopped(self, cause: str | None, horizon: float) -> bool:
        """After a stop: wait until enough nodes are back, launch again. False when that never happens."""
        assert self.core is not None
        self.stops += 1
        core = self.core
        for n, v in core._nodes.items():
            if v.state in (NodeState.LOST, NodeState.CORDONED) and n not in self._out:
                self._out.add(n)
                self._back_after_repair()
        ready = [n for n, v in core._nodes.items() if v.state in (NodeState.ACTIVE, NodeState.SPARE) and v.healthy]
        ready = [n for n in self._members_before if n in ready] + [n for n in ready if n not in self._members_before]
        while len(ready) < self.c.min_nodes:
            if not self.repairs:
                return False
            at, _, name = heapq.heappop(self.repairs)
            if at > horizon:
                return False
            self.acc[_WAIT] += at - self.t
            self.t = at
            ready.append(name)
        while self.repairs and self.repairs[0][0] <= self.t:
            ready.append(heapq.heappop(self.repairs)[2])
        self._launch(ready)
        self._members_before = list(self._members())
        self._restore(replacement=cause == EventKind.AGENT_LOST.value)
        return True

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> None:
        c = self.c
        names = [f"n{i}" for i in range(c.nodes)] + [f"s{i}" for i in range(c.spares)]
        self._launch(names)
        self._members_before = list(self._members())
        horizon = c.days * DAY if c.steps is None else _MAX_TARGET_DAYS * DAY
        planned = list(self.planned) if self.planned is not None else None
        while True:
            members = self._members()
            fct = len(members) / c.nodes
            start = self.t
            if planned is not None:
                fail_at = max(planned[0].at, start) if planned else math.inf
            else:
                rate = self.lam * len(members)
                fail_at = start + (self.rng.expovariate(rate) if rate > 0 else math.inf)
            fin_at = start + self._to_finish(fct)
            # nodes back from repair join while the job runs: the policy decides (scale up, or wait as a spare)
            cut = None
            while self.repairs and self.repairs[0][0] < min(fail_at, fin_at, horizon, self._boundary(start)[0]):
                at, _, name = heapq.heappop(self.repairs)
                self._members_before = list(members)
                ds = self.core.join(name, c.gpus_per_node, at)  # type: ignore[union-attr]
                if any(d.assignment is not None or d.action.kind == "stop" for d in ds):
                    cut = (at, ds)  # a policy that restarts on a join: carried out at once
                    break
                self._carry_out(ds, None)
                if self.pending_at is not None and any(d.pending for d in ds):
                    # the scale-up was decided when the node joined, not when the job's last run began
                    self.pending_at = max(self.pending_at, at)
            if cut is not None:
                self._run(cut[0] - start, fct)
                if self._carry_out(cut[1], None) == "stopped" and not self._stopped(None, horizon):
                    break
                continue
            b, at_save = self._boundary(start)
            if horizon <= min(fail_at, fin_at, b):
                self._run(horizon - start, fct)
                break
            if fin_at <= min(fail_at, b):
                self._run(fin_at - start, fct)
                self.acc[_OTHER] += self.f.teardown_s
                self.t += self.f.teardown_s
                self.finished_at = self.t
                break
            if b <= fail_at:
                self._run(b - start, fct)
                if at_save:
                    ev = Event(kind=EventKind.CKPT_TIER_DONE, node=members[0], rank=0,
                               attempt=self.core.assignment.attempt,  # type: ignore[union-attr]
                               details={"step": self.step - 1, "tier": "local"}, wall=self.t, mono=self.t)
                    ds = self.core.handle(ev, self.t)  # type: ignore[union-attr]
                else:
                    ds = self.core.tick(self.t)  # type: ignore[union-attr]
                self._members_before = list(members)
                if self._carry_out(ds, None) == "stopped" and not self._stopped(None, horizon):
                    break
                if not ds:
                    self.pending_at = None  # the core dropped it (no spare left, budget spent)
                continue
            # a failure
            self.node_decisions += len(self.core._nodes)  # type: ignore[union-attr]
            if self.node_decisions > self.budget:
                raise PlanInputError(f"the simulation passed {self.budget:,.0f} node-decisions in one trial after "
                                     f"{self.failures:,} failures (far more than the rate predicts): plan fewer "
                                     "--steps, --days or nodes, or a lower failure rate")
            if self.failures >= MAX_FAILURES_PER_TRIAL:
                raise PlanInputError(f"more than {MAX_FAILURES_PER_TRIAL:,} failures in one simulated run: the "
                                     "failure rate is far beyond what the job can make progress with; lower it, or "
                                     "plan fewer --days or --steps")
            self._run(fail_at - start, fct)
            if planned is not None:
                pf = planned.pop(0)
                kind, node = pf.kind, members[pf.node % len(members)]
            else:
                node = members[self.rng.randrange(len(members))]
                x = self.rng.random()
                if x < c.node_loss_share:
                    kind = EventKind.AGENT_LOST.value
                elif self.rng.random() < c.hang_share:
                    kind = EventKind.HANG.value
                else:
                    kind = EventKind.WORKER_EXIT.value
            if self._fail(kind, node) == "stopped" and not self._stopped(kind, horizon):
                break
        if self.t < horizon and self.finished_at is None and c.steps is None:
            self.acc[_WAIT] += horizon - self.t  # stopped for good: the rest of the time is waiting
            self.t = horizon

    def _boundary(self, start: float) -> tuple[float, bool]:
        """When a pending scale-up is carried out, and whether that is a local save's end (else the core's
        ``scale_up_wait`` ran out)."""
        if self.pending_at is None:
            return math.inf, False
        assert self.core is not None
        wait = max(self.pending_at + self.core.cfg.scale_up_wait, start)
        if self.k and "local" in self.c.tiers:
            nxt = start + (math.floor((max(self.t, self.pending_at) - start) / self.cycle) + 1) * self.cycle
            if nxt <= wait:
                return nxt, True
        return wait, False


# --------------------------------------------------------------------------------------------- bounds
@dataclass(frozen=True)
class Workload:
    """What a plan simulates, per trial, estimated before it runs (and printed with the result)."""

    horizon_s: float  # wall time simulated: ``days``, or what ``steps`` take without a failure
    steps: int | None  # the steps to finish, None when the horizon is ``days``
    nodes: int
    spares: int
    mtbf_s: float  # the job's mean time between interruptions while it runs (inf: no failures)
    expected_failures: float  # from the rate: failures arrive while the job runs, each costs recovery time
    trials: int

    @property
    def node_decisions(self) -> float:
        return self.trials * (self.nodes + self.spares) * (self.expected_failures + 1.0)


def _step_s(f: Figures) -> float:
    return f.step_s + f.step_gap_s + sum(f.step_extra_s.values())


def _mtbf_s(failures_per_node_day: float, nodes: int) -> float:
    rate = failures_per_node_day * nodes / DAY
    return math.inf if rate == 0 else 1.0 / rate


def _expected_failures(mtbf_s: float, horizon_s: float, f: Figures) -> float:
    """Failures arrive while the job runs, and each costs at least detection, recovery and start-up."""
    down = min(f.detect_s.values()) + min(f.recovery_s.values()) + f.startup_s
    return 0.0 if not math.isfinite(mtbf_s) else horizon_s / (mtbf_s + down)


def workload(c: ClusterConfig, f: Figures, trials: int) -> Workload:
    u = _step_s(f)
    if c.steps is None:
        horizon = c.days * DAY
    else:
        saves = c.steps // c.ckpt_interval if c.ckpt_interval else 0
        horizon = f.launch_s + c.steps * u + saves * f.save_stall_s + f.teardown_s
    mtbf = _mtbf_s(c.failures_per_node_day, c.nodes)
    expected = _expected_failures(mtbf, horizon, f)
    return Workload(horizon_s=horizon, steps=c.steps, nodes=c.nodes, spares=c.spares, mtbf_s=mtbf,
                    expected_failures=expected, trials=trials)


def _human_s(x: float) -> str:
    if not math.isfinite(x):
        return "never"
    for unit, size in (("days", DAY), ("h", 3600.0), ("min", 60.0)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.3g} s"


def check_bounds(c: ClusterConfig, f: Figures, trials: int, points: int = 1) -> Workload:
    """Refuse, with one :class:`PlanInputError` naming what to change, a plan the simulation cannot do in
    reasonable time and memory, or one whose failure rate leaves the job no progress. ``points``: plans of
    this size about to run (a sweep)."""
    w = workload(c, f, trials)
    if c.steps is None and c.days > _MAX_TARGET_DAYS:
        raise PlanInputError(f"--days {c.days:g} is beyond what the planner simulates ({_MAX_TARGET_DAYS:g} days, ten "
                             "years): plan a shorter horizon")
    if c.steps is not None and w.horizon_s > _MAX_TARGET_DAYS * DAY:
        raise PlanInputError(f"--steps {c.steps:,} take {_human_s(w.horizon_s)} without a single failure, beyond what "
                             f"the planner simulates ({_MAX_TARGET_DAYS:g} days): plan fewer steps")
    total = w.node_decisions * points
    if total > MAX_NODE_DECISIONS:
        # trials × (n + spares) × (failures(n) + 1) <= cap / points: the largest n
        k = MAX_NODE_DECISIONS / points / trials
        n_max = 0
        if c.spares < k:
            lo, hi = 0, c.nodes
            while lo < hi:  # the largest n that fits (the product grows with n)
                mid = (lo + hi + 1) // 2
                if (mid + c.spares) * (_expected_failures(_mtbf_s(c.failures_per_node_day, mid), w.horizon_s, f)
                                       + 1) <= k:
                    lo = mid
                else:
                    hi = mid - 1
            n_max = lo
        what = f"{points:,} plans of " if points > 1 else ""
        fix = (f"plan at most about {n_max:,} nodes at these settings, or fewer --days or --trials" if n_max >= 1
               else "plan fewer --spares, --trials or --days")
        raise PlanInputError(
            f"{what}{c.nodes:,} nodes + {c.spares:,} spares over {_human_s(w.horizon_s)} ({w.expected_failures:,.3g} "
            f"expected failures per trial, {trials:,} trials) is about {total:.2g} node-decisions, beyond the "
            f"planner's {MAX_NODE_DECISIONS:,} (it simulates node by node): {fix}")
    if math.isfinite(w.mtbf_s):
        u = _step_s(f)
        # progress is kept at a checkpoint (or at the end, without any): the first one of an attempt comes after
        first = (c.ckpt_interval * u + f.save_stall_s) if c.ckpt_interval else (c.steps * u if c.steps else u)
        first = min(first, w.horizon_s)
        chance = math.exp(-first / w.mtbf_s)
        if w.expected_failures * chance < 1.0 and w.expected_failures >= 1.0:
            raise PlanInputError(
                f"at a job MTBF of {_human_s(w.mtbf_s)} ({c.failures_per_node_day:.3g} failures per node-day on "
                f"{c.nodes:,} nodes) the job makes no progress: an attempt needs {_human_s(first)} to keep any (its "
                f"first checkpoint), and gets there with a chance of {chance:.2g}; give a lower rate (--mtbf-hours, "
                "--failures-per-node-day) or checkpoint more often (--ckpt-interval)")
    return w


# --------------------------------------------------------------------------------------------- API
def simulate(cluster: ClusterConfig, figures: Figures, policy: str | Path | None = None, *, seed: int = 0,
             trials: int = 8, faults: Sequence[PlannedFault] | None = None) -> PlanResult:
    """Expected goodput of ``cluster`` with ``figures`` under ``policy`` (a policy file; None: the default
    policy), over ``trials`` seeded runs. ``faults``: a fixed schedule instead of drawn failures."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise PlanInputError(f"trials must be an integer >= 1, got {trials!r}")
    check_bounds(cluster, figures, trials)
    try:
        make_policy = _policy_loader(policy)
    except PolicyError as e:
        raise PlanInputError(f"policy: {e}") from None
    with _quiet_core():
        return _simulate(cluster, figures, policy, make_policy, seed, trials, faults)


class _Mute(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _quiet_core():
    """The core logs every stop and every overruled policy as a real job's trouble; simulated ones are not."""
    lg = logging.getLogger("resilient.supervisor.core")
    f = _Mute()
    lg.addFilter(f)
    try:
        yield
    finally:
        lg.removeFilter(f)


def _simulate(cluster: ClusterConfig, figures: Figures, policy: str | Path | None, make_policy, seed: int,
              trials: int, faults: Sequence[PlannedFault] | None) -> PlanResult:
    totals: dict[str, float] = defaultdict(float)
    actions: dict[str, float] = defaultdict(float)
    failures = stops = wall = useful = 0.0
    finish_times: list[float] = []
    dp_time: dict[int, float] = defaultdict(float)
    for i in range(trials):
        tr = _Trial(cluster, figures, make_policy, random.Random(f"resilient-plan:{seed}:{i}"), faults)
        tr.budget = 2.0 * MAX_NODE_DECISIONS / trials  # the estimate is checked before; this catches what it missed
        tr.run()
        for k, v in tr.acc.items():
            totals[k] += v
        for k, v in tr.actions.items():
            actions[k] += v
        failures += tr.failures
        stops += tr.stops
        for k, v in tr.dp_time.items():
            dp_time[k] += v
        wall += tr.t
        useful += tr.work
        if tr.finished_at is not None:
            finish_times.append(tr.finished_at)
    n = float(trials)
    badput = {c: max(0.0, totals.get(c, 0.0)) / n for c in CATEGORIES}
    productive = max(0.0, totals.get(_P, 0.0)) / n
    w = wall / n
    hours = w / 3600.0 * (cluster.nodes + cluster.spares)
    u = useful / n
    return PlanResult(
        policy=policy_name(policy), nodes=cluster.nodes, gpus=cluster.gpus, spares=cluster.spares,
        ckpt_interval=cluster.ckpt_interval, goodput=min(1.0, productive / w) if w > 0 else 0.0, wall_seconds=w,
        productive_seconds=productive, badput_seconds=badput, useful_steps=u,
        time_to_finish_s=(sum(finish_times) / len(finish_times)) if cluster.steps is not None and finish_times else None,
        cost_per_useful_step=cluster.cost_per_node_hour * hours / u if u > 0 else math.inf,
        failures=failures / n, actions={k: v / n for k, v in sorted(actions.items())}, stops=stops / n,
        trials=trials, seed=seed, finished=len(finish_times) / n if cluster.steps is not None else 1.0,
        dp_size_seconds={k: v / n for k, v in sorted(dp_time.items(), reverse=True)})


def young_daly_steps(cluster: ClusterConfig, figures: Figures) -> float | None:
    """√(2·δ·M) in steps: δ the blocking cost of a save, M the job's mean time between failures."""
    m = cluster.mtbf_hours * 3600.0
    if not math.isfinite(m) or figures.save_stall_s <= 0:
        return None
    return math.sqrt(2 * figures.save_stall_s * m) / (figures.step_s + figures.step_gap_s + sum(figures.step_extra_s.values()))


def interval_grid(cluster: ClusterConfig, figures: Figures, points: int = 17) -> list[int]:
    """Checkpoint intervals to try: a geometric grid from ¼ to 4 × Young/Daly's (or 1 to 10,000 steps)."""
    yd = young_daly_steps(cluster, figures)
    if yd is None:
        raw = [10 ** (4 * i / (points - 1)) for i in range(points)]
    else:
        half = (points - 1) // 2
        raw = [yd * 2 ** (2 * (i - half) / half) for i in range(points)]
    return sorted({max(1, round(x)) for x in raw})


def sweep(cluster: ClusterConfig, figures: Figures, policy: str | Path | None = None, *, seed: int = 0,
          trials: int = 8, max_spares: int | None = None, intervals: Sequence[int] | None = None) -> SweepResult:
    """The checkpoint interval with the best goodput (at the given spares), then the number of spares with the
    lowest cost per useful step (at that interval). The same seeds at every point, so differences between
    points are the configuration's, not the dice's."""
    from dataclasses import replace

    grid = list(intervals) if intervals is not None else interval_grid(cluster, figures)
    if max_spares is not None and (isinstance(max_spares, bool) or not isinstance(max_spares, int) or max_spares < 0):
        raise PlanInputError(f"--max-spares must be an integer >= 0, got {max_spares!r}")
    if max_spares is not None:
        check_bounds(replace(cluster, spares=max(cluster.spares, max_spares)), figures, trials,
                     points=len(grid) + max_spares + 1)
    else:
        check_bounds(cluster, figures, trials, points=len(grid))
    points: list[PlanResult] = []
    by_interval = []
    for k in grid:
        r = simulate(replace(cluster, ckpt_interval=k), figures, policy, seed=seed, trials=trials)
        points.append(r)
        by_interval.append(r)
    best_k = max(by_interval, key=lambda r: r.goodput).ckpt_interval
    if max_spares is None:
        # enough to cover the node losses expected during one repair, with room to spare
        losses_per_repair = cluster.failures_per_node_day * cluster.nodes * cluster.node_loss_share \
            * cluster.repair_hours / 24.0
        max_spares = max(2, math.ceil(3 * losses_per_repair) + 1)
    by_spares = []
    for s in range(0, max_spares + 1):
        r = next((p for p in points if p.spares == s and p.ckpt_interval == best_k), None)
        if r is None:
            r = simulate(replace(cluster, ckpt_interval=best_k, spares=s), figures, policy, seed=seed, trials=trials)
            points.append(r)
        by_spares.append(r)
    best = min(by_spares, key=lambda r: (r.cost_per_useful_step, -r.goodput))
    return SweepResult(best=best, best_spares=best.spares, best_interval=best_k,
                       young_daly_steps=young_daly_steps(cluster, figures), points=points)
