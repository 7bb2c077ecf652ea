"""The worker runtime: what runs inside a training process under ``resilient-run``.

* :mod:`resilient.worker.steps` — ``steps``, ``section``, ``on_scale``: heartbeats to the node agent, STEP and
  SECTION events, the steps loop.
* :mod:`resilient.worker.preemption` — the one agreement on a preempted attempt's last step (``agree_stop``),
  used by the steps loop, the checkpointer, the trainer integrations and the drills.
* :mod:`resilient.worker.collectives` — timing hooks on ``torch.distributed`` collectives and DDP.
* :mod:`resilient.worker.exit_safety` — what keeps gloo's threads from aborting a finishing interpreter.
* :mod:`resilient.worker.scale` — the world-size record behind ``on_scale``.

It imports ``env``, ``events`` and the packet format of ``signals.protocol``; never the launcher, the
supervisor or the drills. Nothing is imported here: a worker pays only for what it uses.
"""
