"""One node's workers of the current attempt: the starter they come from, their output, their exits.

:class:`WorkerGroup` is the one writer of the starter in use and of the list of workers. It knows starters only
through the :class:`~resilient.launcher.starters.WorkerStarter` protocol; exits and output arrive on descriptors
registered with the agent's selector, so the agent's one wait sees them the moment they happen.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from resilient import env as renv
from resilient.launcher.api import AgentConfig, NodeRound, WorkerExit
from resilient.launcher.exit import failure_cause, oom_kills
from resilient.launcher.starters import ForkServerError, SpawnStarter, WorkerProc, WorkerStarter, signal_workers

logger = logging.getLogger(__name__)


def _keep_local_default() -> object:
    import dataclasses

    from resilient.checkpoint.api import CheckpointConfig

    return next((f.default for f in dataclasses.fields(CheckpointConfig) if f.name == "keep_local"), "?")


def default_ckpt_local(cfg: AgentConfig, run_dir: Path) -> str | None:
    """Resilience by default: with no --ckpt-* flag, CheckpointManager.from_env() gets a local tier under
    the run directory (per host: a run directory on a shared file system must not mix nodes' shards);
    the manager's retention keeps it to the newest few steps."""
    if cfg.ckpt_local or cfg.ckpt_persistent:
        return None
    return str(run_dir.resolve() / "ckpt" / (socket.gethostname() if not cfg.single_node else "local"))


def say_default_ckpt_local(path: str | None) -> None:
    if path is not None:
        logger.warning("no --ckpt-local/--ckpt-persistent given: CheckpointManager.from_env() saves to %s "
                       "(newest %s steps kept); pass --ckpt-local/--ckpt-persistent to choose", path,
                       _keep_local_default())


def worker_env(cfg: AgentConfig, nr: NodeRound, local_rank: int, attempt: int, master: tuple[str, int], *,
               run_dir: Path, node: str, ckpt_local: str | None, monitor_socket: str | None,
               drill_env: dict[str, str], snapshot_dir: str | None = None) -> dict[str, str]:
    """The environment of one worker: torchrun's variables, then ours (:class:`resilient.env.WorkerEnv`)."""
    c = cfg
    rank = nr.base_rank + local_rank
    # a replica's nodes hold consecutive group ranks, so its ranks are consecutive: dp is the outermost dimension
    rpr, dp_size = nr.dp_layout(c.nproc_per_node)
    env = dict(os.environ)
    env.update({
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "GROUP_RANK": str(nr.group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": c.role,
        "LOCAL_WORLD_SIZE": str(c.nproc_per_node),
        "WORLD_SIZE": str(nr.world_size),
        "GROUP_WORLD_SIZE": str(nr.group_world_size),
        "ROLE_WORLD_SIZE": str(nr.world_size),
        # torchrun's standalone runs say localhost; scripts and tools compare it
        "MASTER_ADDR": "localhost" if c.standalone and master[0] == "127.0.0.1" else master[0],
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(nr.max_restarts),
        "TORCHELASTIC_RUN_ID": c.rdzv_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    if c.virtual_local_rank:
        # as torchrun: each worker sees only its own GPU, as device 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible is not None else [str(i) for i in range(c.nproc_per_node)]
        if local_rank >= len(devices):
            raise ValueError(f"local rank {local_rank} exceeds the GPUs in CUDA_VISIBLE_DEVICES={visible}")
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank].strip()
    env.pop(renv.CKPT_SNAPSHOT_DIR, None)  # an outer job's, inherited: only this node's own directory is set
    env.update(renv.WorkerEnv(
        run_dir=str(run_dir.resolve()), run_id=c.run_id, node=node, node_rank=nr.group_rank,
        agent_socket=monitor_socket, ckpt_local=c.ckpt_local or ckpt_local, ckpt_persistent=c.ckpt_persistent,
        ckpt_interval=c.ckpt_interval, ckpt_persistent_every=c.ckpt_persistent_every, ckpt_compress=c.ckpt_compress,
        upload_grace=c.upload_grace, ckpt_max_failed_saves=c.ckpt_max_failed_saves,
        ckpt_snapshot=(None if snapshot_dir is None else "0" if c.ckpt_snapshot == "off" else c.ckpt_snapshot),
        ckpt_snapshot_dir=snapshot_dir, ckpt_upload_process=c.ckpt_upload_process,
        heartbeat_timeout=c.heartbeat_timeout, policy=c.policy, spare_nodes=c.spare_nodes or None,
        dp_size=dp_size, dp_rank=rank // rpr, nodes_per_replica=nr.nodes_per_replica,
        round_reason=nr.reason,
        # the GPU is the worker's own local rank, as torchrun binds it (before --virtual-local-rank renames it 0)
        numa_binding=None if c.numa_binding is None else f"{c.numa_binding}:{local_rank}").to_env())
    env.update(drill_env)
    return env


def start_monitor(cfg: AgentConfig, ledger: object, group_rank: int, default_local: str | None,
                  sel: selectors.BaseSelector) -> tuple[str | None, object]:
    """The node monitor that watches the workers (heartbeats, hangs, stragglers, the local tier's disk), and the
    socket its workers report to; (None, None) when it is unavailable: training goes on without the detectors."""
    try:
        from resilient.signals.api import MonitorConfig
        from resilient.signals.monitor import create_node_monitor
    except ImportError:
        return None, None
    sock = f"@resilient-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mcfg = MonitorConfig(socket_path=sock, heartbeat_timeout=cfg.heartbeat_timeout,
                         initial_timeout=cfg.startup_timeout,
                         ckpt_local=cfg.ckpt_local or default_local,  # the default tier's disk too
                         health_interval=cfg.health_interval)
    try:
        monitor = create_node_monitor(mcfg, ledger, group_rank)
    except Exception as e:  # noqa: BLE001 - fail static
        logger.warning("node monitor unavailable (%s); hang and straggler detection are off", e)
        return sock, None
    sel.register(monitor.fileno(), selectors.EVENT_READ, "monitor")
    return sock, monitor


def record_previous_world(run_dir: Path, previous_world_size: int, previous_dp_size: int | None = None, *,
                          attempt: int | None = None, sat_out: bool = False) -> None:
    """Before a round's workers start on a node that did not train in the round before (``sat_out``: a spare, a
    node benched or lost and back): give its run directory the previous round's world (and data-parallel size,
    default the world size), so its ranks run the ``on_scale`` callbacks like everyone else's. Without a record
    (a node that never trained here) always; over a record this machine wrote for an attempt other than the round
    before (``attempt`` - 1): that one is this node's own, from before it sat out, where every other node's
    record is of the round they trained in since. A record another machine wrote (a shared run directory), or one
    of the round before, is the job's: it stays."""
    from resilient.worker.scale import read_world, record_world

    rec = read_world(run_dir)
    stale = (rec is not None and sat_out and attempt is not None and rec.attempt != attempt - 1
             and rec.host == socket.gethostname())
    if rec is None or stale:
        if stale:
            logger.info("this node's world record (world %d, attempt %s) is from before it sat out: recording the "
                        "previous round's world %d", rec.world_size, rec.attempt, previous_world_size)  # type: ignore[union-attr]
        try:
            record_world(run_dir, previous_world_size, previous_dp_size,
                         attempt=None if attempt is None else attempt - 1)
        except (OSError, ValueError) as e:
            logger.warning("cannot record the previous world size: %s", e)


class Streams:
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


class WorkerGroup:
    """This node's workers: started from one starter, their output tee'd, their exits collected, stopped."""

    def __init__(self, cfg: AgentConfig, run_dir: Path, sel: selectors.BaseSelector) -> None:
        self.cfg, self.run_dir, self.sel = cfg, run_dir, sel
        self.starter: WorkerStarter | None = None  # written by use() only
        self._starter_fd = -1
        self.workers: list[WorkerProc] = []
        self.oom_at_start: int | None = None  # the cgroup's OOM kill count when the attempt's workers started
        self.streams = Streams()

    # ---------------------------------------------------------------- the starter
    def use(self, starter: WorkerStarter) -> None:
        """Start workers from ``starter`` from now on; the caller decides what becomes of the old one."""
        if self._starter_fd >= 0:
            self.sel.unregister(self._starter_fd)
        self.starter = starter
        self._starter_fd = starter.fileno()
        self.sel.register(self._starter_fd, selectors.EVENT_READ, "exit")

    def await_ready(self) -> None:
        assert self.starter is not None
        try:
            self.starter.wait_ready()
        except ForkServerError as e:
            logger.warning("fork server unavailable (%s); starting workers as fresh interpreters", e)
            self.use(SpawnStarter())

    def _fall_back_to_spawn(self) -> None:
        old = self.starter
        self.use(SpawnStarter())
        if old is not None:
            old.close()

    # ---------------------------------------------------------------- workers
    def _log_dir(self, attempt: int, rank: int) -> Path:
        # keyed by the global rank, unique across the nodes of an attempt: the run directory (and --log-dir) may be
        # one volume shared by every node, where local ranks collide and one node's worker would overwrite, or
        # truncate while it is read, another node's error file (its failure then read as unknown)
        base = Path(self.cfg.log_dir) / self.cfg.run_id if self.cfg.log_dir else self.run_dir / "logs"
        d = base / f"attempt_{attempt}" / str(rank)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def start(self, attempt: int, base_rank: int, env_of: Callable[[int], dict[str, str]]) -> None:
        c = self.cfg
        n = c.nproc_per_node
        redirects, tees = _std_map(c.redirects, n), _std_map(c.tee, n)
        self.workers = []
        for lr in range(n):
            d = self._log_dir(attempt, base_rank + lr)
            w = WorkerProc(local_rank=lr, rank=base_rank + lr, env=env_of(lr), error_file=str(d / "error.json"))
            w.env["TORCHELASTIC_ERROR_FILE"] = w.error_file  # type: ignore[assignment]
            Path(w.error_file).unlink(missing_ok=True)  # an earlier run's file would name another failure's cause
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
        self.oom_at_start = oom_kills()
        assert self.starter is not None
        try:
            self.starter.start(c.command, self.workers, os.getcwd())
        except ForkServerError as e:
            logger.warning("fork server failed (%s); falling back to fresh interpreters", e)
            self._fall_back_to_spawn()
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
        for rfd in self.streams.pipes:
            if rfd not in self.sel.get_map():
                self.sel.register(rfd, selectors.EVENT_READ, ("log", rfd))

    def any_alive(self) -> bool:
        return any(w.pid is not None and w.exit_code is None for w in self.workers)

    def live_pids(self) -> dict[int, int]:
        """This node's ranks that run, and their pids."""
        return {w.rank: w.pid for w in self.workers if w.exit_code is None and w.pid}

    def stop(self, first_sig: int, grace: float, wait: Callable[[float], object]) -> None:
        """Signal every live worker, wait up to ``grace`` for them (``wait`` is the agent's one wait: exits,
        output and signals go on being served), then SIGKILL; reap all."""
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
            wait(left)

    def collect_exits(self) -> list[WorkerProc]:
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
            self._fall_back_to_spawn()
            return out

    def pending_exits(self) -> bool:
        """Exits the starter read already: its descriptor will not wake the agent for them."""
        return self.starter is not None and self.starter.buffered()

    def pump(self, fd: int) -> None:
        if not self.streams.pump(fd):
            self.sel.unregister(fd)

    def cause(self, ex: WorkerExit) -> dict:
        """The cause a worker_exit event carries (its error file, an OOM kill since this attempt started, the
        failure class): :func:`resilient.launcher.exit.failure_cause`."""
        return failure_cause(ex, self.oom_at_start, oom_kills())

    def late_failures(self, attempt: int, recorded: set[int]) -> list[WorkerExit]:
        """Workers that failed on their own while the first failure was handled (a rank whose peer died fails
        in its collective), but not the ones the agent killed."""
        return [WorkerExit(w.local_rank, w.rank, w.pid or -1, w.exit_code, w.exit_wall or time.time(),  # type: ignore[arg-type]
                           w.error_file, attempt)
                for w in self.workers if w.rank not in recorded and w.exit_code not in (None, 0, -signal.SIGKILL)]

    def kill_node(self) -> None:
        """A drill's lost node: workers, fork server and this agent SIGKILLed, nothing cleaned up."""
        signal_workers([w for w in self.workers if w.exit_code is None], signal.SIGKILL)
        pid = getattr(getattr(self.starter, "proc", None), "pid", None)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    # ---------------------------------------------------------------- marks the workers leave
    def clear_marks(self, attempt: int, base_rank: int) -> None:
        """Marks of an earlier run in this run dir do not count."""
        from resilient.checkpoint.api import CKPT_STOP_MARK_DIR
        from resilient.worker.preemption import PREEMPT_MARK_DIR

        for r in range(base_rank, base_rank + self.cfg.nproc_per_node):
            (self.run_dir / PREEMPT_MARK_DIR / f"attempt{attempt}.rank{r}").unlink(missing_ok=True)
            (self.run_dir / CKPT_STOP_MARK_DIR / f"attempt{attempt}.rank{r}").unlink(missing_ok=True)

    def preempt_marked(self, attempt: int) -> dict[int, bool]:
        """Each worker's exit code is 0 and it left the mark of a loop ended for a preemption notice."""
        from resilient.worker.preemption import PREEMPT_MARK_DIR

        marks = self.run_dir / PREEMPT_MARK_DIR
        return {w.rank: w.exit_code == 0 and (marks / f"attempt{attempt}.rank{w.rank}").exists() for w in self.workers}

    def ckpt_stop_mark(self, attempt: int, base_rank: int) -> str | None:
        """Why the workers of ``attempt`` stopped for failed checkpoint saves (they leave a mark, then exit 0
        so that nothing restarts them into the same failures), or None."""
        from resilient.checkpoint.api import CKPT_STOP_MARK_DIR

        for r in range(base_rank, base_rank + self.cfg.nproc_per_node):
            try:
                body = json.loads((self.run_dir / CKPT_STOP_MARK_DIR / f"attempt{attempt}.rank{r}").read_text())
            except (OSError, ValueError):
                continue
            return str(body.get("message") or "checkpoint saves kept failing") if isinstance(body, dict) else None
        return None

    def close(self, wait: Callable[[float], object]) -> None:
        try:
            self.stop(signal.SIGKILL, 10.0, wait)
        except Exception as e:  # noqa: BLE001
            logger.error("stopping workers: %s", e)
        self.streams.close()
        if self.starter is not None:
            try:
                self.starter.close()
            except Exception as e:  # noqa: BLE001
                logger.debug("closing %s: %s", type(self.starter).__name__, e)
