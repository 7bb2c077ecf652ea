"""NeMo / NeMo-Run: the same jobs, launched by ``resilient-run`` instead of ``torchrun``.

    import nemo_run as run
    from resilient.integrations import nemo as rnemo

    # local: NeMo-Run's torchrun launcher, through a torchrun shim that starts resilient-run
    executor = rnemo.local_executor(ntasks_per_node=8, resilient_args="--max-restarts 3 --ckpt-local /mnt/ssd/ckpt")
    run.run(run.Script(path="train.py"), executor=executor)

    # Slurm: NeMo-Run's template launcher renders `srun resilient-run ... --no-python {{ command }}`
    executor = run.SlurmExecutor(..., launcher=rnemo.slurm_launcher(nproc_per_node=8, resilient_args="..."))

    # any executor: an inline script that calls resilient-run itself
    run.run(rnemo.inline_script("train.py --lr 3e-4", nproc_per_node=2), executor=run.LocalExecutor())

NeMo-Run ignores custom ``Launcher`` subclasses on ``LocalExecutor``, so the local form puts a ``torchrun``
shim first on the job's ``PATH``. The shim calls the ``resilient-run`` of the Python that built the job
(no need for it to be on ``PATH``). ``nemo_run`` itself is imported only by the functions that return its
objects: the shim and the Slurm template text need nothing but this package.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from resilient import env as renv

SHIM_NAME = "torchrun"

# NeMo-Run substitutes {{ command }} (the job's own command line); one resilient-run agent per node.
SLURM_TEMPLATE = """\
#!/usr/bin/env bash
# resilient-run on every node (one task per node), rendezvous on the first node of the allocation
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun --ntasks-per-node=1 --kill-on-bad-exit=0 \\
    {{ resilient_run }} --nnodes {{ nnodes }} --nproc-per-node {{ nproc_per_node }} \\
    --rdzv-backend c10d --rdzv-endpoint "$head:{{ port }}" --rdzv-id "$SLURM_JOB_ID" {{ resilient_args }} \\
    --no-python {{ command }}
"""


class NemoIntegrationError(ValueError):
    """Bad arguments to a helper here; the message says which and what to give instead."""


def resilient_run_command(python: str | None = None) -> str:
    """How to start ``resilient-run`` from this installation: the script beside the interpreter when it is
    there (a virtual environment's ``bin``), else ``python -m resilient.run``."""
    py = python or sys.executable
    beside = Path(py).parent / "resilient-run"
    if beside.is_file() and os.access(beside, os.X_OK):
        return shlex.quote(str(beside))
    return f"{shlex.quote(py)} -m resilient.run"


def write_shim(directory: str | os.PathLike[str] | None = None, python: str | None = None) -> Path:
    """Write an executable ``torchrun`` into ``directory`` (default: a new temporary directory) that runs
    this installation's ``resilient-run`` with ``$RESILIENT_RUN_ARGS`` and torchrun's arguments. Returns the
    directory: put it first on the job's ``PATH``."""
    d = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="resilient-torchrun-"))
    d.mkdir(parents=True, exist_ok=True)
    shim = d / SHIM_NAME
    shim.write_text("#!/usr/bin/env sh\n"
                    "# torchrun -> resilient-run (written by resilient.integrations.nemo.write_shim)\n"
                    "# shellcheck disable=SC2086\n"
                    f"exec {resilient_run_command(python)} ${renv.RUN_ARGS} \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return d


def shim_env(resilient_args: str = "", shim_dir: str | os.PathLike[str] | None = None,
             path: str | None = None) -> dict[str, str]:
    """The environment that makes a job's ``torchrun`` start ``resilient-run``: the shim first on ``PATH``,
    the flags in ``RESILIENT_RUN_ARGS``, this interpreter in ``RESILIENT_PYTHON`` (the recipe's shim uses it)."""
    if not isinstance(resilient_args, str):
        raise NemoIntegrationError(f"resilient_args must be one string of resilient-run flags, got "
                                   f"{type(resilient_args).__name__}; e.g. '--max-restarts 3'")
    d = write_shim(shim_dir)
    base = path if path is not None else os.environ.get("PATH", "")
    return {"PATH": f"{d}{os.pathsep}{base}" if base else str(d), renv.RUN_ARGS: resilient_args,
            renv.PYTHON: sys.executable}


def local_executor(ntasks_per_node: int = 1, resilient_args: str = "", env_vars: dict[str, str] | None = None,
                   **kwargs: Any) -> Any:
    """``run.LocalExecutor(ntasks_per_node=N, launcher="torchrun")`` whose torchrun is ``resilient-run``."""
    if not isinstance(ntasks_per_node, int) or ntasks_per_node < 1:
        raise NemoIntegrationError(f"ntasks_per_node must be a whole number >= 1, got {ntasks_per_node!r}")
    import nemo_run as run

    env = dict(env_vars or {})
    env.update(shim_env(resilient_args, path=env.get("PATH")))
    return run.LocalExecutor(ntasks_per_node=ntasks_per_node, launcher="torchrun", env_vars=env, **kwargs)


def slurm_launcher(nproc_per_node: int, nnodes: str | int = "$SLURM_JOB_NUM_NODES", resilient_args: str = "",
                   port: int = 29500, resilient_run: str = "resilient-run") -> Any:
    """A NeMo-Run ``SlurmTemplate`` launcher rendering ``srun resilient-run ... --no-python {{ command }}``."""
    import nemo_run as run

    return run.SlurmTemplate(template_inline=SLURM_TEMPLATE,
                             template_vars=slurm_vars(nproc_per_node, nnodes, resilient_args, port, resilient_run))


def slurm_vars(nproc_per_node: int, nnodes: str | int = "$SLURM_JOB_NUM_NODES", resilient_args: str = "",
               port: int = 29500, resilient_run: str = "resilient-run") -> dict[str, Any]:
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise NemoIntegrationError(f"nproc_per_node must be a whole number >= 1, got {nproc_per_node!r}")
    if not (isinstance(port, int) and 0 < port < 65536):
        raise NemoIntegrationError(f"port must be a TCP port number (1-65535), got {port!r}")
    return {"nproc_per_node": nproc_per_node, "nnodes": nnodes, "resilient_args": resilient_args, "port": port,
            "resilient_run": resilient_run}


def render_slurm(command: str, **vars: Any) -> str:
    """The Slurm script text for ``command`` (what NeMo-Run's ``SlurmTemplate`` renders), without NeMo-Run."""
    import jinja2

    return jinja2.Environment().from_string(SLURM_TEMPLATE).render(command=command, **slurm_vars(**vars))


def inline_script(command: str, nproc_per_node: int = 1, resilient_args: str = "", python: str | None = None,
                  **script_kwargs: Any) -> Any:
    """``run.Script(inline=...)`` running ``command`` (a Python script and its arguments) under
    ``resilient-run --standalone``; works with any executor that runs inline scripts."""
    if not command or not isinstance(command, str):
        raise NemoIntegrationError("inline_script needs the script and its arguments as one string, "
                                   "e.g. 'train.py --lr 3e-4'")
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise NemoIntegrationError(f"nproc_per_node must be a whole number >= 1, got {nproc_per_node!r}")
    import nemo_run as run

    line = (f"{resilient_run_command(python)} --standalone --nproc-per-node {nproc_per_node} "
            f"{resilient_args} {command}").replace("  ", " ")
    return run.Script(inline=line, **script_kwargs)


__all__ = ["SLURM_TEMPLATE", "NemoIntegrationError", "inline_script", "local_executor", "render_slurm",
           "resilient_run_command", "shim_env", "slurm_launcher", "slurm_vars", "write_shim"]
