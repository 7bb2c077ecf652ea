"""Reading checkpoints fast: fetched files served from memory, tensors read straight into their targets.

A fetched file (peer transfer, persistent download) is checksummed in memory and handed to DCP from
there: writing it to disk and reading it back would cost two more passes over the bytes.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

logger = logging.getLogger(__name__)


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


class _Slice(io.RawIOBase):
    """A window ``[offset, offset + length)`` of a seekable stream, itself a seekable stream."""

    def __init__(self, base: Any, offset: int, length: int):
        super().__init__()
        self._b, self._off, self._len, self._pos = base, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = min(max(0, base + offset), self._len)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        n = self._len - self._pos if size is None or size < 0 else min(size, self._len - self._pos)
        self._b.seek(self._off + self._pos)
        out = self._b.read(n)
        self._pos += len(out)
        return out

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = min(len(dst), self._len - self._pos)
        self._b.seek(self._off + self._pos)
        got = self._b.readinto(dst[:n])
        self._pos += got
        return got


def _read_exact(stream: Any, dst: memoryview) -> None:
    got = 0
    while got < len(dst):
        k = stream.readinto(dst[got:])
        if not k:
            raise OSError(f"checkpoint item shorter than recorded ({got} < {len(dst)} bytes)")
        got += k


class FastReader(FileSystemReader):
    """DCP's FileSystemReader with a direct path for whole, contiguous tensors.

    DCP reads each tensor with ``torch.load`` (a copy into a new tensor) and copies that into the
    target. For an item holding one contiguous tensor (what ``dcp.save`` writes for plain tensors) we
    read the record's layout (``torch.load`` onto the meta device reads only the small pickle), find
    its bytes in the zip record and read them straight into the target. Anything else (narrowed
    shards, other layouts, transforms) takes DCP's own path, unchanged.
    """

    def __init__(self, path: str | os.PathLike[str], files: Mapping[str, Any] | None = None):
        super().__init__(path)
        if files:
            self.fs = MemoryFS(files)
        self.fast_items = 0
        self.slow_items = 0

    def _fast(self, stream: Any, item_md: Any, req: Any, planner: Any) -> bool:
        import zipfile

        import torch

        if item_md.transform_descriptors:
            return False
        view = _Slice(stream, item_md.offset, item_md.length)
        meta = torch.load(view, map_location="meta", weights_only=True)
        if not isinstance(meta, torch.Tensor) or type(meta) is not torch.Tensor:
            return False
        if meta.storage_offset() != 0 or not meta.is_contiguous():
            return False
        if any(o != 0 for o in req.storage_offsets) or list(req.lengths) != list(meta.shape):
            return False
        target = planner.resolve_tensor(req).detach()
        if target.dtype != meta.dtype or target.shape != meta.shape or not target.is_contiguous() \
                or target.device.type != "cpu":
            return False
        view.seek(0)
        zf = zipfile.ZipFile(view)
        records = [i for i in zf.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl")
                   and "/.data/" not in i.filename]
        nbytes = meta.numel() * meta.element_size()
        if len(records) != 1 or records[0].compress_type != 0 or records[0].file_size != nbytes:
            return False
        view.seek(records[0].header_offset)
        header = view.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return False
        start = records[0].header_offset + 30 + int.from_bytes(header[26:28], "little") \
            + int.from_bytes(header[28:30], "little")
        view.seek(start)
        if nbytes:
            _read_exact(view, memoryview(target.reshape(-1).view(torch.uint8).numpy()))
        planner.commit_tensor(req, target)
        return True

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.futures import Future

        import torch
        from torch.distributed.checkpoint.filesystem import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    item_md = self.storage_data[req.storage_index]
                    if req.type != LoadItemType.BYTE_IO:
                        try:
                            if self._fast(stream, item_md, req, planner):
                                self.fast_items += 1
                                continue
                        except (ValueError, RuntimeError, OSError, EOFError, KeyError) as e:
                            logger.debug("fast read of %s fell back: %s", req.storage_index, e)
                    self.slow_items += 1
                    file_slice = self._slice_file(stream, item_md)
                    transform_from = self.transforms.transform_load_stream(
                        req, item_md.transform_descriptors or (), file_slice)
                    if req.type == LoadItemType.BYTE_IO:
                        read_bytes = io.BytesIO(transform_from.read(-1))
                        read_bytes.seek(0)
                        planner.load_bytes(req, read_bytes)
                        continue
                    seekable = transform_from
                    if not transform_from.seekable():
                        seekable = io.BytesIO(transform_from.read(-1))
                        seekable.seek(0)
                    tensor = torch.load(seekable, map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs "
                                             f"{tensor.size()}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
