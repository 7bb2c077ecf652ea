"""The default policy: escalate from the cheapest recovery to the most drastic.

========================  ================================================================================
event                     action
========================  ================================================================================
worker_exit / hang        ``Restart`` (in-job restart, same nodes and ranks). After ``failures_to_swap`` (3)
                          failures of one node within the failure window: ``HotSwap`` it to a spare (it is
                          cordoned); no spare: ``ScaleDown`` without it if ``--nnodes MIN`` allows; else
                          keep restarting in place.
agent_lost (node lost)    ``HotSwap`` to a spare; no spare: ``ScaleDown`` if MIN allows; else ``Stop``.
node_joined (a spare)     ``ScaleUp`` when the job runs below MAX (carried out at the next checkpoint
                          boundary); otherwise ``Ignore`` (it waits warm).
straggler / host or GPU   ``Ignore``: recorded; a node that really breaks shows up as failures, which
unhealthy                 escalate as above (``policies/evict_stragglers.py`` acts on persistent ones).
preemption_notice         ``Ignore``: the agents save a checkpoint themselves on a notice.
restart budget spent      ``Stop`` with the reason.
========================  ================================================================================

The policy only reads the view, so it can be used anywhere, including as the fallback when a user's
policy fails. Extend it by subclassing :class:`DefaultPolicy` and calling ``super().decide``.
"""

from __future__ import annotations

from resilient.events.api import Event, EventKind
from resilient.supervisor.api import Action, HotSwap, Ignore, JobView, Restart, ScaleDown, ScaleUp, Stop

FAILURE_KINDS = frozenset({EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST})


class DefaultPolicy:
    """Escalating policy (see the module docstring). ``failures_to_swap``: failures of one node within the
    view's failure window after which it is replaced rather than restarted."""

    def __init__(self, failures_to_swap: int = 3) -> None:
        if failures_to_swap < 1:
            raise ValueError(f"failures_to_swap must be >= 1, got {failures_to_swap}")
        self.failures_to_swap = failures_to_swap

    # -- helpers subclasses use
    @staticmethod
    def can_scale_down(view: JobView, n: int = 1) -> bool:
        return len(view.members) - n >= view.min_nodes

    @staticmethod
    def free_spares(view: JobView) -> tuple[str, ...]:
        """Healthy spares not already promised to a pending scale-up."""
        return tuple(s for s in view.spares if s not in view.pending_scale_up)

    def replace(self, node: str, view: JobView, why: str, *, last_resort: Action | None = None) -> Action:
        """Take ``node`` out of the job: a spare takes its place, else the job shrinks, else ``last_resort``
        (``Stop`` when not given)."""
        spares = self.free_spares(view) or view.spares
        if spares:
            return HotSwap(node, spares[0], reason=f"{why}: spare {spares[0]} takes its place")
        if self.can_scale_down(view):
            return ScaleDown((node,), reason=f"{why}: no spare, continuing on {len(view.members) - 1} node(s)")
        if last_resort is not None:
            return last_resort
        return Stop(reason=f"{why}: no spare, and --nnodes min {view.min_nodes} forbids scaling down")

    def decide(self, event: Event, view: JobView) -> Action:
        kind = event.kind
        node = view.nodes.get(event.node)
        if kind is EventKind.NODE_JOINED:
            room = view.max_nodes - len(view.members) - len(view.pending_scale_up)
            spares = self.free_spares(view)
            if room > 0 and spares and view.restarts_left > 0:
                grow = spares[:room]
                return ScaleUp(grow, reason=f"{', '.join(grow)} joined while the job runs on "
                                            f"{len(view.members)} of max {view.max_nodes} node(s)")
            return Ignore(reason=f"{event.node} waits as a spare")
        if kind not in FAILURE_KINDS:
            return Ignore(reason=f"{kind.value} on {event.node} recorded")
        if view.restarts_left <= 0:
            return Stop(reason=f"restart budget spent ({kind.value} on {event.node})")
        if kind is EventKind.AGENT_LOST:
            return self.replace(event.node, view, f"node {event.node} lost")
        failures = node.failures if node is not None else 0
        if failures >= self.failures_to_swap:
            why = f"{event.node} failed {failures} times within {view.failure_window:g} s"
            return self.replace(event.node, view, why,
                                last_resort=Restart(reason=f"{why}; no spare and at --nnodes min: restarting"))
        return Restart(reason=f"{kind.value} on {event.node} (rank {event.rank})")


def default_policy() -> DefaultPolicy:
    return DefaultPolicy()
