"""One rank's plain files of a step sent to the persistent tier: the bytes' part of an upload.

The upload thread (:mod:`.uploader`) runs it in the training process, or hands it to the upload process
(:mod:`.process`), which runs the same function; so this module imports no torch. A file of one part goes up under
its own name; a larger one goes up as hidden parts that the store then composes into the file (GCS compose: no byte
travels twice), where the store can (else one resumable upload). Either way a file appears whole or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.checkpoint.api import FileEntry
from resilient.checkpoint.format.digests import map_verified
from resilient.checkpoint.storage.parts import SENDERS, TierDest, part_size
from resilient.checkpoint.storage.tiers import retry

logger = logging.getLogger(__name__)

COMPOSE_MAX = 32  # parts one GCS compose request takes


@dataclass(frozen=True)
class SendJob:
    """This rank's files ``names`` of ``step``, read from the step's local directory ``src``."""

    step: int
    src: str
    names: tuple[str, ...]
    # the data files among ``names``: they go first, two parts at a time; the rest (the manifest, ``.metadata``)
    # one at a time after them, since a manifest lists files that must be there
    data: frozenset[str]
    # each file's manifest entry: a file is verified against it as it is read (a copy that rotted on the local disk
    # is never uploaded); a file without one (the manifest itself) goes as it is
    expected: dict[str, FileEntry] = field(default_factory=dict)
    retries: int = 0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0

    def deadline_s(self, timeout_s: float, min_rate: float) -> float:
        """How long the whole job may take: every file's upload one after another, each with every retry (each
        attempt is bounded by the tier), so only a sender that stopped answering runs past it."""
        per_call = timeout_s + self.backoff_max_s
        calls, size = 0, 0
        for n in self.names:
            fe = self.expected.get(n)
            b = fe.size if fe is not None else 0
            size += b
            calls += 3 + (-(-b // max(part_size(b), -(-b // COMPOSE_MAX))) if b > part_size(b) else 0)  # parts, compose, deletes
        return (calls * per_call + size / min_rate) * (self.retries + 1)


def send_files(tier: Any, job: SendJob, should_stop: Callable[[], bool] | None = None,
               on_landed: Callable[[str], None] | None = None) -> int:
    """Send ``job``'s files to ``tier``; returns the bytes sent. Raises when a file did not land;
    ``should_stop`` ends the retries (a newer step waits, or the process exits); ``on_landed`` is told the name of
    each file or part as it lands."""
    step, d = job.step, Path(job.src)
    dest = TierDest(tier, step, retries=job.retries, backoff_s=job.backoff_s, backoff_max_s=job.backoff_max_s,
                    should_stop=should_stop)
    can_compose = bool(getattr(tier, "can_compose", False))
    composed: list[tuple[str, list[str], int]] = []  # (file, its parts, bytes): made once the parts landed
    sent: list[tuple[str, int, Future[Any]]] = []
    total = 0

    def again(fn: Callable[[], Any], what: str) -> Any:
        return retry(fn, what=what, retries=job.retries, backoff_s=job.backoff_s, backoff_max_s=job.backoff_max_s,
                     should_stop=should_stop)

    def put(name: str, data: Any) -> None:
        dest.put(name, data)
        if on_landed is not None:
            on_landed(name)

    def put_file(name: str, path: str) -> None:
        again(lambda: tier.put_file(step, name, path), f"upload {name} of step {step}")
        if on_landed is not None:
            on_landed(name)

    def wait_all() -> None:
        try:
            for n, size, fut in sent:
                try:
                    fut.result(timeout=dest.deadline(size))
                except FutureTimeout:
                    if fut.done():
                        raise  # the upload's own timeout (builtin TimeoutError is the futures' one)
                    raise TimeoutError(f"upload of {n} of step {step} got no answer in time "
                                       "(is the store reachable?)") from None
        finally:
            for _, _, fut in sent:
                fut.cancel()

    batches = [[n for n in job.names if n in job.data], [n for n in job.names if n not in job.data]]
    with ThreadPoolExecutor(SENDERS, thread_name_prefix="resilient-ckpt-send") as ex:
        for batch in batches:
            sent.clear()
            composed.clear()
            for n in batch:
                fe = job.expected.get(n)
                data: Any = map_verified(d / n, fe) if fe is not None else (d / n).read_bytes()
                mv = memoryview(data).cast("B") if len(data) else memoryview(b"")
                size = len(mv)
                total += size
                psize = part_size(size)
                if size <= psize:
                    sent.append((n, size, ex.submit(put, n, mv)))
                    if n not in job.data:
                        wait_all()
                        sent.clear()
                elif can_compose:
                    psize = max(psize, -(-size // COMPOSE_MAX))
                    parts = [f".{n}.up{i}" for i in range(-(-size // psize))]
                    for i, p in enumerate(parts):
                        piece = mv[i * psize:(i + 1) * psize]
                        sent.append((p, len(piece), ex.submit(put, p, piece)))
                    composed.append((n, parts, size))
                else:
                    sent.append((n, size, ex.submit(put_file, n, str(d / n))))
            wait_all()
            for n, parts, size in composed:
                again(lambda n=n, parts=parts, size=size: tier.compose(step, n, parts, size),
                      f"compose {n} of step {step}")
            for _, parts, _ in composed:
                for p in parts:  # the parts are copies now; one left behind goes with the step's retention
                    try:
                        tier.delete_file(step, p)
                    except Exception as e:  # best effort, as any failure of a store
                        logger.debug("step %d: deleting part %s failed: %s", step, p, e)
    return total
