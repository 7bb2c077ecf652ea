"""The supervisor: one control loop per job that folds events into a view, asks a policy, and has the
agents carry the action out. See :mod:`resilient.supervisor.api` for the contract."""

from resilient.supervisor.api import (  # noqa: F401
    ACTIONS, Action, Cordon, HotSwap, Ignore, JobView, NodeState, NodeView, Policy, PolicyError, Restart,
    ScaleDown, ScaleUp, Stop,
)
