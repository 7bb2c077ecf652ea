"""Helpers for tests, benchmarks and examples run from the repository root; never imported by ``resilient``.

* :mod:`tests._helpers.wait` — ``wait_for``: poll a real condition, fail (``AssertionError``) naming it.
* :mod:`tests._helpers.load` — ``cpu_burners``: CPU contention beside the code under test.
* :mod:`tests._helpers.gcs` — ``LocalGCS``, ``free_port``: a real GCS API server on loopback.
* :mod:`tests._helpers.procs` — finding and ending every process a launched job started.

Nothing is imported here: a light worker script that needs ``wait_for`` starts with the standard library only.
"""
