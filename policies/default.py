"""The default policy (used when no ``--policy`` is given, and whenever another policy fails).

Restarts in place for what a restart fixes; takes a node out only on node-level evidence:

* worker exit / hang: ``Restart`` in place. A rank that dies or hangs while its agent stays connected does
  not condemn its node. Only failures that single a node out do: at least 3 within the failure window, and
  a chance below 1% that bad luck alone put that many of the job's failures on it (failures falling on
  nodes in proportion to their workers: a binomial tail). With 2 nodes that is 7 in a row on one node.
  Then ``HotSwap`` it to a spare; no spare: ``ScaleDown`` if ``--nnodes MIN`` allows, else keep restarting.
* node lost: ``HotSwap`` to a spare; no spare: ``ScaleDown`` if MIN allows; else ``Stop``.
* host / GPU unhealthy: ``HotSwap`` to a free spare; no spare: ``Ignore`` (it keeps training).
* a node swapped out while its agent is connected is benched, not cordoned: after ``cool_down`` (600 s), if
  its agent still reports and is healthy, it is a warm spare again.
* a spare joins while the job runs below MAX: ``ScaleUp`` at the next checkpoint boundary.
* straggler: ``Ignore`` (recorded).
* preemption notice from a member: every rank stops after one agreed step and saves it; its place goes to a
  free spare (``HotSwap``), or the job shrinks without it (``ScaleDown``) if MIN allows, once that step is
  saved; neither possible: every node exits 75 (preempted) for the scheduler to requeue. A notice from a
  spare: it leaves.
* with ``--nodes-per-replica K``: a swap replaces one node inside its replica; without a spare the broken node's
  whole replica is dropped (its healthy nodes are warm spares at once), and the job grows back by whole replicas
  (K free spares: e.g. a returning node and the benched one).
* restart budget (``--max-restarts``) spent: ``Stop``.

The logic lives in ``resilient.supervisor.default_policy`` so that it ships with the package; this file is
the copy-and-edit starting point: change the numbers below.
"""

from resilient.supervisor.default_policy import DefaultPolicy

policy = DefaultPolicy(failures_to_swap=3, luck=0.01, cool_down=600.0)
