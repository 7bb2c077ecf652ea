"""Scale down first: keep going on fewer nodes rather than wait for, or spend, spares.

* node lost: ``ScaleDown`` without it when ``--nnodes MIN`` allows; else ``Stop``.
* worker exit / hang: ``Restart``; after 3 failures of one node within the window, ``ScaleDown`` without it
  when MIN allows, else keep restarting in place.
* spares are never swapped in; they are only used to grow back: a spare joining while the job runs below
  MAX gives ``ScaleUp`` at the next checkpoint boundary (as the default).
* host / GPU unhealthy: ``Ignore`` (recorded; the node keeps training).
* a worker failure of class ``hardware``: ``ScaleDown`` without the node (cordoned for good) when MIN allows,
  else ``Restart``.
* preemption notice of a member: ``ScaleDown`` without it (after the agreed step is saved) when MIN allows;
  else ``Ignore``: every node saves that step and exits 75.
* everything else: the default policy.

Suits jobs whose spares are shared or slow to warm, and models that tolerate a changing world size.
"""

from resilient.events.api import EventKind
from resilient.supervisor.api import (
    HEALTH_KINDS, Action, FailureClass, HotSwap, Ignore, JobView, Restart, ScaleDown, Stop,
)
from resilient.supervisor.default_policy import DefaultPolicy


class ScaleDownFirst(DefaultPolicy):
    def decide(self, event, view: JobView) -> Action:
        node = view.nodes.get(event.node)
        if event.kind is EventKind.AGENT_LOST and view.restarts_left > 0 and event.node in view.members:
            if self.can_scale_down(view):  # with --nodes-per-replica: its whole replica
                return self.scale_down_without(event.node, view, f"node {event.node} lost")
            return Stop(reason=f"node {event.node} lost and --nnodes min {view.min_nodes} forbids scaling down")
        if (event.kind in (EventKind.WORKER_EXIT, EventKind.HANG) and view.restarts_left > 0 and node is not None
                and node.failures >= self.failures_to_swap
                and view.failure_class(event) is not FailureClass.STATE_UNRECOVERABLE):
            why = f"{event.node} failed {node.failures} times within {view.failure_window:g} s"
            if self.can_scale_down(view):
                return ScaleDown((event.node,), reason=f"{why}: continuing without it")
            return Restart(reason=f"{why}; at --nnodes min: restarting")
        action = super().decide(event, view)
        if isinstance(action, HotSwap) and event.kind is EventKind.PREEMPTION_NOTICE:
            # a preempted node is not replaced either: shrink if allowed, else every node exits as preempted
            if self.can_scale_down(view):
                return ScaleDown((event.node,), reason=action.reason.split(":")[0] + ": continuing without it "
                                                                                   "(spares only grow the job)")
            return Ignore(reason=action.reason.split(":")[0] + ": every node saves the agreed step and exits 75")
        if isinstance(action, HotSwap):  # never spend a spare on a replacement
            if event.kind in HEALTH_KINDS:  # a failing check alone does not shrink the job: it keeps training
                return Ignore(reason=action.reason.split(":")[0] + ": recorded (spares only grow the job)")
            if view.failure_class(event) is FailureClass.HARDWARE and self.can_scale_down(view):
                return ScaleDown((event.node,), reason=action.reason.split(":")[0] + ": continuing without it "
                                                                                   "(spares only grow the job)")
            return Restart(reason=action.reason + " (spares only grow the job)")
        return action


policy = ScaleDownFirst()
