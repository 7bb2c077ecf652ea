"""Whether an upload is worth compressing: ``--ckpt-compress none|bgzstd|zstd|auto``; ``auto`` compares the
measured link and codec throughputs and the ratio, and probes once before it knows them."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from resilient import env as _renv
from resilient.checkpoint.api import CheckpointConfigError
from resilient.checkpoint.format.codec import Codec, CompressMode, parse_mode


logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ when it pays
@dataclass
class UploadChoice:
    tier: str
    codec: Codec
    reason: str
    link_mbps: float | None = None  # the link as last measured (bytes on the wire per second)
    codec_mbps: float | None = None  # the codec as last measured on this run's data (raw bytes per second)
    ratio: float | None = None
    mode: str = CompressMode.AUTO.value

    @property
    def decision(self) -> str:
        return "plain" if self.codec is Codec.NONE else "compress"

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "mode": self.mode, "codec": self.codec.value, "decision": self.decision,
                "reason": self.reason, "link_mbps": self.link_mbps, "codec_mbps": self.codec_mbps,
                "ratio": self.ratio}


MARGIN = 1.1  # compress only when the estimate beats plain by this much: per-step costs the model leaves out


class Chooser:
    """Per tier, per run: compress a transfer only if it is expected to take less time than sending it
    plain, from the measured link throughput (bytes on the wire per second of the last transfer) and the
    codec's measured throughput and ratio on this run's own data. Coding and sending overlap (a pipeline),
    so a coded transfer takes about max(coding, sending the smaller bytes).

    With ``auto``, transfers under ``min_bytes`` per rank go plain; the first transfer of a tier goes plain
    (it measures the link); the codec is measured on
    the first transfer it is tried on, and re-tried every ``probe_every`` transfers so that a link that
    slows down is noticed."""

    def __init__(self, mode: CompressMode | str = CompressMode.AUTO, tier: str = "persistent",
                 probe_every: int = 10, min_bytes: int = 16 << 20):
        self.mode = mode if isinstance(mode, CompressMode) else parse_mode(mode)
        self.tier, self.probe_every, self.min_bytes = tier, probe_every, min_bytes
        self.link_bps: float | None = None
        self.codec_bps: float | None = None
        self.ratio: float | None = None
        self._since_probe = 0
        self._lock = threading.Lock()
        self.last: UploadChoice | None = None
        self.streamed = False  # the last transfer's data went out coded: its link was measured on the stream

    def decide(self, nbytes: int | None = None) -> UploadChoice:
        """``nbytes``: this rank's plain bytes to send."""
        with self._lock:
            d = self._decide(nbytes)
            self.last = d
            return d

    def _decide(self, nbytes: int | None) -> UploadChoice:
        mb = (lambda v: None if v is None else round(v / 1e6, 1))

        def dec(codec: Codec, reason: str) -> UploadChoice:
            return UploadChoice(self.tier, codec, reason, mb(self.link_bps), mb(self.codec_bps),
                            None if self.ratio is None else round(self.ratio, 3), self.mode.value)

        if self.mode is not CompressMode.AUTO:
            return dec(Codec(self.mode.value), "forced by --ckpt-compress")
        if nbytes is not None and nbytes < self.min_bytes:
            # a small transfer's time is round trips, not bandwidth; and it stays readable by plain dcp.load
            return dec(Codec.NONE, f"{nbytes} bytes per rank: below {self.min_bytes}")
        if self.link_bps is None:
            return dec(Codec.NONE, "link not measured yet: this transfer measures it")
        if self.codec_bps is None or self.ratio is None or self._since_probe >= self.probe_every:
            self._since_probe = 0
            return dec(Codec.BGZSTD, "codec not measured on this run's data yet: probing")
        self._since_probe += 1
        plain = 1 / self.link_bps
        coded = max(1 / self.codec_bps, 1 / (self.ratio * self.link_bps))
        pays = coded * MARGIN < plain
        why = (f"plain {plain * 1e6:.1f} s/MB vs coded {coded * 1e6:.1f} s/MB (x{MARGIN} margin; "
               f"codec {self.codec_bps / 1e6:.0f} MB/s, ratio {self.ratio:.2f}, link {self.link_bps / 1e6:.0f} MB/s)")
        return dec(Codec.BGZSTD if pays else Codec.NONE, why)

    def observe_link(self, wire_bytes: int, seconds: float) -> None:
        """A transfer of ``wire_bytes`` (as sent) took ``seconds``."""
        if seconds > 0 and wire_bytes > 0:
            with self._lock:
                self.link_bps = wire_bytes / seconds

    def observe_codec(self, raw_bytes: int, seconds: float, ratio: float) -> None:
        """The codec turned ``raw_bytes`` into ``raw_bytes / ratio`` in ``seconds`` (all its threads together)."""
        if seconds > 0 and raw_bytes > 0:
            with self._lock:
                self.codec_bps, self.ratio = raw_bytes / seconds, ratio


# ------------------------------------------------------------------ the manager's upload hook
ENV_MODE = _renv.CKPT_COMPRESS  # set by resilient-run --ckpt-compress


def chooser_from_env(tier: str = "persistent") -> Chooser:
    raw = os.environ.get(ENV_MODE, "")
    try:
        return Chooser(parse_mode(raw), tier=tier)
    except CheckpointConfigError as e:
        # bad input must not stop training: say so once and send plain bytes
        logger.error("%s=%r: %s; checkpoints are sent uncompressed", ENV_MODE, raw, e)
        return Chooser(CompressMode.NONE, tier=tier)
