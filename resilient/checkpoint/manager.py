"""Kept so that ``from resilient.checkpoint.manager import CheckpointManager`` (the documented import, used by
training scripts written against earlier versions) goes on working; the manager lives in
:mod:`resilient.checkpoint.save.manager`."""

from resilient.checkpoint.save.manager import CheckpointManager

__all__ = ["CheckpointManager"]
