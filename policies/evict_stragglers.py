"""Evict stragglers: a node flagged as a straggler 3 times within the failure window is cordoned and
replaced by a spare (``HotSwap``), when a spare exists and the restart budget allows.

A straggler slows every step of a synchronous job to its pace, so replacing it pays back the restart
within minutes. Without a spare it is left alone (scaling down for slowness would lose more than it
gains). Every other event: the default policy.
"""

from resilient.events.api import EventKind
from resilient.supervisor.api import Action, HotSwap, Ignore, JobView
from resilient.supervisor.default_policy import DefaultPolicy


class EvictStragglers(DefaultPolicy):
    def __init__(self, stragglers_to_evict: int = 3, failures_to_swap: int = 3) -> None:
        super().__init__(failures_to_swap=failures_to_swap)
        self.stragglers_to_evict = stragglers_to_evict

    def decide(self, event, view: JobView) -> Action:
        node = view.nodes.get(event.node)
        if event.kind is EventKind.STRAGGLER and node is not None and event.node in view.members:
            spares = self.free_spares(view) or view.spares
            if node.stragglers >= self.stragglers_to_evict and spares and view.restarts_left > 0:
                return HotSwap(event.node, spares[0], reason=f"{event.node} flagged straggler {node.stragglers} "
                                                             f"times within {view.failure_window:g} s: evicted")
            return Ignore(reason=f"straggler {event.node} ({node.stragglers}/{self.stragglers_to_evict})")
        return super().decide(event, view)


policy = EvictStragglers()
