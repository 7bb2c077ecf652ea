"""Succession in the default set-up: when the agent that hosts the job's store and supervisor is lost, another
agent takes both over, from the last signed plan every agent holds, and the job goes on like after any node loss.

Where to go next is known before it is needed. Every agent but the host keeps a store server of its own bound
from the moment it joins (:class:`Standby`, an ephemeral port on its advertised address) and says its address in
its ``join``; every plan of an agent-hosted supervisor carries ``succession``: the order (members in group-rank
order, then spares; at most :data:`MAX_CANDIDATES`), each candidate's store address, and what the core needs
beyond the assignment (budget spent, the newest decision id). A pre-bound port rather than a deterministic one
(endpoint port + k): nothing else can take it between the plan and the loss, several agents can share a host
(each has its own), and the successor's store is serving the moment it takes over: agents only wait for its term.

The walk (:func:`next_host`), done by each agent whose presence connection to the supervisor closed and whose
host no longer accepts connections: the first candidate of the order that accepts one is the next host; when
that is this agent itself, it takes over (:func:`take_over`), else it reconnects there and waits for the term
its successor publishes. A candidate that accepts but has not taken over yet is waited for, never skipped: two
agents that both see the host gone find the same first live candidate. Candidates skipped on the way (their
nodes lost with the host) are decided on at once, like the host.

A partition closes no connection: an agent whose store stayed unreachable for ``--node-timeout`` walks too (the
host's address then answers nothing, neither accepting nor refusing). The successor carries out its first decisions
only once it accounts for a majority of the plan's nodes (:mod:`resilient.supervisor.quorum`): a host found dead
(its address refused) counts, a silent one does not, so in a partition the agents that reconnect to it make the
majority. The old host, beyond the partition, lost its majority first (half a node timeout of silence, before any
loss is decided), holds its decisions, stands down for good, stops its workers, and leaves the job once a candidate
of its order serves a newer term (:func:`find_successor`); the agents never join a store of an older term again.

A node that joins after a succession knows only ``--rdzv-endpoint``, which named the lost host. When the
successor can bind that endpoint (it names this machine, or an address that moved to it) it serves there a
pointer to its own store (:func:`serve_pointer`) and the joining agent follows it; otherwise nothing answers at
the endpoint and the joining agent fails when its store connection gives up (``--rendezvous-timeout``) with a
line saying that the job may have moved (see ``control.StoreLost``). Point ``--rdzv-endpoint`` at a name that
follows the job (a Kubernetes Service, a DNS name) to let new nodes join after a succession.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from resilient.logs import RateLimitedLog
from resilient.supervisor.quorum import Reach, reach

logger = logging.getLogger(__name__)
_NO_CANDIDATE = RateLimitedLog(logger, 30.0)

#: candidates a plan names: beyond this many nodes lost together with the host, the job fails as before (a plan's
#: size must not grow with the fleet)
MAX_CANDIDATES = 16
#: key of the pointer a successor leaves at the original endpoint: the signed address of its own store
MOVED_KEY_SUFFIX = "moved"


def accepts(addr: str, timeout: float = 1.0) -> bool:
    """Whether ``addr`` (host:port) accepts a TCP connection within ``timeout``: a SIGKILLed node's port refuses at
    once, a dead host's times out."""
    return reach(addr, timeout) is Reach.ACCEPTS


class Standby:
    """The store server this agent keeps bound so that it can take over at once."""

    def __init__(self, advertise: str, timeout: float) -> None:
        from resilient.supervisor.transport import connect_store

        self.store = connect_store("0.0.0.0", 0, timeout, is_master=True)
        self.addr = f"{advertise}:{self.store.port}"


def order_of(plan: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The succession order a plan carries: (node, addr) pairs, or none (a standalone supervisor's plan)."""
    sc = (plan or {}).get("succession")
    if not isinstance(sc, dict):
        return []
    out = []
    for item in sc.get("order", ())[:MAX_CANDIDATES]:
        if isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(x, str) for x in item):
            out.append((item[0], item[1]))
    return out


def next_host(order: Sequence[tuple[str, str]], me: str,
              reach: Callable[[str], bool] = accepts) -> tuple[str, str, list[str]] | None:
    """The walk: (node, addr, candidates skipped as unreachable) of the first candidate that is this agent or
    accepts a connection; None when none does."""
    skipped: list[str] = []
    for node, addr in order:
        if node == me or reach(addr):
            return node, addr, skipped
        skipped.append(node)
    return None


def walk(order: Sequence[tuple[str, str]], me: str, host: str,
         where: str) -> tuple[str, str, list[str], list[str]] | None:
    """The walk, when the supervisor's host at ``where`` stopped answering: None while ``where`` accepts connections
    (the host lives: reconnect there) or when no candidate answers; else (node, addr) of the next host, the nodes
    lost (``host`` first, then the candidates skipped) and those of them known dead (their address refused a
    connection: a silent one may live on beyond a partition and does not count toward a successor's majority)."""
    at_host = reach(where)
    if at_host is Reach.ACCEPTS:
        return None
    refused: set[str] = set()

    def reachable(addr: str) -> bool:
        r = reach(addr)
        if r is Reach.REFUSED:
            refused.add(addr)
        return r is Reach.ACCEPTS

    nxt = next_host(order, me, reachable)
    if nxt is None:
        # tried once a second while the store stays away (a node cut off from every other one): one line per 30 s
        _NO_CANDIDATE.log(logging.ERROR, "the supervisor's host %s was lost and no node of the succession order "
                          "answers", where)
        return None
    node, addr, skipped = nxt
    lost = [n for n in dict.fromkeys([host, *skipped]) if n != me]
    addrs = dict(order)
    dead = [n for n in lost if (n == host and at_host is Reach.REFUSED) or addrs.get(n) in refused]
    return node, addr, lost, dead


def take_over(cfg: Any, node: str, ledger: Any, standby: Standby, signer: Any, plan: dict[str, Any],
              lost: Sequence[str], configured_secret: bool, dead: Sequence[str] = ()) -> Any:
    """This agent hosts the job from now on: its standby store serves the job (claimed for its id, the secret
    there when none is configured, as the first host did), and a supervisor of a newer term adopts ``plan`` and
    decides on ``lost`` (the old host first) at once; it carries that out once it accounts for a majority of the
    plan's nodes (``dead``: those of ``lost`` whose address refused a connection count as accounted for; a silent
    one may be alive beyond a partition, so the agents that reconnect here make the majority). Returns the
    started loop."""
    from resilient.supervisor import transport as T
    from resilient.supervisor.standalone import supervise

    store = standby.store
    store.compare_set(T.JOB_KEY, "", cfg.rdzv_id)
    if not configured_secret:
        store.set(T.Keys(cfg.rdzv_id).secret, signer.secret)
    from resilient.launcher.args import rdzv_seconds

    loop = supervise(cfg.supervisor, cfg.policy, store, signer, ledger,
                     advertise_addr=standby.addr.rsplit(":", 1)[0],
                     last_call=rdzv_seconds(cfg.rdzv_configs, "last_call_timeout"),
                     join_timeout=rdzv_seconds(cfg.rdzv_configs, "join_timeout"),
                     store_timeout=cfg.rendezvous_timeout, tick=min(0.05, cfg.monitor_interval), host_node=node,
                     min_term=int(plan.get("term", 0)))
    loop.succeed(plan, list(lost), time.monotonic(), dead=tuple(dead))
    loop.start()
    return loop


def serve_pointer(endpoint: tuple[str, int], job: str, addr: str, signer: Any, timeout: float,
                  configured_secret: bool) -> Any:
    """Bind the original endpoint, when this machine can, with a signed pointer to ``addr`` for agents that join
    after the succession knowing only ``--rdzv-endpoint``; None when it cannot (the lost host's address)."""
    from resilient.supervisor import transport as T

    host, port = endpoint
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        if not _matches_machine_hostname(host):
            return None
        store = T.connect_store(host, port, timeout, is_master=True)
    except (RuntimeError, ValueError, OSError) as e:
        logger.debug("cannot serve the original endpoint %s:%s: %s", host, port, e)
        return None
    store.compare_set(T.JOB_KEY, "", job)
    if not configured_secret:
        store.set(T.Keys(job).secret, signer.secret)
    store.set(f"{T.Keys(job).prefix}/{MOVED_KEY_SUFFIX}", signer.seal({"addr": addr}))
    return store


def moved_to(store: Any, job: str, signer: Any) -> str | None:
    """The address a successor left at this endpoint, or None (a key that does not open is ignored)."""
    from resilient.supervisor import transport as T

    key = f"{T.Keys(job).prefix}/{MOVED_KEY_SUFFIX}"
    try:
        if not store.check([key]):
            return None
        addr = signer.open(store.get(key)).get("addr")
    except T.BadMessage as e:
        logger.warning("ignored a pointer at the endpoint: %s", e)
        return None
    return addr if isinstance(addr, str) else None


def find_successor(candidates: Sequence[tuple[str, str]], term: int, signer: Any, job: str,
                   probes: Any) -> tuple[str, str, int] | None:
    """(node, addr, term) of the first candidate whose store serves the job under a term newer than ``term``: a
    supervisor that stood down (it lost the majority) learns that the job went on elsewhere once the partition
    healed. ``probes``: the BoundedCaller of the agent's probes (a hung store must not hold the agent)."""
    from resilient.supervisor import transport as T

    key = T.Keys(job).term
    for node, addr in candidates:
        if reach(addr, timeout=0.5) is not Reach.ACCEPTS:
            continue

        def term_there(addr: str = addr) -> int | None:
            h, p = addr.rsplit(":", 1)
            store = T.connect_store(h, int(p), 2.0)
            return int(signer.open(store.get(key))["term"]) if store.check([key]) else None

        try:
            there = probes.call(term_there, 3.0, "looking for a successor")
        except Exception as e:  # noqa: BLE001 - not serving yet, or a forged key: looked at again later
            logger.debug("no successor at %s yet: %s", addr, str(e).splitlines()[0] if str(e) else e)
            continue
        if there is not None and there > term:
            return node, addr, there
    return None
