"""Runs nemo_worker.py with NeMo-Run, in one of the integration's forms: local (LocalExecutor with the
torchrun launcher, through the shim) or inline (run.Script(inline=...))."""

import sys
from pathlib import Path

import nemo_run as run

from resilient.integrations import nemo as rnemo

WORKER = str(Path(__file__).resolve().parent / "nemo_worker.py")

if __name__ == "__main__":  # NeMo-Run needs the guard
    form, out, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    flags = f"--run-dir {run_dir} --max-restarts 2"
    if form == "local":
        task = run.Script(path=WORKER, args=[out], entrypoint="python")
        executor = rnemo.local_executor(ntasks_per_node=2, resilient_args=flags)
    else:
        task = rnemo.inline_script(f"{WORKER} {out}", nproc_per_node=2, resilient_args=flags)
        executor = run.LocalExecutor()
    # NeMo-Run's own Slurm launcher renders the same script as render_slurm (checked where NeMo-Run is importable)
    if rnemo.slurm_launcher(nproc_per_node=2).transform(["python", "x.py"]).inline == \
            rnemo.render_slurm("python x.py", nproc_per_node=2):
        print("[nemo] slurm template matches", flush=True)
    run.run(task, executor=executor, name=f"resilient-{form}")
    print("[nemo] finished", flush=True)
