"""Part objects and the way they are sent, for coded and plain uploads alike: a file larger than a request
goes as several objects named by :func:`part_name`, of :func:`part_size` bytes, :data:`SENDERS` at a time,
each bounded in time (:class:`Sink` for a stream, :class:`DirDest` / :class:`TierDest` for whole parts)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

from resilient.checkpoint.format.layout import step_dirname
from resilient.checkpoint.storage.tiers import retry


logger = logging.getLogger(__name__)
T = TypeVar("T")


PART = 4 << 20  # bytes per request of a streamed item (a multiple of 256 KiB, as GCS requires)


class Sink:
    """One file being written in parts; nothing shows under its name until :meth:`close` returns.

    Every call runs on a sender thread and is waited for at most ``timeout_s`` plus the time its bytes
    take at ``min_rate`` (a dead store must not hold the uploader forever); the caller meanwhile codes
    the next parts on other threads."""

    def __init__(self, open_fn: Callable[[], Any], commit: Callable[[Any], None], discard: Callable[[Any], None],
                 what: str, timeout_s: float = 30.0, min_rate: float = 8 << 20):
        self.what, self.timeout_s, self.min_rate = what, timeout_s, min_rate
        self._commit, self._discard = commit, discard
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="resilient-ckpt-send")
        self.sent, self.seconds, self._buffered = 0, 0.0, 0
        self._f = self._call("open", open_fn, 0)

    def _call(self, what: str, fn: Callable[[], T], nbytes: int) -> T:
        t0 = time.perf_counter()
        fut = self._ex.submit(fn)
        try:
            return fut.result(timeout=self.timeout_s + nbytes / self.min_rate)
        except FutureTimeout:
            raise TimeoutError(f"{self.what}: {what} got no answer within "
                               f"{self.timeout_s + nbytes / self.min_rate:.1f} s (is the store reachable?)") from None
        finally:
            self.seconds += time.perf_counter() - t0

    def write(self, buf: Any) -> None:
        n = len(memoryview(buf).cast("B"))
        self._buffered += n  # a write may send what earlier writes buffered
        self._call("write", lambda: self._f.write(buf), self._buffered)
        if self._buffered >= PART:
            self._buffered = 0
        self.sent += n

    def close(self) -> None:
        f = self._f
        self._call("close", lambda: self._commit(f), self._buffered)
        self._ex.shutdown(wait=False)

    def abort(self) -> None:
        f = self._f
        try:
            self._call("discard", lambda: self._discard(f), 0)
        except Exception as e:  # the file was never committed: nothing shows under its name either way
            logger.debug("%s: discard failed: %s", self.what, e)
        self._ex.shutdown(wait=False)


def dir_sink(out_dir: Path, name: str) -> Sink:
    """A file of a local directory, written under a temporary name and renamed when closed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp, dst = out_dir / f".{name}.tmp", out_dir / name

    def commit(f: Any) -> None:
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, dst)

    def discard(f: Any) -> None:
        f.close()
        tmp.unlink(missing_ok=True)

    return Sink(lambda: open(tmp, "wb"), commit, discard, what=str(dst), timeout_s=600.0)


def tier_sink(tier: Any, step: int, name: str) -> Sink:
    """File ``name`` of ``step`` on a tier (a :class:`~resilient.checkpoint.storage.tiers.BoundedTier` or the tier
    itself): an fsspec file opened without autocommit (on GCS a resumable upload, finalised by commit;
    an aborted one leaves no object), or a temporary file renamed in a directory tier."""
    inner = getattr(tier, "inner", tier)
    timeout_s = float(getattr(tier, "timeout_s", 30.0))
    min_rate = float(getattr(tier, "min_rate", 8 << 20))
    fs = getattr(inner, "fs", None)
    if fs is None:  # a directory tier
        s = dir_sink(Path(inner.path(step)), name)
        s.timeout_s, s.min_rate = timeout_s, min_rate
        return s
    path = f"{inner.root}/{step_dirname(step)}/{name}"

    def open_() -> Any:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(fs, LocalFileSystem):
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return fs.open(path, "wb", block_size=PART, autocommit=False)

    def commit(f: Any) -> None:
        f.close()
        f.commit()

    def discard(f: Any) -> None:
        f.discard()
        try:
            # an unclosed gcsfs file is closed when collected, which would upload what it buffered
            f.closed = True
        except AttributeError:
            pass

    return Sink(open_, commit, discard, what=f"{inner!r}/{step_dirname(step)}/{name}", timeout_s=timeout_s,
                min_rate=min_rate)


def part_name(name: str, k: int) -> str:
    """The ``k``-th part of a coded file: the file's own name first, then ``__0_0.p1.distcp``, ... (DCP's
    ``.metadata`` says which file holds each item, so a coded file may be several objects)."""
    if k == 0:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}.p{k}.{ext}" if dot and ext == "distcp" else f"{name}.p{k}"


SENDERS = 2  # part objects sent at once

PART_MIN, PART_MAX = 4 << 20, 64 << 20


def part_size(raw_bytes: int) -> int:
    """Coded bytes per part object: about 8 parts per file, so sending starts early and parts go out two at
    a time, from PART_MIN (fewer requests) to PART_MAX (fewer objects)."""
    return int(min(PART_MAX, max(PART_MIN, raw_bytes // 8)))


class DirDest:
    """Parts written as files of a local directory (tmp + rename)."""

    def __init__(self, out_dir: str | os.PathLike[str]):
        self.out = Path(out_dir)
        self.timeout_s, self.min_rate = 600.0, float(8 << 20)

    def deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_rate

    def put(self, name: str, data: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / name)

    def open(self, name: str) -> Sink:
        return dir_sink(self.out, name)


class TierDest:
    """Parts written to ``step`` of a tier: a part in one request (``write_bytes``: a single-request upload
    on GCS), retried like any upload; an item larger than a part streamed through a :class:`Sink`."""

    def __init__(self, tier: Any, step: int, retries: int = 0, backoff_s: float = 0.5, backoff_max_s: float = 10.0,
                 should_stop: Callable[[], bool] | None = None):
        self.tier, self.step = tier, step
        self.retries, self.backoff_s, self.backoff_max_s = retries, backoff_s, backoff_max_s
        self.should_stop = should_stop
        self.timeout_s = float(getattr(tier, "timeout_s", 30.0))
        self.min_rate = float(getattr(tier, "min_rate", 8 << 20))

    def deadline(self, nbytes: int) -> float:
        """How long one part's upload may take, every retry included (each attempt is bounded by the tier)."""
        return (self.timeout_s + nbytes / self.min_rate + self.backoff_max_s) * (self.retries + 1)

    def put(self, name: str, data: Any) -> None:
        retry(lambda: self.tier.write_bytes(self.step, name, data), what=f"upload {name} of step {self.step}",
              retries=self.retries, backoff_s=self.backoff_s, backoff_max_s=self.backoff_max_s,
              should_stop=self.should_stop)

    def open(self, name: str) -> Sink:
        return tier_sink(self.tier, self.step, name)
