"""The uploader's hook for compressed uploads: decide with rank 0's measurements whether a step goes coded,
send the coded parts as they are produced, and hand the uploader what is left to send."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from resilient.checkpoint.api import COMMIT_MARKER, DCP_METADATA, Manifest
from resilient.checkpoint.format.codec import Codec, CompressError, CompressMode
from resilient.checkpoint.format.layout import manifest_name
from resilient.checkpoint.format.safe import load_metadata
from resilient.checkpoint.storage.context import Component
from resilient.checkpoint.storage.tiers import read_manifest
from resilient.checkpoint.upload.chooser import Chooser
from resilient.checkpoint.upload.stream import CodeJob
from resilient.checkpoint.upload.transcode import Plan, Transcoded, clear, finish_step, merged_metadata
from resilient.events.api import EventKind

logger = logging.getLogger(__name__)


class Prepared(tuple):  # type: ignore[type-arg]
    """``(directory, manifest)`` for the uploader: what is left to upload from that directory (this rank's
    manifest, and ``.metadata`` on rank 0; the manifest's ``files`` are empty because the data files went
    to the store as they were coded). ``sent``: the bytes of those data files; ``names``: theirs."""

    sent: int
    names: tuple[str, ...]

    def __new__(cls, directory: Path, manifest: Manifest, sent: int, names: tuple[str, ...] = ()) -> "Prepared":
        t = super().__new__(cls, (directory, manifest))
        t.sent = sent
        t.names = names
        return t


def sent_bytes(coded: Any) -> int:
    """Bytes :func:`prepare_upload` already sent to the store (0 for None or an older result)."""
    return int(getattr(coded, "sent", 0) or 0)


def prepare_upload(mgr: Component, chooser: Chooser, step: int, src: Any, group: Any) -> Prepared | None:
    """Collective on ``group`` (every rank): decide, with rank 0's measurements, whether this step goes to
    the persistent tier compressed (rank 0 writes the decision to the ledger); if so send this rank's files
    of ``step`` from the local tier ``src`` to the store as they are coded (``mgr.code``, the uploader's: from the
    upload process where it runs; :mod:`.stream`: coding overlaps sending), gather every rank's item layout, and write
    this rank's manifest and the step's ``.metadata`` into a scratch directory. Returns (that directory, the manifest
    without the files already sent), or None to upload the local files as they are: compression off, not paying, or any rank failed
    to send its part (every rank then uploads plain, over whatever was sent).

    The decision is gathered before any call to the store. The layout is gathered after this rank's sends,
    which are bounded in time (:class:`Sink`), like the uploader's own gather of results that follows."""
    if chooser.mode is CompressMode.NONE:
        return None  # no collective, no work: compression off costs nothing
    chooser.streamed = False
    try:
        m: Manifest | None = read_manifest(src, step, mgr.ctx.rank)
    except (OSError, ValueError, KeyError) as e:
        m = None  # the upload itself reports it
        logger.debug("step %d: no manifest to compress from (%s)", step, e)
    mine = chooser.decide(sum(f.size for f in m.files.values()) if m is not None else None)
    decision = mgr._gather(mine, group)[0]  # rank 0's measurements decide for every rank
    if mgr.ctx.rank == 0:
        logger.info("step %d to the %s tier: %s (%s)", step, decision.tier, decision.codec.value, decision.reason)
        mgr._emit(EventKind.CKPT_COMPRESS, step=step, **decision.to_json())
    if decision.codec is Codec.NONE:
        return None
    # per rank: ranks of a node share the local tier, and each clears its own scratch when done
    out = Path(src.root) / ".coded" / f"step_{step:08d}-rank{mgr.ctx.rank}"
    clear(out)
    part: Transcoded | None = None
    tier = mgr.store  # type: ignore[attr-defined]  # the uploader's: its metadata calls go where its bytes go
    try:
        if m is None:
            raise CompressError("no manifest")
        d = Path(src.path(step))
        md = load_metadata((d / DCP_METADATA).read_bytes(), what=f"{d / DCP_METADATA}")
        # a step uploaded again (a job restored from an older step saves this number anew) must not stay
        # visible as complete while its files are replaced: the marker goes before this rank's first write
        tier.delete_file(step, COMMIT_MARKER)
        cfg = mgr.ctx.config
        plan = Plan(sorted(m.files), md)
        job = CodeJob(step=step, src=str(d), files=plan.files, codec=decision.codec, expected=dict(m.files),
                      retries=cfg.upload_retries, backoff_s=cfg.upload_backoff_s,
                      backoff_max_s=cfg.upload_backoff_max_s)
        part = plan.transcoded(mgr.code(job), decision.codec)  # type: ignore[attr-defined]
    except Exception as e:  # never fatal: the plain upload that follows retries, and reports what it finds
        logger.warning("compressed upload of step %d failed (%s: %s); uploading it plain", step,
                       type(e).__name__, e)
    parts = mgr._gather(part.storage if part else None, group)
    if part is None or m is None or any(p is None for p in parts):
        clear(out)
        return None
    m2: Manifest | None = None
    try:
        m2 = finish_step(out, m, part, merged_metadata(md, parts), manifest_name(mgr.ctx.rank))
    except Exception as e:  # a full scratch disk: every rank must then go plain, or .metadata would lie
        logger.warning("step %d: writing the compressed manifest failed (%s: %s); uploading it plain", step,
                       type(e).__name__, e)
    if not all(mgr._gather(m2 is not None, group)) or m2 is None:
        clear(out)
        return None
    chooser.observe_codec(part.raw_bytes, part.codec_seconds / max(part.threads, 1), part.ratio)
    chooser.observe_link(part.coded_bytes, part.send_seconds)
    chooser.streamed = True
    if mgr.ctx.rank == 0:
        logger.info("step %d: %s %.2fx, sent in %.2f s (codec %.0f MB/s on %d threads, %.2f s blocked sending)",
                    step, decision.codec.value, part.ratio, part.seconds, part.codec_bps / 1e6, part.threads,
                    part.send_seconds)
    return Prepared(out, dataclasses.replace(m2, files={}), part.coded_bytes, tuple(m2.files))


class CodedUploads:
    """One uploader's compressed uploads: the chooser, whose measurements (the link's and the codec's
    throughput, the ratio) carry from one step to the next. The uploader owns it and is its only caller."""

    def __init__(self, chooser: Chooser):
        self.chooser = chooser

    def prepare(self, up: Component, step: int, src: Any, group: Any) -> Prepared | None:
        """:func:`prepare_upload` with this uploader's chooser."""
        return prepare_upload(up, self.chooser, step, src, group)

    def observe(self, nbytes: int, seconds: float) -> None:
        """The bytes this rank sent to the store and how long that took: the link's measured throughput
        (unless the data went out coded: then the stream measured it, and what is left is a few small
        files)."""
        c = self.chooser
        if c.streamed:
            c.streamed = False
            return
        c.observe_link(nbytes, seconds)
