"""The fork server never touches CUDA: a driver (or NVML) set up before ``fork()`` is broken in every worker.

There is no GPU here, so a module "touches CUDA" in one of the two ways the check reads: it sets torch's own flag
(what torch sets once it has initialised CUDA), or it maps a library whose presence counts (a library that exists
without a GPU, given to the zygote as a ``!lib`` entry of its preload list). A driver that is loaded is asked whether
it was initialised: a stand-in built from C source answers as the driver does.
The servers, their copies and the agent are real processes.
"""
import ctypes.util
import json
import os
import subprocess
import sys
import time

import pytest

from resilient.events import EventKind, read_events
from resilient.launcher.args import parse
from resilient.launcher.preload import preload_modules
from resilient.launcher.starters import ForkServer, ForkServerError
from resilient.launcher.zygote import DRIVER_PROBES
from tests.launcher.conftest import run_launcher


def _stand_in() -> str | None:
    """A shared library this machine has and Python, torch and numpy do not load."""
    for name in ("form", "panel", "gdbm", "acl", "attr"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


LIB = _stand_in()
GUARD = LIB.split(".so")[0] + ".so" if LIB else ""
needs_lib = pytest.mark.skipif(LIB is None, reason="no stand-in library for libcuda (libform, libpanel, libgdbm, "
                                                   "libacl or libattr) on this machine")

MAPLIB = f"import ctypes\nctypes.CDLL({LIB!r})\n"
FAKECUDA = "import torch\ntorch.cuda._initialized = True  # what torch sets once it has initialised CUDA\n"


def _site(tmp_path, monkeypatch, **modules: str):
    """Modules in a user site (an install location: automatic preload only takes installed modules), seen by the
    fork servers this test starts (they inherit this process's environment)."""
    user_base = tmp_path / "userbase"
    site_dir = user_base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_dir.mkdir(parents=True)
    for name, text in modules.items():
        (site_dir / f"{name}.py").write_text(text)
    monkeypatch.setenv("PYTHONUSERBASE", str(user_base))
    monkeypatch.setenv("PYTHONPATH", str(site_dir))
    return site_dir


def _warm(server: ForkServer, modules: list[str]) -> None:
    server.preload_more(modules)
    deadline = time.monotonic() + 60
    while not server.poll_ready():
        assert time.monotonic() < deadline, "the copy never answered"
        time.sleep(0.01)


@needs_lib
@pytest.mark.timeout(60)
def test_the_check_reads_the_flag_and_the_maps_and_initialises_nothing():
    code = f"""
import ctypes, torch
from resilient.launcher.zygote import cuda_touched
assert cuda_touched(({GUARD!r},)) is None
ctypes.CDLL({LIB!r})
why = cuda_touched(({GUARD!r},))
assert why and {GUARD!r} in why, why
torch.cuda._initialized = True
assert "is_initialized" in cuda_touched(()), cuda_touched(())
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@needs_lib
@pytest.mark.timeout(90)
@pytest.mark.parametrize("module", ["maplib", "fakecuda"])
def test_an_explicit_preload_that_touches_cuda_is_rejected_naming_it(tmp_path, monkeypatch, module):
    _site(tmp_path, monkeypatch, maplib=MAPLIB, fakecuda=FAKECUDA)
    fs = ForkServer((f"!{GUARD}", module))
    try:
        with pytest.raises(ForkServerError) as e:
            fs.wait_ready(60)
    finally:
        fs.close()
    assert e.value.bad_module == module
    msg = str(e.value)
    assert f"--preload {module}" in msg and "must never touch CUDA" in msg, msg
    assert (GUARD if module == "maplib" else "is_initialized") in msg, msg


@needs_lib
@pytest.mark.timeout(120)
def test_automatic_preload_refuses_a_module_that_touches_cuda_and_takes_torch_and_numpy(tmp_path, monkeypatch):
    _site(tmp_path, monkeypatch, maplib=MAPLIB, calm="VALUE = 1\n")
    fs = ForkServer((f"!{GUARD}",))
    copies = []
    try:
        fs.wait_ready(60)
        bad = fs.fork()
        copies.append(bad)
        with pytest.raises(ForkServerError) as e:
            _warm(bad, ["calm", "maplib"])
        assert e.value.bad_module == "maplib"  # the agent never preloads it again
        assert GUARD in str(e.value), str(e.value)
        good = fs.fork()
        copies.append(good)
        _warm(good, ["numpy", "torch.distributed.checkpoint", "calm"])  # normal modules pass the same check
        maps = open(f"/proc/{fs.proc.pid}/maps").read()
        assert f"/{GUARD}" not in maps  # the serving fork server stayed clean: copies import, it never does
    finally:
        for c in copies:
            c.close()
        fs.close()


@pytest.mark.timeout(90)
def test_the_fork_server_after_preloading_torch_maps_no_cuda_or_nvml_library(tmp_path):
    # (the name is kept: bench/gpu/check.sh runs this test on GPU machines) A CUDA build of torch maps libcuda at
    # import, which is harmless; the server must not have INITIALISED the driver or NVML. It checks itself before
    # every fork with the driver's own "not initialised" answer, so a copy forked from it proves the check passed,
    # here and on a GPU machine alike; on a machine without a driver, no driver library is mapped at all.
    (tmp_path / "x.py").write_text("")
    cfg = parse(["--standalone", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), str(tmp_path / "x.py")])
    fs = ForkServer(preload_modules(cfg) + ("numpy",))
    try:
        fs.wait_ready(60)
        maps = open(f"/proc/{fs.proc.pid}/maps").read()
        copy = fs.fork()
        copy.wait_ready(60)
        copy.close()
    finally:
        fs.close()
    assert "libtorch" in maps  # read from the right process, after torch was imported
    import torch

    if not torch.cuda.is_available():
        assert not [lib for lib in DRIVER_PROBES if f"/{lib}" in maps]


DRIVER = r"""
static int initialised = 0;
int cuInit(unsigned flags) { initialised = 1; return 0; }
int cuCtxGetCurrent(void **ctx) { if (!initialised) return 3; *ctx = 0; return 0; }
"""


@pytest.mark.timeout(60)
def test_a_loaded_driver_counts_only_once_initialised(tmp_path):
    """The driver's contract, from a stand-in built here: before cuInit every call answers
    CUDA_ERROR_NOT_INITIALIZED (3). Loaded and not initialised is safe to fork; initialised is not."""
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stand-in driver")
    src, lib = tmp_path / "driver.c", tmp_path / "libcuda.so.1"
    src.write_text(DRIVER)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    code = f"""
import ctypes
from resilient.launcher.zygote import cuda_touched
assert cuda_touched() is None
drv = ctypes.CDLL({str(lib)!r})
assert cuda_touched() is None, cuda_touched()  # mapped, not initialised: forking is safe
drv.cuInit(0)
why = cuda_touched()
assert why and "libcuda.so.1" in why and "cuCtxGetCurrent answered 0" in why, why
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


LATE = """import os, signal, torch
def _touch(*_):
    torch.cuda._initialized = True  # what torch sets once it has initialised CUDA
    with open(os.environ["LATE_MARK"] + f".{os.getpid()}", "w"):
        pass
signal.signal(signal.SIGUSR1, _touch)
"""

# Attempt 0 makes the fork server that forked it "initialise CUDA", and so every copy of it that automatic
# preload may have warmed already (a copy forked later comes from a server that refuses to fork it).
WORKER = """import json, os, signal, sys, time
import psutil
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    server = psutil.Process(os.getppid())
    deadline = time.monotonic() + 60
    while True:
        servers = [server] + [c for c in server.children()
                              if c.pid != os.getpid() and c.status() != psutil.STATUS_ZOMBIE]
        todo = [p for p in servers if not os.path.exists(os.environ["LATE_MARK"] + f".{p.pid}")]
        if not todo:
            sys.exit(1)
        if time.monotonic() > deadline:
            sys.exit(3)
        for p in todo:
            p.send_signal(signal.SIGUSR1)
        time.sleep(0.05)
with open(os.path.join(sys.argv[1], "a1.json"), "w") as f:
    json.dump({"attempt": attempt}, f)
"""


@pytest.mark.timeout(150)
def test_a_fork_server_that_finds_cuda_before_a_fork_refuses_and_workers_are_spawned(tmp_path):
    (tmp_path / "latecuda.py").write_text(LATE)
    (tmp_path / "worker.py").write_text(WORKER)
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    r = run_launcher(["--standalone", "--nproc-per-node", "1", "--preload", "latecuda", "--max-restarts", "1",
                      "--run-dir", str(run), str(tmp_path / "worker.py"), str(out)], cwd=tmp_path, timeout=140,
                     env={"PYTHONPATH": str(tmp_path), "LATE_MARK": str(tmp_path / "touched"),
                          "RESILIENT_LOG_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "a1.json").read_text()) == {"attempt": 1}
    starts = {e.attempt: e.details["method"] for e in read_events(run) if e.kind == EventKind.ATTEMPT_START}
    assert starts == {0: "ForkServer", 1: "SpawnStarter"}, starts
    assert "initialised CUDA" in r.stderr and "fresh interpreters" in r.stderr, r.stderr
