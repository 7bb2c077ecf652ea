"""Signals, the agent side: what the node agent detects from what workers report (the worker side is
:mod:`resilient.worker`).

* :mod:`resilient.signals.api` — ``MonitorConfig``, the ``NodeMonitor`` protocol, ``ScaleEvent``.
* :mod:`resilient.signals.monitor` — agent side: ``create_node_monitor`` (hang, straggler, health, notices).
* :mod:`resilient.signals.protocol` — the worker → agent packet format.
* :mod:`resilient.signals.straggler`, :mod:`resilient.signals.health`.

Nothing is imported here: a worker pays only for what it uses.
"""
