"""Reading checkpoints fast: fetched files served from memory, tensors read straight into their targets.

A fetched file (peer transfer, persistent download) is checksummed in memory and handed to DCP from
there: writing it to disk and reading it back would cost two more passes over the bytes.
"""

from __future__ import annotations

import collections
import copy
import io
import logging
import os
import pickle
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from resilient.checkpoint.api import UnsafeCheckpointError
from resilient.checkpoint.format.codec import ItemTooLargeError, decode_item, item_limit
from resilient.checkpoint.format.dcp_extension import extension_registry
from resilient.checkpoint.format.safe import load_metadata, safe_torch_load
from resilient.checkpoint.restore.device import ChunkCopier

logger = logging.getLogger(__name__)


class _ReadWindow(io.RawIOBase):
    """Seek/tell bookkeeping shared by the read-only in-memory streams below: a position in ``[0, _len]``."""

    _len: int
    _pos: int = 0

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


class MemoryStream(_ReadWindow):
    """Read-only seekable stream over a buffer, without copying it."""

    def __init__(self, data: Any):
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._len = len(self._mv)
        self._pos = 0

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


class _Slice(_ReadWindow):
    """A window ``[offset, offset + length)`` of a seekable stream, itself a seekable stream."""

    def __init__(self, base: Any, offset: int, length: int):
        super().__init__()
        self._b, self._off, self._len, self._pos = base, offset, length, 0

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


class _MetaUnpickler(pickle.Unpickler):
    """Reads a ``torch.save``d plain tensor's pickle without building the tensor: the C unpickler with
    only the globals such a pickle uses; anything else raises (the item then takes DCP's own path)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TypedStorage is deprecated; we only read its dtype
                dtype = getattr(getattr(torch, name, None), "dtype", None)
            if isinstance(dtype, torch.dtype):
                return _StorageType(dtype)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType):
            return ("storage", pid[1].dtype, str(pid[2]), int(pid[4]))
        raise pickle.UnpicklingError("unexpected persistent id")


@dataclass(frozen=True)
class _StorageType:
    dtype: Any


def _rebuilt(storage: Any, storage_offset: int, size: Any, stride: Any, requires_grad: bool, hooks: Any,
             metadata: Any = None) -> Any:
    if hooks or metadata:
        raise pickle.UnpicklingError("tensor with hooks or metadata")
    return ("tensor", storage, int(storage_offset), tuple(int(x) for x in size), tuple(int(x) for x in stride))


def _tensor_record(pkl: bytes) -> tuple[Any, str, int, int, tuple[int, ...], tuple[int, ...]] | None:
    """(dtype, storage key, storage numel, storage offset, shape, stride) of a pickled plain tensor, or None."""
    try:
        out = _MetaUnpickler(io.BytesIO(pkl)).load()
    except Exception:
        return None
    if not (isinstance(out, tuple) and len(out) == 5 and out[0] == "tensor" and isinstance(out[1], tuple)
            and out[1][0] == "storage"):
        return None
    _, (_, dtype, key, numel), offset, shape, stride = out
    return dtype, key, numel, offset, shape, stride


def _read_exact(stream: Any, dst: memoryview) -> None:
    got = 0
    while got < len(dst):
        k = stream.readinto(dst[got:])
        if not k:
            raise OSError(f"checkpoint item shorter than recorded ({got} < {len(dst)} bytes)")
        got += k


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that objects are loaded with ``torch.load(weights_only=True)``
    (DCP's own ``load_bytes`` uses ``weights_only=False``: a planted pickle would run)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = safe_torch_load(value, what=f"item {read_item.storage_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class FastReader(FileSystemReader):
    """DCP's FileSystemReader with a direct path for whole, contiguous tensors.

    DCP reads each tensor with ``torch.load`` (a copy into a new tensor) and copies that into the
    target. For an item holding one contiguous tensor (what ``dcp.save`` writes for plain tensors) we
    read the record's layout (``torch.load`` onto the meta device reads only the small pickle), find
    its bytes in the zip record and read them straight into the target. Anything else (narrowed
    shards, other layouts, transforms) takes DCP's own path, unchanged.
    """

    def __init__(self, path: str | os.PathLike[str], files: Mapping[str, Any] | None = None,
                 metadata: Any = None):
        """``files``: name -> bytes held in memory instead of on disk. ``metadata``: the ``Metadata`` to read
        with, already parsed (a rank's index, ``format/rank_index.py``), instead of the directory's ``.metadata``."""
        super().__init__(path, _extension_registry=extension_registry())  # items compressed for transfer
        if files:
            self.fs = MemoryFS(files)
        self._given = metadata
        self.fast_items = 0
        self.slow_items = 0
        self._copier: Any = None
        self._pending: list[Any] = []
        self._gpu: Any = None  # a ChunkCopier while GPU targets are read
        self._gpu_pending: list[Any] = []

    def set_up_storage_reader(self, metadata: Any, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)
        self._metadata = metadata  # the items' true sizes: what a coded item may decode to

    def _decoded(self, relative_path: str, req: Any, item_md: Any, raw: Any) -> "MemoryStream":
        """A coded item decoded in memory, at most the size ``.metadata`` gives it (DCP's own transforms
        read a stream to its end: a 128 KB bomb would grow to GBs); a bomb is refused as unsafe."""
        md = getattr(self, "_metadata", None)
        limit = item_limit(md, req.storage_index) if md is not None else None
        try:
            return MemoryStream(decode_item(raw.read(item_md.length), item_md.transform_descriptors, limit))
        except ItemTooLargeError as e:
            raise UnsafeCheckpointError(relative_path, None, f"item {req.storage_index.fqn!r} {e}, more than its "
                                        ".metadata entry allows (a decompression bomb)") from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's read_metadata, through the restricted unpickler instead of ``pickle.load``."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._given is not None:
            md = copy.copy(self._given)  # its storage_meta is set below: the caller's object stays as it was
            md.storage_meta = copy.copy(md.storage_meta)
        else:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
            md = load_metadata(data, what=str(path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _fast(self, stream: Any, item_md: Any, req: Any, planner: Any) -> bool:
        import zipfile

        import torch

        if item_md.transform_descriptors:
            return False
        view = _Slice(stream, item_md.offset, item_md.length)
        zf = zipfile.ZipFile(view)
        infos = zf.infolist()
        pkls = [i for i in infos if i.filename.endswith("/data.pkl")]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(pkls) != 1 or (order and zf.read(order[0]).strip() != b"little"):
            return False
        prefix = pkls[0].filename[:-len("data.pkl")]
        meta = _tensor_record(zf.read(pkls[0]))
        if meta is None:
            return False
        dtype, key, storage_numel, offset, shape, stride = meta
        expect_stride, acc = [], 1
        for d in reversed(shape):
            expect_stride.append(acc)
            acc *= d
        numel = acc
        if offset != 0 or storage_numel != numel or tuple(reversed(expect_stride)) != stride and numel > 1:
            return False
        if any(o != 0 for o in req.storage_offsets) or tuple(req.lengths) != shape:
            return False
        target = planner.resolve_tensor(req).detach()
        gpu = target.device.type == "cuda"  # any layout: copied through pinned buffers in row-major order
        if target.dtype != dtype or tuple(target.shape) != shape or not (target.is_contiguous() or gpu) \
                or target.device.type not in ("cpu", "cuda"):
            return False
        records = [i for i in infos if i.filename.startswith(prefix + "data/") and not i.filename.endswith(".pkl")]
        nbytes = numel * target.element_size()
        if len(records) != 1 or records[0].filename != f"{prefix}data/{key}" or records[0].compress_type != 0 \
                or records[0].file_size != nbytes:
            return False
        view.seek(records[0].header_offset)
        header = view.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return False
        start = records[0].header_offset + 30 + int.from_bytes(header[26:28], "little") \
            + int.from_bytes(header[28:30], "little")
        if gpu:
            if self._gpu is None or self._gpu.device != target.device:
                self._finish_gpu(planner)
                self._gpu = ChunkCopier(target.device)

            def fill(off: int, dst: memoryview) -> None:
                view.seek(start + off)
                _read_exact(view, dst)

            self._gpu.copy_into(target, fill)
            self._gpu_pending.append((req, target))  # committed once its copy landed
            return True
        if nbytes and isinstance(stream, MemoryStream) and self._copier is not None:
            # bytes already in memory (a verified file mapping, a received file): copied on a worker
            # thread (torch's copy releases the GIL) while this one parses the next item's header
            src_off = item_md.offset + start
            if src_off + nbytes > len(stream._mv):
                raise OSError(f"checkpoint item shorter than recorded ({len(stream._mv) - src_off} < {nbytes})")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*non-writable.*")
                src = torch.frombuffer(stream._mv, dtype=torch.uint8, count=nbytes, offset=src_off)
            dst = target.reshape(-1).view(torch.uint8)
            self._pending.append((self._copier.submit(dst.copy_, src), req, target))
            return True
        view.seek(start)
        if nbytes:
            _read_exact(view, memoryview(target.reshape(-1).view(torch.uint8).numpy()))
        planner.commit_tensor(req, target)
        return True

    def _finish_gpu(self, planner: Any) -> None:
        if self._gpu is not None:
            gpu, self._gpu = self._gpu, None
            gpu.close()
        pending, self._gpu_pending = self._gpu_pending, []
        for req, target in pending:
            planner.commit_tensor(req, target)

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.futures import Future

        from concurrent.futures import ThreadPoolExecutor

        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-ckpt-copy")
        try:
            self._read_all(plan, planner)
            self._finish_gpu(planner)
            for fut_copy, req, target in self._pending:
                fut_copy.result()
                planner.commit_tensor(req, target)
        finally:
            self._copier.shutdown(wait=True)  # never leave a copy running into a state being returned
            self._copier = None
            self._pending = []
            if self._gpu is not None:
                self._gpu.close()
                self._gpu = None
            self._gpu_pending = []
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, plan: Any, planner: Any) -> None:
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
                    if item_md.transform_descriptors:  # decoded within the item's true size, never more
                        transform_from = self._decoded(relative_path, req, item_md, file_slice)
                    else:
                        transform_from = self.transforms.transform_load_stream(req, (), file_slice)
                    if req.type == LoadItemType.BYTE_IO:
                        read_bytes = io.BytesIO(transform_from.read(-1))
                        read_bytes.seek(0)
                        try:
                            if not isinstance(planner, SafeLoadPlanner):
                                # another planner would torch.load(weights_only=False): hand it a re-save
                                # of what the restricted load accepted, never the file's own pickle
                                obj = safe_torch_load(read_bytes, what=f"item {req.storage_index.fqn!r}")
                                read_bytes = io.BytesIO()
                                torch.save(obj, read_bytes)
                                read_bytes.seek(0)
                            planner.load_bytes(req, read_bytes)
                        except UnsafeCheckpointError as e:
                            raise UnsafeCheckpointError(relative_path, e.forbidden,
                                                        f"item {req.storage_index.fqn!r}: {e.why}") from None
                        continue
                    seekable = transform_from
                    if not transform_from.seekable():
                        seekable = io.BytesIO(transform_from.read(-1))
                        seekable.seek(0)
                    try:
                        tensor = safe_torch_load(seekable, what=f"item {req.storage_index.fqn!r}")
                    except UnsafeCheckpointError as e:
                        raise UnsafeCheckpointError(relative_path, e.forbidden,
                                                    f"item {req.storage_index.fqn!r}: {e.why}") from None
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs "
                                             f"{tensor.size()}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
