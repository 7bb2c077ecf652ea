"""The default policy (used when no ``--policy`` is given, and whenever another policy fails).

Escalates from the cheapest recovery to the most drastic:

* worker exit / hang: ``Restart`` in place; after 3 failures of one node within the failure window,
  ``HotSwap`` it to a spare (the node is cordoned); no spare: ``ScaleDown`` without it if ``--nnodes MIN``
  allows, else keep restarting in place.
* node lost: ``HotSwap`` to a spare; no spare: ``ScaleDown`` if MIN allows; else ``Stop``.
* a spare joins while the job runs below MAX: ``ScaleUp`` at the next checkpoint boundary.
* straggler, host/GPU unhealthy: ``Ignore`` (recorded; see ``evict_stragglers.py`` to act on them).
* preemption notice: ``Ignore`` (the agents save a checkpoint themselves).
* restart budget (``--max-restarts``) spent: ``Stop``.

The logic lives in ``resilient.supervisor.default_policy`` so that it ships with the package; this file is
the copy-and-edit starting point.
"""

from resilient.supervisor.default_policy import DefaultPolicy

policy = DefaultPolicy(failures_to_swap=3)
