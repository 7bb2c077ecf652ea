"""``resilient supervisor``: the supervisor as its own process, on a CPU host (a Kubernetes pod, the Slurm
batch host), hosting the rendezvous store and the per-round stores, so that no training node is special:
losing node 0 is like losing any node.

    resilient supervisor --rdzv-endpoint HOST:PORT --nnodes MIN:MAX [--rdzv-id ID] [--spare-nodes N] \\
        [--policy FILE] --run-dir DIR

Agents use the same ``--rdzv-endpoint``, and the same ``--rdzv-id`` (the job's id); without ``--rdzv-id`` this
supervisor serves the id of the first agent that reaches it, and agents of another id are refused. If this process dies, agents keep their workers training (fail
static); started again with the same flags and run directory, it adopts the ledger's newest assignment and
the agents reconnect to it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from resilient import env as renv
from resilient.events.api import EventKind
from resilient.events.ledger import Ledger, read_events
from resilient.supervisor.api import PolicyError
from resilient.supervisor.config import SupervisorConfig, add_supervisor_arguments, parse_nnodes, supervisor_config

logger = logging.getLogger(__name__)

EXIT_SUCCEEDED, EXIT_STOPPED, EXIT_BAD_INPUT = 0, 1, 2


class _BadInput(Exception):
    pass


@dataclass
class StandaloneConfig:
    rdzv_endpoint: str
    supervisor: SupervisorConfig  # what decides: --nnodes, --max-restarts, --node-timeout, --policy-timeout
    run_dir: str
    spare_nodes: int = 0
    policy: str | None = None
    last_call: float = 30.0
    join_timeout: float = 600.0
    job_secret_file: str | None = None
    rdzv_id: str | None = None  # None: the first agent's id
    advertise_addr: str | None = None  # what workers use as MASTER_ADDR for the per-round stores
    store_timeout: float = 30.0
    name: str = field(default_factory=lambda: f"supervisor@{socket.gethostname()}")

    def __post_init__(self) -> None:
        _check_flags(self.spare_nodes, self.supervisor.max_restarts, self.supervisor.nproc_per_node,
                     self.supervisor.node_timeout, self.supervisor.policy_timeout, self.last_call, self.join_timeout)
        if self.rdzv_id is not None:
            from resilient.supervisor.transport import ANY_JOB, Keys

            if self.rdzv_id == ANY_JOB:
                raise _BadInput(f"--rdzv-id {ANY_JOB!r} is reserved; leave --rdzv-id out to serve the first "
                                "agent's id")
            try:
                Keys(self.rdzv_id)
            except ValueError as e:
                raise _BadInput(f"--rdzv-id: {e}") from None
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise _BadInput(f"--rdzv-endpoint must be HOST:PORT with a fixed port, got {self.rdzv_endpoint!r}")


def _check_flags(spare_nodes: int, max_restarts: int, nproc: int, node_timeout: float, policy_timeout: float,
                 last_call: float, join_timeout: float) -> None:
    if spare_nodes < 0 or max_restarts < 0 or nproc < 1:
        raise _BadInput("--spare-nodes and --max-restarts must be >= 0, --nproc-per-node >= 1")
    for flag, v in (("--node-timeout", node_timeout), ("--policy-timeout", policy_timeout),
                    ("--last-call-timeout", last_call), ("--join-timeout", join_timeout)):
        if not (v == v and 0 <= v < float("inf")) or (flag != "--last-call-timeout" and v == 0):
            raise _BadInput(f"{flag} must be a positive, finite number of seconds, got {v}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="resilient supervisor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="HOST:PORT the agents rendezvous at")
    p.add_argument("--nnodes", required=True, help="N or MIN:MAX active nodes")
    p.add_argument("--rdzv-id", "--rdzv_id", default=os.environ.get(renv.RDZV_ID) or None,
                   help="the job's id, as the agents' --rdzv-id (default: $PET_RDZV_ID, else the id of the first "
                        "agent that joins); agents of another id are refused")
    p.add_argument("--run-dir", "--run_dir", required=True, help="directory of the job's ledger (events.jsonl)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=3,
                   help="budget of restarts, swaps and scalings for the whole job (default 3); the agents show this "
                        "budget to their workers (TORCHELASTIC_MAX_RESTARTS) and in their restart lines, whatever "
                        "their own --max-restarts")
    p.add_argument("--last-call-timeout", type=float, default=30.0,
                   help="once MIN nodes joined, seconds to wait for more (up to MAX) before starting")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="seconds to wait for --nnodes MIN nodes before the job's first start; the job then stops "
                        "(default 600, torchrun's rendezvous join_timeout)")
    p.add_argument("--advertise-addr", default=None,
                   help="address workers use to reach the stores hosted here (default: this host's name)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    add_supervisor_arguments(p)
    return p


def parse(argv: list[str]) -> StandaloneConfig:
    a = build_parser().parse_args(argv)
    try:
        lo, hi = parse_nnodes(a.nnodes)
    except ValueError as e:
        raise _BadInput(str(e)) from None
    # the flags' own words first: SupervisorConfig's checks name its fields, not the flags
    _check_flags(a.spare_nodes, a.max_restarts, a.nproc_per_node, a.node_timeout, a.policy_timeout,
                 a.last_call_timeout, a.join_timeout)
    # nproc_per_node: only until the agents report their own
    try:
        sup = supervisor_config(a, min_nodes=lo, max_nodes=hi, nproc_per_node=a.nproc_per_node,
                                max_restarts=a.max_restarts)
    except ValueError as e:  # --nnodes MIN/MAX against --nodes-per-replica: its message names the flags
        raise _BadInput(str(e)) from None
    if a.policy is not None:  # loaded under the job's limits: a policy refused here would be refused in the job
        from resilient.supervisor.policy import load_policy

        try:
            load_policy(a.policy, limits=sup.policy_limits()).close()  # type: ignore[attr-defined]
        except PolicyError as e:
            raise _BadInput(str(e)) from None
    return StandaloneConfig(rdzv_endpoint=a.rdzv_endpoint, supervisor=sup, run_dir=a.run_dir,
                            spare_nodes=a.spare_nodes, policy=a.policy, last_call=a.last_call_timeout,
                            join_timeout=a.join_timeout,
                            job_secret_file=a.job_secret_file, advertise_addr=a.advertise_addr, rdzv_id=a.rdzv_id)


def supervise(core_cfg: SupervisorConfig, policy_file: str | None, store: object, signer: object,
              ledger: Ledger | None, *, advertise_addr: str, last_call: float, store_timeout: float,
              join_timeout: float = 600.0, tick: float | None = None, name: str | None = None, host_node: str | None = None,
              min_term: int = 0):
    """The supervisor wired up (core, policy, loop over the job's store), not started yet: the one way both
    ``resilient supervisor`` and the agent that hosts the job's store build it (``host_node``: that agent, whose
    plans then carry the succession; ``min_term``: the newest term a successor saw)."""
    from resilient.supervisor.core import SupervisorCore
    from resilient.supervisor.loop import LoopConfig, SupervisorLoop
    from resilient.supervisor.policy import UnloadablePolicy, load_policy

    how = {k: v for k, v in (("tick", tick), ("name", name)) if v is not None}
    loop_cfg = LoopConfig(core=core_cfg, advertise_addr=advertise_addr, last_call=last_call,
                          join_timeout=join_timeout, store_timeout=store_timeout, host_node=host_node, min_term=min_term, **how)
    policy = None
    if policy_file:
        try:
            policy = load_policy(policy_file, limits=core_cfg.policy_limits())
        except PolicyError as e:  # checked at the job's start: changed or gone since (a successor host)
            logger.error("the policy %s cannot be loaded by this supervisor: %s; the default policy decides every "
                         "decision, and each action event's fallback says why", policy_file, e)
            policy = UnloadablePolicy(policy_file, str(e))
    return SupervisorLoop(loop_cfg, store, signer, ledger, SupervisorCore(core_cfg, policy))


def run(cfg: StandaloneConfig, stop: threading.Event | None = None) -> int:
    """Host the job's store and supervise until the job ends (0: succeeded, 1: stopped) or ``stop`` is set."""
    from resilient.supervisor import transport as T

    stop = stop or threading.Event()
    host, port = cfg.rdzv_endpoint.rsplit(":", 1)
    try:
        secret = T.load_secret(cfg.job_secret_file)
    except ValueError as e:
        raise _BadInput(str(e)) from None
    try:
        store = T.connect_store(host, int(port), cfg.store_timeout, is_master=True)
    except (RuntimeError, ValueError) as e:
        raise _BadInput(f"cannot host the rendezvous store on port {port} ({str(e).splitlines()[0]}); is another "
                        "supervisor or agent using it?") from None
    job = _job_id(cfg, store, stop)
    if job is None:
        return EXIT_STOPPED  # told to stop before any agent came
    keys = T.Keys(job)
    if secret is None:
        logger.warning("no job secret configured (--job-secret-file or %s): agents learn a generated one from "
                       "the store, and after a restart of this supervisor they need it again", renv.JOB_SECRET)
        secret = T.new_secret()
        store.set(keys.secret, secret)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(run_dir, node=cfg.name)
    addr = cfg.advertise_addr or (host if host not in ("0.0.0.0", "") else socket.getfqdn())
    loop = supervise(cfg.supervisor, cfg.policy, store, T.Signer(secret, job), ledger, advertise_addr=addr,
                     last_call=cfg.last_call, join_timeout=cfg.join_timeout, store_timeout=cfg.store_timeout,
                     name=cfg.name)
    core = loop.core
    try:
        past = list(read_events(run_dir, kinds={EventKind.ACTION}))  # resume adopts the decisions alone
    except FileNotFoundError:
        past = []
    if loop.resume(past, time.monotonic()) is not None and core.stopped is not None:
        logger.error("the job in %s was already stopped: %s", run_dir, core.stopped)
    loop.start()
    try:
        while not stop.is_set():
            if loop.settled.is_set() or (loop.finished.is_set() and loop._thread is not None
                                         and not loop._thread.is_alive()):
                break
            stop.wait(0.2)
    finally:
        loop.close()
        ledger.close()
    if loop.result is None:
        return EXIT_STOPPED  # told to stop before the job ended
    return EXIT_SUCCEEDED if loop.result == "succeeded" else EXIT_STOPPED


def _job_id(cfg: StandaloneConfig, store: object, stop: threading.Event) -> str | None:
    """The id of the job served here: ``--rdzv-id``, else the first agent's (it claims the store's job key)."""
    from resilient.supervisor import transport as T

    if cfg.rdzv_id is not None:
        store.compare_set(T.JOB_KEY, "", cfg.rdzv_id)  # type: ignore[attr-defined]
        return cfg.rdzv_id
    store.compare_set(T.JOB_KEY, "", T.ANY_JOB)  # type: ignore[attr-defined]
    while not stop.is_set():
        job = store.get(T.JOB_KEY).decode(errors="replace")  # type: ignore[attr-defined]
        if job != T.ANY_JOB:
            logger.warning("serving job %r (the id of the first agent; pass --rdzv-id to fix it)", job)
            return job
        stop.wait(0.1)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse(argv)
    except _BadInput as e:
        print(f"resilient supervisor: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from resilient.logs import setup_logging

    setup_logging("supervisor", run_dir=cfg.run_dir,
                  level=os.environ.get(renv.LOG_LEVEL, "WARNING").upper())
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.warning("supervisor stopping on %s; agents keep training", signal.Signals(signum).name)
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    try:
        return run(cfg, stop)
    except _BadInput as e:
        print(f"resilient supervisor: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
