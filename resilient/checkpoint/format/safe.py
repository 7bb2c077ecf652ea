"""Loading checkpoint data without running code from it.

crc32c in the manifests catches corruption, not someone who can write to the bucket: they can plant a
payload and update the manifest to match. So nothing read from a tier goes through a general
unpickler: DCP's ``.metadata`` goes through :class:`MetadataUnpickler` (DCP's own metadata classes and
the few torch/stdlib types they hold), objects through ``torch.load(weights_only=True)``. Anything else is
refused with :class:`~resilient.checkpoint.api.UnsafeCheckpointError` naming the file and the global.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

from resilient.checkpoint.api import CheckpointError, UnsafeCheckpointError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# what a real .metadata references besides the metadata module's classes (read from DCP's pickles of
# tensors of every dtype, optimizer states, bytes items and sharded tensors)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


def unsafe_name(name: str) -> str | None:
    """Why ``name`` cannot be a file of a step directory (which is flat), or None when it can."""
    if not isinstance(name, str) or not name:
        return "empty file name"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return f"absolute path {name!r} escapes the checkpoint directory"
    if "/" in name or "\\" in name or name in (".", ".."):
        return f"path {name!r} escapes the checkpoint directory"
    if "\x00" in name:
        return f"file name {name!r} holds a NUL byte"
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else."""

    def __init__(self, data: bytes, what: str):
        super().__init__(io.BytesIO(data))
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == _METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as md

            obj = getattr(md, name, None)
            if isinstance(obj, type) and obj.__module__ == _METADATA_MODULE:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(self.what, f"{module}.{name}",
                                    "a DCP .metadata holds only DCP's metadata classes")


def load_metadata(data: bytes | memoryview, what: str) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, refusing any other global."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = MetadataUnpickler(bytes(data), what).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or garbage: not a pickle we can read at all
        raise CheckpointError(f"{what}: unreadable DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(what, type(md).__qualname__, "a DCP .metadata holds a Metadata object")
    seen: set[Any] = set()  # thousands of items name a handful of files: each name is checked once
    for idx, info in (getattr(md, "storage_data", None) or {}).items():
        name = getattr(info, "relative_path", None)
        if name in seen and isinstance(name, str):
            continue
        problem = unsafe_name(name)
        if problem:
            raise UnsafeCheckpointError(what, None, f"item {getattr(idx, 'fqn', idx)!r}: {problem}")
        if isinstance(name, str):
            seen.add(name)
    return md


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def safe_torch_load(stream: Any, what: str) -> Any:
    """``torch.load(weights_only=True)``: tensors, containers and plain values; a refused global raises
    :class:`UnsafeCheckpointError` naming ``what`` and the global."""
    import torch

    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = _GLOBAL.search(str(e))
        raise UnsafeCheckpointError(what, m.group(1) if m else None,
                                    "checkpoint objects are loaded with torch.load(weights_only=True); "
                                    "register a trusted type with torch.serialization.add_safe_globals") from e


_NUMPY: list[Any] | None = None


def _numpy_globals() -> list[Any]:
    """numpy arrays, scalars and dtypes (a data loader's numpy RNG state): rebuilt from raw bytes, with any
    object elements unpickled by the same restricted unpickler. Admitted per load, never globally."""
    global _NUMPY
    if _NUMPY is None:
        out: list[Any] = []
        try:
            import numpy as np

            try:
                from numpy._core import multiarray
            except ImportError:  # numpy < 2
                from numpy.core import multiarray  # type: ignore[no-redef]
            out = [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype]
            out += [v for v in vars(getattr(np, "dtypes", object)).values() if isinstance(v, type)]
        except ImportError:
            pass
        _NUMPY = out
    return _NUMPY


def find_unsafe(e: BaseException) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError in ``e``, its causes, or DCP's per-rank failures."""
    seen = 0
    stack = [e]
    while stack and seen < 50:
        x = stack.pop()
        seen += 1
        if isinstance(x, UnsafeCheckpointError):
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack.extend(v[0] for v in failures.values() if isinstance(v, tuple) and v
                         and isinstance(v[0], BaseException))
        for nxt in (x.__cause__, x.__context__):
            if nxt is not None:
                stack.append(nxt)
    return None
