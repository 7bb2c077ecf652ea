"""The default policy: restart in place for what a restart fixes, replace a node only on node-level evidence.

========================  ================================================================================
event                     action
========================  ================================================================================
worker_exit / hang        ``Restart`` (in-job restart, same nodes and ranks): a rank that dies or hangs while
                          its agent stays connected and healthy says nothing about the node by itself (the
                          rank that fails first is often the survivor of a peer's failure, and faults come
                          at random). A node is replaced for worker failures only when they single it out
                          (see *a bad node* below); then ``HotSwap`` to a spare, benched for ``cool_down``;
                          no spare: ``ScaleDown`` without it if ``--nnodes MIN`` allows; else keep
                          restarting in place.
agent_lost (node lost)    ``HotSwap`` to a spare; no spare: ``ScaleDown`` if MIN allows; else, while a spare
                          is joining (its agent connected, still warming up), ``Ignore``: the core waits for it
                          up to ``--spare-wait`` seconds and asks again; else, within
                          ``--replacement-wait`` of the loss, ``Ignore`` too: a node that joins in
                          its place is swapped in; else ``Stop``.
host / GPU unhealthy      ``HotSwap`` to a free spare, benched (it returns only once it reports healthy);
                          no spare: ``Ignore`` (the node still trains; a failing check is not a failure).
node_joined (a spare)     ``ScaleUp`` when the job runs below MAX (carried out at the next checkpoint
                          boundary); otherwise ``Ignore`` (it waits warm).
straggler                 ``Ignore``: recorded (``policies/evict_stragglers.py`` acts on persistent ones).
preemption_notice         A member is going (its agent got SIGTERM, or a notice file/URL): every rank stops
                          after one agreed step and saves it; meanwhile ``HotSwap`` to a free spare, else
                          ``ScaleDown`` without it if MIN allows; the core carries either out once that step is
                          saved (the job loses nothing). Neither possible: ``Ignore``, and every node exits 75
                          (preempted: the scheduler requeues, the rerun resumes). A notice from a spare: it
                          leaves, ``Ignore``.
restart budget spent      ``Stop`` with the reason.
========================  ================================================================================

**Replicas** (``--nodes-per-replica K``, ``JobView.nodes_per_replica``): a swap still replaces one node inside its
replica; without a free spare the scale-down drops the broken node's whole replica (``scale_down_without``) when
MIN allows, and the core makes the replica's healthy nodes warm spares at once; a spare joining grows the job only
by whole replicas (K free spares, e.g. a returning node and the benched one), otherwise it waits warm.

**By failure class** (``JobView.failure_class``, :mod:`resilient.supervisor.classify`), before the rows above:

=======================  =================================================================================
class                    action
=======================  =================================================================================
state_unrecoverable      ``Stop`` at once, budget or not: no checkpoint step can be assembled, so every restart
                         would fail the same way. The reason names what is missing (steps, ranks, files, tiers)
                         and what would restore it (a persistent tier, an older checkpoint directory).
software                 ``Restart``; but the same exception raised at the same frame in two consecutive
                         attempts is a crash loop: ``Stop`` after the second, naming the exception and frame (a
                         crash loop burns the budget, not faults).
hardware                 the node is replaced (``HotSwap`` to a spare, else ``ScaleDown``) and cordoned for good;
                         neither possible: ``Restart``.
transient, resource,     as the rows above (in-job ``Restart``; a node singled out by its failures is replaced).
unknown
preemption               as ``preemption_notice`` above.
=======================  =================================================================================

**A bad node** (``node_is_bad``): it has at least ``failures_to_swap`` (3) failures within the view's failure
window (``JobView.failure_window``), and bad luck alone would put that many of the job's failures on it
with a chance below ``luck`` (1%). Under bad luck every failure of the job falls on a node in proportion to
its share of the workers, so a node's count is Binomial(F, share), F being the failures of all current
members within the window; the chance is that binomial's upper tail. With 2 equal nodes it takes 7
failures in a row on one node (0.5**7 < 1%); with 8 nodes, 3 of 3. A single-node job has no other node to
compare with: worker failures never replace its node (a lost or unhealthy node still is).

**The same failure again and again** (``same_failure_streak``): when one rank failed the same way (same
exit code or signal, or a hang) in each of the last N attempts, the reasons say so ("rank 1 failed the same
way (exit code 3) 3 times in a row") and quote no bad-luck chance: a script that exits deterministically is
not unlucky, and a probability would suggest a hardware fault. The decision itself does not change.

**Benched, not cordoned.** A node swapped out while its agent is connected (failures, a failing check) is
benched for ``cool_down`` seconds (600); after it, if its agent still reports and is healthy, it is a warm
spare again (the core carries this out: see ``HotSwap.cool_down``). ``cool_down=None`` cordons for good.

The policy only reads the view, so it can be used anywhere, including as the fallback when a user's
policy fails. Extend it by subclassing :class:`DefaultPolicy` and calling ``super().decide``.
"""

from __future__ import annotations

import math

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import (
    FAILURE_KINDS, HEALTH_KINDS, Action, FailureClass, HotSwap, Ignore, JobView, NodeState, Restart, ScaleDown,
    ScaleUp, Stop,
)


def bad_luck_chance(k: int, total: int, share: float) -> float:
    """P(X >= k) for X ~ Binomial(total, share): the chance that ``k`` or more of ``total`` failures fall on a
    node holding ``share`` of the workers when failures strike at random."""
    if k <= 0:
        return 1.0
    if k > total:
        return 0.0
    if share >= 1.0:
        return 1.0
    if share <= 0.0:
        return 0.0
    return min(1.0, sum(math.comb(total, i) * share ** i * (1.0 - share) ** (total - i) for i in range(k, total + 1)))


class DefaultPolicy:
    """See the module docstring. ``failures_to_swap``: the fewest failures of one node within the failure window
    that can single it out; ``luck``: how unlikely bad luck must be before the node is blamed; ``cool_down``:
    seconds a node swapped out while its agent is healthy stays benched before it is a spare again (None:
    cordoned for good)."""

    def __init__(self, failures_to_swap: int = 3, luck: float = 0.01, cool_down: float | None = 600.0) -> None:
        if isinstance(failures_to_swap, bool) or not isinstance(failures_to_swap, int) or failures_to_swap < 1:
            raise ValueError(f"failures_to_swap must be an integer >= 1, got {failures_to_swap!r}")
        if isinstance(luck, bool) or not isinstance(luck, (int, float)) or not 0.0 < luck < 1.0:
            raise ValueError(f"luck must be a probability between 0 and 1 (exclusive), got {luck!r}")
        if cool_down is not None and (isinstance(cool_down, bool) or not isinstance(cool_down, (int, float))
                                      or not 0.0 <= cool_down < math.inf):
            raise ValueError(f"cool_down must be None or a finite number of seconds >= 0, got {cool_down!r}")
        self.failures_to_swap = failures_to_swap
        self.luck = float(luck)
        self.cool_down = None if cool_down is None else float(cool_down)

    # -- helpers subclasses use
    @staticmethod
    def can_scale_down(view: JobView, n: int | None = None) -> bool:
        """Whether dropping ``n`` nodes (default: one replica, a node without --nodes-per-replica) keeps MIN."""
        return len(view.members) - (n if n is not None else view.nodes_per_replica or 1) >= view.min_nodes

    @staticmethod
    def scale_down_without(node: str, view: JobView, why: str, *, cool_down: float | None = None) -> ScaleDown:
        """The scale-down that takes ``node`` out: its whole replica with --nodes-per-replica (the core makes the
        replica's healthy nodes warm spares), else the node alone."""
        if not view.nodes_per_replica:
            return ScaleDown((node,), reason=f"{why}: no spare, continuing on {len(view.members) - 1} node(s)",
                             cool_down=cool_down)
        r = view.replica_of(node) or (node,)
        i = view.replicas.index(r) if r in view.replicas else 0
        left = len(view.replicas) - 1
        healthy = [n for n in r if n != node and view.nodes[n].state is NodeState.ACTIVE]
        return ScaleDown(r, cool_down=cool_down,
                         reason=f"{why}: no spare, dropping replica {i} ({', '.join(r)}), continuing on {left} "
                                f"replica(s) ({len(view.members) - len(r)} node(s))"
                                + (f"; {', '.join(healthy)} benched as warm spare(s)" if healthy else ""))

    @staticmethod
    def free_spares(view: JobView) -> tuple[str, ...]:
        """Healthy spares not already promised to a pending scale-up."""
        return tuple(s for s in view.spares if s not in view.pending_scale_up)

    def node_is_bad(self, node: str, view: JobView) -> tuple[bool, str]:
        """Whether ``node``'s failures within the window single it out (see the module docstring), and why."""
        v = view.nodes.get(node)
        members = [m for m in view.members if m in view.nodes]
        if v is None or node not in members:
            return False, f"{node} holds no group rank"
        k = v.failures
        total = sum(view.nodes[m].failures for m in members)
        workers = sum(view.nodes[m].nproc for m in members)
        share = v.nproc / workers if workers > 0 else 1.0
        p = bad_luck_chance(k, total, share)
        why = (f"{node} had {k} of the job's {total} failure(s) within {view.failure_window:g} s holding "
               f"{share:.0%} of the workers (bad luck: {p:.2%})")
        return k >= self.failures_to_swap and p < self.luck, why

    @staticmethod
    def same_failure_streak(event: Event, view: JobView) -> tuple[int, str]:
        """How many attempts in a row, ending with ``event``'s, saw ``event.rank`` fail the same way (same kind,
        exit code and signal), and that way in words; (1, ...) for a failure not seen in the attempt before."""
        how = _failure_how(event)
        if event.rank is None or event.attempt is None:
            return 1, how
        same = {e.attempt for e in view.recent
                if e.kind is event.kind and e.rank == event.rank and e.attempt is not None
                and _failure_how(e) == how}
        n, a = 1, event.attempt - 1
        while a in same:
            n, a = n + 1, a - 1
        return n, how

    @staticmethod
    def unrecoverable(event: Event) -> str:
        """Why the job stops when no checkpoint can be restored: what is missing, and what would restore it."""
        d = event.details if isinstance(event.details, dict) else {}
        said = str(d.get("message") or d.get("error") or "no committed step could be assembled from any tier")
        why = f"the state cannot be restored (rank {event.rank} on {event.node}: {said})"
        if "persistent tier" not in said:
            why += ("; a persistent tier (--ckpt-persistent) or an older checkpoint directory holding the missing "
                    "shards would restore it")
        return why + "; a restart would fail the same way"

    @staticmethod
    def crash_loop(event: Event, view: JobView) -> str | None:
        """The reason to stop when ``event``'s exception was raised at the same frame in the attempt before (any
        rank), else None. Only a known exception at a known frame counts: an exit code or a signal says too little
        to tell a bug from bad luck."""
        where = _raised_at(event)
        if where is None or event.attempt is None:
            return None
        before = [e for e in view.recent if e.kind is EventKind.WORKER_EXIT and e.attempt == event.attempt - 1
                  and _raised_at(e) == where and view.failure_class(e) is FailureClass.SOFTWARE]
        if not before:
            return None
        return (f"the same failure in attempts {event.attempt - 1} and {event.attempt}: {_exception(event)} raised "
                f"at {where[1]} (rank {event.rank} on {event.node}); a restart would repeat it (a crash loop "
                "spends the restart budget, not faults): fix it and rerun, the job resumes from its last checkpoint")

    def replace(self, node: str, view: JobView, why: str, *, last_resort: Action | None = None,
                cool_down: float | None = None) -> Action:
        """Take ``node`` out of the job: a spare takes its place, else the job shrinks, else ``last_resort``
        (``Stop`` when not given). ``cool_down``: bench it rather than cordon it (a lost node needs none: it
        comes back as a spare by joining again)."""
        spares = self.free_spares(view) or view.spares
        if spares:
            return HotSwap(node, spares[0], reason=f"{why}: spare {spares[0]} takes its place", cool_down=cool_down)
        if self.can_scale_down(view):
            return self.scale_down_without(node, view, why, cool_down=cool_down)
        if last_resort is not None:
            return last_resort
        if view.joining:  # the core bounds the wait (--spare-wait), then asks again
            return Ignore(reason=f"{why}: no ready spare; waiting for joining spare(s) {', '.join(view.joining)}")
        if view.replacement_wait_left > 0:  # the core asks again when a node joins, or when the wait is over
            return Ignore(reason=f"{why}: no spare; waiting up to {view.replacement_wait_left:.0f} s more "
                                 "(--replacement-wait) for a node to join in its place")
        return Stop(reason=f"{why}: no spare, and --nnodes min {view.min_nodes} forbids scaling down")

    def preempted(self, event: Event, view: JobView) -> Action:
        """A preemption notice: not a failure and not a loss. The node's place goes to a free spare, or the job
        shrinks without it; otherwise nothing can replace it and the job ends as preempted (exit 75)."""
        d = event.details if isinstance(event.details, dict) else {}
        why = f"node {event.node} is preempted ({d.get('source') or 'notice'})"
        if event.node not in view.members:
            return Ignore(reason=f"{why}; it holds no group rank: it just leaves")
        if view.restarts_left > 0:
            spares = self.free_spares(view)
            if spares:
                return HotSwap(event.node, spares[0],
                               reason=f"{why}: spare {spares[0]} takes its place after the agreed step is saved")
            if self.can_scale_down(view):
                a = self.scale_down_without(event.node, view, why)
                return ScaleDown(a.nodes, reason=f"{a.reason} after the agreed step is saved")
            no = f"no spare, and --nnodes min {view.min_nodes} forbids scaling down"
        else:
            no = "the restart budget is spent"
        return Ignore(reason=f"{why}: {no}; every node saves the agreed step and exits 75 (requeue to resume)")

    def decide(self, event: Event, view: JobView) -> Action:
        kind = event.kind
        if kind is EventKind.NODE_JOINED:
            room = view.max_nodes - len(view.members) - len(view.pending_scale_up)
            spares = self.free_spares(view)
            k = view.nodes_per_replica or 1
            grow = spares[:room - room % k] if room > 0 else ()
            grow = grow[:len(grow) - len(grow) % k]  # whole replicas only
            if grow and view.restarts_left > 0:
                what = f" ({len(grow) // k} replica(s) of {k})" if view.nodes_per_replica else ""
                return ScaleUp(grow, reason=f"{', '.join(grow)} joined while the job runs on "
                                            f"{len(view.members)} of max {view.max_nodes} node(s){what}")
            if k > 1 and room >= k and view.restarts_left > 0:
                return Ignore(reason=f"{event.node} waits as a spare ({len(spares)} free of the {k} a replica needs)")
            return Ignore(reason=f"{event.node} waits as a spare")
        if kind in HEALTH_KINDS:
            node = view.nodes.get(event.node)
            spares = self.free_spares(view)
            if (node is not None and node.state is NodeState.ACTIVE and event.node in view.members and spares
                    and view.restarts_left > 0):
                check = event.details.get("check") if isinstance(event.details, dict) else None
                return HotSwap(event.node, spares[0], cool_down=self.cool_down,
                               reason=f"{kind.value} on {event.node} ({check or 'check failing'}): spare "
                                      f"{spares[0]} takes its place")
            return Ignore(reason=f"{kind.value} on {event.node} recorded (no free spare: it keeps training)")
        if kind is EventKind.PREEMPTION_NOTICE:
            return self.preempted(event, view)
        if kind not in FAILURE_KINDS:
            return Ignore(reason=f"{kind.value} on {event.node} recorded")
        cls = view.failure_class(event)
        if cls is FailureClass.STATE_UNRECOVERABLE:
            return Stop(reason=self.unrecoverable(event))
        if view.restarts_left <= 0:
            return Stop(reason=f"restart budget spent ({kind.value} on {event.node})")
        if kind is EventKind.AGENT_LOST:
            return self.replace(event.node, view, f"node {event.node} lost")
        if cls is FailureClass.SOFTWARE and (loop := self.crash_loop(event, view)) is not None:
            return Stop(reason=loop)
        if cls is FailureClass.HARDWARE:
            why = f"hardware failure on {event.node} (rank {event.rank}: {_exception(event)})"
            return self.replace(event.node, view, why,
                                last_resort=Restart(reason=f"{why}; no spare and at --nnodes min: restarting"))
        bad, why = self.node_is_bad(event.node, view)
        streak, how = self.same_failure_streak(event, view)
        if streak > 1:
            # deterministic, not unlucky: no probability (it would point at the hardware)
            why = f"rank {event.rank} failed the same way ({how}) {streak} times in a row"
        if bad:
            return self.replace(event.node, view, why, cool_down=self.cool_down,
                                last_resort=Restart(reason=f"{why}; no spare and at --nnodes min: restarting"))
        return Restart(reason=f"{kind.value} on {event.node} (rank {event.rank}): in-job restart; {why}")


def _raised_at(ev: Event) -> tuple[str, str] | None:
    """(exception type, frame) of a worker's failure when its error file named both, else None."""
    d = ev.details if isinstance(ev.details, dict) else {}
    exc, frame = d.get("exc_type"), d.get("frame")
    return (str(exc), str(frame)) if exc and frame else None


def _exception(ev: Event) -> str:
    """``Type: first line`` of a worker's exception, or how it failed when no error file said."""
    d = ev.details if isinstance(ev.details, dict) else {}
    if d.get("exc_type"):
        return f"{d['exc_type']}: {d.get('message') or ''}".rstrip(": ")
    return _failure_how(ev)


def _failure_how(ev: Event) -> str:
    """A failure's way of failing, in words: what makes two failures "the same"."""
    if ev.kind is EventKind.HANG:
        return "hung"
    d = ev.details if isinstance(ev.details, dict) else {}
    if d.get("signal"):
        return f"signal {d['signal']}"
    return f"exit code {d.get('exit_code')}"

