"""Uploads to the persistent tier: one thread copies committed local steps (or in-memory copies of steps the
local tier could not hold) to the store on a gloo group of its own, newest requested step first.

Plain files travel like compressed ones (:mod:`resilient.checkpoint.storage.parts`): in part objects of one
request each, two at a time (:mod:`.send`), sent from the upload process (:mod:`.process`, so that their Python
does not hold the training process's interpreter lock) unless ``CheckpointConfig.upload_process`` is off or the
process cannot be used. A file appears whole or not at all, and the step stays invisible until rank 0 commits it
after every rank's files landed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilient.checkpoint.api import COMMIT_MARKER, CheckpointError, CorruptFileError, DCP_METADATA, Manifest, TierName
from resilient.checkpoint.format.digests import verify_bytes
from resilient.checkpoint.format.layout import manifest_name
from resilient.checkpoint.storage.context import Component, Context, FAILURES, one_line as _one_line
from resilient.checkpoint.storage.tiers import DirTier, read_manifest, retry
from resilient.checkpoint.upload import prepare
from resilient.checkpoint.upload.chooser import chooser_from_env
from resilient.checkpoint.upload.process import (ProcessTier, SendProcess, SenderDied, SenderUnavailable, TierSpec,
                                                 use_process)
from resilient.checkpoint.upload.send import SendJob, send_files
from resilient.checkpoint.upload.stream import CodeJob, Streamed, code_files
from resilient.checkpoint.upload.transcode import clear
from resilient.events.api import EventKind

logger = logging.getLogger(__name__)


class Uploader(Component):
    """The upload queue and its thread. ``interval`` is the manager's save schedule (its tuner learns the
    upload time)."""

    def __init__(self, ctx: Context, interval: Any):
        super().__init__(ctx)
        self._interval = interval
        self.coded = prepare.CodedUploads(chooser_from_env())
        self.closed = False  # the manager is closing: see _give_up
        self._up_abandon = False
        self._up_cv = threading.Condition()
        self._up_pending: list[int] = []
        self._up_mem: dict[int, dict[str, bytes]] = {}  # steps the local tier could not hold
        self._up_busy = False
        self._up_current: int | None = None  # the step being uploaded
        self._up_closing = False
        self._thread: threading.Thread | None = None
        # written by the upload thread (and request() under _up_cv); read by wait()/close()
        self.requested_max: int | None = None  # newest step ever asked of the persistent tier
        self.outcomes: dict[int, bool] = {}  # step -> whether every rank's files landed (the same on every rank)
        self.last_error: str | None = None  # this rank's error of the last failed upload
        self.errors: dict[int, str] = {}  # step -> this rank's error of its failed upload (set before outcomes)
        # step -> the newer step whose upload replaced it before it started (the newest pending step goes first):
        # such a step never gets an outcome, so the manager reports it from here (the same on every rank: the
        # step to upload is agreed by a gather, and every rank drops the same older ones)
        self.superseded: dict[int, int] = {}
        self._collective = threading.Event()  # set while the upload thread is inside a collective on its group
        cfg = ctx.config
        # the bytes of uploads go from a process of its own (see .process); None: from this thread
        use, why = use_process(cfg.upload_process, ctx.local_world_size) if cfg.persistent else (False, "")
        if cfg.persistent:
            (logger.info if ctx.rank == 0 else logger.debug)("uploads to the persistent tier from %s: %s",
                                                              "an upload process" if use else "the upload thread", why)
        self.sender: SendProcess | None = (
            SendProcess(TierSpec(url=cfg.persistent, name=TierName.PERSISTENT.value,
                                 storage_options=dict(cfg.storage_options), timeout_s=cfg.persistent_timeout_s,
                                 nice=cfg.background_nice))
            if use else None)
        # the persistent tier for an upload's metadata calls (uncommit, commit, sweep, retention): through the upload
        # process too, whose store client's Python would otherwise run here
        self.store: Any = (ProcessTier(self.sender, ctx.persistent, _unavailable) if self.sender is not None
                           else ctx.persistent)
        if self.sender is not None:
            self.sender.on_failure = self._sender_failed
            if self.sender.off is not None and not self.sender.spec.in_process:
                # storage options that cannot be sent to another process: said once, as a failure found later is
                e = SenderUnavailable(self.sender.off)
                _unavailable(e)
                self._sender_failed(e, None)

    def _sender_failed(self, e: CheckpointError, step: int | None) -> None:
        """The upload process died or was turned off (its warning line is logged where it is handled): one ledger
        record, which ``resilient goodput`` and the metrics endpoint count."""
        off = self.sender is not None and self.sender.off is not None
        self._emit(EventKind.CKPT_UPLOAD_PROCESS, step=step, state="off" if off else "died", error=str(e))

    def start(self, on_start: Callable[[], Any] | None = None) -> None:
        """Start the upload thread; it first calls ``on_start`` (the manager lowers its priority there, which
        the threads it starts inherit)."""
        def run() -> None:
            if on_start is not None:
                on_start()
            try:
                self._upload_loop()
            finally:
                if self.sender is not None:
                    self.sender.close()

        self._thread = threading.Thread(target=run, name="resilient-ckpt-upload", daemon=True)
        self._thread.start()

    def warm(self) -> None:
        """Start the upload process without waiting for it (the manager calls this at every save; only the first one
        starts it): its imports and store client take 0.2-0.7 s, which the save's local write covers, where a first
        upload would wait for them while newer steps supersede it. A manager that never saves starts none."""
        sender = self.sender
        if sender is None or sender.off is not None or sender.pid is not None:
            return
        try:
            sender.spawn()
        except SenderUnavailable as e:
            _unavailable(e)

    def drain(self, deadline: float) -> bool:
        """Wait until no upload is pending or running, at most until ``deadline`` (monotonic)."""
        with self._up_cv:
            while self._up_pending or self._up_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._up_cv.wait(left)
        return True

    def abandon(self) -> list[int]:
        """Stop retrying (exit): the steps still pending or in flight, now abandoned."""
        self._up_abandon = True
        if self.sender is not None:
            self.sender.kill()  # an upload in it is abandoned too; the thread sends nothing more by itself
        with self._up_cv:
            return sorted(set(self._up_pending) | ({self._up_current} if self._up_current is not None else set()))

    def settle(self, timeout: float) -> bool:
        """At exit, after :meth:`abandon`: wait (at most ``timeout``) until the upload thread is out of its
        collectives. An abandoned upload enters no new one, so the process may then tear its groups down without
        a thread inside one (gloo would abort the process). A thread left in a store call is harmless there."""
        deadline = time.monotonic() + timeout
        while self._collective.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _abandoned(self) -> bool:
        return self.closed and self._up_abandon

    def stop(self) -> None:
        with self._up_cv:
            self._up_closing = True
            self._up_cv.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def upload_floor(self) -> int | None:
        with self._up_cv:
            pend = list(self._up_pending)
            return min(pend) if pend else None

    def request(self, step: int, files: dict[str, bytes] | None = None) -> None:
        """Queue ``step`` for upload, from the local tier or (``files``) from memory."""
        with self._up_cv:
            self._up_pending.append(step)
            self.requested_max = step if self.requested_max is None else max(self.requested_max, step)
            if files is not None:
                self._up_mem[step] = files
            self._up_cv.notify_all()

    def _drop_pending(self, keep: Any) -> None:
        """(under _up_cv) keep only pending steps for which ``keep(step)``; their in-memory copies too."""
        self._up_pending = [s for s in self._up_pending if keep(s)]
        for s in [s for s in self._up_mem if not keep(s)]:
            del self._up_mem[s]

    def _upload_loop(self) -> None:
        while True:
            step: int | None = None
            with self._up_cv:
                while not self._up_pending and not self._up_closing:
                    self._up_cv.wait()
                if not self._up_pending:
                    return
                if self._abandoned():
                    return  # exit: no new upload, no new collective
                newest = max(self._up_pending)
                self._up_busy = True
            try:
                # ranks may have seen different numbers of requests: agree on one every rank has
                self._collective.set()
                try:
                    step = min(self._gather(newest, self.ctx.pg_up))
                finally:
                    self._collective.clear()
                with self._up_cv:
                    for s in self._up_pending:
                        if s < step:
                            self.superseded[s] = step
                    self._drop_pending(lambda s: s >= step)
                    mem = self._up_mem.get(step)
                    self._up_current = step
                assert self.ctx.local is not None
                self.upload_step(step, self.ctx.local, group=self.ctx.pg_up, mem=mem)
            except BaseException as e:  # the uploader must outlive any one upload
                logger.exception("upload loop error: %s", e)
            finally:
                with self._up_cv:
                    if step is not None:
                        self._drop_pending(lambda s: s > step)
                    self._up_busy = False
                    self._up_current = None
                    self._up_cv.notify_all()

    def upload_step(self, step: int, src: DirTier, group: Any, mem: dict[str, bytes] | None = None) -> bool:
        """Copy this rank's files of ``step`` from ``src`` (or from ``mem``: name -> bytes) to the
        persistent tier; rank 0 commits. Returns whether every rank's files landed: the same answer on every
        rank (rank 0's own commit failing is its event to report, not a reason for the ranks to disagree)."""
        assert self.ctx.persistent is not None

        cfg = self.ctx.config
        t0 = time.perf_counter()
        # collective (every rank takes part): it agrees on compressing before any call to the store, and the
        # coded parts it sends are bounded in time, so a rank stuck on a dead store holds the others in its
        # later gathers no longer than that bound
        coded = self.coded.prepare(self, step, src, group) if mem is None else None
        ok, error, nbytes = True, None, prepare.sent_bytes(coded)  # parts prepare_upload already sent
        names: list[str] = list(getattr(coded, "names", ()))  # every file of this rank's copy: the coded ones sent
        try:
            # a step uploaded again (a job restored from an older step saves this number anew) must not stay
            # visible as complete while its files are replaced: each rank removes the marker before its own
            # first write (no collective for it: a rank must never wait in one while another is stuck on a
            # dead store), and only rank 0 writes it back, after every rank's files are in
            retry(lambda: self.store.delete_file(step, COMMIT_MARKER),
                  what=f"uncommit step {step}", retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                  backoff_max_s=cfg.upload_backoff_max_s, should_stop=lambda: self._give_up(step))
            if mem is not None:
                m = Manifest.from_json(json.loads(mem[manifest_name(self.ctx.rank)]))
            else:
                m = read_manifest(src, step, self.ctx.rank)
            d = src.path(step)
            if coded is not None:
                d, m = coded  # the same step with every item compressed, and its manifest
            t_put = time.perf_counter()
            to_send = list(m.files) + [manifest_name(self.ctx.rank)]
            if self.ctx.rank == 0:
                to_send.append(DCP_METADATA)
            names += to_send
            if mem is not None:
                for n in to_send:
                    fe = m.all_files().get(n)
                    data = mem[n]
                    if fe is not None:
                        verify_bytes(data, fe, what=f"{n} of step {step} in memory")
                    # from this process: a step held in memory would be copied whole into the upload process
                    retry(lambda n=n, data=data: self.ctx.persistent.write_bytes(step, n, data),  # type: ignore
                          what=f"upload {n} of step {step}", retries=cfg.upload_retries,
                          backoff_s=cfg.upload_backoff_s, backoff_max_s=cfg.upload_backoff_max_s,
                          should_stop=lambda: self._give_up(step))
                    nbytes += len(data)
            else:
                nbytes += self._send_plain(step, Path(d), to_send, m)
            self.coded.observe(nbytes, time.perf_counter() - t_put)
        except FAILURES as e:
            ok, error = False, e
            newer = self._newer_pending(step)
            if newer is not None and not isinstance(e, CorruptFileError):
                # retrying an old step against a store that is down only delays the newer one
                error = CheckpointError(f"gave up: step {newer} is waiting ({_one_line(e)})")
            logger.error("upload of step %d failed: %s", step, _one_line(error))
        if coded is not None:
            clear(coded[0])
        if self._abandoned():
            # abandoned at exit: the other ranks may be gone already, a gather could wait on them forever
            results = [(False, nbytes, names)]
            if ok:
                ok, error = False, CheckpointError("abandoned at exit")
        else:
            self._collective.set()
            try:
                results = self._gather((ok, nbytes, names), group)
            finally:
                self._collective.clear()
        landed = all(r[0] for r in results)
        if landed and self.ctx.rank == 0:
            try:
                retry(lambda: self._commit(self.store, step, ranks=list(range(self.ctx.world_size))),
                      what=f"commit step {step}", retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                      backoff_max_s=cfg.upload_backoff_max_s)
                seconds = time.perf_counter() - t0
                self._emit(EventKind.CKPT_TIER_DONE, step=step, tier=TierName.PERSISTENT.value,
                           seconds=seconds, bytes=sum(r[1] for r in results))
                self._sweep(step, {n for r in results for n in r[2]})
                tuner = self._interval.tuner
                if tuner is not None and hasattr(tuner, "observe_upload"):
                    try:
                        with self._interval.lock:
                            tuner.observe_upload(seconds)
                    except FAILURES as e:
                        logger.debug("tuner.observe_upload failed: %s", e)
                self._retain(self.store, cfg.keep_persistent, pinned_from=None)
            except FAILURES as e:
                ok, error = False, e
        if not ok:
            self.last_error = (_one_line(error) if not isinstance(error, CheckpointError) else str(error)) \
                if error is not None else "failed on another rank"
            self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PERSISTENT.value, error=self.last_error)
            self.errors[step] = self.last_error
        with self._up_cv:
            self.outcomes[step] = landed
        return landed

    def _sweep(self, step: int, keep: set[str]) -> None:
        """Rank 0, after the commit: remove what an earlier upload of this step number left that no rank's copy
        names now (more coded parts than this time, parts of a compose cut short, the files of ranks beyond a
        smaller world). No manifest lists them, so no restore reads them, but they cost storage and ``resilient
        ckpt ls`` counts them. Best effort: a file that cannot be removed now goes with the step's retention."""
        tier = self.store
        assert tier is not None
        try:
            stale = sorted(set(tier.list_files(step)) - keep - {COMMIT_MARKER})
        except FAILURES as e:
            # the step is committed and complete; what may be left is storage, and a user paying for it should know
            logger.warning("step %d is uploaded, but listing it for files an earlier upload left failed (%s): any "
                           "such file stays until the step's retention removes it", step, _one_line(e))
            return
        left: list[str] = []
        error: BaseException | None = None
        for n in stale:
            try:
                tier.delete_file(step, n)
            except FAILURES as e:
                left.append(n)
                error = e
        if len(left) < len(stale):
            logger.info("step %d: removed %d file(s) an earlier upload of this step left: %s", step,
                        len(stale) - len(left), _names(sorted(set(stale) - set(left))))
        if left:
            logger.warning("step %d is uploaded, but %d file(s) an earlier upload of it left could not be removed "
                           "(%s): %s; no manifest names them and no restore reads them, and the step's retention "
                           "removes them", step, len(left), _one_line(error), _names(left))

    def _send_plain(self, step: int, d: Path, names: list[str], m: Manifest) -> int:
        """Send the files ``names`` of ``d`` to ``step`` of the persistent tier (see the module note), each verified
        against ``m`` first. Returns the bytes sent; raises when a file did not land."""
        cfg = self.ctx.config
        job = SendJob(step=step, src=str(d), names=tuple(names), data=frozenset(m.files), expected=m.all_files(),
                      retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                      backoff_max_s=cfg.upload_backoff_max_s)
        return self._from_process(step, "sends", lambda sender, stop: sender.send(job, stop),
                                  lambda stop: send_files(self.ctx.persistent, job, stop))

    def code(self, job: CodeJob) -> Streamed:
        """Code and send a compressed upload's files (:func:`.prepare.prepare_upload` calls this): from the upload
        process, as :meth:`_send_plain` sends, or from this thread when the process cannot be used or died."""
        return self._from_process(job.step, "codes and sends", lambda sender, stop: sender.code(job, stop),
                                  lambda stop: code_files(self.ctx.persistent, job, stop))

    def _from_process(self, step: int, what: str, there: Callable[[SendProcess, Callable[[], bool]], Any],
                      here: Callable[[Callable[[], bool]], Any]) -> Any:
        """``there(sender, should_stop)`` in the upload process, or ``here(should_stop)`` on this thread where the
        process cannot be used, or died during it (the step must not miss the persistent tier for that)."""
        stop = (lambda: self._give_up(step))
        sender = self.sender
        if sender is not None and sender.off is None:
            try:
                return there(sender, stop)
            except SenderUnavailable as e:
                _unavailable(e)
            except SenderDied as e:
                if self._abandoned():
                    raise
                logger.warning("%s; this thread %s step %d itself", e, what, step)
        return here(stop)

    def _newer_pending(self, step: int) -> int | None:
        """A later step queued for upload on this rank, if any."""
        with self._up_cv:
            newer = [s for s in self._up_pending if s > step]
        return max(newer) if newer else None

    def _give_up(self, step: int) -> bool:
        """Stop retrying the upload of ``step``: exit abandons it, or a newer step waits behind it (each rank
        decides alone; the upload's closing gather makes every rank drop the step if one did)."""
        return (self.closed and self._up_abandon) or self._newer_pending(step) is not None


def _unavailable(e: SenderUnavailable) -> None:
    logger.warning("the upload process cannot be used (%s): uploads are sent from the training process for the rest "
                   "of this run", e)


def _names(names: list[str], most: int = 5) -> str:
    """A log line's list of file names: the first few, then how many more."""
    return ", ".join(names[:most]) + (f", and {len(names) - most} more" if len(names) > most else "")
