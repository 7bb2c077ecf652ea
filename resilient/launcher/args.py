"""Command line → :class:`AgentConfig`.

Every torchrun flag (both spellings, ``PET_*`` variables) is accepted with the same meaning; our flags are added
beside them. torchrun's flags are a copy of ``torch.distributed.run.get_args_parser`` (:func:`torchrun_parser`; a
test holds it to torch's own), not torch's parser itself: importing that imports torch (seconds), and the launcher
must start its fork server (which imports torch for the workers) before it spends them. All checks that can fail
happen here, before any process starts, and end in one line naming the problem (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from resilient import env as renv
from resilient.launcher.api import AgentConfig, LaunchError, WorkerCommand, WorkerLaunchMethod, check_seconds
from resilient.supervisor.config import add_supervisor_arguments, parse_nnodes, supervisor_config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise LaunchError(message)


class _Env(argparse.Action):
    """torch's ``argparse_util.env``: the value, else ``PET_<DEST>``, else the default."""

    def __init__(self, dest, default=None, required=False, **kwargs) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        super().__init__(dest=dest, default=default, required=False if default else required, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """torch's ``argparse_util.check_env``: a flag, also set by a non-zero ``PET_<DEST>``."""

    def __init__(self, dest, default=False, **kwargs) -> None:
        default = bool(int(os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")))
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)


def _comma_separated_list(value: str) -> list[str]:
    """torchrun's: items split on ``,``; ``,,`` is a literal comma."""
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


# torchrun's flags as torch.distributed.run.get_args_parser defines them (torch 2.13; a test compares every
# action to the installed torch's): (option strings, action, type, default, choices, help)
_TORCHRUN_FLAGS: tuple[tuple[tuple[str, ...], type, object, object, tuple[str, ...] | None, str], ...] = (
    (("--nnodes",), _Env, str, "1:1", None, "number of nodes, or a range MIN:MAX"),
    (("--nproc-per-node", "--nproc_per_node"), _Env, str, "1", None, "workers per node: auto, cpu, gpu, xpu or a number"),
    (("--rdzv-backend", "--rdzv_backend"), _Env, str, "static", None, "rendezvous backend"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), _Env, str, "", None, "rendezvous endpoint, HOST:PORT"),
    (("--rdzv-id", "--rdzv_id"), _Env, str, "none", None, "the job's id"),
    (("--rdzv-conf", "--rdzv_conf"), _Env, str, "", None, "more rendezvous configuration, KEY=VALUE,..."),
    (("--standalone",), _CheckEnv, None, False, None, "a local rendezvous on a free port (single node)"),
    (("--max-restarts", "--max_restarts"), _Env, int, 0, None, "restarts of the workers before the job fails"),
    (("--monitor-interval", "--monitor_interval"), _Env, float, 0.1, None, "seconds between looks at the workers"),
    (("--start-method", "--start_method"), _Env, str, "spawn", ("spawn", "fork", "forkserver"),
     "accepted for torchrun's sake (see --worker-launch)"),
    (("--event-log-handler", "--event_log_handler"), _Env, str, "null", None, "accepted for torchrun's sake"),
    (("--role",), _Env, str, "default", None, "the workers' role"),
    (("-m", "--module"), _CheckEnv, None, False, None, "run the training script as a module (python -m)"),
    (("--no-python", "--no_python"), _CheckEnv, None, False, None, "run the training program itself, not python"),
    (("--run-path", "--run_path"), _CheckEnv, None, False, None, "accepted for torchrun's sake"),
    (("--log-dir", "--log_dir"), _Env, str, None, None, "directory for the workers' log files"),
    (("-r", "--redirects"), _Env, str, "0", None, "redirect std streams into log files (0-3, or per rank)"),
    (("-t", "--tee"), _Env, str, "0", None, "tee std streams into log files and the console"),
    (("--local-ranks-filter", "--local_ranks_filter"), _Env, str, "", None, "show only these local ranks' output"),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), _Env, _comma_separated_list, [], None,
     "accepted for torchrun's sake"),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), _Env, _comma_separated_list, [], None,
     "accepted for torchrun's sake"),
    (("--node-rank", "--node_rank"), _Env, int, 0, None, "this node's rank (static rendezvous)"),
    (("--master-addr", "--master_addr"), _Env, str, "127.0.0.1", None, "the master node's address (static rendezvous)"),
    (("--master-port", "--master_port"), _Env, int, None, None, "the master node's port (static rendezvous)"),
    (("--local-addr", "--local_addr"), _Env, str, None, None, "this node's address"),
    (("--logs-specs", "--logs_specs"), "store", str, None, None, "accepted for torchrun's sake"),
    (("--numa-binding", "--numa_binding"), "store", str, None, ("node", "socket", "exclusive", "core-complex"),
     "bind each worker to the CPUs near its GPU (GPU = local rank), as torchrun does (torch.numa.binding)"),
    (("--signals-to-handle", "--signals_to_handle"), _Env, str, "SIGTERM,SIGINT,SIGHUP,SIGQUIT", None,
     "signals forwarded to the workers"),
    (("--shutdown-timeout", "--shutdown_timeout"), _Env, int, None, None, "accepted for torchrun's sake"),
    (("--virtual-local-rank", "--virtual_local_rank"), _CheckEnv, None, False, None,
     "LOCAL_RANK 0 for every worker, each seeing only its own device"),
)


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser, without importing torch."""
    parser = argparse.ArgumentParser(description="Torch Distributed Elastic Training Launcher")
    for opts, action, typ, default, choices, help_ in _TORCHRUN_FLAGS:
        kw: dict[str, object] = {"action": action, "default": default, "help": help_}
        if typ is not None:
            kw["type"] = typ
        if choices is not None:
            kw["choices"] = choices
        parser.add_argument(*opts, **kw)
    parser.add_argument("training_script", type=str, help="the training program, followed by its arguments")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def build_parser() -> argparse.ArgumentParser:
    base = torchrun_parser()
    # Same arguments, our error handling and program name.
    # allow_abbrev=False: a script's own flag (``script.py --worker x``) must never be taken for a prefix of
    # one of ours; everything after the script goes to the script, as with torchrun.
    parser = _Parser(prog="resilient-run", description="torchrun, with restarts that work, checkpoint tiers "
                     "and goodput accounting. Every torchrun flag is accepted.", parents=[base], add_help=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    g = parser.add_argument_group("resilient")
    g.add_argument("--run-dir", "--run_dir", default=None,
                   help="directory for the run's ledger (events.jsonl) and logs (default ./runs/<run id>)")
    g.add_argument("--ckpt-local", "--ckpt_local", default=None, help="node-local checkpoint directory")
    g.add_argument("--ckpt-persistent", "--ckpt_persistent", default=None, help="fsspec URL of the persistent tier")
    g.add_argument("--ckpt-interval", "--ckpt_interval", default=None, help="save every N steps, or 'auto'")
    g.add_argument("--ckpt-persistent-every", "--ckpt_persistent_every", type=int, default=None,
                   help="upload every M-th local save to the persistent tier")
    g.add_argument("--ckpt-compress", "--ckpt_compress", default=None, choices=("auto", "none", "bgzstd", "zstd"),
                   help="compress persistent uploads: auto (when the measured link is slower than the codec "
                        "pays for; default), none, bgzstd (byte planes + zstd), zstd (DCP's own, plain-readable)")
    g.add_argument("--ckpt-max-failed-saves", "--ckpt_max_failed_saves", type=_max_failed_saves,
                   default=None, metavar="N",
                   help="stop the job (exit 74) after N checkpoint saves in a row reached no tier; 0 trains on "
                        f"without checkpoints (default 3; env {renv.CKPT_MAX_FAILED_SAVES})")
    g.add_argument("--ckpt-snapshot", "--ckpt_snapshot", type=_snapshot, default=None, metavar="auto|N|off",
                   help="snapshot each rank's state into node memory (/dev/shm) after a step, so a restart on the "
                        "same node resumes from the last step instead of the last save: auto (whenever its measured "
                        f"cost stays within 1%% of the step; default), every N steps, or off (env {renv.CKPT_SNAPSHOT})")
    g.add_argument("--ckpt-upload-process", "--ckpt_upload_process", default="auto", choices=("auto", "on", "off"),
                   help="send the persistent tier's uploads (and code compressed ones) from a process of their own, "
                        "so that their Python does not hold the training process's interpreter lock: auto (default: "
                        "where the node has at least 2 cores a local rank), on, or off (from a thread of the training "
                        f"process) (env {renv.CKPT_UPLOAD_PROCESS})")
    g.add_argument("--upload-grace", "--upload_grace", type=float, default=60.0,
                   help="seconds pending persistent uploads get at exit before they are abandoned (default 60)")
    g.add_argument("--heartbeat-timeout", "--heartbeat_timeout", type=float, default=None,
                   help="seconds without a heartbeat before a rank counts as hung; replaces the learned step timeout "
                        "(default: learned, max(1 s, 3 x the longest step seen))")
    g.add_argument("--startup-timeout", "--startup_timeout", type=float, default=600.0,
                   help="seconds a worker may take from its spawn to its first message (imports, rendezvous), and "
                        "for each of its first 3 steps of an attempt (a restore, a compile) unless --heartbeat-timeout "
                        "is given, before it counts as hung; a later attempt gets at least 3 x the longest start-up "
                        "seen (default 600)")
    g.add_argument("--health-interval", "--health_interval", type=float, default=5.0,
                   help="seconds between the node's health checks: memory, the local tier's disk, the workers' "
                        "GPUs through NVML (default 5)")
    g.add_argument("--inject", default=None,
                   help="faults for a drill, e.g. kill-worker@30s,hang-worker@60s,kill-node@90s,slow-rank:1@0s,"
                        "raise-worker:0@step12 (seconds after training starts, or a step; each recorded in the "
                        "ledger as fault_injected)")
    g.add_argument("--inject-seed", type=int, default=0, help="seed choosing the targets --inject leaves open")
    g.add_argument("--metrics-port", "--metrics_port", type=int, default=None,
                   help="serve Prometheus metrics on this port (node 0), on loopback unless --metrics-addr")
    g.add_argument("--metrics-addr", "--metrics_addr", default="127.0.0.1",
                   help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0: every interface)")
    g.add_argument("--term-timeout", "--term_timeout", type=float, default=30.0,
                   help="seconds between forwarding SIGTERM/SIGINT to workers and SIGKILL")
    g.add_argument("--supervisor-timeout", "--supervisor_timeout", type=float,
                   default=os.environ.get(renv.SUPERVISOR_TIMEOUT) or None,
                   help="seconds an agent that needs a decision (its workers failed or hung, it waits as a spare "
                        "or for the job's end) waits for an unreachable (dead or hung) supervisor before it exits "
                        "76 for a requeue; healthy workers train on meanwhile. Default: 3 x --node-timeout, at "
                        "least 30, at most the rendezvous timeout: one node timeout to notice the supervisor is "
                        "away, one for a restarted or woken supervisor's grace, one for reconnecting under load "
                        f"(or {renv.SUPERVISOR_TIMEOUT})")
    g.add_argument("--worker-launch", "--worker_launch", choices=[m.value for m in WorkerLaunchMethod],
                   default=os.environ.get(renv.WORKER_LAUNCH, WorkerLaunchMethod.FORK_SERVER.value),
                   help="fork-server: fork workers from a process that already imported torch (fast "
                        "restarts); spawn: a fresh interpreter per worker, as torchrun")
    g.add_argument("--preload", default=os.environ.get(renv.PRELOAD, ""),
                   help="comma-separated modules the fork server imports ahead of time")
    add_supervisor_arguments(parser.add_argument_group("supervisor (hosted by the agent that hosts the job's store)"))
    return parser


def _max_failed_saves(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a whole number of failed saves in a row >= 0 (0 trains on without "
                                         f"checkpoints), got {v!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 trains on without checkpoints), got {n}")
    return n


def _snapshot(v: str) -> str:
    t = v.strip().lower()
    if t in ("auto", "off") or (t.isdigit() and int(t) >= 0):
        return "off" if t == "0" else t
    raise argparse.ArgumentTypeError(f"give auto (a snapshot in node memory whenever its cost allows), a number of "
                                     f"steps between snapshots, or off; got {v!r}")


def _numa_binding_of(mode: str | None) -> str | None:
    """``--numa-binding``, refused at once where no worker could be bound: torch's binding finds each GPU's NUMA node
    through torch.cuda, which a CPU build of torch has not (torchrun fails there too, in its agent, with a
    traceback). Told by the build's files: importing torch here would cost every launch a second."""
    if mode is None:
        return None
    import importlib.util

    spec = importlib.util.find_spec("torch")
    lib = Path(spec.origin).parent / "lib" if spec is not None and spec.origin else None
    if lib is None or not any(lib.glob("libtorch_cuda*.so*")) and not any(lib.glob("libtorch_hip*.so*")):
        raise LaunchError(f"--numa-binding {mode}: binds each worker to the CPUs near its GPU, and this torch has no "
                          "GPU support (a CPU build). Drop the flag, or run a CUDA build of torch on GPU nodes")
    return mode


def _snapshot_of(flag: str | None) -> str:
    """The flag, else its environment twin, else auto."""
    if flag is not None:
        return flag
    raw = os.environ.get(renv.CKPT_SNAPSHOT, "").strip()
    try:
        return _snapshot(raw) if raw else "auto"
    except argparse.ArgumentTypeError as e:
        raise LaunchError(f"{renv.CKPT_SNAPSHOT}: {e}") from None


def _max_failed_saves_of(flag: int | None) -> int:
    """The flag, else its environment twin, else 3."""
    if flag is not None:
        return flag
    raw = os.environ.get(renv.CKPT_MAX_FAILED_SAVES, "").strip()
    try:
        return _max_failed_saves(raw) if raw else 3
    except argparse.ArgumentTypeError as e:
        raise LaunchError(f"{renv.CKPT_MAX_FAILED_SAVES}: {e}") from None


def _nproc(v: str) -> int:
    if v.strip().isdigit():  # the usual case, without importing torch
        return int(v)
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(v)
    except (ValueError, RuntimeError) as e:
        raise LaunchError(f"--nproc-per-node {v!r}: {e}") from None


def _writable_dir(path: Path, flag: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise LaunchError(f"{flag} {str(path)!r} is not writable ({e.strerror or e}); choose another directory") from None


def rdzv_seconds(rdzv_configs: dict[str, object], key: str) -> float:
    """A duration of ``--rdzv-conf`` (torchrun's keys and defaults: ``join_timeout`` 600 s, ``last_call_timeout``
    30 s), checked: a bad value is named here rather than failing the supervisor's start later."""
    default = RDZV_SECONDS[key]
    raw = rdzv_configs.get(key, default)
    try:
        v = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        v = float("nan")
    if not (v == v and v < float("inf") and (v > 0 or (v == 0 and key == "last_call_timeout"))):
        raise LaunchError(f"--rdzv-conf {key} must be a {'positive' if key == 'join_timeout' else 'non-negative'} "
                          f"finite number of seconds, got {raw!r}")
    return v


#: torchrun's c10d rendezvous defaults for the durations the supervisor honours
RDZV_SECONDS: dict[str, float] = {"join_timeout": 600.0, "last_call_timeout": 30.0}


def parse(argv: list[str]) -> AgentConfig:
    try:
        args = build_parser().parse_args(argv)
    except LaunchError as e:
        if "training_script" in str(e):
            raise LaunchError("no training script given: resilient-run [flags] SCRIPT [ARGS...]") from None
        raise
    if not args.training_script:
        raise LaunchError("no training script given: resilient-run [flags] SCRIPT [ARGS...]")

    try:
        min_nodes, max_nodes = parse_nnodes(args.nnodes)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if args.max_restarts is not None and int(args.max_restarts) < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")

    script = args.training_script
    if args.no_python and args.module:
        raise LaunchError("--no-python and -m cannot be used together")
    if args.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise LaunchError(f"module {script!r} not found (-m); check the name and PYTHONPATH")
        command = WorkerCommand(script, tuple(args.training_script_args), "module")
    elif args.no_python:
        if shutil.which(script) is None:
            raise LaunchError(f"program {script!r} not found or not executable (--no-python)")
        command = WorkerCommand(script, tuple(args.training_script_args), "exec")
    else:
        if not os.path.isfile(script):
            raise LaunchError(f"training script {script!r} does not exist")
        command = WorkerCommand(script, tuple(args.training_script_args), "script")

    if args.policy is not None and not os.path.isfile(args.policy):
        raise LaunchError(f"--policy {args.policy!r} does not exist; give the path of a policy .py file")

    rdzv_backend, rdzv_endpoint, rdzv_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    standalone = bool(args.standalone)
    if standalone or (rdzv_backend == "static" and not rdzv_endpoint and args.master_port is None and max_nodes == 1):
        rdzv_backend, rdzv_endpoint, rdzv_id = "c10d", "localhost:0", rdzv_id if rdzv_id != "none" else str(uuid.uuid4())
    rdzv_configs: dict[str, object] = {}
    if args.rdzv_conf:
        for kv in args.rdzv_conf.split(","):
            if "=" not in kv:
                raise LaunchError(f"--rdzv-conf entries must be key=value, got {kv!r}")
            k, v = kv.split("=", 1)
            rdzv_configs[k.strip()] = v.strip()
    for key in ("join_timeout", "last_call_timeout"):  # torchrun's names; read where the supervisor is started
        if key in rdzv_configs:
            rdzv_seconds(rdzv_configs, key)
    if rdzv_backend == "static":
        rdzv_configs["rank"] = int(args.node_rank)
        if not rdzv_endpoint:
            rdzv_endpoint = f"{args.master_addr}:{args.master_port or 29500}"

    run_id = rdzv_id if rdzv_id not in ("none", "") else f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / run_id

    ranks_filter = None
    if args.local_ranks_filter:
        try:
            ranks_filter = {int(x) for x in args.local_ranks_filter.split(",")}
        except ValueError:
            raise LaunchError(f"--local-ranks-filter must be comma-separated integers, got {args.local_ranks_filter!r}") from None

    nproc = _nproc(str(args.nproc_per_node))
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        # as torchrun: one thread per worker unless the user chose otherwise
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", getattr(args, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"))

    inject: tuple = ()
    if args.inject:
        from resilient.drill.spec import FaultKind, FaultSpecError, parse_inject

        try:
            inject = tuple(parse_inject(args.inject, args.inject_seed, world_size=nproc * max_nodes, nnodes=max_nodes))
        except FaultSpecError as e:
            raise LaunchError(str(e)) from None
        for f in inject:
            if f.kind == FaultKind.KILL_NODE and f.at_seconds is None:
                raise LaunchError(f"--inject: {f.describe()}: a node is killed at a time (kill-node@90s), not a step")
            if f.kind in (FaultKind.SLOW_RANK, FaultKind.RAISE_WORKER) and f.at_seconds not in (None, 0.0):
                raise LaunchError(f"--inject: {f.describe()}: {f.kind.value} happens inside the worker at a step "
                                  f"(@stepN, or @0s for the start); the script must use resilient.steps()")

    for flag, v in (("--node-timeout", args.node_timeout), ("--policy-timeout", args.policy_timeout),
                    ("--supervisor-timeout", args.supervisor_timeout)):
        check_seconds(flag, v)
    try:
        supervisor = supervisor_config(args, min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
                                       max_restarts=int(args.max_restarts))
        if args.policy is not None:
            from resilient.supervisor.api import PolicyError
            from resilient.supervisor.policy import load_policy

            try:  # a broken policy is refused before anything starts, naming file and line, under the job's limits
                load_policy(args.policy, limits=supervisor.policy_limits()).close()  # type: ignore[attr-defined]
            except PolicyError as e:
                raise LaunchError(f"--policy: {e}") from None
        cfg = AgentConfig(
            command=command, nproc_per_node=nproc, supervisor=supervisor,
            rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, rdzv_configs=rdzv_configs,
            node_rank=int(args.node_rank), master_addr=args.master_addr,
            master_port=int(args.master_port) if args.master_port is not None else None,
            local_addr=args.local_addr, standalone=standalone, role=args.role,
            monitor_interval=float(args.monitor_interval),
            term_timeout=float(args.term_timeout), log_dir=args.log_dir, redirects=str(args.redirects),
            tee=str(args.tee), local_ranks_filter=ranks_filter, run_id=run_id, run_dir=str(run_dir),
            launch_method=WorkerLaunchMethod(args.worker_launch),
            preload=tuple(m for m in args.preload.split(",") if m),
            policy=args.policy, ckpt_local=args.ckpt_local, ckpt_persistent=args.ckpt_persistent,
            ckpt_interval=args.ckpt_interval, ckpt_persistent_every=args.ckpt_persistent_every,
            ckpt_compress=args.ckpt_compress,
            upload_grace=args.upload_grace, ckpt_max_failed_saves=_max_failed_saves_of(args.ckpt_max_failed_saves),
            ckpt_snapshot=_snapshot_of(args.ckpt_snapshot), ckpt_upload_process=args.ckpt_upload_process,
            heartbeat_timeout=args.heartbeat_timeout, startup_timeout=args.startup_timeout,
            health_interval=args.health_interval,
            spare_nodes=args.spare_nodes, metrics_port=args.metrics_port,
            metrics_addr=args.metrics_addr,
            virtual_local_rank=bool(getattr(args, "virtual_local_rank", False)),
            numa_binding=_numa_binding_of(getattr(args, "numa_binding", None)),
            inject=inject, job_secret_file=args.job_secret_file,
            supervisor_timeout=args.supervisor_timeout,
        )
    except (ValueError, TypeError) as e:
        raise LaunchError(str(e)) from None
    # directories last: a rejected command line leaves nothing behind
    _writable_dir(run_dir, "--run-dir")
    if args.ckpt_local:
        _writable_dir(Path(args.ckpt_local), "--ckpt-local")
    return cfg
