"""The peer ring: each rank's files of a committed local step go to the same local rank on its partner node,
and the files of the node whose partner this one is come here (``<local>/peer``), so a lost node's shards
survive on its partner.

The partner (:func:`partners`): the next node, as before, when nothing says more; with data-parallel
replicas of K nodes (``RESILIENT_NODES_PER_REPLICA`` in the workers' environment) the node at the same
position in the next replica, so that dropping a whole replica leaves every shard of it on the replicas that
stay; with failure domains (``RESILIENT_FAILURE_DOMAIN`` on the nodes, e.g. the rack; gathered over the group
at the first save) a node of another domain. Every node sends to one partner and receives from one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from resilient import env
from resilient.checkpoint.api import COMMIT_MARKER, DCP_METADATA, Manifest, TierName
from resilient.checkpoint.format.digests import verify_file
from resilient.checkpoint.format.layout import manifest_name
from resilient.checkpoint.replicate.transfer import FileSpec, ring_exchange
from resilient.checkpoint.storage.context import Component, FAILURES
from resilient.checkpoint.storage.tiers import read_manifest
from resilient.events.api import EventKind

logger = logging.getLogger(__name__)

_CANDIDATES = 64  # shifts tried per family: enough for any layout a rack plan makes, bounded at thousands of nodes


def partners(nnodes: int, nodes_per_replica: int | None = None,
             domains: Sequence[str | None] | None = None) -> tuple[list[int], list[str]]:
    """Node -> the node holding its peer copy (a permutation: each node also receives exactly one node's
    copy), and what could not be met, in words (empty when every constraint holds).

    Constraints, when they can apply: the partner is another node; in another replica (more than one replica
    of ``nodes_per_replica`` nodes); in another failure domain (``domains[n]``, more than one label). The
    candidates, in order of preference: shifts by whole replicas keeping the position in the replica (then
    also shifting the position), then shifts in the order of the nodes sorted by domain. The first candidate
    that meets every constraint wins; else the one meeting most (domain first), and the shortfall is told.
    """
    if nnodes <= 1:
        return list(range(nnodes)), []
    k = nodes_per_replica if nodes_per_replica and nnodes % nodes_per_replica == 0 else 1
    n_rep = nnodes // k
    labels = list(domains) if domains is not None and len(domains) == nnodes else [None] * nnodes
    use_domains = len({d for d in labels}) > 1 and None not in labels
    cands: list[list[int]] = []
    if n_rep > 1:
        for q in range(min(k, 8)):
            for s in range(1, min(n_rep, _CANDIDATES + 1)):
                cands.append([((n // k + s) % n_rep) * k + (n % k + q) % k for n in range(nnodes)])
    else:
        cands.append([(n + 1) % nnodes for n in range(nnodes)])  # today's ring
    if use_domains:
        order = sorted(range(nnodes), key=lambda n: (str(labels[n]), n))
        biggest = max(sum(1 for x in labels if x == d) for d in set(labels))
        shifts = [biggest, nnodes - biggest] + [t for t in range(1, min(nnodes, _CANDIDATES + 1))]
        for t in dict.fromkeys(t % nnodes for t in shifts if t % nnodes):
            p = [0] * nnodes
            for i, n in enumerate(order):
                p[n] = order[(i + t) % nnodes]
            cands.append(p)

    def score(p: list[int]) -> tuple[int, int, int]:
        other_domain = sum(labels[n] != labels[p[n]] for n in range(nnodes)) if use_domains else nnodes
        other_replica = sum(n // k != p[n] // k for n in range(nnodes)) if n_rep > 1 else nnodes
        return other_domain, other_replica, sum(p[n] != n for n in range(nnodes))

    full = (nnodes, nnodes, nnodes)
    best = cands[0]
    for p in cands:
        if score(p) == full:
            best = p
            break
        if score(p) > score(best):
            best = p
    said = []
    d, r, _ = score(best)
    if use_domains and d < nnodes:
        said.append(f"{nnodes - d} of {nnodes} nodes keep their peer copy in their own failure domain (domains of "
                    f"{', '.join(f'{x}: {labels.count(x)}' for x in sorted(set(map(str, labels))))} nodes: one domain "
                    "holds more than half of them)")
    if n_rep > 1 and r < nnodes:
        said.append(f"{nnodes - r} of {nnodes} nodes keep their peer copy in their own replica (the failure "
                    "domains left no other choice)")
    return best, said


class PeerRing(Component):
    """Replication of a committed local step to the partner node (collective on the manager's group)."""

    _layout: tuple[int, list[int], list[int]] | None = None  # (world size, partner, inverse) of the last save
    _warned = False

    def partner(self, offset: int) -> int:
        """The rank holding this rank's peer copy (``+1``), or the rank whose copy this rank holds (``-1``)."""
        _, to, frm = self._place()
        node = to[self.ctx.node] if offset > 0 else frm[self.ctx.node]
        return node * self.ctx.local_world_size + self.ctx.local_rank

    def _place(self) -> tuple[int, list[int], list[int]]:
        """The partner of every node, computed once per world size (collective the first time: the failure
        domains are gathered over the group)."""
        if self._layout is not None and self._layout[0] == self.ctx.world_size:
            return self._layout
        raw = os.environ.get(env.NODES_PER_REPLICA, "").strip()
        try:
            k = int(raw) if raw else None
        except ValueError:
            k = None
        domain = os.environ.get(env.FAILURE_DOMAIN, "").strip() or None
        labels = self._gather(domain, self.ctx.pg)
        per_node = [labels[n * self.ctx.local_world_size] for n in range(self.ctx.nnodes)]
        to, said = partners(self.ctx.nnodes, k, per_node)
        frm = [0] * len(to)
        for n, p in enumerate(to):
            frm[p] = n
        if self.ctx.rank == 0 and not self._warned:
            if any(per_node) and (len(set(per_node)) == 1 or None in per_node):
                if None in per_node:
                    logger.warning("peer copies: %d of %d nodes carry no failure domain; domains are ignored",
                                   per_node.count(None), len(per_node))
                logger.warning("peer copies: every node is in failure domain %r; each node's copy goes where it "
                               "would without domains, in the same domain", per_node[0])
                self._warned = True
            for line in said:
                logger.warning("peer copies: %s", line)
                self._warned = True
        self._layout = (self.ctx.world_size, to, frm)
        return self._layout

    def replicate(self, step: int, m: Manifest) -> None:
        """Send this rank's files to the same local rank on the partner node; receive the files of the node
        whose partner this one is."""
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
            self._commit(self.ctx.peer, step, ranks=self._node_ranks(src // self.ctx.local_world_size))
        if self.ctx.rank == 0:
            self._emit(EventKind.CKPT_TIER_DONE, step=step, tier=TierName.PEER.value,
                       seconds=time.perf_counter() - t0, bytes=sum(s.size for s in specs) * self.ctx.world_size)
