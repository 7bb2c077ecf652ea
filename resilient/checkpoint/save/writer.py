"""DCP writers of our own, each writing plain DCP files that stock ``dcp.load`` reads.

:class:`RecordWriter` writes the local tier. DCP's ``FileSystemWriter`` serialises every tensor with its own
``torch.save`` call (a pickler, a zip writer and a few classes built per item, all under the GIL), which cost a
background save more CPU than the training step it overlapped. A tensor's ``torch.save`` record depends only on
its dtype, shape and stride apart from its bytes and their crc32, so each kind of tensor is saved once into a
template and every later record is the template's head, the tensor's bytes and the template's tail with the crc32
set (ISA-L's or zlib's, outside the GIL for large tensors). The file's manifest entry (size, crc32c and xxh3 per
block, where each tensor's bytes are) is computed from the same bytes as they are written, instead of reading the
file back.
Each template is checked once against ``zipfile`` and ``torch.load``; a tensor that is not plain (a view into a
larger storage after DCP's own clone, a subclass, a layout other than strided) or whose template fails the check
is written by ``torch.save`` as DCP does, and its file then gets no precomputed entry. Where DCP's per-item write
has been wrapped (the drills' kill in the middle of a write wraps it), the whole file goes DCP's way.

A checkpointer writes the same tensors (its staging buffers) with the same plan at every save; a
:class:`RecordMemo` keeps what each tensor's record is made of (its template, a view of its bytes, its write
result) from one write to the next, so a save of the same layout looks nothing up again: about 20 us a tensor
of the checkpoint thread's hold of the GIL, which a GPU job's training thread waits out. It also keeps the bytes
of the last ``.metadata`` written for the same metadata and write results: the next one differs only in the save's
ids (its directory, a uuid), strings of the same lengths, which are put in their place (``pickle`` of one entry
per tensor again, the rest of that hold, is skipped); where that cannot be done exactly DCP's ``finish`` pickles.

:class:`MemoryWriter` writes into memory: the files of one step as bytes, for a tier that cannot be written
through the local disk (a full or failed local tier still owes the persistent tier its step)."""

from __future__ import annotations

import io
import logging
import os
import pickle
import struct
import threading
import zipfile
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import crc32c as _crc
import torch
import torch.distributed.checkpoint.filesystem as _dcp_fs
import xxhash as _xxh
from torch.distributed.checkpoint.filesystem import (DEFAULT_SUFFIX, FileSystem, FileSystemWriter, _StorageInfo,
                                                     _StoragePrefix)
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resilient.checkpoint.api import DCP_METADATA, FileEntry

try:  # ISA-L's crc32, the zip records' checksum: the same value as zlib's at 2-3x its speed (both release the GIL)
    from isal.isal_zlib import crc32 as _zip_crc32
except ImportError:  # pragma: no cover - a speed-up only: the dependency is declared, a build without it still works
    from zlib import crc32 as _zip_crc32
from resilient.checkpoint.format.digests import BLOCK, crc_bytes, crc_combine
from resilient.checkpoint.format.state import local_tensor

logger = logging.getLogger(__name__)

# DCP's per-item write as torch ships it: when someone has wrapped it (a drill's kill in the middle of a write,
# a user's instrumentation), they expect every item to go through it, so the record writer steps aside
_STOCK_WRITE_ITEM = _dcp_fs._write_item


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


_DESC = b"PK\x07\x08"  # a zip data descriptor: its crc32 follows the signature
_CEN = b"PK\x01\x02"
_SMALL_WRITE = 1 << 18  # pieces under this go through one buffer, larger tensors straight to the file


@dataclass(frozen=True)
class _Template:
    """``torch.save`` of one kind of tensor with its data record cut out: ``head`` ends where the tensor's
    bytes start; ``crc_at`` are the offsets in ``tail`` of that record's crc32 (its data descriptor's and the
    central directory's); ``crc`` whether torch wrote crc32s at all (``torch.serialization.set_crc32_options``)."""

    head: bytes
    tail: bytes
    crc_at: tuple[int, ...]
    crc: bool

    def tail_for(self, crc: int) -> bytes:
        if not self.crc_at:
            return self.tail
        t = bytearray(self.tail)
        for at in self.crc_at:
            struct.pack_into("<I", t, at, crc)
        return bytes(t)


def _data_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor on the CPU that owns exactly its bytes, laid out row-major: what a template covers."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _build_template(t: torch.Tensor) -> _Template | None:
    """The template of ``t``'s kind, checked by writing a tensor of that kind with bytes of its own through it."""
    probe = torch.zeros(t.shape, dtype=t.dtype)
    buf = io.BytesIO()
    torch.save(probe, buf)
    raw = buf.getvalue()
    nbytes = probe.numel() * probe.element_size()
    zf = zipfile.ZipFile(io.BytesIO(raw))
    data = [i for i in zf.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl")
            and "/.data/" not in i.filename]
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != nbytes:
        return None
    info = data[0]
    ho = info.header_offset
    nlen, elen = struct.unpack_from("<HH", raw, ho + 26)
    start = ho + 30 + nlen + elen
    end = start + nbytes
    head, tail = raw[:start], raw[end:]
    crc_on = info.CRC != 0 or zlib.crc32(b"\0" * nbytes) == 0
    crc_at: list[int] = []
    if crc_on and nbytes:
        if info.flag_bits & 0x08:
            if tail[:4] != _DESC:
                return None
            crc_at.append(4)
        elif struct.unpack_from("<I", raw, ho + 14)[0] != info.CRC:
            return None  # a crc in the local header: it is in ``head``, which templates keep constant
        name = info.filename.encode()
        at = tail.find(_CEN)
        while at >= 0:
            n = struct.unpack_from("<H", tail, at + 28)[0]
            if tail[at + 46:at + 46 + n] == name:
                crc_at.append(at + 16)
                break
            at = tail.find(_CEN, at + 4)
        else:
            return None
    tpl = _Template(head, tail, tuple(crc_at), crc_on)
    # the check: a tensor of this kind with its own bytes, through the template, reads back exactly
    check = torch.arange(max(nbytes, 1), dtype=torch.int64).remainder(251).to(torch.uint8)[:nbytes]
    probe.reshape(-1).view(torch.uint8).copy_(check)
    mv = _data_view(probe)
    rec = head + bytes(mv) + tpl.tail_for(_zip_crc32(mv) if crc_on else 0)
    zf = zipfile.ZipFile(io.BytesIO(rec))
    if crc_on and zf.testzip() is not None:
        return None
    back = torch.load(io.BytesIO(rec), map_location="cpu", weights_only=True)
    if not (isinstance(back, torch.Tensor) and back.dtype == probe.dtype and back.shape == probe.shape
            and bytes(_data_view(back.contiguous())) == bytes(mv)):
        return None
    return tpl


class _Templates:
    """Templates by tensor kind, shared by every writer of a process (a kind is built and checked once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[tuple[Any, ...], _Template | None] = {}

    def get(self, t: torch.Tensor) -> _Template | None:
        kind = (t.dtype, tuple(t.shape))
        with self._lock:
            if kind in self._by_kind:
                return self._by_kind[kind]
        try:
            tpl = _build_template(t)
        except (RuntimeError, ValueError, TypeError, zipfile.BadZipFile, struct.error, OSError) as e:
            logger.debug("no record template for %s %s: %s", t.dtype, tuple(t.shape), e)
            tpl = None
        if tpl is None:
            logger.debug("tensors of %s %s are written by torch.save", t.dtype, tuple(t.shape))
        with self._lock:
            self._by_kind[kind] = tpl
        return tpl


TEMPLATES = _Templates()


class _HashedFile:
    """A file written in pieces, hashed as written: its size, crc32c, and crc32c and xxh3 per ``block`` (what
    ``format.digests.file_blocks`` computes by reading it back)."""

    def __init__(self, f: Any, hashed: bool = True, block: int = BLOCK) -> None:
        self._f = f
        self.block = block
        self.hashed = hashed  # off: only counted and written (the manifest reads the file back itself)
        self.size = 0
        self._crc = 0
        self._bcrc, self._bfill = 0, 0
        self._h = _xxh.xxh3_64()
        self._blocks: list[int] = []
        self._xxh: list[int] = []
        self._buf = bytearray()

    def tell(self) -> int:
        return self.size + len(self._buf)

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if len(mv) < _SMALL_WRITE:
            self._buf += mv
            if len(self._buf) >= _SMALL_WRITE:
                self._flush()
            return
        self._flush()
        self._emit(mv)

    def _flush(self) -> None:
        if self._buf:
            self._emit(memoryview(self._buf))
            self._buf = bytearray()

    def _emit(self, mv: memoryview) -> None:
        pos = 0
        while self.hashed and pos < len(mv):
            k = min(len(mv) - pos, self.block - self._bfill)
            part = mv[pos:pos + k]
            self._bcrc = _crc.crc32c(part, self._bcrc)
            self._h.update(part)
            self._bfill += k
            pos += k
            if self._bfill == self.block:
                self._blocks.append(self._bcrc)
                self._crc = crc_combine(self._crc, self._bcrc, self.block)  # from the blocks': one crc pass
                self._xxh.append(self._h.intdigest())
                self._bcrc, self._bfill, self._h = 0, 0, _xxh.xxh3_64()
        done = 0
        while done < len(mv):
            done += self._f.write(mv[done:])
        self.size += len(mv)

    def entry(self, items: tuple[tuple[int, int, int], ...]) -> FileEntry:
        self._flush()
        blocks, xxh = list(self._blocks), list(self._xxh)
        crc = crc_combine(self._crc, self._bcrc, self._bfill) if self.hashed else 0
        if self._bfill or not self.size:
            blocks.append(self._bcrc)
            xxh.append(self._h.intdigest())
        if not self.size:
            blocks = []
        return FileEntry(size=self.size, crc32c=crc, block_size=self.block, blocks=tuple(blocks), items=items,
                         xxh3=tuple(xxh))


@dataclass(frozen=True)
class _Record:
    """One tensor's record as a write laid it out: ``src`` the state's tensor or DTensor (its bytes, or its local
    shard's, at ``ptr``), ``mv`` its bytes."""

    fqn: str
    src: torch.Tensor
    ptr: int
    mv: memoryview
    tpl: _Template
    result: WriteResult


class RecordMemo:
    """The records of the last write of ``plan``, every one of its tensors through a template, for the next write
    of the same plan over the same tensors (:meth:`RecordWriter.write_data` fills it; its owner, the planner that
    made the plan, clears it when the state's layout changes). It holds the tensors it names: after a layout
    change their memory is freed only when it is cleared."""

    def __init__(self) -> None:
        self.plan: SavePlan | None = None
        self.records: list[_Record] = []
        self.hits = 0  # writes that took their records from here
        self.patched = 0  # .metadata files written from the last one's bytes
        # metadata, results, ids, the file's bytes, and where each id is in them (each once: found at keep time, so
        # each later file is the kept bytes with ids written at those places, no search of a file of 100s of MB)
        self._md: tuple[Any, Any, list[bytes], bytes, list[int]] | None = None
        self.generation = 0  # changes whenever the kept bytes do: two files of one generation differ only in ids

    def clear(self) -> None:
        self.plan, self.records, self._md = None, [], None
        self.generation += 1

    def keep_metadata(self, metadata: Any, results: Any, meta: StorageMeta | None, blob: bytes) -> None:
        """``blob``: the ``.metadata`` written for ``metadata`` and ``results`` with ``meta``'s ids."""
        self.generation += 1
        self._md = None
        ids = _ids(meta)
        if ids is None:
            return
        at = []
        for a in ids:
            i = blob.find(a)
            if i < 0 or blob.find(a, i + 1) >= 0:
                return  # an id found other than once: which occurrence is the id cannot be told
            at.append(i)
        self._md = (metadata, results, ids, blob, at)

    def derived(self, metadata: Any, meta: StorageMeta | None) -> tuple[tuple[int, int], tuple[bytes, ...]] | None:
        """Where the ``.metadata`` just written for ``metadata`` is the kept bytes with ``meta``'s ids: (this memo's
        generation, those ids), so that a node holding another file of the same generation makes this one by
        writing ids at :meth:`id_offsets` (``CheckpointManager._spread_metadata``); else None."""
        ids = _ids(meta)
        if self._md is None or self._md[0] is not metadata or ids is None or len(ids) != len(self._md[2]):
            return None
        return (id(self), self.generation), tuple(ids)

    def id_offsets(self) -> list[int]:
        """Where each id is in every file of this generation."""
        return list(self._md[4]) if self._md is not None else []

    def metadata_bytes(self, metadata: Any, results: Any, meta: StorageMeta | None) -> list[Any] | None:
        """The bytes of ``.metadata`` for ``metadata`` and ``results`` (the last ones kept) with ``meta``'s ids, as
        pieces to write in order (views of the kept bytes, and the new ids between them: no copy of the file). None
        where that cannot be done exactly: other metadata, ids of other lengths."""
        if self._md is None or self._md[0] is not metadata or self._md[1] is not results:
            return None
        old, new, blob, at = self._md[2], _ids(meta), self._md[3], self._md[4]
        if new is None or len(new) != len(old) or any(len(a) != len(b) for a, b in zip(old, new)):
            return None
        view = memoryview(blob)
        pieces: list[Any] = []
        pos = 0
        for i, a, b in sorted(zip(at, old, new)):
            if a != b:
                pieces += [view[pos:i], b]
                pos = i + len(b)
        pieces.append(view[pos:])
        return pieces

    def holds(self, plan: SavePlan, state: dict[str, Any] | None) -> bool:
        """The records are ``plan``'s, and every tensor is the one they were made from, where it was."""
        if plan is not self.plan or state is None:
            return False
        get = state.get
        return all(get(r.fqn) is r.src and local_tensor(r.src).data_ptr() == r.ptr for r in self.records)


def _ids(meta: StorageMeta | None) -> list[bytes] | None:
    """A save's ids as they are pickled in its ``.metadata`` (protocol 4's short strings: the path's parts and the
    save's uuid), or None for a shape this does not cover."""
    if meta is None or meta.load_id is not None or meta.modules or not isinstance(meta.save_id, str):
        return None
    cid = meta.checkpoint_id
    parts = list(cid.parts) if isinstance(cid, PurePosixPath) else [cid] if isinstance(cid, str) else None
    if parts is None or pickle.DEFAULT_PROTOCOL < 4:
        return None
    out = []
    for p in parts + [meta.save_id]:
        b = p.encode()
        if len(b) > 255:
            return None
        out.append(b"\x8c" + bytes([len(b)]) + b)  # SHORT_BINUNICODE
    return out


class RecordWriter(FileSystemWriter):
    """``FileSystemWriter`` for one file per rank (one writing thread) whose tensor records are written from
    templates; the files are the same DCP files. :attr:`entries`: after ``write_data``, the manifest entry of
    each file every one of whose tensors went through a template (a file with another tensor has none).
    :attr:`results` (this rank's write results) and :attr:`all_results` (every rank's, on the coordinator, after
    ``finish``) let the next save tell that its files came out laid out alike (``plan.save``)."""

    def __init__(self, path: str | os.PathLike[str], sync_files: bool = True, entries: bool = True,
                 block: int = BLOCK) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=True)
        self._hash = entries  # off: no pass over the bytes for entries that nobody reads
        self._block = block  # the manifest's verification block (the manager's)
        self.entries: dict[str, FileEntry] = {}
        self.templated = 0
        self.fallbacks = 0
        self.results: list[WriteResult] | None = None
        self.all_results: list[list[WriteResult]] | None = None
        self._memo: RecordMemo | None = None  # the planner's, from write_data: finish has no planner
        # (coordinator, after finish) the .metadata's generation and ids where it is the memo's bytes with ids
        # replaced (RecordMemo.derived): the manager sends the other nodes the ids, not the file
        self.derived: tuple[tuple[int, int], tuple[bytes, ...]] | None = None
        # (coordinator) the manifest entry of the .metadata written from pieces, hashed as it was written
        self.metadata_entry: FileEntry | None = None
        self.id_offsets: list[int] = []  # (coordinator, with derived) where its ids are in the file

    def _metadata_exists(self) -> bool:
        # torch warns at every save into a directory that holds a checkpoint ("overwrite will default to False"):
        # a step saved again (a job restored from an older step saves its number anew) is overwritten on purpose,
        # after the manager took its commit marker away, and the warning was noise in every such job's log
        return False

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        memo, meta = self._memo, self.storage_meta()
        blob = memo.metadata_bytes(metadata, results, meta) if memo is not None else None
        self.metadata_entry = None
        if blob is None:
            super().finish(metadata=metadata, results=results)
            if memo is not None:  # the file just written, from the page cache: no second pickle of it
                with self.fs.create_stream(self.fs.concat_path(self.path, DCP_METADATA), "rb") as f:
                    memo.keep_metadata(metadata, results, meta, f.read())
        else:
            metadata.storage_meta = meta  # as DCP's finish leaves it
            tmp = self.fs.concat_path(self.path, f"{DCP_METADATA}.tmp")
            crc, size, h = 0, 0, _xxh.xxh3_64()
            with self.fs.create_stream(tmp, "wb") as f:
                for piece in blob:
                    f.write(piece)
                    crc = crc_bytes(piece, crc)
                    h.update(piece)
                    size += len(piece)
                if self.sync_files:
                    f.flush()
                    os.fsync(f.fileno())
            self.fs.rename(tmp, self.fs.concat_path(self.path, DCP_METADATA))
            memo.patched += 1
            self.metadata_entry = FileEntry(size=size, crc32c=crc, xxh3=(h.intdigest(),))  # as file_entry() reads it
        self.all_results = results
        self.derived = memo.derived(metadata, meta) if memo is not None else None
        self.id_offsets = memo.id_offsets() if self.derived is not None and memo is not None else []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if _dcp_fs._write_item is not _STOCK_WRITE_ITEM:
            return super().write_data(plan, planner)
        prefix: _StoragePrefix = plan.storage_data
        name = f"{prefix.prefix}0{DEFAULT_SUFFIX}"
        path = self.fs.concat_path(self.path, name)
        results: list[WriteResult] = []
        layout: list[tuple[int, int, int]] = []
        whole = True
        with self.fs.create_stream(path, "wb") as stream:
            out = _HashedFile(stream, hashed=self._hash, block=self._block)

            def result(item: Any, offset: int) -> WriteResult:
                n = out.tell() - offset
                r = WriteResult(index=item.result.index if isinstance(item, _Record) else item.index,
                                size_in_bytes=n, storage_data=_StorageInfo(name, offset, n))
                results.append(r)
                return r

            # as DCP orders them: byte items first, then tensors in plan order
            for item in (i for i in plan.items if i.type == WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                offset = out.tell()
                out.write(data.getbuffer())
                result(item, offset)
            memo: RecordMemo | None = getattr(planner, "records", None)
            self._memo = memo
            if memo is not None and memo.holds(plan, getattr(planner, "state_dict", None)):
                for rec in memo.records:
                    offset = out.tell()
                    mv, tpl = rec.mv, rec.tpl
                    out.write(tpl.head)
                    layout.append((offset, offset + len(tpl.head), len(mv)))
                    out.write(mv)
                    out.write(tpl.tail_for(_zip_crc32(mv) if tpl.crc and len(mv) else 0))
                    if rec.result.storage_data.offset == offset:  # the byte items kept their sizes
                        results.append(rec.result)
                    else:
                        result(rec, offset)
                self.templated += len(memo.records)
                memo.hits += 1
            else:
                whole = self._write_tensors(plan, planner, out, layout, result, memo)
            entry = out.entry(tuple(layout))
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        if whole and self._hash:
            self.entries[name] = entry
        self.results = results
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_tensors(self, plan: SavePlan, planner: SavePlanner, out: _HashedFile,
                       layout: list[tuple[int, int, int]], result: Any, memo: RecordMemo | None) -> bool:
        """The plan's tensors in plan order, each through its template where it has one (else ``torch.save``);
        True when every one had. ``memo`` gets their records when every one was also written from the state's
        own tensor (no copy of it made here)."""
        whole = True
        records: list[_Record] = []
        state: dict[str, Any] | None = getattr(planner, "state_dict", None)
        for item in (i for i in plan.items if i.type != WriteItemType.BYTE_IO):
            src = planner.resolve_data(item)
            t = src.detach().cpu()
            if type(t) is torch.Tensor and t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # DCP's own rule: a view into a larger storage is saved as its own bytes
            offset = out.tell()
            tpl = TEMPLATES.get(t) if _plain(t) else None
            if tpl is None:
                whole = False
                self.fallbacks += 1
                b = io.BytesIO()
                torch.save(t, b)
                out.write(b.getbuffer())
                result(item, offset)
                continue
            self.templated += 1
            mv = _data_view(t)
            out.write(tpl.head)
            layout.append((offset, offset + len(tpl.head), len(mv)))
            out.write(mv)
            out.write(tpl.tail_for(_zip_crc32(mv) if tpl.crc and len(mv) else 0))
            r = result(item, offset)
            if memo is not None and type(src) is torch.Tensor and src.device.type == "cpu" \
                    and t.data_ptr() == src.data_ptr():
                # a DTensor's item resolves to a fresh view of its local shard each save: the record names the
                # DTensor the state holds, which the stager keeps around the same buffer from save to save
                owner = state.get(item.index.fqn) if state is not None else None
                if owner is not src and local_tensor(owner) is owner:
                    owner = None
                if owner is not None:
                    records.append(_Record(item.index.fqn, owner, src.data_ptr(), mv, tpl, r))
        if memo is not None:
            memo.clear()
            if whole and len(records) == sum(1 for i in plan.items if i.type != WriteItemType.BYTE_IO):
                memo.plan, memo.records = plan, records
        return whole
