"""Integrations with the trainers users already run; each is an optional extra and imports its trainer.

* ``resilient.integrations.lightning`` (``pip install 'resilient[lightning]'``): ``ResilientCheckpointIO``,
  ``ResilientCheckpoint``, ``ResilientPreemption``;
* ``resilient.integrations.hf`` (``[hf]``): ``ResilientCallback``, ``ResilientTrainer`` for
  ``transformers.Trainer``;
* ``resilient.integrations.nemo`` (``[nemo]``): NeMo-Run executors and launch commands under ``resilient-run``.

Importing this package imports none of them.
"""
