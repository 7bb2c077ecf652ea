"""A DCP writer into memory: the files of one step as bytes, for a tier that cannot be written through the
local disk (a full or failed local tier still owes the persistent tier its step)."""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter


class _Capture(io.BytesIO):
    def __init__(self, sink: dict[str, bytes], name: str):
        super().__init__()
        self._sink, self._name = sink, name

    def close(self) -> None:
        if not self.closed:
            self._sink[self._name] = self.getvalue()
        super().close()


class _MemoryFS(FileSystem):
    """DCP's FileSystem over a dict of file name -> bytes (one flat directory)."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, bytes] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if "w" in mode:
            s = _Capture(self.files, name)
            try:
                yield s
            finally:
                s.close()
            return
        if name not in self.files:
            raise FileNotFoundError(name)
        yield io.BytesIO(self.files[name])

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.files[Path(new_path).name] = self.files.pop(Path(path).name)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return Path(path).name in self.files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.files.pop(Path(path).name, None)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [str(Path(path) / n) for n in self.files]


class MemoryWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files land in :attr:`files` instead of a directory."""

    def __init__(self, name: str = "memory") -> None:
        super().__init__(Path(name), sync_files=False, thread_count=1, overwrite=True)
        self.fs: Any = _MemoryFS()

    @property
    def files(self) -> dict[str, bytes]:
        return self.fs.files
