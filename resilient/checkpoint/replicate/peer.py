"""The peer ring: each rank's files of a committed local step go to the same local rank on the next node, and
the previous node's come here (``<local>/peer``), so a lost node's shards survive on its partner."""

from __future__ import annotations

import logging
import time

from resilient.checkpoint.api import COMMIT_MARKER, DCP_METADATA, Manifest, TierName
from resilient.checkpoint.format.digests import verify_file
from resilient.checkpoint.format.layout import manifest_name
from resilient.checkpoint.replicate.transfer import FileSpec, ring_exchange
from resilient.checkpoint.storage.context import Component, FAILURES
from resilient.checkpoint.storage.tiers import read_manifest
from resilient.events.api import EventKind

logger = logging.getLogger(__name__)


class PeerRing(Component):
    """Replication of a committed local step to the partner node (collective on the manager's group)."""

    def partner(self, offset: int) -> int:
        return (self.ctx.rank + offset * self.ctx.local_world_size) % self.ctx.world_size

    def replicate(self, step: int, m: Manifest) -> None:
        """Send this rank's files to the same local rank on the next node; receive the previous node's."""
        assert self.ctx.local is not None and self.ctx.peer is not None
        t0 = time.perf_counter()
        d = self.ctx.local.path(step)
        names = list(m.files) + [manifest_name(self.ctx.rank)]
        if self.ctx.local_rank == 0:
            names.append(DCP_METADATA)
        specs = [FileSpec(n, (d / n).stat().st_size) for n in names]
        everyone = self._gather(specs, self.ctx.pg)
        src, dst = self.partner(-1), self.partner(+1)
        ok, error = True, None
        out = self.ctx.peer.path(step)
        try:
            if self.ctx.local_rank == 0:
                self.ctx.peer.delete_file(step, COMMIT_MARKER)
            ring_exchange(self.ctx.pg, send_to=dst, send_paths=[d / n for n in names], send_files=specs,
                          recv_from=src, recv_files=everyone[src], out_dir=out)
            got = read_manifest(self.ctx.peer, step, src)
            for n, fe in got.all_files().items():
                if any(s.name == n for s in everyone[src]):
                    verify_file(out / n, fe)
        except FAILURES as e:
            ok, error = False, e
            logger.error("peer replication of step %d from rank %d failed: %s", step, src, e)
        results = self._gather(ok, self.ctx.pg)
        if not all(results):
            if error is not None:
                self._emit(EventKind.CKPT_TIER_FAILED, step=step, tier=TierName.PEER.value,
                           error=f"{type(error).__name__}: {error}")
            return
        if self.ctx.local_rank == 0:
            self._commit(self.ctx.peer, step, ranks=self._node_ranks((self.ctx.node - 1) % self.ctx.nnodes))
        if self.ctx.rank == 0:
            self._emit(EventKind.CKPT_TIER_DONE, step=step, tier=TierName.PEER.value,
                       seconds=time.perf_counter() - t0, bytes=sum(s.size for s in specs) * self.ctx.world_size)
