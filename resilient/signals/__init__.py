"""Signals: what workers report and what the node agent detects.

* :mod:`resilient.signals.api` — ``MonitorConfig``, the ``NodeMonitor`` protocol, ``ScaleEvent``.
* :mod:`resilient.signals.client` — worker side: ``steps``, ``section``, ``on_scale``.
* :mod:`resilient.signals.monitor` — agent side: ``create_node_monitor`` (hang, straggler, health, notices).
* :mod:`resilient.signals.protocol` — the worker → agent packet format.
* :mod:`resilient.signals.straggler`, :mod:`resilient.signals.health`, :mod:`resilient.signals.scale`.

Nothing is imported here: a worker pays only for what it uses.
"""
