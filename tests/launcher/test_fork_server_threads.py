"""A worker forked from the fork server runs the intra-op thread count its own ``OMP_NUM_THREADS`` asks for, as a
fresh interpreter does. The OpenMP runtime reads the variable once, when the server loads torch: before the mend,
three ranks with ``OMP_NUM_THREADS=1`` on two cores each ran two spinning threads (the server's count), and a
straggler test among equal ranks flagged one of them, or their all-reduce stalled for minutes. Real fork server,
real workers."""
import os
import select
import time

import pytest

from resilient.launcher.api import WorkerCommand
from resilient.launcher.starters import ForkServer, WorkerProc

SCRIPT = r'''
import sys, torch
open(sys.argv[1], "w").write(str(torch.get_num_threads()))
'''


def _until_exited(fs: ForkServer, workers: list[WorkerProc], timeout: float) -> None:
    """Wait (at most ``timeout`` s) for every worker's exit to come back from the fork server."""
    deadline = time.monotonic() + timeout
    while any(w.exit_code is None for w in workers) and (left := deadline - time.monotonic()) > 0:
        if not fs.buffered():
            select.select([fs.fileno()], [], [], left)
        fs.poll_exits()


@pytest.mark.timeout(150)
def test_a_forked_worker_runs_the_thread_count_of_its_own_environment(tmp_path, monkeypatch):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what the server itself sees
    fs = ForkServer(("torch",), tag="threads-test")
    try:
        fs.wait_ready(90)
        asked = {0: "1", 1: "3", 2: None}  # None: the variable unset, the server's count stays
        workers = []
        for i, n in asked.items():
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            if n is not None:
                env["OMP_NUM_THREADS"] = n
            workers.append(WorkerProc(local_rank=i, rank=i, env=env))
            fs.start(WorkerCommand(str(script), (str(tmp_path / f"n{i}"),)), [workers[-1]], str(tmp_path))
        _until_exited(fs, workers, 60)
        assert [w.exit_code for w in workers] == [0, 0, 0]
        assert [(tmp_path / f"n{i}").read_text() for i in asked] == ["1", "3", "2"]
    finally:
        fs.close()


BLAS_SCRIPT = r'''
import ctypes, glob, os, sys
import numpy
lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(numpy.__file__) + ".libs", "libscipy_openblas*.so"))[0])
open(sys.argv[1], "w").write(str(lib.scipy_openblas_get_num_threads64_()))
'''
BLAS_ENVS = {"unset": {}, "openblas": {"OPENBLAS_NUM_THREADS": "2"}, "omp_1": {"OMP_NUM_THREADS": "1"},
             "goto_over_omp": {"GOTO_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}, "too_many": {"OPENBLAS_NUM_THREADS": "64"}}
BLAS_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


@pytest.mark.timeout(150)
def test_a_forked_worker_runs_numpys_blas_on_the_threads_its_environment_asks_for(tmp_path):
    """numpy's OpenBLAS is loaded in the server with one thread (its pool would make the fork unsafe); a worker gets
    the count a fresh interpreter would take from the same environment."""
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: every rule gives one BLAS thread, so a forked worker cannot differ")
    script = tmp_path / "blas.py"
    script.write_text(BLAS_SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    fresh = {}
    for name, extra in BLAS_ENVS.items():
        subprocess.run([sys.executable, str(script), str(tmp_path / f"fresh-{name}")], env={**base, **extra},
                       check=True, timeout=60)
        fresh[name] = (tmp_path / f"fresh-{name}").read_text()
    assert fresh["unset"] != "1" and fresh["omp_1"] == "1"  # the premise: the environment makes a difference
    fs = ForkServer(("torch", "numpy"), tag="blas-test")
    try:
        fs.wait_ready(90)
        workers = []
        for i, (name, extra) in enumerate(BLAS_ENVS.items()):
            workers.append(WorkerProc(local_rank=i, rank=i, env={**base, **extra}))
            fs.start(WorkerCommand(str(script), (str(tmp_path / f"forked-{name}"),)), [workers[-1]], str(tmp_path))
        _until_exited(fs, workers, 60)
        assert [w.exit_code for w in workers] == [0] * len(BLAS_ENVS)
        assert {n: (tmp_path / f"forked-{n}").read_text() for n in BLAS_ENVS} == fresh
    finally:
        fs.close()
