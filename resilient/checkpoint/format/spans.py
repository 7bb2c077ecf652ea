"""A byte range of a checkpoint file and, when it holds a tensor's bytes, the tensor they land in: the unit
a restore loads and a peer transfer receives."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch


logger = logging.getLogger(__name__)


class Span:
    """A run of file bytes: into ``dst`` (a uint8 view of a target) or, with ``dst`` None, only checked.

    Planned once per tensor, so kept cheap: a plain class with slots, and a target's uint8 views (torch for
    transfers, numpy for local reads) made only when a path asks for one (``target``: the tensor itself)."""

    __slots__ = ("off", "n", "_dst", "_t", "_arr")

    def __init__(self, off: int, n: int, dst: torch.Tensor | None = None, *, target: torch.Tensor | None = None):
        self.off, self.n, self._dst, self._t, self._arr = off, n, dst, target, None

    @property
    def takes(self) -> bool:
        """Do the bytes go into a target (else they are only checked)?"""
        return self._dst is not None or self._t is not None

    @property
    def dst(self) -> torch.Tensor | None:
        if self._dst is None and self._t is not None:
            self._dst = self._t.detach().view(-1).view(torch.uint8)
        return self._dst

    def array(self) -> Any:
        """The target's bytes as a uint8 numpy array (made once: slicing it is far cheaper than slicing a
        tensor); straight from the tensor when numpy knows its dtype (one call instead of three)."""
        if self._arr is None:
            if self._dst is None and self._t is not None:
                try:
                    self._arr = self._t.detach().numpy().reshape(-1).view(np.uint8)
                except (TypeError, RuntimeError, ValueError):  # bf16 and other dtypes numpy lacks
                    self._arr = self.dst.numpy()  # type: ignore[union-attr]
            else:
                assert self._dst is not None
                self._arr = self._dst.numpy()
        return self._arr

    def __repr__(self) -> str:
        return f"Span(off={self.off}, n={self.n}, takes={self.takes})"
