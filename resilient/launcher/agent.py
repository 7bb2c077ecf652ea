"""The node agent: torchrun's job (rendezvous, spawn, environment, logs, signals, exit codes) with
restarts that work and are fast.

Why torchrun's gloo restarts fail: its rendezvous keeps one TCPStore across attempts and workers add no
per-attempt prefix, so a restarted rank can read the dead rank's address. Here every attempt gets a
fresh store on a fresh port, hosted by node 0's agent and announced to the other agents through the
rendezvous store; nothing from an earlier attempt can be read. Restarting within the same set of nodes
needs no new rendezvous round: agents agree on the attempt number through the rendezvous store.

The loop is event-driven: worker exits arrive on a file descriptor (fork-server messages or pidfds),
signals through a wakeup pipe, detector events from the node monitor; nothing waits a fixed time.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from resilient import env as renv
from resilient.events import Event, EventKind, Ledger
from resilient.launcher.api import (
    AgentConfig, LaunchError, NodeRole, NodeRound, Outcome, WorkerExit, WorkerLaunchMethod,
)
from resilient.launcher.workers import ForkServer, ForkServerError, SpawnStarter, WorkerProc, signal_workers
from resilient.logs import RateLimitedLog

logger = logging.getLogger(__name__)
_RECONNECT_REFUSED = RateLimitedLog(logger, 30.0)  # an endpoint taken by another job, tried every second

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _keep_local_default() -> object:
    import dataclasses

    from resilient.checkpoint.api import CheckpointConfig

    return next((f.default for f in dataclasses.fields(CheckpointConfig) if f.name == "keep_local"), "?")


class _StoreLost(Exception):
    """The job's store (and with it the supervisor) stayed unreachable while this node had nothing to run."""


class _JobRefused(Exception):
    """The rendezvous endpoint serves another job (another --rdzv-id): this agent must not join it."""


def _conf_bool(v: object) -> bool | None:
    if v is None:
        return None
    if str(v).lower() in ("1", "true", "yes", "y", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "n", "off"):
        return False
    raise LaunchError(f"--rdzv-conf is_host must be true or false, got {v!r}")


def _describe(action: dict) -> str:
    kind = action.get("action", "?")
    # "hot_swap node=a spare=s: reason", never a Python dict repr: people read this line
    rest = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in action.items()
                    if k not in ("action", "reason") and v not in (None, "", []))
    reason = action.get("reason")
    return f"{kind}{' ' + rest if rest else ''}{': ' + reason if reason else ''}"


def _start_supervisor(c: AgentConfig, store: object, signer: object, ledger: Ledger, addr: str):
    """The default place of the supervisor: a thread of the agent that hosts the job's store."""
    from resilient.supervisor.core import SupervisorConfig, SupervisorCore
    from resilient.supervisor.loop import LoopConfig, SupervisorLoop
    from resilient.supervisor.policy import load_policy

    core_cfg = SupervisorConfig(min_nodes=c.min_nodes, max_nodes=c.max_nodes, nproc_per_node=c.nproc_per_node,
                                max_restarts=c.max_restarts, node_timeout=c.node_timeout,
                                policy_timeout=c.policy_timeout)
    policy = load_policy(c.policy) if c.policy else None
    last_call = float(c.rdzv_configs.get("last_call_timeout", 30.0))  # type: ignore[arg-type]
    loop = SupervisorLoop(LoopConfig(core=core_cfg, advertise_addr=addr, tick=min(0.05, c.monitor_interval),
                                     last_call=last_call, store_timeout=c.rendezvous_timeout),
                          store, signer, ledger, SupervisorCore(core_cfg, policy))
    loop.start()
    return loop


class _Streams:
    """Tee'd worker output: read from pipes, written to the log file and (filtered) to the console."""

    # a partial line longer than this (a progress bar that never ends its line) goes out as it is
    MAX_PARTIAL = 64 * 1024

    def __init__(self) -> None:
        # rfd → [log fd, console, prefix, show, partial line not yet shown]
        self.pipes: dict[int, list] = {}

    def add(self, rfd: int, log_path: Path, console: object, prefix: str, show: bool) -> None:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pipes[rfd] = [log_fd, console, prefix, show, b""]

    def pump(self, rfd: int) -> bool:
        """Copy what is readable; False at end of stream."""
        st = self.pipes[rfd]
        log_fd, console, prefix, show, partial = st
        try:
            data = os.read(rfd, 65536)
        except BlockingIOError:
            return True
        if not data:
            if show and partial:
                self._show(console, prefix, partial + b"\n")
            os.close(rfd)
            if log_fd >= 0:
                os.close(log_fd)
            del self.pipes[rfd]
            return False
        if log_fd >= 0:
            try:
                os.write(log_fd, data)
            except OSError as e:  # a full log disk must not stop the agent: the console still gets the output
                where = "goes to the terminal only" if show else "is lost (it is not tee'd)"
                print(f"resilient-run: cannot write worker output to its log file ({e.strerror or e}); "
                      f"{prefix.strip() or 'this worker'}'s output from now on {where}", file=sys.stderr)
                os.close(log_fd)
                st[0] = log_fd = -1
        if show:
            # Unbuffered workers write a line in pieces, and two ranks write at once: only whole lines go to
            # the console, so a line is never glued to another rank's (a carriage return ends a line too:
            # progress bars). What is left waits for the rest of its line.
            buf = partial + data
            cut = max(buf.rfind(b"\n"), buf.rfind(b"\r")) + 1
            if cut == 0 and len(buf) > self.MAX_PARTIAL:
                cut = len(buf)
            st[4] = buf[cut:]
            if cut:
                self._show(console, prefix, buf[:cut])
        return True

    @staticmethod
    def _show(console: object, prefix: str, data: bytes) -> None:
        lines = data.decode(errors="replace").splitlines(keepends=True)
        # one write per batch of whole lines, each with its rank's prefix
        console.write("".join(f"{prefix}{ln}" if ln.endswith(("\n", "\r")) else f"{prefix}{ln}\n"
                              for ln in lines))  # type: ignore[attr-defined]
        console.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        for rfd, (log_fd, *_rest) in list(self.pipes.items()):
            for fd in (rfd, log_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pipes.clear()


def _std_map(spec: str, n: int) -> dict[int, int]:
    from torch.distributed.elastic.multiprocessing.api import Std, to_map

    return {k: int(v.value) for k, v in to_map(Std.from_str(spec), n).items()}


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.node = socket.gethostname() if cfg.single_node else f"{socket.gethostname()}:{os.getpid()}"
        self.run_dir = Path(cfg.run_dir)
        self.ledger = Ledger(self.run_dir, node=self.node)
        self.starter: ForkServer | SpawnStarter | None = None
        self.monitor = None
        self.metrics = None
        self.workers: list[WorkerProc] = []
        self.streams = _Streams()
        self.first_failure: WorkerExit | None = None
        self.failures: list[WorkerExit] = []
        self._hang_note = ""
        self._ckpt_default_said = False
        # automatic preload: modules the workers loaded, and the fork server being warmed with them
        self._learned: list[str] = []
        self._learned_set: set[str] = set()
        self._learned_at = 0.0
        self._preloaded: tuple[str, ...] = ()
        self._next_starter: ForkServer | None = None
        self._next_preload: tuple[str, ...] = ()
        self._next_set: set[str] = set()
        self._next_asked = 0.0
        self._preload_refreshes = 0
        self._next_ready_said = False
        self._preload_polled = 0.0
        self._preload_denied = self._load_denied()
        self._signal: int | None = None
        self._sig_r, self._sig_w = os.pipe()
        for fd in (self._sig_r, self._sig_w):
            os.set_blocking(fd, False)
        self.restart_count = 0
        self._interruptible = False
        # the supervised job: this node's part of the current assignment
        self.store = None
        self.chan = None
        self.sup_loop = None  # the supervisor's loop, when this agent hosts the job's store
        self.node_round = NodeRound(world_size=cfg.nproc_per_node)
        self._ran = False
        self._t_join = time.monotonic()
        self._last_hb = 0.0
        self._hb_interval = min(1.0, cfg.node_timeout / 4)
        self._store_lost_at: float | None = None
        self._unsent: list[Event] = []  # reports that found no supervisor
        self._presence = None  # our end of the supervisor's presence connection: closes when we die
        self._sup_gone = False  # the supervisor closed its end: join it again (its new term) when it is back
        self._clock = None  # ClockSample: the supervisor host's clock minus ours, measured when joining
        self._last_reconnect = 0.0
        self._resync = False  # reconnected to a restarted supervisor: its store may lack round + 1
        self._next_plan: dict | None = None  # a verified plan seen while workers ran
        self.injector = None
        if cfg.inject:
            from resilient.launcher.inject import Injector

            self.injector = Injector(cfg.inject, self.ledger)
        self._done_round: int | None = None  # the round whose workers all finished here
        self._endpoint: tuple[str, int] = ("", 0)

    # the current round's fields, read-only: only _follow replaces the record
    round = property(lambda self: self.node_round.round)
    active = property(lambda self: self.node_round.active)
    group_rank = property(lambda self: self.node_round.group_rank)
    group_world_size = property(lambda self: self.node_round.group_world_size)
    base_rank = property(lambda self: self.node_round.base_rank)
    world_size = property(lambda self: self.node_round.world_size)

    # ---------------------------------------------------------------- set-up
    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._sig_w)

        def handler(signum: int, _frame: object) -> None:
            if self._signal is None:
                self._signal = signum
            if self._interruptible:
                # a blocking rendezvous has no wake-up fd: leave it the way torchrun does
                raise _Stopped(signum)

        for s in HANDLED_SIGNALS:
            signal.signal(s, handler)

    def _start_workers_backend(self) -> None:
        if self.cfg.command.kind == "exec" or self.cfg.launch_method == WorkerLaunchMethod.SPAWN:
            self.starter = SpawnStarter()
            return
        try:
            self.starter = self._new_fork_server(())
        except OSError as e:
            logger.warning("fork server unavailable (%s); starting workers as fresh interpreters", e)
            self.starter = SpawnStarter()

    def _new_fork_server(self, learned: tuple[str, ...]) -> ForkServer:
        d = self.run_dir / "preload"
        if learned:
            d.mkdir(parents=True, exist_ok=True)
        return ForkServer(self._preload_modules() + tuple(f"+{m}" for m in learned), tag=f"run={self.run_dir.resolve()}",
                          preload_file=str(d / f"modules-{os.getpid()}.txt"))

    # ---------------------------------------------------------------- automatic preload
    PRELOAD_QUIET = 0.5  # seconds without a new module before the list is taken as settled
    PRELOAD_REFRESHES = 4  # fork servers warmed per agent for learned modules: imports cost CPU

    def _learn(self) -> None:
        """Collect the modules workers reported loading (through the fork server)."""
        if not isinstance(self.starter, ForkServer):
            return
        new = [m for m in self.starter.take_learned() if m not in self._learned_set]
        if new:
            self._learned += new
            self._learned_set.update(new)
            self._learned_at = time.monotonic()

    def _refresh_preload(self) -> None:
        """Automatic preload: after the first attempt, a fork server that has already imported what the workers
        imported replaces the current one at the next restart (a spare's at once), so heavy scripts restart as
        fast as with a hand-written --preload. It is a copy of the running one (forked: torch and the rest come for
        free) that then imports only the learned modules, and more as the workers report them; it takes over only
        once it has imported all it was given: training and restarts never wait for it."""
        if self.cfg.launch_method != WorkerLaunchMethod.FORK_SERVER or self.cfg.command.kind == "exec":
            return
        self._learn()
        now = time.monotonic()
        if not self.active and now - self._preload_polled > 1.0:
            self._preload_polled = now
            self._fetch_learned()
        want = tuple(m for m in self._learned if m not in self._preload_denied)
        settled = now - self._learned_at >= self.PRELOAD_QUIET
        nxt = self._next_starter
        if nxt is not None:
            try:
                extra = [m for m in want if m not in self._next_set]
                if extra and settled:  # it is idle: it imports them too, before it takes over
                    nxt.preload_more(extra)
                    self._next_preload += tuple(extra)
                    self._next_set.update(extra)
                    self._next_ready_said = False
                    if self.active:
                        self._publish_learned(self._next_preload)
                warm = nxt.poll_ready()
            except ForkServerError as e:
                self._next_starter = None
                nxt.close()
                if e.bad_module:
                    self._preload_denied.add(e.bad_module)
                    self._save_denied()
                    logger.warning("automatic preload: %s; %s is never preloaded again", e, e.bad_module)
                else:
                    logger.warning("automatic preload failed (%s); restarts import as before", e)
                    self._preload_refreshes = self.PRELOAD_REFRESHES
                return
            if warm and not self._next_ready_said:
                self._next_ready_said = True
                logger.info("automatic preload: fork server ready with %d learned modules (warm %.2fs after it was "
                            "asked); it takes over at the next restart", len(self._next_preload),
                            now - self._next_asked)
            if warm and not any(w.pid is not None and w.exit_code is None for w in self.workers):
                self._swap_starter()
            return
        have = set(self._preloaded)
        if (not want or all(m in have for m in want) or not settled
                or self._preload_refreshes >= self.PRELOAD_REFRESHES):
            return
        self._preload_refreshes += 1
        cur = self.starter
        try:
            if isinstance(cur, ForkServer) and cur.alive() and cur.poll_ready():
                nxt = cur.fork()  # a copy: only the modules it lacks cost time
                nxt.preload_more([m for m in want if m not in have])
                how = "a copy of the running one"
            else:
                nxt = self._new_fork_server(want)
                how = "a new one"
        except (OSError, ForkServerError) as e:
            logger.warning("automatic preload: cannot start a fork server (%s)", e)
            self._preload_refreshes = self.PRELOAD_REFRESHES
            return
        self._next_starter = nxt
        self._next_preload = want
        self._next_set = set(want)
        self._next_asked = now
        self._next_ready_said = False
        new = [m for m in want if m not in have]
        logger.info("automatic preload: warming a fork server (%s) with %d modules the workers loaded (%s%s)", how,
                    len(new), ", ".join(new[:5]), ", ..." if len(new) > 5 else "")
        if self.active:
            self._publish_learned(want)

    def _swap_starter(self) -> None:
        """Between attempts (no live worker): the warmed fork server takes over."""
        nxt = self._next_starter
        try:
            if nxt is None or not nxt.poll_ready():
                return
        except ForkServerError:
            return  # _refresh_preload says why and forgets it
        self._next_starter = None
        old = self.starter
        if old is not None:
            self._learn()
            self.sel.unregister(old.fileno())
            if nxt.origin is old:
                nxt.adopt(old)  # the copy dies with the server it was forked from: that one stays, idle
            else:
                old.close()
        self.starter = nxt
        self._preloaded = self._next_preload
        self.sel.register(nxt.fileno(), selectors.EVENT_READ, "exit")
        logger.info("automatic preload: fork server with %d learned modules in use", len(self._preloaded))

    def _publish_learned(self, names: tuple[str, ...]) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self.chan.keys.preload, self.signer.seal({"modules": list(names), "node": self.node}))
        except Exception as e:  # noqa: BLE001 - a speed-up for spares only
            logger.debug("cannot publish learned modules: %s", e)

    def _fetch_learned(self) -> None:
        """A spare learns from the active nodes what their workers import."""
        if self.store is None or self._store_lost_at is not None:
            return
        try:
            if not self.store.check([self.chan.keys.preload]):
                return
            body = self.signer.open(self.store.get(self.chan.keys.preload))
        except Exception as e:  # noqa: BLE001 - forged, or the store is away: nothing learned
            logger.debug("cannot read learned modules: %s", e)
            return
        names = [str(m) for m in body.get("modules", ()) if isinstance(m, str)]
        new = [m for m in names if m not in self._learned_set]
        if new:
            self._learned += new
            self._learned_set.update(new)
            self._learned_at = time.monotonic() - self.PRELOAD_QUIET  # settled already on the node that sent it

    def _save_denied(self) -> None:
        try:
            (self.run_dir / "preload").mkdir(parents=True, exist_ok=True)
            (self.run_dir / "preload" / "denied.txt").write_text("".join(f"{m}\n" for m in sorted(self._preload_denied)))
        except OSError as e:
            logger.debug("cannot remember denied preloads: %s", e)

    def _load_denied(self) -> set[str]:
        try:
            return set((self.run_dir / "preload" / "denied.txt").read_text().split())
        except OSError:
            return set()

    def _preload_modules(self) -> tuple[str, ...]:
        """What the fork server imports ahead of time: what every resilient worker imports anyway
        (soft: a failure only costs speed), then the user's ``--preload`` modules (hard)."""
        # DistributedDataParallel imports torch._dynamo on construction: seconds per restart otherwise
        soft = ["torch._dynamo", "torch.distributed.checkpoint", "torch.nn.parallel", "resilient.checkpoint.manager",
                "resilient.worker.steps"]
        if (self.cfg.ckpt_persistent or "").startswith("gs://"):
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                # gcsfs reads this at import, and the fork server imports it before a worker could set it;
                # against an emulator its bucket-type probe otherwise waits a minute per call
                os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            soft.append("gcsfs")
        return tuple(f"?{m}" for m in soft) + tuple(self.cfg.preload)

    def _await_starter(self) -> None:
        if isinstance(self.starter, ForkServer):
            try:
                self.starter.wait_ready()
            except ForkServerError as e:
                logger.warning("fork server unavailable (%s); starting workers as fresh interpreters", e)
                self.starter = SpawnStarter()

    def _join(self) -> None:
        """Reach the job's store (hosting it, and the supervisor, when the endpoint is this machine's and the
        port is free, as torch's c10d rendezvous decides its host), then announce this node.

        Membership is the supervisor's: it answers with assignments (members and their group ranks, spares,
        a fresh store per round). torch's dynamic rendezvous closes at ``--nnodes`` MAX and a late agent
        then kills the job (nvidia-resiliency-ext#348); a spare must be able to arrive at any moment.
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
            store = T.connect_store(host, port, c.rendezvous_timeout)
        # the id names the job (torchrun's meaning): an endpoint serving another id is not ours to join
        if c.rdzv_id == T.ANY_JOB:
            raise _JobRefused(f"--rdzv-id {T.ANY_JOB!r} is reserved; choose another id for the job")
        try:
            keys = T.Keys(c.rdzv_id)
        except ValueError as e:
            raise _JobRefused(f"--rdzv-id: {e}") from None
        served = T.claim_job(store, c.rdzv_id, hosting=hosting, timeout=c.rendezvous_timeout)
        if served != c.rdzv_id:
            T.knock(store, c.rdzv_id, self.node)
            raise _JobRefused(T.refused_line(served, c.rdzv_id, self.node, f"{host}:{port}"))
        secret = T.load_secret(c.job_secret_file)
        if secret is None:
            # without a configured secret the store itself is the only guard (single host, or trusted network)
            if hosting:
                secret = T.new_secret()
                store.set(keys.secret, secret)
            else:
                store.wait([keys.secret], timedelta(seconds=c.rendezvous_timeout))
                secret = store.get(keys.secret)
        self.store = store
        self.signer = T.Signer(secret, c.rdzv_id)
        self.chan = T.AgentChannel(store, self.signer, self.node)
        if hosting:
            self.sup_loop = _start_supervisor(c, store, self.signer, self.ledger, self._advertised_addr())
        self.chan.sync_term(c.rendezvous_timeout)  # what this node sends is bound to the supervisor's term
        self.chan.send(T.MessageKind.JOIN, nproc=c.nproc_per_node, pid=os.getpid(), host=socket.gethostname())
        store.wait([keys.presence], timedelta(seconds=c.rendezvous_timeout))
        self._presence, self._clock = T.presence_connect_clocked(store.get(keys.presence).decode(), self.signer,
                                                                 self.node, timeout=min(30.0, c.rendezvous_timeout),
                                                                 term=self.chan.term)
        self._last_hb = time.monotonic()
        # past the join, a store call must fail within a node timeout, not a rendezvous timeout: a dead or
        # hung supervisor must not freeze this loop (the workers go on either way)
        store.set_timeout(timedelta(seconds=min(c.rendezvous_timeout, max(5.0, c.node_timeout))))
        self._endpoint = (host, port)
        logger.debug("joined the job at %s:%s in %.3fs (hosting: %s)", host, port, time.monotonic() - t0, hosting)

    def _advertised_addr(self) -> str:
        if self.cfg.local_addr:
            return self.cfg.local_addr
        if self.cfg.single_node and not self.cfg.spare_nodes:
            return "127.0.0.1"
        return socket.getfqdn()

    def _kick(self) -> None:
        """Run the in-process supervisor's pass now: a decision then costs no polling period."""
        if self.sup_loop is not None:
            self.sup_loop.step(time.monotonic())

    def _report(self, ev: Event) -> None:
        """Tell the supervisor (never raises: a lost supervisor must not stop training)."""
        from resilient.supervisor.transport import MessageKind

        if self.chan is None:
            return  # not joined yet (or torn down): the node's ledger has it
        try:
            self.chan.send(MessageKind.EVENT, event=ev.to_json())
        except Exception as e:  # noqa: BLE001 - DistStoreError and friends
            self._store_trouble(e)
            self._unsent.append(ev)  # told again once the supervisor is back: it must not be lost
            return
        self._kick()

    def _flush_unsent(self) -> None:
        """A failure reported while the supervisor was away still needs its decision: tell it again."""
        unsent, self._unsent = self._unsent, []
        for ev in unsent:
            self._report(ev)

    def _heartbeat(self, force: bool = False) -> None:
        from resilient.supervisor.transport import MessageKind, presence_closed

        if (self._presence is not None and self.sup_loop is None and not self._sup_gone
                and presence_closed(self._presence)):
            # the supervisor stopped or died: a new one takes nothing bound to the old one's term, so this node
            # joins it again, even if the store itself answers (torch's client may reconnect by itself)
            self._sup_gone = True
            self._store_trouble(ConnectionError("the supervisor closed its connection"))
        if self._unsent and self._store_lost_at is None:
            self._flush_unsent()  # the store answers again (torch's client may reconnect by itself)

        now = time.monotonic()
        if not force and now - self._last_hb < self._hb_interval:
            return
        self._last_hb = now
        try:
            self.chan.send(MessageKind.HB, round=self.round, active=self.active)
        except Exception as e:  # noqa: BLE001
            self._store_trouble(e)

    def _store_trouble(self, e: Exception) -> None:
        if self._store_lost_at is None:
            self._store_lost_at = time.monotonic()
            logger.error("the job's store is unreachable (%s); workers keep training", str(e).splitlines()[0])

    def _maybe_reconnect(self) -> None:
        """Fail static: the supervisor (and the store it hosts) went away. Try again every second; once back,
        join again with our current round — the supervisor adopted it from its ledger — and carry on."""
        from resilient.supervisor import transport as T

        if (self._store_lost_at is None and not self._sup_gone) or self.sup_loop is not None:
            return
        now = time.monotonic()
        if now - self._last_reconnect < 1.0:
            return
        self._last_reconnect = now
        c = self.cfg
        keys = T.Keys(c.rdzv_id)
        try:
            store = T.connect_store(self._endpoint[0], self._endpoint[1], 2.0)
            served = T.claim_job(store, c.rdzv_id, hosting=False, timeout=2.0)
            if served != c.rdzv_id:  # another job's supervisor took the endpoint: not ours, keep waiting for ours
                raise _JobRefused(T.refused_line(served, c.rdzv_id, self.node, "{}:{}".format(*self._endpoint)))
            secret = T.load_secret(c.job_secret_file)
            if secret is None:
                store.wait([keys.secret], timedelta(seconds=2))
                secret = store.get(keys.secret)
            store.wait([keys.presence, keys.term], timedelta(seconds=2))
            presence = store.get(keys.presence).decode()
            store.set_timeout(timedelta(seconds=min(c.rendezvous_timeout, max(5.0, c.node_timeout))))
            signer = T.Signer(secret, c.rdzv_id)
            chan = T.AgentChannel(store, signer, self.node)
            chan.sync_term()
            chan.send(T.MessageKind.JOIN, nproc=c.nproc_per_node, pid=os.getpid(), host=socket.gethostname(),
                      rejoin=True, round=self.round, active=self.active, done=self._done_round == self.round)
            conn = T.presence_connect(presence, signer, self.node, timeout=2.0, term=chan.term)
        except _JobRefused as e:
            T.knock(store, c.rdzv_id, self.node)
            _RECONNECT_REFUSED.warning("%s", e)
            return
        except Exception as e:  # noqa: BLE001 - not back yet
            logger.debug("supervisor not reachable yet: %s", str(e).splitlines()[0])
            return
        if self._presence is not None:
            self._presence.close()
        self.store, self.signer, self.chan, self._presence = store, signer, chan, conn
        self._flush_unsent()
        self._resync = True
        lost_at = self._store_lost_at if self._store_lost_at is not None else now
        logger.warning("reconnected to the supervisor after %.1fs; round %d goes on", now - lost_at, self.round)
        self._store_lost_at = None
        self._sup_gone = False

    def _new_plan(self) -> dict | None:
        """The newest plan if one newer than the current round exists (bounded store calls)."""
        try:
            # a restarted supervisor's store holds its newest round only: an agent more than one round behind (a
            # spare still warming up while the job restarted) finds no round + 1 there and must take the latest
            if not self.chan.has_round(self.round + 1) and not (self._resync and self.chan.latest_round() > self.round):
                self._store_lost_at = None
                return None
            latest = self.chan.latest_round()
            # the newest round, or the next one if ``latest`` lags: either way its signature is checked
            plan = self.chan.plan(latest if latest > self.round else self.round + 1)
        except Exception as e:  # noqa: BLE001
            self._store_trouble(e)
            return None
        self._store_lost_at = None
        if plan is not None and int(plan.get("round", -1)) > self.round:
            self._resync = False
            return plan
        return None

    # ---------------------------------------------------------------- workers
    def _worker_env(self, local_rank: int, attempt: int, master: tuple[str, int]) -> dict[str, str]:
        c = self.cfg
        rank = self.base_rank + local_rank
        env = dict(os.environ)
        env.update({
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(self.group_rank),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": c.role,
            "LOCAL_WORLD_SIZE": str(c.nproc_per_node),
            "WORLD_SIZE": str(self.world_size),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_WORLD_SIZE": str(self.world_size),
            # torchrun's standalone runs say localhost; scripts and tools compare it
            "MASTER_ADDR": "localhost" if c.standalone and master[0] == "127.0.0.1" else master[0],
            "MASTER_PORT": str(master[1]),
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts),
            "TORCHELASTIC_RUN_ID": c.rdzv_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(True),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            renv.RUN_DIR: str(self.run_dir.resolve()),
            renv.RUN_ID: c.run_id,
            renv.NODE: self.node,
            renv.NODE_RANK: str(self.group_rank),
        })
        if c.virtual_local_rank:
            # as torchrun: each worker sees only its own GPU, as device 0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible is not None else [str(i) for i in range(c.nproc_per_node)]
            if local_rank >= len(devices):
                raise ValueError(f"local rank {local_rank} exceeds the GPUs in CUDA_VISIBLE_DEVICES={visible}")
            env["LOCAL_RANK"] = "0"
            env["CUDA_VISIBLE_DEVICES"] = devices[local_rank].strip()
        if self.monitor is not None:
            env[renv.AGENT_SOCKET] = self.monitor_socket
        optional = {
            renv.CKPT_LOCAL: c.ckpt_local or self._default_ckpt_local(), renv.CKPT_PERSISTENT: c.ckpt_persistent,
            renv.CKPT_INTERVAL: c.ckpt_interval,
            renv.CKPT_PERSISTENT_EVERY: None if c.ckpt_persistent_every is None else str(c.ckpt_persistent_every),
            renv.UPLOAD_GRACE: str(c.upload_grace),
            renv.CKPT_MAX_FAILED_SAVES: str(c.ckpt_max_failed_saves),
            renv.HEARTBEAT_TIMEOUT: None if c.heartbeat_timeout is None else str(c.heartbeat_timeout),
            renv.POLICY: c.policy, renv.SPARE_NODES: str(c.spare_nodes) if c.spare_nodes else None,
        }
        env.update({k: v for k, v in optional.items() if v is not None})
        if self.injector is not None:
            env.update(self.injector.env())
        return env

    def _default_ckpt_local(self) -> str | None:
        """Resilience by default: with no --ckpt-* flag, CheckpointManager.from_env() gets a local tier under
        the run directory (per host: a run directory on a shared file system must not mix nodes' shards);
        the manager's retention keeps it to the newest few steps."""
        c = self.cfg
        if c.ckpt_local or c.ckpt_persistent:
            return None
        d = self.run_dir.resolve() / "ckpt" / (socket.gethostname() if not c.single_node else "local")
        if not self._ckpt_default_said:
            self._ckpt_default_said = True
            logger.warning("no --ckpt-local/--ckpt-persistent given: CheckpointManager.from_env() saves to %s "
                           "(newest %s steps kept); pass --ckpt-local/--ckpt-persistent to choose", d, _keep_local_default())
        return str(d)

    def _log_dir(self, attempt: int, local_rank: int) -> Path:
        base = Path(self.cfg.log_dir) / self.cfg.run_id if self.cfg.log_dir else self.run_dir / "logs"
        d = base / f"attempt_{attempt}" / str(local_rank)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _spawn(self, attempt: int, master: tuple[str, int]) -> None:
        c = self.cfg
        n = c.nproc_per_node
        redirects, tees = _std_map(c.redirects, n), _std_map(c.tee, n)
        self.workers = []
        for lr in range(n):
            d = self._log_dir(attempt, lr)
            w = WorkerProc(local_rank=lr, rank=self.base_rank + lr, env=self._worker_env(lr, attempt, master),
                           error_file=str(d / "error.json"))
            w.env["TORCHELASTIC_ERROR_FILE"] = w.error_file  # type: ignore[assignment]
            show = c.local_ranks_filter is None or lr in c.local_ranks_filter
            for bit, name, console in ((1, "stdout", sys.stdout), (2, "stderr", sys.stderr)):
                fd: int | None = None
                if tees[lr] & bit:
                    rfd, fd = os.pipe()
                    os.set_blocking(rfd, False)
                    self.streams.add(rfd, d / f"{name}.log", console, f"[{c.role}{lr}]:", show)
                elif redirects[lr] & bit:
                    fd = os.open(d / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                elif not show:
                    fd = os.open(os.devnull, os.O_WRONLY)
                setattr(w, f"{name}_fd", fd)
            self.workers.append(w)
        assert self.starter is not None
        # A warm fork server with the learned modules takes over now (no worker is alive here); one still warming
        # is not waited for: this restart forks from the current one at once, and it takes over at the next.
        if self._next_starter is not None:
            self._refresh_preload()
        try:
            self.starter.start(c.command, self.workers, os.getcwd())
        except ForkServerError as e:
            logger.warning("fork server failed (%s); falling back to fresh interpreters", e)
            self._replace_starter_with_spawn()
            for w in self.workers:
                w.pid = None
            self.starter.start(c.command, self.workers, os.getcwd())
        for w in self.workers:
            for fd in (w.stdout_fd, w.stderr_fd):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            w.stdout_fd = w.stderr_fd = None

    def _replace_starter_with_spawn(self) -> None:
        if self.starter is not None:
            self.sel.unregister(self.starter.fileno())
            self.starter.close()
        self.starter = SpawnStarter()
        self.sel.register(self.starter.fileno(), selectors.EVENT_READ, "exit")

    def _stop_workers(self, first_sig: int, grace: float) -> None:
        """Signal every live worker, wait up to ``grace`` for them, then SIGKILL; reap all."""
        live = [w for w in self.workers if w.exit_code is None]
        if not live:
            return
        signal_workers(live, first_sig)
        deadline = time.monotonic() + grace
        killed = first_sig == signal.SIGKILL
        while any(w.exit_code is None for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                if killed:
                    logger.error("workers %s survived SIGKILL for %.0fs", [w.pid for w in live if w.exit_code is None], grace)
                    break
                signal_workers(self.workers, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + 10
                continue
            self._serve(left)

    def _collect_exits(self) -> list[WorkerProc]:
        assert self.starter is not None
        try:
            return self.starter.poll_exits()
        except ForkServerError as e:
            # The fork server died: its workers died with it (PDEATHSIG). Report them as failed.
            logger.error("fork server lost: %s", e)
            out = []
            for w in self.workers:
                if w.exit_code is None:
                    w.exit_code, w.exit_wall = -signal.SIGKILL, time.time()
                    out.append(w)
            self._replace_starter_with_spawn()
            return out

    def _read_signal(self) -> None:
        try:
            os.read(self._sig_r, 512)
        except BlockingIOError:
            pass

    # ---------------------------------------------------------------- the attempt loop
    def _watch(self, attempt: int) -> Outcome:
        """Run one attempt until its workers finish, one fails or hangs, a new plan arrives, or a signal."""
        while True:
            if self._signal is not None:
                return Outcome.STOPPED
            timeout = self.cfg.monitor_interval
            if self.monitor is not None:
                nd = self.monitor.next_deadline()
                if nd is not None:
                    timeout = min(timeout, max(0.0, nd - time.monotonic()))
            if self.injector is not None:
                due = self.injector.next_due()
                if due is not None:
                    timeout = min(timeout, due)
                self.injector.fire({w.rank: w.pid for w in self.workers if w.exit_code is None and w.pid},
                                   self.group_rank, self.cfg.ckpt_local or self._default_ckpt_local(), self._kill_node)
            exited = self._serve(timeout)
            failed = False
            for w in exited:  # every failing worker of the batch is recorded: simultaneous failures all matter
                if w.exit_code != 0:
                    self._record_failure(w, attempt)
                    failed = True
            if failed:
                return Outcome.FAILED
            if exited and all(w.exit_code == 0 for w in self.workers):
                return Outcome.SUCCEEDED
            if self.monitor is not None:
                hung = False
                for ev in self.monitor.tick(time.monotonic()):
                    self._observe(ev)  # every event of the tick: the suspect comes first, the rest matter too
                    if ev.kind == EventKind.HANG:
                        logger.error("rank %s hung: %s", ev.rank, ev.details)
                        self._hang_note = f"rank {ev.rank} hung (no heartbeat)"
                        hung = True
                if hung:
                    return Outcome.HUNG
            self._heartbeat()
            # no supervisor pass here: the loop's own thread ticks; kicks follow only this agent's reports
            self._maybe_reconnect()
            self._refresh_preload()
            # only a plan that carries the job's signature counts: a forged key must not restart anything
            plan = self._new_plan()
            if plan is not None:
                self._next_plan = plan
                return Outcome.PEER_FAILED

    def _note_late_failures(self, attempt: int) -> None:
        """Workers that failed on their own while the first failure was handled (a rank whose peer died fails
        in its collective): the summary lists every failed rank, as torchrun's does. Not reported again: the
        supervisor already decides on this attempt's first failure."""
        recorded = {f.rank for f in self.failures if f.attempt == attempt}
        for w in self.workers:
            if w.rank in recorded or w.exit_code in (None, 0, -signal.SIGKILL):
                continue
            ex = WorkerExit(w.local_rank, w.rank, w.pid or -1, w.exit_code, w.exit_wall or time.time(),
                            w.error_file, attempt)
            self.failures.append(ex)
            logger.warning("worker %s", ex.describe())

    def _record_failure(self, w: WorkerProc, attempt: int) -> None:
        ex = WorkerExit(w.local_rank, w.rank, w.pid or -1, w.exit_code or 0, w.exit_wall or time.time(), w.error_file,
                        attempt)
        self.failures.append(ex)
        if self.first_failure is None:
            self.first_failure = ex
        ev = self.ledger.emit(EventKind.WORKER_EXIT, rank=w.rank, attempt=attempt, pid=w.pid, exit_code=w.exit_code,
                              signal=ex.signal_name, local_rank=w.local_rank,
                              detect_seconds=round(max(0.0, time.time() - ex.wall), 4))
        logger.warning("worker %s", ex.describe())
        self._report(ev)

    def _observe(self, ev: Event) -> None:
        """A detector's event: into the node's ledger, and to the supervisor when it may need a decision."""
        from resilient.supervisor.loop import FORWARDED

        self.ledger.write(ev)
        if ev.kind in FORWARDED:
            self._report(ev)

    def _serve(self, timeout: float) -> list[WorkerProc]:
        """One wait on the agent's descriptors: signals, detector events (recorded, and forwarded when they may
        need a decision), worker output; returns the workers whose exits arrived."""
        exited: list[WorkerProc] = []
        if isinstance(self.starter, ForkServer) and self.starter.buffered():
            # read along with the spawn answers (a fast exit, learned modules): the socket won't wake us for them
            exited += self._collect_exits()
            timeout = 0
        for key, _ in self.sel.select(timeout=timeout):
            if key.data == "exit":
                exited += self._collect_exits()
            elif key.data == "signal":
                self._read_signal()
            elif key.data == "monitor" and self.monitor is not None:
                for ev in self.monitor.on_readable(time.monotonic()):
                    self._observe(ev)
            elif isinstance(key.data, tuple) and key.data[0] == "log":
                if not self.streams.pump(key.fd):
                    self.sel.unregister(key.fd)
        return exited

    def _await_plan(self) -> dict | None:
        """Wait for a plan newer than the current round; None when a signal came first or the job's store
        stayed unreachable for ``--rendezvous-timeout`` while this node had nothing running."""
        if self._next_plan is not None:
            plan, self._next_plan = self._next_plan, None
            return plan
        while True:
            if self._signal is not None:
                return None
            self._heartbeat()
            self._maybe_reconnect()
            self._refresh_preload()
            plan = self._new_plan()
            if plan is not None:
                return plan
            if self._store_lost_at is not None and time.monotonic() - self._store_lost_at > self.cfg.rendezvous_timeout:
                raise _StoreLost(f"the job's store stayed unreachable for {self.cfg.rendezvous_timeout:.0f}s")
            self._serve(self.cfg.monitor_interval)

    def run(self) -> int:
        c = self.cfg
        self._install_signals()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self._sig_r, selectors.EVENT_READ, "signal")
        from resilient.logs import scrub_argv  # tokens passed as flags must not land in the ledger

        self.ledger.emit(EventKind.RUN_START, argv=scrub_argv(sys.argv), run_id=c.run_id, nproc_per_node=c.nproc_per_node,
                         nnodes=f"{c.min_nodes}:{c.max_nodes}", launch=c.launch_method.value)
        exit_code = 1
        reason = "failed"
        try:
            t0 = time.monotonic()
            self._start_workers_backend()
            self._interruptible = True
            try:
                # join only once the fork server is warm (torch imported): a node then never goes silent
                # between joining and its first round, and a spare that joined is ready to take over at once
                self._await_starter()
                self._join()
            except _Stopped as e:
                logger.warning("%s before workers started", e)
                reason = str(e)
                return exit_code
            finally:
                self._interruptible = False
            assert self.starter is not None
            self.sel.register(self.starter.fileno(), selectors.EVENT_READ, "exit")
            logger.debug("worker starter ready in %.2fs", time.monotonic() - t0)
            if self._signal is not None:
                return 1
            self._start_monitor()
            self._start_metrics()
            exit_code, reason = self._follow()
        except _JobRefused as e:
            # not this job's endpoint: a wrong --rdzv-id or --rdzv-endpoint, which no retry mends
            logger.error("%s", e)
            reason = str(e)
            exit_code = 2
        except _StoreLost as e:
            from resilient.launcher.api import INFRASTRUCTURE_EXIT_CODE

            logger.error("%s; giving up (exit %d: requeue the job)", e, INFRASTRUCTURE_EXIT_CODE)
            reason = str(e)
            exit_code = INFRASTRUCTURE_EXIT_CODE
        finally:
            self._shutdown()
            exit_code, reason = self._close_checkpoints(exit_code, reason)
            self.ledger.emit(EventKind.RUN_END, exit_code=exit_code, reason=reason)
            self.ledger.close()
            self._say_ledger_lost()
        return exit_code

    def _say_ledger_lost(self) -> None:
        """The final word on a ledger that lost events (any writer of this run dir: the agent, a worker)."""
        from resilient.events.follow import ledger_incomplete

        lost = ledger_incomplete(self.run_dir)
        if lost is not None:
            print(f"resilient-run: {lost} ({self.ledger.path}); `resilient goodput` reports the run as "
                  "incomplete", file=sys.stderr)

    def _start_monitor(self) -> None:
        try:
            from resilient.signals.api import MonitorConfig
            from resilient.signals.monitor import create_node_monitor
        except ImportError:
            return
        self.monitor_socket = f"@resilient-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        cfg = MonitorConfig(socket_path=self.monitor_socket, heartbeat_timeout=self.cfg.heartbeat_timeout,
                            ckpt_local=self.cfg.ckpt_local or self._default_ckpt_local())  # the default tier's disk too
        try:
            self.monitor = create_node_monitor(cfg, self.ledger, self.group_rank)
        except Exception as e:  # noqa: BLE001 - fail static: training goes on without the detectors
            logger.warning("node monitor unavailable (%s); hang and straggler detection are off", e)
            return
        self.sel.register(self.monitor.fileno(), selectors.EVENT_READ, "monitor")

    def _start_metrics(self) -> None:
        if self.cfg.metrics_port is None or (self.sup_loop is None and not self.cfg.single_node):
            return
        try:
            from resilient.goodput.metrics import MetricsServer

            self.metrics = MetricsServer(self.cfg.metrics_port, str(self.run_dir), addr=self.cfg.metrics_addr)
            self.metrics.start()
        except Exception as e:  # noqa: BLE001 - fail static: training goes on without the endpoint
            logger.warning("metrics endpoint on port %s unavailable: %s", self.cfg.metrics_port, e)

    def _follow(self) -> tuple[int, str]:
        """Carry out the supervisor's plans until the final one: run the workers of each round this node is a
        member of, wait as a warm spare otherwise. Decisions are the supervisor's; this only executes."""
        from resilient.supervisor.core import Assignment
        from resilient.supervisor.transport import MessageKind

        c = self.cfg
        last: tuple[str, float] | None = None  # (cause, detect seconds) of this node's last disruption
        while True:
            plan = self._await_plan()
            if plan is None:
                sig = self._signal or signal.SIGTERM
                self._leave(f"signal {signal.Signals(sig).name}")
                return 1, f"signal {signal.Signals(sig).name}"
            was_active = self.node_round.active
            if plan.get("final"):
                self.node_round = replace(self.node_round, round=int(plan["round"]))
                self._ack()
                return self._final(plan)
            a = Assignment.from_json(plan["assignment"])
            if self.node not in a.members:
                self.node_round = NodeRound(round=a.round, role=NodeRole.SPARE, world_size=a.world_size)
                self._ack()
                if was_active:
                    logger.warning("this node left the active set (%s); waiting as a spare", plan["action"])
                else:
                    logger.info("waiting as a spare (round %d)", self.round)
                continue
            self.node_round = NodeRound(round=a.round, role=NodeRole.ACTIVE, group_rank=a.members.index(self.node),
                                        group_world_size=len(a.members), base_rank=a.base_rank(self.node),
                                        world_size=a.world_size)
            self._ack()
            attempt = a.attempt
            self.restart_count = attempt
            if not self._ran:
                # this node's clock against the supervisor host's, so the job-level report reads one clock
                clock = {} if self._clock is None else {"clock_offset": round(self._clock.offset, 6),
                                                        "clock_rtt": round(self._clock.rtt, 6)}
                self.ledger.emit(EventKind.RENDEZVOUS_DONE, group_rank=self.group_rank,
                                 group_world_size=self.group_world_size, seconds=round(time.monotonic() - self._t_join, 4),
                                 **clock)
            if a.previous_world_size is not None and a.previous_world_size != a.world_size:
                self._record_previous_world(a)
            if self._ran:
                cause, lag = last or ("peer_failed", 0.0)
                self.ledger.emit(EventKind.RESTART, attempt=attempt, cause=cause, detect_seconds=round(lag, 4),
                                 action=plan["action"].get("action"))
                logger.warning("%s; restarting workers (attempt %d of at most %d, %s)", self._why(cause), attempt,
                               c.max_restarts, _describe(plan["action"]))
            self._ran = True
            if self.injector is not None:
                self.injector.started(self.round, plan.get("started"))
            host, port = plan["master"].rsplit(":", 1)
            outcome = self._run_attempt(attempt, (host, int(port)))
            t_detect = time.time()
            if outcome == Outcome.SUCCEEDED:
                last = None
                self._done_round = self.round
                try:
                    self.chan.send(MessageKind.DONE, round=self.round)
                except Exception as e:  # noqa: BLE001
                    self._store_trouble(e)
                self._kick()
                continue
            if outcome == Outcome.STOPPED:
                return self._on_stopped(attempt)
            fault_wall = self.failures[-1].wall if outcome == Outcome.FAILED and self.failures else t_detect
            last = (outcome.value, max(0.0, t_detect - fault_wall))

    def _why(self, cause: str) -> str:
        """What the terminal says a restart is for: the failed ranks with pid and exit code or signal, as
        torchrun does, the hung rank, or (for another node's failure) the supervisor's reason."""
        if cause == Outcome.FAILED.value and self.failures:
            last = self.failures[-1].attempt
            return "; ".join(f.describe() for f in self.failures if f.attempt == last)
        if cause == Outcome.HUNG.value and self._hang_note:
            return self._hang_note
        return {Outcome.PEER_FAILED.value: "the job restarts (another node's workers failed or it was lost)"}.get(
            cause, cause)

    def _run_attempt(self, attempt: int, master: tuple[str, int]) -> Outcome:
        c = self.cfg
        self._clear_preempt_marks(attempt)  # marks of an earlier run in this run dir do not count
        t_spawn = time.time()
        self._spawn(attempt, master)
        for rfd in self.streams.pipes:
            if rfd not in self.sel.get_map():
                self.sel.register(rfd, selectors.EVENT_READ, ("log", rfd))
        if self.monitor is not None:
            self.monitor.attempt_started(attempt, {w.local_rank: w.rank for w in self.workers},
                                         {w.local_rank: w.pid for w in self.workers if w.pid})
        self.ledger.emit(EventKind.ATTEMPT_START, attempt=attempt, world_size=self.world_size,
                         local_world_size=c.nproc_per_node, group_rank=self.group_rank,
                         method=type(self.starter).__name__, spawn_seconds=round(time.time() - t_spawn, 4),
                         pids={str(w.rank): w.pid for w in self.workers})
        outcome = self._watch(attempt)
        if outcome in (Outcome.SUCCEEDED, Outcome.STOPPED):
            if outcome == Outcome.SUCCEEDED:
                self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=outcome.value)
            return outcome
        # failure of some kind, or a new plan: survivors are killed at once — their collectives can't complete
        self._stop_workers(signal.SIGKILL, 10.0)
        if outcome == Outcome.FAILED:
            self._note_late_failures(attempt)
        if self.monitor is not None:
            self.monitor.attempt_stopped()
        self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=outcome.value)
        return outcome

    def _on_stopped(self, attempt: int) -> tuple[int, str]:
        """A signal to the agent (the scheduler's preemption notice, or Ctrl-C): forward it, then leave."""
        c = self.cfg
        sig = self._signal or signal.SIGTERM
        if sig == signal.SIGTERM:
            ev = self.ledger.emit(EventKind.PREEMPTION_NOTICE, attempt=attempt, source="SIGTERM",
                                  deadline=time.time() + c.term_timeout)
            # the supervisor hears a preemption as what it is, before this node goes, not as a lost node: a spare
            # takes its place, or the job shrinks, once the step every rank agrees to stop after is saved
            self._report(ev)
        logger.warning("received %s: forwarding to workers", signal.Signals(sig).name)
        self._stop_workers(sig, c.term_timeout)
        self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=f"signal {signal.Signals(sig).name}")
        if sig == signal.SIGTERM and self._preempted_cleanly(attempt):
            from resilient.launcher.api import PREEMPTED_EXIT_CODE

            if self.sup_loop is not None:
                # the supervisor goes with this node: the others stop after the agreed step too and exit 75
                self.sup_loop.end_preempted(self.node, f"node {self.node}, which hosts the supervisor, was preempted",
                                            c.term_timeout)
            self._leave("preempted")
            logger.warning("preempted: every worker saved its last step; rerun the same command to resume")
            return PREEMPTED_EXIT_CODE, "preempted"
        self._leave(f"signal {signal.Signals(sig).name}")
        # torchrun exits 1 when stopped by a signal; schedulers and wrappers rely on it
        return 1, f"signal {signal.Signals(sig).name}"

    def _clear_preempt_marks(self, attempt: int) -> None:
        from resilient.checkpoint.api import CKPT_STOP_MARK_DIR
        from resilient.worker.preemption import PREEMPT_MARK_DIR

        for r in range(self.base_rank, self.base_rank + self.cfg.nproc_per_node):
            (self.run_dir / PREEMPT_MARK_DIR / f"attempt{attempt}.rank{r}").unlink(missing_ok=True)
            (self.run_dir / CKPT_STOP_MARK_DIR / f"attempt{attempt}.rank{r}").unlink(missing_ok=True)

    def _ckpt_stop_mark(self) -> str | None:
        """Why the workers of the last attempt stopped for failed checkpoint saves (they leave a mark, then exit 0
        so that nothing restarts them into the same failures), or None."""
        import json

        from resilient.checkpoint.api import CKPT_STOP_MARK_DIR

        if not self._ran:
            return None
        for r in range(self.base_rank, self.base_rank + self.cfg.nproc_per_node):
            try:
                body = json.loads((self.run_dir / CKPT_STOP_MARK_DIR / f"attempt{self.restart_count}.rank{r}").read_text())
            except (OSError, ValueError):
                continue
            return str(body.get("message") or "checkpoint saves kept failing") if isinstance(body, dict) else None
        return None

    def _close_checkpoints(self, exit_code: int, reason: str) -> tuple[int, str]:
        """The run's closing lines on its checkpoints (which steps went where, which saves failed), and the exit
        rules that depend on them: a job its failed saves stopped exits CKPT_FAILED_EXIT_CODE; a finished run whose
        newest saved step is not on the persistent tier exits NOT_DURABLE_EXIT_CODE (a preempted one keeps
        PREEMPTED_EXIT_CODE, so that it is still requeued, and says so in a line and the ledger)."""
        from resilient.launcher.api import CKPT_FAILED_EXIT_CODE, NOT_DURABLE_EXIT_CODE, PREEMPTED_EXIT_CODE

        try:
            from resilient.events.ledger import read_events
            from resilient.goodput.calculator import checkpoint_summary

            events = list(read_events(self.run_dir))
            mine = [i for i, e in enumerate(events) if e.kind is EventKind.RUN_START and e.node == self.node]
            summary = checkpoint_summary(events[mine[-1]:] if mine else events)
        except Exception as e:  # noqa: BLE001 - a report: the exit goes on without it
            logger.debug("no checkpoint summary: %s", e)
            return exit_code, reason
        for line in summary.lines():
            print(f"resilient-run: {line}", file=sys.stderr)
        stop = self._ckpt_stop_mark() if exit_code == 0 else None
        if stop is not None:
            print(f"resilient-run: the job stopped (exit {CKPT_FAILED_EXIT_CODE}): {stop}", file=sys.stderr)
            return CKPT_FAILED_EXIT_CODE, f"checkpoint saves failed: {stop}"
        gap = summary.not_durable() if self.cfg.ckpt_persistent and exit_code in (0, PREEMPTED_EXIT_CODE) else None
        if gap is None:
            return exit_code, reason
        step, there = gap
        code = NOT_DURABLE_EXIT_CODE if exit_code == 0 else exit_code
        self.ledger.emit(EventKind.CKPT_NOT_DURABLE, step=step, persistent_step=there, exit_code=code)
        what = (f"the newest saved step {step} is not on the persistent tier {self.cfg.ckpt_persistent} (newest "
                f"there: {'none' if there is None else there}); only node-local tiers hold it")
        if exit_code == 0:
            print(f"resilient-run: training finished, but {what} (exit {code})", file=sys.stderr)
            return code, f"succeeded, but step {step} is not durable"
        print(f"resilient-run: preempted (exit {code} kept, so that the job is requeued), but {what}", file=sys.stderr)
        return code, f"{reason}; step {step} is not durable"

    def _preempted_cleanly(self, attempt: int) -> bool:
        """Every local worker ended its loop for the notice after a saved step (resilient.steps marks it)
        and exited 0; a script that does not use resilient never marks, and exits as under torchrun."""
        from resilient.worker.preemption import PREEMPT_MARK_DIR

        marks = self.run_dir / PREEMPT_MARK_DIR
        return bool(self.workers) and all(
            w.exit_code == 0 and (marks / f"attempt{attempt}.rank{w.rank}").exists() for w in self.workers)

    def _final(self, plan: dict) -> tuple[int, str]:
        stop = plan.get("stop")
        if stop is None:
            self._wait_settled()
            if plan.get("preempted") or (self._ran and self._preempted_cleanly(self.restart_count)):
                # a preemption (a notice file, or another node's that nothing could replace) ended the loop:
                # exit as preempted, so the scheduler requeues
                from resilient.launcher.api import PREEMPTED_EXIT_CODE

                logger.warning("preempted: every worker saved its last step; rerun the same command to resume")
                return PREEMPTED_EXIT_CODE, "preempted"
            return 0, "succeeded"
        if self.failures or self.first_failure:
            self._print_failure_summary()
        else:
            print(f"resilient-run: the supervisor stopped the job: {stop}", file=sys.stderr)
        self._wait_settled()
        return 1, f"stopped by the supervisor: {stop}"

    def _wait_settled(self) -> None:
        """The agent hosting the store stays until every agent read the final plan (torchrun's exit barrier)."""
        if self.sup_loop is not None:
            deadline = time.monotonic() + self.sup_loop.cfg.linger
            while not self.sup_loop.settled.is_set() and time.monotonic() < deadline and self._signal is None:
                self.sup_loop.step(time.monotonic())
                self.sup_loop.settled.wait(self.cfg.monitor_interval)

    def _kill_node(self) -> None:
        """A drill's lost node: workers, fork server and this agent SIGKILLed, nothing cleaned up."""
        signal_workers([w for w in self.workers if w.exit_code is None], signal.SIGKILL)
        pid = getattr(getattr(self.starter, "proc", None), "pid", None)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    def _ack(self) -> None:
        from resilient.supervisor.transport import MessageKind

        try:
            self.chan.send(MessageKind.ACK, round=self.round)
        except Exception as e:  # noqa: BLE001
            self._store_trouble(e)
        self._kick()

    def _leave(self, reason: str) -> None:
        from resilient.supervisor.transport import MessageKind

        if self.sup_loop is not None:
            # the supervisor goes down with this agent: nothing is left for it to decide
            self.sup_loop.core.finish(reason)
            return
        try:
            self.chan.send(MessageKind.LEAVE, reason=reason)
        except Exception as e:  # noqa: BLE001
            logger.debug("could not say goodbye: %s", e)

    def _record_previous_world(self, a: object) -> None:
        """A node that did not train before has no world record: give it the previous world, so its ranks run
        the ``on_scale`` callbacks like everyone else's."""
        from resilient.worker.scale import read_world, record_world

        if read_world(self.run_dir) is None:
            try:
                record_world(self.run_dir, a.previous_world_size)  # type: ignore[attr-defined]
            except (OSError, ValueError) as e:
                logger.warning("cannot record the previous world size: %s", e)

    def _print_failure_summary(self) -> None:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

        failures = {}
        # as torchrun: the failures of the last attempt, every failed rank (ChildFailedError makes the earliest
        # the root cause); earlier attempts' failures were printed when they happened
        last = self.failures[-1].attempt if self.failures else None
        for f in [f for f in self.failures if f.attempt == last] or ([self.first_failure] if self.first_failure else []):
            err = f.error_file if f.error_file and os.path.exists(f.error_file) else "<N/A>"
            failures[f.rank] = ProcessFailure(local_rank=f.local_rank, pid=f.pid, exitcode=f.exit_code, error_file=err)
        if not failures:
            print(f"{self.cfg.script_name} FAILED (no worker failure recorded)", file=sys.stderr)
            return
        print(ChildFailedError(name=self.cfg.script_name, failures=failures).format_msg(), file=sys.stderr)

    def _shutdown(self) -> None:
        try:
            self._stop_workers(signal.SIGKILL, 10.0)
        except Exception as e:  # noqa: BLE001
            logger.error("stopping workers: %s", e)
        self.streams.close()
        for part in (self.monitor, self.metrics, self.starter, self._next_starter):
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # noqa: BLE001
                    logger.debug("closing %s: %s", type(part).__name__, e)
        if self._presence is not None:
            self._presence.close()
        if self.sup_loop is not None:
            self.sup_loop.close()
        self.store = None
        signal.set_wakeup_fd(-1)
