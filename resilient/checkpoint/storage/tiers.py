"""Tier implementations (a directory on this node; any fsspec URL) and the checksum/manifest helpers."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from resilient.bounded import BoundedCaller
from resilient.checkpoint.api import (COMMIT_MARKER, CheckpointError, CorruptFileError, DCP_METADATA, FileEntry,
                                      Manifest, STEP_PREFIX, StepInfo, Tier, UnsafeCheckpointError)
from resilient.checkpoint.format.codec import check_item
from resilient.checkpoint.format.digests import _CHUNK, verify_file
from resilient.checkpoint.format.layout import manifest_name, parse_step, step_dirname
from resilient.checkpoint.format.safe import load_metadata, safe_torch_load, unsafe_name


logger = logging.getLogger(__name__)


T = TypeVar("T")


def retry(fn: Callable[[], T], *, what: str, retries: int, backoff_s: float, backoff_max_s: float,
          should_stop: Callable[[], bool] | None = None) -> T:
    """Call ``fn`` until it succeeds, at most ``retries`` extra times, with jittered exponential backoff."""
    delay = backoff_s
    for attempt in range(retries + 1):
        try:
            return fn()
        except (OSError, RuntimeError, ValueError, TimeoutError) as e:  # remote stores raise all of these
            if attempt >= retries or (should_stop is not None and should_stop()):
                raise
            logger.warning("%s failed (%s: %s); retry %d/%d in %.1f s", what, type(e).__name__, e,
                           attempt + 1, retries, delay)
            time.sleep(delay * (0.8 + 0.4 * random.random()))
            delay = min(delay * 2, backoff_max_s)
    raise AssertionError("unreachable")


class DirTier:
    """A tier in a directory of this machine (node-local SSD, RAM disk, or the peer replica area)."""

    def __init__(self, root: str | os.PathLike[str], name: str = "local"):
        self.root = Path(root)
        self.name = name

    def __repr__(self) -> str:
        return f"DirTier({str(self.root)!r}, name={self.name!r})"

    def path(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def url(self, step: int | None = None) -> str:
        return str(self.root if step is None else self.path(step))

    def steps(self) -> dict[int, bool]:
        out: dict[int, bool] = {}
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return out
        for n in names:
            s = parse_step(n)
            if s is not None:
                out[s] = os.path.exists(self.root / n / COMMIT_MARKER)
        return out

    def list_files(self, step: int) -> dict[str, int]:
        d = self.path(step)
        try:
            return {e.name: e.stat().st_size for e in os.scandir(d) if e.is_file()}
        except FileNotFoundError:
            return {}

    def put_file(self, step: int, name: str, local_path: str) -> None:
        d = self.path(step)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.tmp"
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, d / name)

    def get_file(self, step: int, name: str, local_path: str) -> None:
        shutil.copyfile(self.path(step) / name, local_path)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        d = self.path(step)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / name)

    def read_bytes(self, step: int, name: str) -> bytes:
        return (self.path(step) / name).read_bytes()

    can_compose = True

    def compose(self, step: int, name: str, parts: list[str], nbytes: int = 0) -> None:
        """``name`` made of ``parts`` (files of the step) in order, appearing whole (tmp + rename)."""
        d = self.path(step)
        tmp = d / f".{name}.tmp"
        with open(tmp, "wb") as out:
            for p in parts:
                with open(d / p, "rb") as f:
                    shutil.copyfileobj(f, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, d / name)

    def read_range(self, step: int, name: str, offset: int, n: int) -> bytes:
        with open(self.path(step) / name, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def delete_file(self, step: int, name: str) -> None:
        try:
            os.unlink(self.path(step) / name)
        except FileNotFoundError:
            pass

    def delete_step(self, step: int) -> None:
        d = self.path(step)
        # the marker goes first so a half-deleted step is never taken for a complete one
        try:
            os.unlink(d / COMMIT_MARKER)
        except FileNotFoundError:
            pass
        shutil.rmtree(d, ignore_errors=True)


class _OneLineStoreErrors(logging.Filter):
    """gcsfs logs each call that failed for good with its traceback (``logger.exception``: "out of retries",
    "non-retriable exception"), calls this package stopped waiting for included: against a dead store, two chained
    tracebacks of 40-odd lines for every call, on the training process's stderr when the job configured no logging.
    The caller gets the exception and reports it; the record stays, as one line and a warning. With the ``gcsfs``
    logger at DEBUG the traceback is kept."""

    MESSAGES = ("out of retries on exception", "non-retriable exception")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and any(m in str(record.msg) for m in self.MESSAGES) \
                and not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


_ONE_LINE = _OneLineStoreErrors()


def _fs_for(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    opts = dict(storage_options)
    if protocol in ("gs", "gcs"):
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            # gcsfs probes the bucket type over gRPC unless told not to; against an emulator that
            # probe waits a minute per call
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            opts.setdefault("token", "anon")
            opts.setdefault("endpoint_url", emulator)
        opts.setdefault("use_listings_cache", False)
        opts.setdefault("skip_instance_cache", True)
        gcsfs_log = logging.getLogger("gcsfs")
        if _ONE_LINE not in gcsfs_log.filters:
            gcsfs_log.addFilter(_ONE_LINE)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path.rstrip("/")


RANGE_PIECE = 8 << 20  # concurrent ranged reads of one object from the persistent tier


class FsspecTier:
    """A tier at any fsspec URL (``gs://`` through gcsfs, ``s3://``, ``file://``)."""

    def __init__(self, url: str, name: str = "persistent", storage_options: dict[str, Any] | None = None):
        self._url = url.rstrip("/")
        self.name = name
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = _fs_for(self._url, self.storage_options)
        from fsspec.implementations.local import LocalFileSystem

        self._needs_dirs = isinstance(self.fs, LocalFileSystem)  # object stores have no directories

    def __repr__(self) -> str:
        return f"FsspecTier({self._url!r}, name={self.name!r})"

    def _p(self, step: int, name: str | None = None) -> str:
        d = f"{self.root}/{step_dirname(step)}"
        return d if name is None else f"{d}/{name}"

    def url(self, step: int | None = None) -> str:
        return self._url if step is None else f"{self._url}/{step_dirname(step)}"

    def _invalidate(self) -> None:
        try:
            self.fs.invalidate_cache()
        except Exception:  # some filesystems keep no cache
            pass

    def steps(self) -> dict[int, bool]:
        self._invalidate()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[int, bool] = {}
        for e in entries:
            s = parse_step(e.rstrip("/").rsplit("/", 1)[-1])
            if s is not None:
                out[s] = False
        if out:
            # one listing per step would be N round trips; COMMITTED files are found with one glob
            for m in self.fs.glob(f"{self.root}/{STEP_PREFIX}*/{COMMIT_MARKER}"):
                s = parse_step(m.rstrip("/").split("/")[-2])
                if s is not None:
                    out[s] = True
        return out

    def list_files(self, step: int) -> dict[str, int]:
        self._invalidate()
        try:
            entries = self.fs.ls(self._p(step), detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def _mkdir(self, step: int) -> None:
        if self._needs_dirs:
            self.fs.makedirs(self._p(step), exist_ok=True)

    def put_file(self, step: int, name: str, local_path: str) -> None:
        self._mkdir(step)
        self.fs.put_file(local_path, self._p(step, name))

    def get_file(self, step: int, name: str, local_path: str) -> None:
        self.fs.get_file(self._p(step, name), local_path)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self._mkdir(step)
        self.fs.pipe_file(self._p(step, name), data)

    def read_bytes(self, step: int, name: str) -> bytes:
        return self.fs.cat_file(self._p(step, name))

    @property
    def can_compose(self) -> bool:
        """Can the store make one object of several (GCS compose, S3 multipart copy: ``fs.merge``)?"""
        return callable(getattr(self.fs, "merge", None))

    def compose(self, step: int, name: str, parts: list[str], nbytes: int = 0) -> None:
        """``name`` made of ``parts`` (objects of the step) in order, by the store itself (GCS: at most 32)."""
        self.fs.merge(self._p(step, name), [self._p(step, p) for p in parts])

    def read_range(self, step: int, name: str, offset: int, n: int) -> bytes:
        return self.fs.cat_file(self._p(step, name), start=offset, end=offset + n)

    def read_parallel(self, step: int, name: str, size: int, piece: int = RANGE_PIECE) -> Any:
        """The whole object as concurrent ranged reads (gcsfs runs ``cat_ranges`` on its event loop)."""
        path = self._p(step, name)
        starts = list(range(0, size, piece))
        if len(starts) <= 1 or not hasattr(self.fs, "cat_ranges"):
            return self.fs.cat_file(path)
        out = bytearray(size)
        parts = self.fs.cat_ranges([path] * len(starts), starts, [min(size, a + piece) for a in starts])
        for a, part in zip(starts, parts):
            if isinstance(part, BaseException):
                raise part
            if len(part) != min(size, a + piece) - a:
                raise OSError(f"{path}: ranged read at {a} returned {len(part)} bytes")
            out[a:a + len(part)] = part
        return out

    def delete_file(self, step: int, name: str) -> None:
        try:
            self.fs.rm_file(self._p(step, name))
        except FileNotFoundError:
            pass

    def delete_step(self, step: int) -> None:
        self.delete_file(step, COMMIT_MARKER)
        try:
            self.fs.rm(self._p(step), recursive=True)
        except FileNotFoundError:
            pass


# calls of one tier that may overrun at once: the uploader's senders and a restore's ranged reads, with room
MAX_ABANDONED = 4


class BoundedTier:
    """Any tier, every call bounded in time: ``timeout_s`` plus the time to move the call's bytes at
    ``min_rate`` bytes/s (so a large upload is not cut short by a bound meant for a dead store).

    A store that is down can hold one call for minutes (gcsfs retries a refused connection with backoff) and
    the call cannot be cancelled; once ``max_abandoned`` calls have overrun and still run, further calls are
    refused at once (:class:`~resilient.bounded.CallBusy`, a ``TimeoutError``) instead of starting yet
    another thread against the same dead store, but for one probe at a time (``BoundedCaller(probe=True)``): the
    store is called again as soon as it answers, not only once the calls it left behind have given up."""

    def __init__(self, inner: Tier, timeout_s: float, min_rate: float = 8 << 20, max_abandoned: int = MAX_ABANDONED):
        self.inner, self.timeout_s, self.min_rate = inner, timeout_s, min_rate
        self.name = inner.name
        self.max_abandoned = max_abandoned
        # probe: a store back from an outage is called at once, not after the calls it left behind give up
        self._caller = BoundedCaller(f"tier-{inner.name}", max_abandoned=max_abandoned, probe=True)

    def __repr__(self) -> str:
        return f"Bounded({self.inner!r}, {self.timeout_s:g} s)"

    def __getattr__(self, attr: str) -> Any:  # fs, root, storage_options... of the wrapped tier
        return getattr(self.inner, attr)

    def _call(self, what: str, fn: Callable[[], T], nbytes: int = 0, timeout_s: float | None = None) -> T:
        t = (self.timeout_s if timeout_s is None else timeout_s) + nbytes / self.min_rate
        return self._caller.call(fn, t, f"{self.inner!r}.{what} (is the store reachable?)")

    def url(self, step: int | None = None) -> str:
        return self.inner.url(step)

    def steps(self, timeout_s: float | None = None) -> dict[int, bool]:
        return self._call("steps()", self.inner.steps, timeout_s=timeout_s)

    def list_files(self, step: int) -> dict[str, int]:
        return self._call(f"list_files({step})", lambda: self.inner.list_files(step))

    def put_file(self, step: int, name: str, local_path: str) -> None:
        self._call(f"put_file({step}, {name!r})", lambda: self.inner.put_file(step, name, local_path),
                   nbytes=os.path.getsize(local_path))

    def get_file(self, step: int, name: str, local_path: str, nbytes: int = 0) -> None:
        self._call(f"get_file({step}, {name!r})", lambda: self.inner.get_file(step, name, local_path), nbytes)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self._call(f"write_bytes({step}, {name!r})", lambda: self.inner.write_bytes(step, name, data),
                   nbytes=len(data))

    def read_bytes(self, step: int, name: str, nbytes: int = 0) -> bytes:
        return self._call(f"read_bytes({step}, {name!r})", lambda: self.inner.read_bytes(step, name), nbytes)

    def read_range(self, step: int, name: str, offset: int, n: int) -> bytes:
        return self._call(f"read_range({step}, {name!r}, {offset}, {n})",
                          lambda: self.inner.read_range(step, name, offset, n), n)  # type: ignore[attr-defined]

    def read_parallel(self, step: int, name: str, size: int) -> Any:
        inner = self.inner
        if not hasattr(inner, "read_parallel"):
            return self.read_bytes(step, name, size)
        return self._call(f"read_parallel({step}, {name!r})",
                          lambda: inner.read_parallel(step, name, size), size)  # type: ignore[attr-defined]

    def delete_file(self, step: int, name: str) -> None:
        self._call(f"delete_file({step}, {name!r})", lambda: self.inner.delete_file(step, name))

    @property
    def can_compose(self) -> bool:
        return bool(getattr(self.inner, "can_compose", False))

    def compose(self, step: int, name: str, parts: list[str], nbytes: int = 0) -> None:
        self._call(f"compose({step}, {name!r})", lambda: self.inner.compose(step, name, parts),  # type: ignore
                   nbytes)

    def delete_step(self, step: int) -> None:
        self._call(f"delete_step({step})", lambda: self.inner.delete_step(step))


def make_tier(url: str, name: str, storage_options: dict[str, Any] | None = None) -> Tier:
    """A :class:`DirTier` for a plain path, else an :class:`FsspecTier`."""
    if "://" not in url:
        return DirTier(url, name=name)
    return FsspecTier(url, name=name, storage_options=storage_options)


def read_manifest(tier: Tier, step: int, rank: int) -> Manifest:
    return Manifest.from_json(json.loads(tier.read_bytes(step, manifest_name(rank))))


def read_commit(tier: Tier, step: int) -> dict[str, Any]:
    return json.loads(tier.read_bytes(step, COMMIT_MARKER))


def manifest_ranks(files: dict[str, int]) -> list[int]:
    out = []
    for n in files:
        if n.startswith("manifest-rank") and n.endswith(".json"):
            r = n[len("manifest-rank"):-len(".json")]
            if r.isdigit():
                out.append(int(r))
    return sorted(out)


def step_info(tier: Tier, step: int, committed: bool) -> StepInfo:
    files = tier.list_files(step)
    ranks = manifest_ranks(files)
    world = None
    if committed:
        try:
            world = int(read_commit(tier, step).get("world_size"))
        except (OSError, ValueError, TypeError, KeyError):
            world = None
    return StepInfo(step=step, committed=committed, ranks=tuple(ranks), world_size=world,
                    bytes=sum(v for k, v in files.items() if k != COMMIT_MARKER))


def verify_step(tier: Tier, step: int, scratch: str | os.PathLike[str],
                progress: Callable[[int], None] | None = None, content: bool = True) -> dict[str, str]:
    """Re-check every file of a step against its manifests: name -> "ok" or the problem.

    Beyond sizes and checksums (which someone who can write to the tier can forge), the content is
    loaded the way restore loads it: ``.metadata`` through the restricted unpickler, every item with
    ``weights_only=True``; a file that would run code, or a name that escapes the step directory, is
    reported as ``unsafe: ...``. ``content=False``: sizes and checksums only.
    """
    result: dict[str, str] = {}
    files = tier.list_files(step)
    entries: dict[str, FileEntry] = {}
    if COMMIT_MARKER in files:
        # a complete step holds a manifest of every rank its marker names: a lost manifest hides its files
        try:
            body = read_commit(tier, step)
            ranks = [int(r) for r in body.get("ranks", range(int(body["world_size"])))]
            for r in ranks:
                if manifest_name(r) not in files:
                    result[manifest_name(r)] = "missing (the commit marker names this rank)"
        except (OSError, ValueError, KeyError, TypeError) as e:
            result[COMMIT_MARKER] = f"unreadable commit marker: {e}"
    for r in manifest_ranks(files):
        try:
            m = read_manifest(tier, step, r)
        except (OSError, ValueError, KeyError, TypeError) as e:
            result[manifest_name(r)] = f"unreadable manifest: {e}"
            continue
        for n, fe in m.files.items():
            problem = unsafe_name(n)
            if problem:
                result[n] = f"unsafe: {manifest_name(r)} lists {problem}"
                continue
            entries[n] = fe
        entries.setdefault(DCP_METADATA, m.metadata)
    md: Any = None
    for n, fe in sorted(entries.items()):  # ".metadata" sorts first: the items' layout comes from it
        if n not in files:
            result[n] = "missing"
            continue
        try:
            if isinstance(tier, DirTier):
                verify_file(tier.path(step) / n, fe)
                problem, md = _content_problem(tier.path(step) / n, n, md) if content else (None, md)
            else:
                tmp = Path(scratch) / f"verify-{os.getpid()}-{n}"
                try:
                    tier.get_file(step, n, str(tmp))
                    verify_file(tmp, fe)
                    problem, md = _content_problem(tmp, n, md) if content else (None, md)
                finally:
                    tmp.unlink(missing_ok=True)
            result[n] = problem or "ok"
        except CorruptFileError as e:
            result[n] = str(e).split(": ", 1)[-1]
        if progress is not None:
            progress(fe.size)
    return result


def _content_problem(path: Path, name: str, md: Any) -> tuple[str | None, Any]:
    """Load a verified file as restore would: (problem or None, DCP metadata once read)."""
    import io

    try:
        if name == DCP_METADATA:
            return None, load_metadata(path.read_bytes(), what=name)
        if md is None:
            return None, md
        with open(path, "rb") as f:
            for idx, info in md.storage_data.items():
                if info.relative_path != name:
                    continue
                f.seek(info.offset)
                body = f.read(info.length)
                if info.transform_descriptors:  # decoded within its true size and checked (format/codec.py)
                    check_item(body, info.transform_descriptors, md, idx, what=name)
                    continue
                safe_torch_load(io.BytesIO(body), what=f"item {idx.fqn!r}")
        return None, md
    except UnsafeCheckpointError as e:
        return f"unsafe: {e}", md
    except (CheckpointError, OSError, RuntimeError, ValueError, EOFError) as e:
        return f"unreadable: {type(e).__name__}: {e}", md
