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
from datetime import timedelta
from pathlib import Path

from resilient import env as renv
from resilient.events import EventKind, Ledger
from resilient.launcher.api import AgentConfig, Outcome, WorkerExit, WorkerLaunchMethod
from resilient.launcher.workers import ForkServer, ForkServerError, SpawnStarter, WorkerProc, signal_workers

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
KEY = "resilient"


class _Streams:
    """Tee'd worker output: read from pipes, written to the log file and (filtered) to the console."""

    def __init__(self) -> None:
        # rfd → [log fd, console, prefix, show, at start of a line]
        self.pipes: dict[int, list] = {}

    def add(self, rfd: int, log_path: Path, console: object, prefix: str, show: bool) -> None:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pipes[rfd] = [log_fd, console, prefix, show, True]

    def pump(self, rfd: int) -> bool:
        """Copy what is readable; False at end of stream."""
        st = self.pipes[rfd]
        log_fd, console, prefix, show, at_start = st
        try:
            data = os.read(rfd, 65536)
        except BlockingIOError:
            return True
        if not data:
            os.close(rfd)
            os.close(log_fd)
            del self.pipes[rfd]
            return False
        os.write(log_fd, data)
        if show:
            # unbuffered workers write a line in pieces: prefix only where a line starts
            out = []
            for piece in data.decode(errors="replace").splitlines(keepends=True):
                out.append(f"{prefix}{piece}" if at_start else piece)
                at_start = piece.endswith("\n")
            st[4] = at_start
            console.write("".join(out))  # type: ignore[attr-defined]
            console.flush()  # type: ignore[attr-defined]
        return True

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
        self._signal: int | None = None
        self._sig_r, self._sig_w = os.pipe()
        for fd in (self._sig_r, self._sig_w):
            os.set_blocking(fd, False)
        self._attempt_store = None
        self.restart_count = 0
        self._interruptible = False

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
            self.starter = ForkServer(self._preload_modules(), tag=f"run={self.run_dir.resolve()}")
        except OSError as e:
            logger.warning("fork server unavailable (%s); starting workers as fresh interpreters", e)
            self.starter = SpawnStarter()

    def _preload_modules(self) -> tuple[str, ...]:
        """What the fork server imports ahead of time: what every resilient worker imports anyway
        (soft: a failure only costs speed), then the user's ``--preload`` modules (hard)."""
        # DistributedDataParallel imports torch._dynamo on construction: seconds per restart otherwise
        soft = ["torch._dynamo", "torch.distributed.checkpoint", "torch.nn.parallel", "resilient.checkpoint.manager",
                "resilient.signals.client"]
        if (self.cfg.ckpt_persistent or "").startswith("gs://"):
            soft.append("gcsfs")
        return tuple(f"?{m}" for m in soft) + tuple(self.cfg.preload)

    def _await_starter(self) -> None:
        if isinstance(self.starter, ForkServer):
            try:
                self.starter.wait_ready()
            except ForkServerError as e:
                logger.warning("fork server unavailable (%s); starting workers as fresh interpreters", e)
                self.starter = SpawnStarter()

    def _rendezvous(self) -> tuple[object, int, int]:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        c = self.cfg
        params = RendezvousParameters(
            backend=c.rdzv_backend, endpoint=c.rdzv_endpoint, run_id=c.rdzv_id,
            min_nodes=c.min_nodes, max_nodes=c.max_nodes, local_addr=c.local_addr, **c.rdzv_configs,
        )
        self.rdzv_handler = get_rendezvous_handler(params)
        t0 = time.monotonic()
        info = self.rdzv_handler.next_rendezvous()
        self.ledger.emit(EventKind.RENDEZVOUS_DONE, group_rank=info.rank, group_world_size=info.world_size,
                         seconds=round(time.monotonic() - t0, 4))
        return info.store, info.rank, info.world_size

    def _assign_ranks(self) -> None:
        """Global ranks by node rank order; one role, so role ranks equal global ranks."""
        n = self.cfg.nproc_per_node
        if self.group_world_size == 1:
            self.base_rank, self.world_size = 0, n
            return
        self.store.set(f"{KEY}/lws/{self.group_rank}", str(n))
        keys = [f"{KEY}/lws/{i}" for i in range(self.group_world_size)]
        self.store.wait(keys, timedelta(seconds=self.cfg.rendezvous_timeout))
        sizes = [int(v) for v in self.store.multi_get(keys)]
        self.base_rank = sum(sizes[: self.group_rank])
        self.world_size = sum(sizes)

    def _advertised_addr(self) -> str:
        if self.cfg.local_addr:
            return self.cfg.local_addr
        if self.group_world_size == 1:
            return "127.0.0.1"
        return socket.getfqdn()

    def _attempt_master(self, attempt: int) -> tuple[str, int]:
        """A fresh store per attempt, hosted by node 0's agent: no stale key can reach a new attempt."""
        import torch.distributed as dist

        key = f"{KEY}/master/{attempt}"
        if self.group_rank == 0:
            store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.cfg.rendezvous_timeout))
            self._attempt_store = store  # the previous attempt's server closes with its last reference
            addr = self._advertised_addr()
            if self.group_world_size > 1:
                self.store.set(key, f"{addr}:{store.port}")
            return addr, store.port
        self.store.wait([key], timedelta(seconds=self.cfg.rendezvous_timeout))
        addr, port = self.store.get(key).decode().rsplit(":", 1)
        return addr, int(port)

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
            "MASTER_ADDR": master[0],
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
            renv.CKPT_LOCAL: c.ckpt_local, renv.CKPT_PERSISTENT: c.ckpt_persistent,
            renv.CKPT_INTERVAL: c.ckpt_interval,
            renv.CKPT_PERSISTENT_EVERY: None if c.ckpt_persistent_every is None else str(c.ckpt_persistent_every),
            renv.HEARTBEAT_TIMEOUT: None if c.heartbeat_timeout is None else str(c.heartbeat_timeout),
            renv.POLICY: c.policy, renv.SPARE_NODES: str(c.spare_nodes) if c.spare_nodes else None,
        }
        env.update({k: v for k, v in optional.items() if v is not None})
        return env

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
            for key, _ in self.sel.select(timeout=left):
                if key.data == "exit":
                    self._collect_exits()
                elif isinstance(key.data, tuple) and key.data[0] == "log":
                    if not self.streams.pump(key.fd):
                        self.sel.unregister(key.fd)
                elif key.data == "signal":
                    self._read_signal()
                elif key.data == "monitor" and self.monitor is not None:
                    self.monitor.on_readable(time.monotonic())

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
        multi = self.group_world_size > 1
        fail_key = f"{KEY}/fail/{attempt}"
        while True:
            if self._signal is not None:
                return Outcome.STOPPED
            timeout = None
            if self.monitor is not None:
                nd = self.monitor.next_deadline()
                if nd is not None:
                    timeout = max(0.0, nd - time.monotonic())
            if multi:
                timeout = self.cfg.monitor_interval if timeout is None else min(timeout, self.cfg.monitor_interval)
            for key, _ in self.sel.select(timeout=timeout):
                if key.data == "exit":
                    for w in self._collect_exits():
                        if w.exit_code != 0:
                            ex = WorkerExit(w.local_rank, w.rank, w.pid or -1, w.exit_code or 0,
                                            w.exit_wall or time.time(), w.error_file)
                            self.failures.append(ex)
                            if self.first_failure is None:
                                self.first_failure = ex
                            self.ledger.emit(EventKind.WORKER_EXIT, rank=w.rank, attempt=attempt, pid=w.pid,
                                             exit_code=w.exit_code, signal=ex.signal_name, local_rank=w.local_rank,
                                             detect_seconds=round(max(0.0, time.time() - ex.wall), 4))
                            if multi:
                                self.store.set(fail_key, f"{self.group_rank}:worker_exit")
                            return Outcome.FAILED
                    if all(w.exit_code == 0 for w in self.workers):
                        return Outcome.SUCCEEDED
                elif key.data == "signal":
                    self._read_signal()
                elif key.data == "monitor" and self.monitor is not None:
                    for ev in self.monitor.on_readable(time.monotonic()):
                        self.ledger.write(ev)
                elif isinstance(key.data, tuple) and key.data[0] == "log":
                    if not self.streams.pump(key.fd):
                        self.sel.unregister(key.fd)
            if self.monitor is not None:
                hung = False
                for ev in self.monitor.tick(time.monotonic()):
                    self.ledger.write(ev)  # every event of the tick: the suspect comes first, the rest matter too
                    if ev.kind == EventKind.HANG:
                        logger.error("rank %s hung: %s", ev.rank, ev.details)
                        hung = True
                if hung:
                    if multi:
                        self.store.set(fail_key, f"{self.group_rank}:hang")
                    return Outcome.HUNG
            if multi and self.store.check([fail_key]):
                return Outcome.PEER_FAILED

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
            self._start_workers_backend()  # the fork server imports torch while we rendezvous
            self._interruptible = True
            try:
                self.store, self.group_rank, self.group_world_size = self._rendezvous()
                self._await_starter()
                self._assign_ranks()
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
            exit_code, reason = self._attempts()
        finally:
            self._shutdown()
            self.ledger.emit(EventKind.RUN_END, exit_code=exit_code, reason=reason)
            self.ledger.close()
        return exit_code

    def _start_monitor(self) -> None:
        try:
            from resilient.signals.api import MonitorConfig
            from resilient.signals.monitor import create_node_monitor
        except ImportError:
            return
        self.monitor_socket = f"@resilient-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        cfg = MonitorConfig(socket_path=self.monitor_socket, heartbeat_timeout=self.cfg.heartbeat_timeout,
                            ckpt_local=self.cfg.ckpt_local)
        try:
            self.monitor = create_node_monitor(cfg, self.ledger, self.group_rank)
        except Exception as e:  # noqa: BLE001 - fail static: training goes on without the detectors
            logger.warning("node monitor unavailable (%s); hang and straggler detection are off", e)
            return
        self.sel.register(self.monitor.fileno(), selectors.EVENT_READ, "monitor")

    def _start_metrics(self) -> None:
        if self.cfg.metrics_port is None or self.group_rank != 0:
            return
        try:
            from resilient.goodput.metrics import MetricsServer

            self.metrics = MetricsServer(self.cfg.metrics_port, str(self.run_dir), addr=self.cfg.metrics_addr)
            self.metrics.start()
        except Exception as e:  # noqa: BLE001 - fail static: training goes on without the endpoint
            logger.warning("metrics endpoint on port %s unavailable: %s", self.cfg.metrics_port, e)

    def _attempts(self) -> tuple[int, str]:
        c = self.cfg
        attempt = 0
        while True:
            self.restart_count = attempt
            master = self._attempt_master(attempt)
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
            t_detect = time.time()
            if outcome == Outcome.SUCCEEDED:
                self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=outcome.value)
                self._exit_barrier()
                return 0, "succeeded"
            if outcome == Outcome.STOPPED:
                sig = self._signal or signal.SIGTERM
                if sig == signal.SIGTERM:
                    self.ledger.emit(EventKind.PREEMPTION_NOTICE, attempt=attempt, source="SIGTERM",
                                     deadline=time.time() + c.term_timeout)
                logger.warning("received %s: forwarding to workers", signal.Signals(sig).name)
                self._stop_workers(sig, c.term_timeout)
                self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=f"signal {signal.Signals(sig).name}")
                # torchrun exits 1 when stopped by a signal; schedulers and wrappers rely on it
                return 1, f"signal {signal.Signals(sig).name}"
            # failure of some kind: survivors are killed at once — their collectives can't complete anyway
            self._stop_workers(signal.SIGKILL, 10.0)
            if self.monitor is not None:
                self.monitor.attempt_stopped()
            self.ledger.emit(EventKind.ATTEMPT_END, attempt=attempt, reason=outcome.value)
            if attempt >= c.max_restarts:
                self._print_failure_summary()
                return 1, f"{outcome.value}, no restarts left ({c.max_restarts})"
            attempt += 1
            fault_wall = self.failures[-1].wall if outcome == Outcome.FAILED and self.failures else t_detect
            self.ledger.emit(EventKind.RESTART, attempt=attempt, cause=outcome.value,
                             detect_seconds=round(max(0.0, t_detect - fault_wall), 4))
            logger.warning("%s; restarting workers (attempt %d of at most %d)", outcome.value, attempt,
                           c.max_restarts)

    def _exit_barrier(self) -> None:
        """Node 0's agent hosts the stores: it stays until every node's workers are done (as torchrun's 300 s)."""
        if self.group_world_size == 1:
            return
        try:
            self.store.add(f"{KEY}/done", 1)
            deadline = time.monotonic() + 300
            while int(self.store.add(f"{KEY}/done", 0)) < self.group_world_size:
                if time.monotonic() > deadline or self._signal is not None:
                    break
                try:
                    self.store.wait([f"{KEY}/all_done"], timedelta(seconds=1))
                    break
                except Exception:  # noqa: BLE001 - store.wait timeouts are RuntimeError subclasses
                    continue
            self.store.set(f"{KEY}/all_done", "1")
        except Exception as e:  # noqa: BLE001 - a peer or the store went away after success: nothing to lose
            logger.debug("exit barrier: %s", e)

    def _print_failure_summary(self) -> None:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

        failures = {}
        for f in self.failures[-self.cfg.nproc_per_node:] or ([self.first_failure] if self.first_failure else []):
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
        for part in (self.monitor, self.metrics, self.starter):
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # noqa: BLE001
                    logger.debug("closing %s: %s", type(part).__name__, e)
        handler = getattr(self, "rdzv_handler", None)
        if handler is not None:
            try:
                handler.shutdown()
            except Exception as e:  # noqa: BLE001
                logger.debug("rendezvous shutdown: %s", e)
        self._attempt_store = None
        signal.set_wakeup_fd(-1)
