"""Writing a step: the :class:`~resilient.checkpoint.save.manager.CheckpointManager` façade, staging
(``stage``), the in-memory DCP writer (``writer``) and the interval tuner (``interval``). The top of the
package: may import every other sub-package."""
