"""Hot swap first: any failure of a node replaces it with a spare at once, when a spare is available.

* worker exit, hang, node lost, host or GPU unhealthy on an active node, with a healthy spare:
  ``HotSwap(node, spare)`` (the node is cordoned, or stays lost) — no in-place restart first.
* a restore that found no usable step (``state_unrecoverable``), a crash loop, no spare, or any other event: the default
  policy (restart, scale down, scale up, stop).

Suits fleets with warm spares and hardware that, once it failed, tends to fail again.
"""

from resilient.events.api import EventKind
from resilient.supervisor.api import Action, FailureClass, HotSwap, JobView, NodeState
from resilient.supervisor.default_policy import DefaultPolicy

SWAP_ON = {EventKind.WORKER_EXIT, EventKind.HANG, EventKind.AGENT_LOST, EventKind.HOST_UNHEALTHY,
           EventKind.GPU_UNHEALTHY}


class HotSwapFirst(DefaultPolicy):
    def decide(self, event, view: JobView) -> Action:
        node = view.nodes.get(event.node)
        spares = self.free_spares(view) or view.spares
        if view.failure_class(event) is FailureClass.STATE_UNRECOVERABLE or self.crash_loop(event, view):
            return super().decide(event, view)  # the same failure on any node: a swap cannot help
        if (event.kind in SWAP_ON and node is not None and event.node in view.members and spares
                and view.restarts_left > 0 and node.state in (NodeState.ACTIVE, NodeState.LOST)):
            return HotSwap(event.node, spares[0], reason=f"{event.kind.value} on {event.node}: "
                                                         f"swapped to spare {spares[0]} at once")
        return super().decide(event, view)


policy = HotSwapFirst()
