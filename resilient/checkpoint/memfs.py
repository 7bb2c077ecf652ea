"""Serving DCP reads from verified in-memory copies of fetched files (peer transfers, persistent downloads).

A fetched file is checksummed in memory and handed to DCP from there: writing it to disk and reading it
back would cost two more passes over the bytes.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem


class MemoryStream(io.RawIOBase):
    """Read-only seekable stream over a buffer, without copying it."""

    def __init__(self, data: Any):
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        out = self._mv[self._pos:end].tobytes()
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = min(len(dst), len(self._mv) - self._pos)
        dst[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n


class MemoryFS(FileSystem):
    """DCP's local FileSystem, except that names found in ``files`` are read from memory."""

    def __init__(self, files: Mapping[str, Any]):
        super().__init__()
        self.files = files

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if "r" in mode and name in self.files:
            yield MemoryStream(self.files[name])
            return
        with super().create_stream(path, mode) as s:
            yield s

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return Path(path).name in self.files or super().exists(path)
