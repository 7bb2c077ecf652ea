"""The node agent: torchrun's job on one node (spawn, environment, logs, signals, exit codes), carrying out the
supervisor's plans round by round. The supervisor decides; the agent joins the job (:mod:`.control`, which also
hosts the supervisor when this node hosts the job's store), then for each plan runs this node's workers of the
round (:mod:`.workers`) or waits as a warm spare, and reports what happens to them; :mod:`.exit` says how it ends.

One loop, event-driven: each pass waits once on the agent's descriptors (worker exits, output, signals through a
wakeup pipe, the node monitor), then carries out the drill's due faults and does the control work (heartbeat,
reconnect, automatic preload, the next plan). Nothing waits a fixed time.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

from resilient.drill.agent import Injector
from resilient.events import Event, EventKind, Ledger
from resilient.launcher.api import INFRASTRUCTURE_EXIT_CODE, AgentConfig, NodeRole, NodeRound, Outcome, WorkerExit
from resilient.launcher.control import ControlClient, JobEnded, JobRefused, StoreLost, Superseded, SupervisorUnreachable
from resilient.launcher.exit import Ending, exit_code, failure_summary, preempted_cleanly, supervisor_unreachable
from resilient.launcher.forward import Forwarder, start_forwarder
from resilient.launcher.preload import Preloader, first_starter
from resilient.launcher.report import (close_checkpoints, describe, follow_checkpoints, say_ledger_lost, start_metrics,
                                       why)
from resilient.launcher.starters import WorkerProc, WorkerStarter
from resilient.launcher.workers import WorkerGroup, default_ckpt_local, record_previous_world, say_default_ckpt_local
from resilient.launcher.workers import start_monitor, worker_env

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class Agent:
    def __init__(self, cfg: AgentConfig, starter: WorkerStarter | None = None):
        """``starter``: the worker starter started already (run.py starts the fork server before importing this)."""
        self.cfg = cfg
        self._first_starter = starter
        self.node = socket.gethostname() if cfg.single_node else f"{socket.gethostname()}:{os.getpid()}"
        self.run_dir = Path(cfg.run_dir)
        self.ledger = Ledger(self.run_dir, node=self.node)
        self.sel = selectors.DefaultSelector()
        self.group = WorkerGroup(cfg, self.run_dir, self.sel)
        self.control = ControlClient(cfg, self.node, self.ledger)
        self.preload = Preloader(cfg, self.run_dir)
        self.monitor = None
        self.monitor_socket: str | None = None
        self.snapshot_dir: str | None = None  # this node's snapshots in memory (made in run(), removed at its end)
        self.metrics = None
        self.forward: Forwarder | None = None  # this node's checkpoint events to the supervisor
        self.failures: list[WorkerExit] = []  # appended by _add_failure only
        self._hang_note = ""
        self._ckpt_default_said = False
        self._signal: int | None = None
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.restart_count = 0
        self._interruptible = False
        self.node_round = NodeRound(world_size=cfg.nproc_per_node)  # replaced whole, by _follow only
        self._ran = False
        self._sat_out = False  # a round since it last trained left this node out (spare, benched)
        self._t_join = time.monotonic()
        self.injector = Injector(cfg.inject, self.ledger) if cfg.inject else None
        self._done_round: int | None = None  # the round whose workers all finished here

    # the current round's fields, read-only: only _follow replaces the record
    round = property(lambda self: self.node_round.round)
    group_rank = property(lambda self: self.node_round.group_rank)
    base_rank = property(lambda self: self.node_round.base_rank)

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

    def _default_ckpt_local(self) -> str | None:
        d = default_ckpt_local(self.cfg, self.run_dir)
        if not self._ckpt_default_said:
            self._ckpt_default_said = True
            say_default_ckpt_local(d)
        return d

    def run(self) -> int:
        c = self.cfg
        self._install_signals()
        self.sel.register(self._sig_r, selectors.EVENT_READ, "signal")
        from resilient.logs import scrub_argv  # tokens passed as flags must not land in the ledger

        follower = follow_checkpoints(self.run_dir, self.node)  # before RUN_START: it must see it
        self.ledger.emit(EventKind.RUN_START, argv=scrub_argv(sys.argv), run_id=c.run_id, nproc_per_node=c.nproc_per_node,
                         nnodes=f"{c.supervisor.min_nodes}:{c.supervisor.max_nodes}", launch=c.launch_method.value)
        end = Ending(1, "failed")
        if follower is not None:
            follower.start()
        if c.ckpt_snapshot != "off":
            from resilient.checkpoint.snapshot.dirs import make_dir

            self.snapshot_dir = make_dir(c.run_id)
        try:
            t0 = time.monotonic()
            self.group.use(self._first_starter or first_starter(c, self.run_dir))
            # while the fork server warms up: between the join and the first spawn it cost tenths of a second
            self.monitor_socket, self.monitor = start_monitor(c, self.ledger, self.group_rank, self._default_ckpt_local(), self.sel)
            self._interruptible = True
            try:
                # join only once the fork server is warm (torch imported): a node then never goes silent
                # between joining and its first round, and a spare that joined is ready to take over at once;
                # while it warms, the supervisor knows it as arriving (a joining spare worth waiting for)
                self.control.join(warm=self.group.await_ready)
            except _Stopped as e:
                logger.warning("%s before workers started", e)
                end = Ending(1, str(e))
                return end.code
            finally:
                self._interruptible = False
            logger.debug("worker starter ready in %.2fs", time.monotonic() - t0)
            if self._signal is not None:
                return 1
            self.metrics = start_metrics(c, self.run_dir, hosts_supervisor=self.control.sup_loop is not None)
            # this node's checkpoint boundaries to the supervisor, wherever it runs (here too: it reads no ledger)
            self.forward = start_forwarder(self.run_dir, self.node)
            end = self._follow()
        except JobEnded as e:
            # a spare that arrived as the job ended: it ends the way the job did, like the spares that had joined
            plan = {"final": True, "stop": e.outcome if e.outcome == "stopped" else None,
                    "preempted": e.outcome if e.outcome == "preempted" else None}
            end = exit_code(Outcome.SUCCEEDED, plan)
            print(f"resilient-run: {e}; nothing left to join", file=sys.stderr)
        except JobRefused as e:
            # not this job's endpoint: a wrong --rdzv-id or --rdzv-endpoint, which no retry mends
            logger.error("%s", e)
            end = Ending(2, str(e))
        except StoreLost as e:
            logger.error("%s; giving up (exit %d: requeue the job)", e, INFRASTRUCTURE_EXIT_CODE)
            end = Ending(INFRASTRUCTURE_EXIT_CODE, str(e))
        except SupervisorUnreachable as e:
            end = supervisor_unreachable(e.need, e.waited, c.supervisor_bound, c.rdzv_endpoint)
            logger.error("%s", end.reason)
        except Superseded as e:
            # the job goes on without this node (its ranks were given to others): its part ended, nothing failed
            # here that a requeue would mend
            end = Ending(0, str(e))
            logger.error("%s (exit 0)", e)
        finally:
            self._shutdown()
            if self.snapshot_dir is not None:  # the workers are gone: their snapshots are of no use to anyone
                from resilient.checkpoint.snapshot.dirs import remove_dir

                remove_dir(self.snapshot_dir)
            end = close_checkpoints(end, self.ledger, self.run_dir, self.node, self.cfg.ckpt_persistent,
                                     lambda: self.group.ckpt_stop_mark(self.restart_count, self.base_rank)
                                     if self._ran else None, follower)
            self.ledger.emit(EventKind.RUN_END, exit_code=end.code, reason=end.reason,
                             plan_looks=dict(self.control.plan_looks))
            self.ledger.close()
            say_ledger_lost(self.run_dir, self.ledger.path)
        return end.code

    # ---------------------------------------------------------------- the round loop
    def _follow(self) -> Ending:
        """Carry out the supervisor's plans until the final one: run the workers of each round this node is a
        member of, wait as a warm spare otherwise. Decisions are the supervisor's; this only executes."""
        from resilient.supervisor.core import Assignment

        last: tuple[str, float] | None = None  # (cause, detect seconds) of this node's last disruption
        plan: dict | None = None  # a plan seen while workers ran
        while True:
            plan = plan or self._await_plan(self._need(last))
            if plan is None:
                return self._leave(exit_code(Outcome.STOPPED, None, signum=self._signal or signal.SIGTERM))
            was_active = self.node_round.active
            if plan.get("final"):
                self.node_round = replace(self.node_round, round=int(plan["round"]))
                self.control.ack(self.round)
                return self._final(plan)
            a = Assignment.from_json(plan["assignment"])
            if self.node not in a.members:
                self.node_round = NodeRound(round=a.round, role=NodeRole.SPARE, world_size=a.world_size)
                self._sat_out = True  # its world record is stale once it trains again (see record_previous_world)
                self.control.ack(self.round)
                if was_active:
                    logger.warning("this node left the active set (%s); waiting as a spare", plan["action"])
                else:
                    logger.info("waiting as a spare (round %d)", self.round)
                plan = None
                continue
            self.node_round = NodeRound.active_in(a, plan, self.node, self.cfg.supervisor.max_restarts)
            self.control.ack(self.round)
            self.restart_count = attempt = a.attempt
            self._begin_attempt(a, plan, last)
            host, port = plan["master"].rsplit(":", 1)
            outcome, plan = self._run_attempt(attempt, (host, int(port)))
            t_detect = time.time()
            if outcome == Outcome.SUCCEEDED:
                last = None
                self._done_round = self.round
                self.control.done(self.round)
                continue
            if outcome == Outcome.STOPPED:
                return self._on_stopped(attempt)
            fault_wall = self.failures[-1].wall if outcome == Outcome.FAILED and self.failures else t_detect
            last = (outcome.value, max(0.0, t_detect - fault_wall))

    def _begin_attempt(self, a: object, plan: dict, last: tuple[str, float] | None) -> None:
        """The ledger's and the terminal's account of an attempt about to start."""
        attempt = a.attempt  # type: ignore[attr-defined]
        if not self._ran:
            # this node's clock against the supervisor host's, so the job-level report reads one clock
            clk = self.control.clock
            self.ledger.emit(EventKind.RENDEZVOUS_DONE, group_rank=self.group_rank,
                             group_world_size=self.node_round.group_world_size, seconds=round(time.monotonic() - self._t_join, 4),
                             **({} if clk is None else {"clock_offset": round(clk.offset, 6), "clock_rtt": round(clk.rtt, 6)}))
        prev = a.previous_world_size  # type: ignore[attr-defined]
        if prev is not None:
            record_previous_world(self.run_dir, prev, self.node_round.previous_dp_size, attempt=attempt,
                                  sat_out=self._sat_out or not self._ran)
        self._sat_out = False
        if self._ran:
            cause, lag = last or ("peer_failed", 0.0)
            self.ledger.emit(EventKind.RESTART, attempt=attempt, cause=cause, detect_seconds=round(lag, 4),
                             action=plan["action"].get("action"))
            logger.warning("%s; restarting workers (attempt %d of at most %d, %s)", why(cause, self.failures, self._hang_note), attempt,
                           self.node_round.max_restarts, describe(plan["action"]))
        self._ran = True
        if self.injector is not None:
            self.injector.started(self.round, plan.get("started"))

    def _run_attempt(self, attempt: int, master: tuple[str, int]) -> tuple[Outcome, dict | None]:
        """Start this node's workers of the round and watch them until they finish, one fails or hangs, a new plan
        arrives (returned with PEER_FAILED) or a signal."""
        self.group.clear_marks(attempt, self.base_rank)
        t_spawn = time.time()
        # A warm fork server with the learned modules takes over now (no worker is alive here); one still warming
        # is not waited for: this restart forks from the current one at once, and it takes over at the next.
        if self.preload.next is not None:
            self._control_pass(plans=False)
        self.group.start(attempt, self.base_rank, lambda lr: worker_env(
            self.cfg, self.node_round, lr, attempt, master, run_dir=self.run_dir, node=self.node,
            ckpt_local=self._default_ckpt_local(), monitor_socket=self.monitor_socket if self.monitor else None,
            drill_env=self.injector.env() if self.injector is not None else {}, snapshot_dir=self.snapshot_dir))
        workers = self.group.workers
        if self.monitor is not None:
            k = self.node_round.nodes_per_replica  # straggler scores compare data-parallel peers only
            self.monitor.attempt_started(attempt, {w.local_rank: w.rank for w in workers},
                                         {w.local_rank: w.pid for w in workers if w.pid},
                                         ranks_per_replica=k * self.cfg.nproc_per_node if k else None)
        self.ledger.emit(EventKind.ATTEMPT_START, attempt=attempt, world_size=self.node_round.world_size,
                         local_world_size=self.cfg.nproc_per_node, group_rank=self.group_rank,
                         method=type(self.group.starter).__name__, spawn_seconds=round(time.time() - t_spawn, 4),
                         pids={str(w.rank): w.pid for w in workers})
        self.control.training = True
        try:
            outcome, plan = self._watch(attempt)
        finally:
            self.control.training = False
        if outcome in (Outcome.SUCCEEDED, Outcome.STOPPED):
            if outcome == Outcome.SUCCEEDED:
                self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=outcome.value)
            return outcome, plan
        # failure of some kind, or a new plan: survivors are killed at once — their collectives can't complete
        self.group.stop(signal.SIGKILL, 10.0, self._serve)
        if outcome == Outcome.FAILED:
            # the summary lists every failed rank, as torchrun's does; not reported again: the supervisor
            # already decides on this attempt's first failure
            for ex in self.group.late_failures(attempt, {f.rank for f in self.failures if f.attempt == attempt}):
                self._add_failure(ex)
        if self.monitor is not None:
            self.monitor.attempt_stopped()
        self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=outcome.value)
        return outcome, plan

    def _watch(self, attempt: int) -> tuple[Outcome, dict | None]:
        while True:
            if self._signal is not None:
                return Outcome.STOPPED, None
            exited = self._serve(self._watch_timeout())
            failed = False
            for w in exited:  # every failing worker of the batch is recorded: simultaneous failures all matter
                if w.exit_code != 0:
                    self._add_failure(WorkerExit(w.local_rank, w.rank, w.pid or -1, w.exit_code or 0,
                                                 w.exit_wall or time.time(), w.error_file, attempt), report=True)
                    failed = True
            if failed:
                return Outcome.FAILED, None
            if exited and all(w.exit_code == 0 for w in self.group.workers):
                return Outcome.SUCCEEDED, None
            if self.monitor is not None:
                hung = False
                for ev in self.monitor.tick(time.monotonic()):
                    if ev.kind == EventKind.HANG:
                        self.control.training = False  # a hung rank: this attempt's workers are done for
                    self._observe(ev)  # every event of the tick: the suspect comes first, the rest matter too
                    if ev.kind == EventKind.HANG:
                        logger.error("rank %s hung: %s", ev.rank, ev.details)
                        self._hang_note = f"rank {ev.rank} hung (no heartbeat)"
                        hung = True
                if hung:
                    return Outcome.HUNG, None
            plan = self._control_pass()
            if plan is not None:
                return Outcome.PEER_FAILED, plan
            if self.control.cut_off:
                logger.error("this node is cut off from the majority of the job's nodes and its supervisor stood "
                             "down: stopping its workers (their collectives need the others, which go on without "
                             "them)")
                return Outcome.PEER_FAILED, None

    def _need(self, last: tuple[str, float] | None) -> str:
        """Why this node waits for a plan now, for the line that says it gave up waiting."""
        if self.control.cut_off:
            return "this node was cut off from the majority of the job's nodes (its supervisor stood down)"
        if last is not None:
            return f"this node's workers {'hung' if last[0] == Outcome.HUNG.value else 'failed'} and it needed a decision"
        if self._done_round is not None and self._done_round == self.round:
            return "this node's workers had finished and it waited for the job's end"
        if self.node_round.role == NodeRole.SPARE:
            return "this node waited as a spare"
        return "this node waited for its first plan" if self.node_round.role == NodeRole.JOINING else \
            "this node waited for its next plan"

    def _await_plan(self, need: str) -> dict | None:
        """Wait for a plan newer than the current round; None when a signal came first. Raises
        SupervisorUnreachable once no supervisor could be reached for --supervisor-timeout seconds of this wait
        (``need``: why this node waits), StoreLost when the job's store stayed unreachable for
        ``--rendezvous-timeout`` (a longer bound set lower than --supervisor-timeout)."""
        since = time.monotonic()
        bound = self.cfg.supervisor_bound
        while True:
            if self._signal is not None:
                return None
            plan = self._control_pass()
            if plan is not None:
                return plan
            lost = self.control.lost_for()
            if lost > 0:
                self.control.say_waiting()
            if lost > self.cfg.rendezvous_timeout:
                raise StoreLost(f"the job's store stayed unreachable for {self.cfg.rendezvous_timeout:.0f}s")
            # counted from the later of the loss and the need: a supervisor away while healthy workers trained
            # (fail static) still gets the whole bound to come back once a decision is needed
            waited = min(lost, time.monotonic() - since)
            if lost > 0 and waited >= bound:
                raise SupervisorUnreachable(need, waited)
            self._serve(self.cfg.monitor_interval)

    def _watch_timeout(self) -> float:
        """The drill's due faults, carried out (once per pass while workers run); how long the pass's wait may be:
        the monitor's next deadline and the drill's next fault cut it short."""
        timeout = self.cfg.monitor_interval
        if self.monitor is not None and (nd := self.monitor.next_deadline()) is not None:
            timeout = min(timeout, max(0.0, nd - time.monotonic()))
        if self.injector is not None and (due := self.injector.tick(
                self.group.live_pids(), self.group_rank, self.cfg.ckpt_local or self._default_ckpt_local(),
                self.group.kill_node)) is not None:
            timeout = min(timeout, due)
        return timeout

    def _control_pass(self, plans: bool = True) -> dict | None:
        """The pass's control work: automatic preload, then heartbeat, reconnect and the next plan (no supervisor
        pass here: the loop's own thread ticks; kicks follow only this agent's reports)."""
        self.preload.refresh(self.group, self.node_round.active, self.control.fetch_learned, self.control.publish_learned)
        if self.forward is not None:
            self.forward.pump(self.control.report)
        return self.control.poll(self.node_round, self._done_round) if plans else None

    def _serve(self, timeout: float) -> list[WorkerProc]:
        """One wait on the agent's descriptors: signals, detector events (recorded, and forwarded when they may
        need a decision), worker output; returns the workers whose exits arrived."""
        exited: list[WorkerProc] = []
        if self.group.pending_exits():
            # read along with the spawn answers (a fast exit, learned modules): the socket won't wake us for them
            exited += self.group.collect_exits()
            timeout = 0
        for key, _ in self.sel.select(timeout=timeout):
            if key.data == "exit":
                exited += self.group.collect_exits()
            elif key.data == "signal":
                try:
                    os.read(self._sig_r, 512)
                except BlockingIOError:
                    pass
            elif key.data == "monitor" and self.monitor is not None:
                for ev in self.monitor.on_readable(time.monotonic()):
                    self._observe(ev)
            elif isinstance(key.data, tuple) and key.data[0] == "log":
                self.group.pump(key.fd)
        return exited

    # ---------------------------------------------------------------- what happened
    def _add_failure(self, ex: WorkerExit, report: bool = False) -> None:
        self.failures.append(ex)
        if report:
            ev = self.ledger.emit(EventKind.WORKER_EXIT, rank=ex.rank, attempt=ex.attempt, pid=ex.pid,
                                  exit_code=ex.exit_code, signal=ex.signal_name, local_rank=ex.local_rank,
                                  detect_seconds=round(max(0.0, time.time() - ex.wall), 4), **self.group.cause(ex))
        logger.warning("worker %s", ex.describe())
        if report:
            self.control.training = False  # a failed worker: the node's workers of this attempt are done for
            self.control.report(ev)

    def _observe(self, ev: Event) -> None:
        """A detector's event: into the node's ledger, and to the supervisor when it may need a decision."""
        from resilient.supervisor.loop import FORWARDED

        self.ledger.write(ev)
        if ev.kind in FORWARDED:
            self.control.report(ev)

    # ---------------------------------------------------------------- endings
    def _leave(self, end: Ending) -> Ending:
        self.control.leave(end.reason)
        return end

    def _on_stopped(self, attempt: int) -> Ending:
        """A signal to the agent (the scheduler's preemption notice, or Ctrl-C): forward it, then leave."""
        c = self.cfg
        sig = self._signal or signal.SIGTERM
        if sig == signal.SIGTERM:
            ev = self.ledger.emit(EventKind.PREEMPTION_NOTICE, attempt=attempt, source="SIGTERM",
                                  deadline=time.time() + c.term_timeout)
            # the supervisor hears a preemption as what it is, before this node goes, not as a lost node: a spare
            # takes its place, or the job shrinks, once the step every rank agrees to stop after is saved
            self.control.report(ev)
        logger.warning("received %s: forwarding to workers", signal.Signals(sig).name)
        self.group.stop(sig, c.term_timeout, self._serve)
        self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=f"signal {signal.Signals(sig).name}")
        end = exit_code(Outcome.STOPPED, None, signum=sig,
                        preempted=preempted_cleanly(self.group.preempt_marked(attempt)))
        if end.reason == "preempted":
            # the supervisor goes with this node: the others stop after the agreed step too and exit 75
            self.control.end_preempted(f"node {self.node}, which hosts the supervisor, was preempted", c.term_timeout)
            self._leave(end)
            logger.warning("preempted: every worker saved its last step; rerun the same command to resume")
            return end
        return self._leave(end)

    def _final(self, plan: dict) -> Ending:
        preempted = self._ran and preempted_cleanly(self.group.preempt_marked(self.restart_count))
        end = exit_code(Outcome.SUCCEEDED, plan, preempted=preempted)
        if plan.get("stop") is not None:
            if self.failures:
                print(failure_summary(self.cfg.script_name, self.failures), file=sys.stderr)
            else:
                print(f"resilient-run: the supervisor stopped the job: {plan['stop']}", file=sys.stderr)
        self.control.wait_settled(lambda: self._signal is not None, self.cfg.monitor_interval)
        if end.reason == "preempted":
            logger.warning("preempted: every worker saved its last step; rerun the same command to resume")
        return end

    def _shutdown(self) -> None:
        self.group.close(self._serve)
        for part in (self.monitor, self.metrics, self.preload, self.forward):
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # noqa: BLE001
                    logger.debug("closing %s: %s", type(part).__name__, e)
        self.control.close()
        signal.set_wakeup_fd(-1)
