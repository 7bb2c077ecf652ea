"""The agent's end of the control plane: the job's store, the signer, the channel to the supervisor, the presence
connection and heartbeats, reconnecting after the supervisor went away, plans and acknowledgements.

Decisions are the supervisor's; this client only carries messages both ways. It never raises on a lost store
past the join: the workers go on training (fail static), reports wait in ``unsent`` until the supervisor is back.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

from resilient.bounded import BoundedCaller
from resilient.events import Event, Ledger
from resilient.launcher.api import AgentConfig, LaunchError, NodeRound
from resilient.logs import RateLimitedLog

logger = logging.getLogger(__name__)
_RECONNECT_REFUSED = RateLimitedLog(logger, 30.0)  # an endpoint taken by another job, tried every second
# seconds between two reads of the succession: a spare that joined is a candidate (and a known spare for the
# successor) this long after its join at most; one small read per node per period
_SUCCESSION_EVERY = 2.0
# seconds between two looks for a plan in the store when no notice announced one: the supervisor announces each new
# round on every presence connection, so the store is read when a plan is there; this look only covers a notice that
# did not go whole (a full socket buffer). Looks every 0.1 s (the agent's pass) cost the supervisor 17.1 against 6.7 % of
# a core at rest at 512 nodes, 24.4 against 8.1 % at 1,024 (bench/results/supervisor_scale-poll*-1207.json)
PLAN_LOOK_S = 0.5
# after a (re)connection, the store is read once a --monitor-interval for this long: a plan published before the
# supervisor took this connection's hello was announced on the others only
_LOOK_AFTER_CONNECT_S = 1.0


class StoreLost(Exception):
    """The job's store (and with it the supervisor) stayed unreachable while this node had nothing to run."""


class SupervisorUnreachable(Exception):
    """This node needed a decision and no supervisor answered within --supervisor-timeout: (why it needed one,
    seconds it waited)."""

    def __init__(self, need: str, waited: float):
        super().__init__(f"no supervisor reachable for {waited:.0f} s while {need}")
        self.need, self.waited = need, waited


class Superseded(Exception):
    """This node's supervisor stood down (it lost the majority of the job's nodes: a partition cut this node off)
    and a supervisor of a newer term serves the job elsewhere: this node's part in the job is over."""

    def __init__(self, node: str, addr: str, term: int, cut_off: float):
        super().__init__(f"this node was cut off from the majority of the job's nodes for {cut_off:.0f} s and its "
                         f"supervisor stood down; the job goes on under {node}'s supervisor (at {addr}, term {term}) "
                         "without it: leaving the job")
        self.node, self.addr, self.term, self.cut_off = node, addr, term, cut_off


class JobRefused(Exception):
    """The rendezvous endpoint serves another job (another --rdzv-id): this agent must not join it."""


class JobEnded(Exception):
    """The job ended while this node was still joining (a spare warming up as the job ended): there is no round
    left to take a place in. ``outcome``: one of ``transport.DOOR_OUTCOMES``."""

    def __init__(self, outcome: str):
        super().__init__(f"the job had ended ({outcome}) before this node joined")
        self.outcome = outcome


def _conf_bool(v: object) -> bool | None:
    if v is None:
        return None
    if str(v).lower() in ("1", "true", "yes", "y", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "n", "off"):
        return False
    raise LaunchError(f"--rdzv-conf is_host must be true or false, got {v!r}")


def _start_supervisor(c: AgentConfig, store: object, signer: object, ledger: Ledger, addr: str, node: str):
    """The default place of the supervisor: a thread of the agent that hosts the job's store (``node``: its plans
    then carry the succession, see :mod:`.succession`)."""
    from resilient.supervisor.standalone import supervise

    from resilient.launcher.args import rdzv_seconds

    loop = supervise(c.supervisor, c.policy, store, signer, ledger, advertise_addr=addr,
                     last_call=rdzv_seconds(c.rdzv_configs, "last_call_timeout"),
                     join_timeout=rdzv_seconds(c.rdzv_configs, "join_timeout"),
                     store_timeout=c.rendezvous_timeout, tick=min(0.05, c.monitor_interval), host_node=node)
    loop.start()
    return loop


class ControlClient:
    """One node's connection to the job's supervisor (hosting both, when this node hosts the store)."""

    def __init__(self, cfg: AgentConfig, node: str, ledger: Ledger) -> None:
        self.cfg, self.node, self.ledger = cfg, node, ledger
        self.store = None
        self.signer = None
        self._secret_configured = False  # --job-secret-file or RESILIENT_JOB_SECRET gave the secret (read at join)
        self.chan = None
        self.sup_loop = None  # the supervisor's loop, when this agent hosts the job's store
        self.clock = None  # ClockSample: the supervisor host's clock minus ours, measured when joining
        self._presence = None  # our end of the supervisor's presence connection: closes when we die
        self._notices = None  # transport.PresenceReader of _presence (its closing, the rounds it announced)
        self._look_often_until = 0.0  # see _LOOK_AFTER_CONNECT_S
        self._last_plan_look = 0.0  # the last read of the store for a plan
        # reads of the store for a plan, by what made this node look: "announced" (a notice of a newer round),
        # "connected" (the first second of a connection), "resync", "hosting" (its own store), "timer"
        # (PLAN_LOOK_S without a notice). The agent's run_end event carries it (plan_looks)
        self.plan_looks: dict[str, int] = {}
        self._endpoint: tuple[str, int] = ("", 0)  # where the job's store is now (a successor's, after a succession)
        self._rdzv: tuple[str, int] = ("", 0)  # --rdzv-endpoint
        self._standby = None  # succession.Standby: the store this agent keeps bound to take over (not the host)
        self._plan: dict | None = None  # the newest plan that carries a succession (written by _new_plan only)
        self._host_node: str | None = None  # the node hosting the supervisor this agent talks to, when known
        self._pointer = None  # a successor's store at --rdzv-endpoint, pointing joiners to its own
        self._last_succession = 0.0
        self._succession_body: dict | None = None  # the newest Keys.succession read
        self._unsent: list[Event] = []  # reports that found no supervisor
        # reports pushed since the store last answered a call: a queue push reads no answer (torch's client), and one
        # written on the connection of a supervisor that had died meanwhile is taken by the kernel and lost; told
        # again with the unsent ones unless a later call's answer shows the store read them (one connection, in order)
        self._unconfirmed: list[Event] = []
        self._sup_gone = False  # the supervisor closed its end: join it again (its new term) when it is back
        self._lost_at: float | None = None  # written by _reached only
        self._last_ok = time.monotonic()  # the last store call that succeeded; written by _reached only
        self._said_waiting = False  # say_waiting's line is out for this loss of the store
        # this node's workers are running (fail static: they train on without a supervisor); written by the agent
        self.training = False
        self._last_hb = 0.0
        self._hb_interval = min(1.0, cfg.supervisor.node_timeout / 4)
        self._last_reconnect = 0.0
        # the newest supervisor term this node followed: a store serving an older one (a supervisor that lost the
        # majority, reachable again after a partition healed) is never joined again, whatever channel reads it
        self._term_floor = 0
        # after this long without the store, the supervisor's host counts as cut off (not just slow), and the
        # succession walk runs even though its presence connection never closed (a partition sends no FIN)
        self._cut_after = cfg.supervisor.node_timeout
        self._last_look = 0.0  # the last look for a successor, once this node's own supervisor stood down
        self._resync = False  # reconnected to a restarted supervisor: its store may lack round + 1
        # torch's TCPStore client honours its timeout against a dead server, not against a hung one (SIGSTOP: the
        # kernel still accepts and buffers, the reply never comes, the call blocks until the server runs again),
        # so every call past the join is bounded here; a client whose call overran is never used again (see
        # _away), and a fresh one per reconnect probe gets its own caller
        self._call_timeout = min(cfg.rendezvous_timeout, max(5.0, cfg.supervisor.node_timeout))
        self._calls = BoundedCaller("store", max_abandoned=4)
        self._probes = BoundedCaller("store-probe", max_abandoned=2)

    # ---------------------------------------------------------------- joining
    def _advertised_addr(self) -> str:
        if self.cfg.local_addr:
            return self.cfg.local_addr
        if self.cfg.single_node:
            return "127.0.0.1"
        return socket.getfqdn()

    def join(self, warm: Callable[[], object] | None = None) -> None:
        """Reach the job's store (hosting it, and the supervisor, when the endpoint is this machine's and the
        port is free, as torch's c10d rendezvous decides its host), then announce this node.

        Membership is the supervisor's: it answers with assignments (members and their group ranks, spares,
        a fresh store per round). torch's dynamic rendezvous closes at ``--nnodes`` MAX and a late agent
        then kills the job (nvidia-resiliency-ext#348); a spare must be able to arrive at any moment.

        ``warm``: run between connecting and joining (the fork server's warm-up); meanwhile the supervisor knows
        this node as arriving, so that a lost node may wait for it rather than end the job.
        """
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

        from resilient.supervisor import transport as T

        c = self.cfg
        t0 = time.monotonic()
        host, port = parse_rendezvous_endpoint(c.rdzv_endpoint, default_port=29400)
        is_host = _conf_bool(c.rdzv_configs.get("is_host"))
        store = None
        if is_host is not False and (is_host or port == 0 or _matches_machine_hostname(host)):
            try:
                store = T.connect_store(host, port, c.rendezvous_timeout, is_master=True)
            except (RuntimeError, ValueError) as e:  # the port is taken: another agent or a supervisor hosts it
                if is_host:
                    raise LaunchError(f"cannot host the rendezvous store on {host}:{port}: {e}") from None
                logger.debug("not hosting %s:%s (%s); joining as a client", host, port, e)
        hosting = store is not None
        if store is None:
            try:
                store = T.connect_store_waiting(host, port, c.rendezvous_timeout)
            except (RuntimeError, OSError) as e:  # torch's DistNetworkError: nothing answered within the timeout
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise StoreLost(f"no job's store answered at {host}:{port} within {c.rendezvous_timeout:g} s "
                                f"(--rendezvous-timeout; {first}): if the job's first host was lost, the job goes on "
                                "at another node, which a new node finds only through an endpoint that follows it "
                                "(a DNS name or a Kubernetes Service)") from None
        # the id names the job (torchrun's meaning): an endpoint serving another id is not ours to join
        if c.rdzv_id == T.ANY_JOB:
            raise JobRefused(f"--rdzv-id {T.ANY_JOB!r} is reserved; choose another id for the job")
        try:
            keys = T.Keys(c.rdzv_id)
        except ValueError as e:
            raise JobRefused(f"--rdzv-id: {e}") from None
        served = T.claim_job(store, c.rdzv_id, hosting=hosting, timeout=c.rendezvous_timeout)
        if served != c.rdzv_id:
            T.knock(store, c.rdzv_id, self.node)
            raise JobRefused(T.refused_line(served, c.rdzv_id, self.node, f"{host}:{port}"))
        secret = T.load_secret(c.job_secret_file)
        # read once: a job's secret never changes, and a file gone or unreadable later (a remounted Secret) must
        # not stop a reconnect or a succession that only needs what is known
        self._secret_configured = secret is not None
        if secret is None:
            # without a configured secret the store itself is the only guard (single host, or trusted network)
            if hosting:
                secret = T.new_secret()
                store.set(keys.secret, secret)
            else:
                store.wait([keys.secret], timedelta(seconds=c.rendezvous_timeout))
                secret = store.get(keys.secret)
        self.signer = T.Signer(secret, c.rdzv_id)
        self._rdzv = (host, port)
        if not hosting:
            from resilient.launcher.succession import Standby, moved_to

            moved = moved_to(store, c.rdzv_id, self.signer)
            if moved is not None:
                # the host --rdzv-endpoint named was lost and another node took the job over: join it there
                logger.warning("the job moved to %s (its first host was lost and another node took over); joining "
                               "there", moved)
                host, port = moved.rsplit(":", 1)[0], int(moved.rsplit(":", 1)[1])
                store = T.connect_store(host, port, c.rendezvous_timeout)
            if not c.single_node:
                self._standby = Standby(self._advertised_addr(), c.rendezvous_timeout)
        self.store = store
        self.chan = T.AgentChannel(store, self.signer, self.node)
        if hosting:
            self.sup_loop = _start_supervisor(c, store, self.signer, self.ledger, self._advertised_addr(), self.node)
        try:
            self._term_floor = self.chan.sync_term(c.rendezvous_timeout)  # what this node sends is bound to it
            # each message is followed by a look at the door: open, the supervisor reads the message before the
            # job can end and waits for this node; closed, the job ended and its store may already be closing
            if warm is not None:
                self.chan.send(T.MessageKind.ARRIVING, nproc=c.nproc_per_node)
                self._warm_watching_the_door(warm)
            self.chan.send(T.MessageKind.JOIN, nproc=c.nproc_per_node, pid=os.getpid(), host=socket.gethostname(),
                           **self._standby_body())
            self._check_door()
            store.wait([keys.presence], timedelta(seconds=c.rendezvous_timeout))
            conn, self.clock = T.presence_connect_clocked(store.get(keys.presence).decode(), self.signer, self.node,
                                                          timeout=min(30.0, c.rendezvous_timeout), term=self.chan.term)
            self._set_presence(conn, self.signer, self.chan.term)
            self.chan.attach(self._presence)  # what follows goes over it, not one store round trip each
        except (RuntimeError, OSError) as e:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
            # it answered a moment ago, and the door was open: the node hosting the store was lost
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise StoreLost(f"the job's store at {host}:{port} went away while this node was joining ({first}): "
                            "the node hosting it was lost") from None
        self._last_hb = time.monotonic()
        # past the join, a store call must fail within a node timeout, not a rendezvous timeout: a dead or
        # hung supervisor must not freeze this loop (the workers go on either way)
        store.set_timeout(timedelta(seconds=min(c.rendezvous_timeout, max(5.0, c.supervisor.node_timeout))))
        self._endpoint = (host, port)
        logger.debug("joined the job at %s:%s in %.3fs (hosting: %s)", host, port, time.monotonic() - t0, hosting)

    def _standby_body(self) -> dict[str, object]:
        """What a join says beside its workers: the address of its standby store, and its ``--node-rank`` under
        a static rendezvous (the supervisor orders the job's first members by it, as torchrun does)."""
        body: dict[str, object] = {} if self._standby is None else {"standby": self._standby.addr}
        rank = self.cfg.rdzv_configs.get("rank") if self.cfg.rdzv_backend == "static" else None
        if rank is not None:
            body["node_rank"] = int(rank)  # type: ignore[call-overload]
        return body

    def _warm_watching_the_door(self, warm: Callable[[], object]) -> None:
        """``warm()`` (seconds: importing torch in the fork server) while watching the door: a job that ends while
        this spare warms up waits (``linger``) for its acknowledgement, and this node must not keep it waiting."""
        import threading

        failed: list[BaseException] = []

        def run() -> None:
            try:
                warm()
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                failed.append(e)

        t = threading.Thread(target=run, name="resilient-warm", daemon=True)
        t.start()
        while t.is_alive():
            self._check_door()
            t.join(0.25)
        if failed:
            raise failed[0]
        self._check_door()

    def _check_door(self) -> None:
        """Raise JobEnded once the job's supervisor closed its door (acknowledging its final plan, best effort:
        its store may be going away)."""
        from resilient.supervisor.transport import MessageKind

        outcome = self.chan.door()
        if outcome is None:
            return
        try:
            final = self.chan.latest_round()
            if final >= 0:
                self.chan.send(MessageKind.ACK, round=final)
        except Exception as e:  # noqa: BLE001
            logger.debug("could not acknowledge the final plan: %s", e)
        raise JobEnded(outcome)

    # ---------------------------------------------------------------- reachability
    def _reached(self, e: Exception | None) -> None:
        """The one writer of ``_lost_at``: None once a store call succeeded; after a failure, the time of the last
        call that succeeded (a failing call took up to its timeout: the store was already away then). After a failure,
        the reports no answer confirmed are told again with the unsent ones."""
        if e is None:
            self._lost_at = None
            self._last_ok = time.monotonic()
            self._said_waiting = False
            return
        self._unsent[:0], self._unconfirmed = self._unconfirmed, []
        if self._lost_at is None:
            self._lost_at = self._last_ok
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            if self.training:
                logger.error("the job's store is unreachable (%s); workers keep training", first)
            else:
                logger.error("the job's store is unreachable (%s)", first)
                self.say_waiting()

    def say_waiting(self) -> None:
        """The line an agent that needs a decision prints once per loss of the store (the agent calls it when it
        starts waiting for a plan: its workers may have died after the loss was first noticed)."""
        if self._lost_at is None or self._said_waiting:
            return
        self._said_waiting = True
        logger.error("no supervisor reachable and this node's workers are not running: waiting up to %g s "
                     "(--supervisor-timeout) for a supervisor's decision", self.cfg.supervisor_bound)

    @property
    def reachable(self) -> bool:
        return self._lost_at is None

    def lost_for(self) -> float:
        """Seconds the store has been unreachable (0 while it answers); for the node hosting the supervisor, seconds
        since that supervisor stood down (no decision can come from it any more)."""
        if self.sup_loop is not None:
            at = self.sup_loop.stood_down_at
            return 0.0 if at is None else time.monotonic() - at
        return 0.0 if self._lost_at is None else time.monotonic() - self._lost_at

    @property
    def cut_off(self) -> bool:
        """This node hosts a supervisor that lost the majority of the job's nodes and stood down: its workers must
        stop (their collectives need the others, which go on under a successor) and it decides nothing more."""
        return self.sup_loop is not None and self.sup_loop.stood_down_at is not None

    def _set_presence(self, conn: object, signer: object, term: int | None) -> None:
        """``conn`` is this node's presence connection now (the one it had, when the same supervisor came back)."""
        from resilient.supervisor.transport import PresenceReader

        if self._notices is None or self._notices.conn is not conn or self._notices.term != term:
            self._notices = PresenceReader(conn, signer, term)  # type: ignore[arg-type]
            self._look_often_until = time.monotonic() + _LOOK_AFTER_CONNECT_S
        self._presence = conn

    # ---------------------------------------------------------------- messages
    def kick(self) -> None:
        """Run the in-process supervisor's pass now: a decision then costs no polling period."""
        if self.sup_loop is not None:
            self.sup_loop.step(time.monotonic())

    def report(self, ev: Event) -> None:
        """Tell the supervisor (never raises: a lost supervisor must not stop training)."""
        from resilient.supervisor.transport import MessageKind

        if self.chan is None:
            return  # not joined yet (or torn down): the node's ledger has it
        if self._away():
            self._unsent.append(ev)
            return
        chan = self.chan
        try:
            self._bounded(lambda: chan.send(MessageKind.EVENT, event=ev.to_json()), "a report")
        except Exception as e:  # noqa: BLE001 - DistStoreError and friends, TimeoutError
            self._reached(e)
            self._unsent.append(ev)  # told again once the supervisor is back: it must not be lost
            return
        if self.sup_loop is None:  # (an in-process supervisor's store cannot die without this process)
            self._unconfirmed.append(ev)
        self.kick()

    def _flush_unsent(self) -> None:
        """A failure reported while the supervisor was away still needs its decision: tell it again."""
        unsent, self._unsent = self._unsent, []
        if unsent:
            logger.warning("telling the supervisor %d report(s) it may not have had: %s", len(unsent), _tally(unsent))
        for ev in unsent:
            self.report(ev)

    def _away(self) -> bool:
        """The store is known to be away and hosted elsewhere: a call would only wait out its timeout (a hung
        supervisor's kernel still accepts connections); the reconnect probe, bounded to seconds, is the one caller
        until it answers again."""
        return self._lost_at is not None and self.sup_loop is None

    def _bounded(self, fn: Callable[[], object], what: str) -> object:
        """``fn()`` (calls on the job's store), given up after the store's timeout: raises TimeoutError then."""
        return self._calls.call(fn, self._call_timeout, what)

    def _send(self, kind: str, **body: object) -> None:
        if self._away():
            return  # a rejoin tells the supervisor this node's round and whether its workers are done
        chan = self.chan
        try:
            self._bounded(lambda: chan.send(kind, **body), kind)
        except Exception as e:  # noqa: BLE001
            self._reached(e)
        self.kick()

    def ack(self, round_: int) -> None:
        from resilient.supervisor.transport import MessageKind

        self._send(MessageKind.ACK, round=round_)

    def done(self, round_: int) -> None:
        from resilient.supervisor.transport import MessageKind

        self._send(MessageKind.DONE, round=round_)

    def leave(self, reason: str) -> None:
        from resilient.supervisor.transport import MessageKind

        if self.sup_loop is not None:
            # the supervisor goes down with this agent: nothing is left for it to decide
            self.sup_loop.core.finish(reason)
            return
        if self._away():
            return  # its presence connection closes as this agent exits: the supervisor hears of it that way
        chan = self.chan
        try:
            self._bounded(lambda: chan.send(MessageKind.LEAVE, reason=reason), "a goodbye")
        except Exception as e:  # noqa: BLE001
            logger.debug("could not say goodbye: %s", e)

    def end_preempted(self, reason: str, timeout: float) -> None:
        """This node hosts the supervisor and was preempted: the others stop after the agreed step and exit 75."""
        if self.sup_loop is not None:
            self.sup_loop.end_preempted(self.node, reason, timeout)

    def wait_settled(self, stop_asked: object, interval: float) -> None:
        """The agent hosting the store stays until every agent read the final plan (torchrun's exit barrier)."""
        if self.sup_loop is not None:
            deadline = time.monotonic() + self.sup_loop.cfg.linger
            while not self.sup_loop.settled.is_set() and time.monotonic() < deadline and not stop_asked():  # type: ignore[operator]
                self.sup_loop.step(time.monotonic())
                self.sup_loop.settled.wait(interval)

    # ---------------------------------------------------------------- one pass
    def poll(self, node_round: NodeRound, done_round: int | None) -> dict | None:
        """Heartbeat, reconnect if the supervisor went away, and the newest plan if one newer than the current
        round exists. Only a plan that carries the job's signature counts: a forged key must not restart anything."""
        self._heartbeat(node_round)
        self._maybe_reconnect(node_round, done_round)
        self._refresh_succession()
        if self.cut_off:
            self._look_for_successor()
            return None  # its own plans are no decisions any more
        return self._new_plan(node_round.round)

    def _look_for_successor(self) -> None:
        """This node's supervisor stood down: once a candidate of its succession serves the job under a newer term
        (the partition healed), raise Superseded; until then look again once a second (the agent gives up after
        --supervisor-timeout)."""
        from resilient.launcher.succession import find_successor

        now = time.monotonic()
        if now - self._last_look < 1.0:
            return
        self._last_look = now
        found = find_successor(self.sup_loop.candidates(), self.sup_loop.term, self.signer, self.cfg.rdzv_id,
                               self._probes)
        if found is not None:
            raise Superseded(*found, self.lost_for())

    def _refresh_succession(self) -> None:
        """The succession changes between plans (a spare joins): read it every few seconds, so that this node knows
        where to go, and what to adopt, when the supervisor's host is lost (bounded store calls)."""
        if self._standby is None or self._plan is None or self.sup_loop is not None or self._away():
            return
        now = time.monotonic()
        if now - self._last_succession < _SUCCESSION_EVERY:
            return
        self._last_succession = now
        chan, key = self.chan, self.chan.keys.succession

        def read() -> dict | None:
            return chan.signer.open(chan.store.get(key)) if chan.store.check([key]) else None

        try:
            body = self._bounded(read, "reading the succession")
        except Exception as e:  # noqa: BLE001 - a forged key or a store away: the plan's own succession stands
            logger.debug("cannot read the succession: %s", e)
            return
        plan = self._plan
        if (body is None or body.get("round") != plan.get("round") or body.get("term") != plan.get("term")
                or body == self._succession_body):
            return
        self._succession_body = body
        self._plan = {**plan, "succession": body}
        logger.info("succession: %s, then %s", body.get("host"), ", ".join(n for n, _ in body.get("order", ())))

    def _heartbeat(self, node_round: NodeRound) -> None:
        from resilient.supervisor.transport import MessageKind

        if (self._notices is not None and self.sup_loop is None and not self._sup_gone
                and self._notices.closed()):
            # the supervisor stopped or died: a new one takes nothing bound to the old one's term, so this node
            # joins it again, even if the store itself answers (torch's client may reconnect by itself)
            self._sup_gone = True
            self._reached(ConnectionError("the supervisor closed its connection"))
        if self._unsent and self._lost_at is None:
            self._flush_unsent()  # the store answers again (torch's client may reconnect by itself)
        if self._away():
            return
        now = time.monotonic()
        if now - self._last_hb < self._hb_interval:
            return
        self._last_hb = now
        chan = self.chan
        try:
            self._bounded(lambda: chan.send(MessageKind.HB, round=node_round.round, active=node_round.active),
                          "a heartbeat")
        except Exception as e:  # noqa: BLE001
            self._reached(e)

    def _maybe_reconnect(self, node_round: NodeRound, done_round: int | None) -> None:
        """Fail static: the supervisor (and the store it hosts) went away. Try again every second; once back,
        join again with our current round — the supervisor adopted it from its ledger — and carry on."""
        from resilient.launcher.succession import moved_to
        from resilient.supervisor import transport as T

        if (self._lost_at is None and not self._sup_gone) or self.sup_loop is not None:
            return
        now = time.monotonic()
        if now - self._last_reconnect < 1.0:
            return
        self._last_reconnect = now
        c = self.cfg
        keys = T.Keys(c.rdzv_id)
        where = "{}:{}".format(*self._endpoint)
        cut = self._lost_at is not None and self.lost_for() >= self._cut_after
        if (self._sup_gone or cut) and self._standby is not None and self._succession_walk(where, node_round,
                                                                                          done_round):
            return
        where = "{}:{}".format(*self._endpoint)

        def probe() -> tuple[object, object, str, tuple[str, int]]:
            endpoint = self._endpoint
            store = T.connect_store(endpoint[0], endpoint[1], 2.0)
            served = T.claim_job(store, c.rdzv_id, hosting=False, timeout=2.0)
            if served != c.rdzv_id:  # another job's supervisor took the endpoint: not ours, keep waiting for ours
                T.knock(store, c.rdzv_id, self.node)
                raise JobRefused(T.refused_line(served, c.rdzv_id, self.node, where))
            secret = self.signer.secret if self._secret_configured else None
            if secret is None:
                store.wait([keys.secret], timedelta(seconds=2))
                secret = store.get(keys.secret)
            moved = moved_to(store, c.rdzv_id, T.Signer(secret, c.rdzv_id)) if self._standby is not None else None
            if moved is not None:  # a successor's pointer at --rdzv-endpoint: the job is served there
                endpoint = (moved.rsplit(":", 1)[0], int(moved.rsplit(":", 1)[1]))
                store = T.connect_store(endpoint[0], endpoint[1], 2.0)
            store.wait([keys.presence, keys.term], timedelta(seconds=2))
            presence = store.get(keys.presence).decode()
            store.set_timeout(timedelta(seconds=self._call_timeout))
            chan = T.AgentChannel(store, T.Signer(secret, c.rdzv_id), self.node)
            if chan.sync_term() < self._term_floor:
                # a supervisor that lost the majority, reachable again after a partition healed: it must not get
                # this node back (it would count toward a majority it no longer has)
                raise JobRefused(f"the supervisor at {where} is of term {chan.term}, older than term "
                                 f"{self._term_floor} this node follows: not joining it")
            return store, chan, presence, endpoint

        try:
            # a hung server holds even a new client's handshake: the probe is bounded as a whole
            # (a live one answers in milliseconds; the agent's loop waits on this, so a few seconds at most)
            store, chan, presence, endpoint = self._probes.call(probe, 3.0, "reconnecting to the supervisor")
            calls = BoundedCaller("store", max_abandoned=4)  # calls stuck on the old client stay with the old one
            # the rejoin is sent from here, never by the probe: a probe abandoned on its bound runs on, and a join
            # it sealed later would overtake this thread's re-sent failure in the store queue, which the supervisor
            # then refused as a replay (older sequence number), and the failure was never decided
            calls.call(lambda: chan.send(T.MessageKind.JOIN, nproc=c.nproc_per_node, pid=os.getpid(),
                                         host=socket.gethostname(), rejoin=True, round=node_round.round,
                                         active=node_round.active, done=done_round == node_round.round,
                                         **self._standby_body()),
                       self._call_timeout, "rejoining the supervisor")
            signer = chan.signer  # type: ignore[attr-defined]
            same = (not self._sup_gone and self._presence is not None and self.chan is not None
                    and chan.term == self.chan.term)  # type: ignore[attr-defined]
            # the same supervisor, back from a stall: its end of our presence connection never closed, and closing
            # ours would tell it this node died
            conn = self._presence if same else T.presence_connect(presence, signer, self.node, timeout=2.0,
                                                                  term=chan.term)  # type: ignore[attr-defined]
        except JobRefused as e:
            _RECONNECT_REFUSED.warning("%s", e)
            return
        except Exception as e:  # noqa: BLE001 - not back yet
            logger.debug("supervisor not reachable yet: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        self._calls = calls
        if self._presence is not None and self._presence is not conn:
            self._presence.close()
        if not same or self.chan.presence is not None:  # type: ignore[union-attr]
            chan.attach(conn)  # type: ignore[attr-defined]  # (not one a cut line left unusable for lines)
        self.store, self.signer, self.chan = store, signer, chan
        self._set_presence(conn, signer, chan.term)  # type: ignore[attr-defined]
        self._term_floor = max(self._term_floor, chan.term)  # type: ignore[attr-defined]
        self._endpoint = endpoint
        lost_for = self.lost_for()
        self._reached(None)
        self._sup_gone = False
        self._flush_unsent()
        self._resync = True
        logger.warning("reconnected to the supervisor after %.1fs; round %d goes on", lost_for, node_round.round)

    def _succession_walk(self, where: str, node_round: NodeRound, done_round: int | None) -> bool:
        """The supervisor's connection closed, or its store stayed away past --node-timeout (a partition closes
        nothing): if its host no longer accepts connections and the newest plan names a succession, find the next
        host (see :mod:`.succession`); True when this agent took the job over."""
        from resilient.launcher.succession import order_of, walk

        order = order_of(self._plan)
        found = walk(order, self.node, self._host_node or str((self._plan or {}).get("succession", {}).get("host")),
                     where) if order else None
        if found is None:
            return False
        node, addr, lost, dead = found
        if node == self.node:
            self._take_over(node_round, done_round, lost, dead)
            return True
        if addr != where:
            logger.warning("the supervisor's host %s was lost: %s takes over at %s", where, node, addr)
            self._host_node = node
            h, p = addr.rsplit(":", 1)
            self._endpoint = (h, int(p))
        return False

    def _take_over(self, node_round: NodeRound, done_round: int | None, lost: list[str], dead: list[str]) -> None:
        """This agent is the next host: its standby store and a new supervisor serve the job from now on."""
        from resilient.launcher.succession import serve_pointer, take_over
        from resilient.supervisor import transport as T

        c = self.cfg
        configured = self._secret_configured
        t0 = time.monotonic()
        loop = take_over(c, self.node, self.ledger, self._standby, self.signer, self._plan, lost, configured, dead)
        store = self._standby.store
        store.set_timeout(timedelta(seconds=self._call_timeout))
        chan = T.AgentChannel(store, self.signer, self.node)
        chan.sync_term()
        conn = T.presence_connect(store.get(chan.keys.presence).decode(), self.signer, self.node, timeout=2.0,
                                  term=chan.term)
        chan.send(T.MessageKind.JOIN, nproc=c.nproc_per_node, pid=os.getpid(), host=socket.gethostname(),
                  rejoin=True, round=node_round.round, active=node_round.active, done=done_round == node_round.round)
        chan.attach(conn)
        if self._presence is not None:
            self._presence.close()
        self._calls = BoundedCaller("store", max_abandoned=4)
        self.store, self.chan, self.sup_loop = store, chan, loop
        self._set_presence(conn, self.signer, chan.term)
        self._term_floor = max(self._term_floor, loop.term)
        h, p = self._standby.addr.rsplit(":", 1)
        self._endpoint, self._host_node = (h, int(p)), self.node
        lost_for = self.lost_for()
        self._reached(None)
        self._sup_gone = False
        self._flush_unsent()
        self._resync = True
        self._pointer = serve_pointer(self._rdzv, c.rdzv_id, self._standby.addr, self.signer, self._call_timeout,
                                      configured)
        pointer = "" if self._pointer is None else ", and points --rdzv-endpoint {}:{} here".format(*self._rdzv)
        logger.warning("took the job over from %s after %.1fs (%.2fs to take over): this node hosts its store and "
                       "supervisor now%s", ", ".join(lost), lost_for, time.monotonic() - t0, pointer)

    def _new_plan(self, round_: int) -> dict | None:
        """The newest plan if one newer than ``round_`` exists (bounded store calls)."""
        if self._away():
            return None
        chan, resync = self.chan, self._resync
        now = time.monotonic()
        # a node that does not host the supervisor reads the store when a notice announced a newer round (see
        # PLAN_LOOK_S); the host's store is its own
        notices = self._notices
        since = now - self._last_plan_look
        why = ("hosting" if self.sup_loop is not None or notices is None else "resync" if resync
               else "announced" if notices.newest > round_
               else "connected" if now < self._look_often_until and since >= self.cfg.monitor_interval
               else "timer" if since >= PLAN_LOOK_S else None)
        if why is None:
            return None
        self._last_plan_look = now
        self.plan_looks[why] = self.plan_looks.get(why, 0) + 1
        pushed = len(self._unconfirmed)  # the reports pushed before this call: its answer comes after theirs

        def read() -> dict | None:
            # a restarted supervisor's store holds its newest round only: an agent more than one round behind (a
            # spare still warming up while the job restarted) finds no round + 1 there and must take the latest
            if not chan.has_round(round_ + 1) and not (resync and chan.latest_round() > round_):
                return None
            latest = chan.latest_round()
            # the newest round, or the next one if ``latest`` lags: either way its signature is checked
            return chan.plan(latest if latest > round_ else round_ + 1)

        try:
            plan = self._bounded(read, "reading the plan")
        except Exception as e:  # noqa: BLE001
            self._reached(e)
            return None
        self._reached(None)
        del self._unconfirmed[:pushed]
        if plan is not None and int(plan.get("round", -1)) > round_:
            self._resync = False
            if isinstance(plan.get("succession"), dict):
                self._plan = plan
                self._host_node = str(plan["succession"].get("host"))
            return plan
        return None

    # ---------------------------------------------------------------- learned modules (automatic preload)
    def publish_learned(self, names: tuple[str, ...]) -> None:
        if self.store is None or self._away():
            return
        store, key, body = self.store, self.chan.keys.preload, self.signer.seal({"modules": list(names), "node": self.node})
        try:
            self._bounded(lambda: store.set(key, body), "publishing the learned modules")
        except Exception as e:  # noqa: BLE001 - a speed-up for spares only
            logger.debug("cannot publish learned modules: %s", e)

    def fetch_learned(self) -> list[str]:
        """What the active nodes' workers import, for a spare (nothing when the store is away or the key forged)."""
        if self.store is None or self._lost_at is not None:
            return []
        store, key, signer = self.store, self.chan.keys.preload, self.signer

        def read() -> dict | None:
            return signer.open(store.get(key)) if store.check([key]) else None

        try:
            body = self._bounded(read, "reading the learned modules")
            if body is None:
                return []
        except Exception as e:  # noqa: BLE001 - forged, or the store is away: nothing learned
            logger.debug("cannot read learned modules: %s", e)
            return []
        return [str(m) for m in body.get("modules", ()) if isinstance(m, str)]

    def close(self) -> None:
        if self._presence is not None:
            self._presence.close()
        if self.sup_loop is not None:
            self.sup_loop.close()
        self.store = self._standby = self._pointer = None


def _tally(events: list[Event]) -> str:
    """``1 worker_exit (rank 1), 9 ckpt_tier_done``: the kinds of ``events`` in their order, the ranks of the few."""
    ranks: dict[str, list[int]] = {}
    for ev in events:
        ranks.setdefault(ev.kind.value, []).append(-1 if ev.rank is None else ev.rank)
    parts = []
    for kind, rs in ranks.items():
        named = sorted({r for r in rs if r >= 0})
        rank_s = f" (rank {', '.join(map(str, named))})" if named and len(rs) <= 3 else ""
        parts.append(f"{len(rs)} {kind}{rank_s}")
    return ", ".join(parts)
