"""The first fork server imports what the entry script's imports name (read statically, before the first spawn),
installed packages only, and never a module that makes forking unsafe."""
import json
import sys

import pytest

from resilient.launcher.api import WorkerCommand
from resilient.launcher.preload import entry_imports
from tests.launcher.conftest import run_launcher

ENTRY = r'''
import sys
found = {m: m in sys.modules for m in ("calmpkg", "calmpkg.heavy", "thready", "helper")}  # before any import

import json, os  # noqa: E402
import helper  # noqa: E402,F401  (a local module: it imports calmpkg and thready)

out = sys.argv[1]
if os.environ["RANK"] == "0":  # the agent remembers the left-out module before this run ends
    import time
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(os.environ["RESILIENT_RUN_DIR"], "preload", "denied.txt")):
        assert time.monotonic() < deadline, "denied.txt never written"
        time.sleep(0.05)
with open(os.path.join(out, "r" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(found, f)
'''

HELPER = "from calmpkg import heavy\nimport thready\n"


def _user_site(tmp_path):
    # an install location (a user site): the user's own code is never preloaded
    user_base = tmp_path / "userbase"
    site_dir = user_base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site_dir / "calmpkg").mkdir(parents=True)
    (site_dir / "calmpkg" / "__init__.py").write_text("")
    (site_dir / "calmpkg" / "heavy.py").write_text("VALUE = 1\n")
    (site_dir / "thready.py").write_text("import threading\nthreading.Thread(target=threading.Event().wait, "
                                         "daemon=True).start()\n")
    return user_base, site_dir


@pytest.mark.timeout(150)
def test_first_fork_server_imports_the_entry_scripts_imports_but_not_one_that_starts_a_thread(tmp_path):
    user_base, site_dir = _user_site(tmp_path)
    job, out, run = tmp_path / "job", tmp_path / "out", tmp_path / "run"
    job.mkdir()
    out.mkdir()
    (job / "train.py").write_text(ENTRY)
    (job / "helper.py").write_text(HELPER)
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", str(run),
                      str(job / "train.py"), str(out)], cwd=tmp_path, timeout=140,
                     env={"PYTHONUSERBASE": str(user_base), "PYTHONPATH": str(site_dir),
                          "RESILIENT_LOG_LEVEL": "INFO"})
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        # calmpkg.heavy was imported by the fork server before the first spawn; thready (a thread at import) was
        # left out, and the local helper is the user's own code
        assert json.loads((out / f"r{rank}.json").read_text()) == {
            "calmpkg": True, "calmpkg.heavy": True, "thready": False, "helper": False}
    assert "thready" in (run / "preload" / "denied.txt").read_text().split()


def test_entry_imports_follow_local_modules_and_skip_what_cannot_be_read(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .models import Net\n")
    (tmp_path / "pkg" / "models.py").write_text("import accelerate\nfrom transformers import Trainer\n"
                                                "def f():\n    import scipy\n")
    (tmp_path / "broken.py").write_text("import x(\n")
    (tmp_path / "train.py").write_text("import os\nimport pkg\nimport broken\ntry:\n    import lightning\n"
                                       "except ImportError:\n    import nothing\nimport typing\n"
                                       "if typing.TYPE_CHECKING:\n    import typed_only\n")
    got = entry_imports(WorkerCommand(target=str(tmp_path / "train.py")), str(tmp_path))
    assert got == ("os", "lightning", "typing", "accelerate", "transformers", "transformers:Trainer")
    # a script that does not parse, or is missing: nothing, and no error
    assert entry_imports(WorkerCommand(target=str(tmp_path / "broken.py")), str(tmp_path)) == ()
    assert entry_imports(WorkerCommand(target=str(tmp_path / "missing.py")), str(tmp_path)) == ()
    assert entry_imports(WorkerCommand(target="pkg.models", kind="module"), str(tmp_path)) == (
        "accelerate", "transformers", "transformers:Trainer")
    # a bound on the local files read
    assert entry_imports(WorkerCommand(target=str(tmp_path / "train.py")), str(tmp_path), max_files=1) == (
        "os", "lightning", "typing")


PROBE = r'''
import sys
torch_first = "torch" in sys.modules  # before any import of this program
import json, os  # noqa: E402
{extra}
with open(os.path.join(sys.argv[1], "r" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(torch_first, f)
'''


@pytest.mark.parametrize("extra, torch_preloaded", [
    ("", False),  # the standard library only: the fork server skips torch
    ("import helper  # noqa: E402,F401", False),  # a local module that imports the standard library only
    ("import broken  # noqa: E402,F401", True),  # a local module that cannot be read: the read is incomplete
    ("import torch  # noqa: E402,F401", True),
])
@pytest.mark.timeout(150)
def test_a_standard_library_program_starts_from_a_fork_server_without_torch(tmp_path, extra, torch_preloaded):
    # broken.py: valid Python, but over the agent's ENTRY_MAX_BYTES: left unread, so what it imports is unknown
    assert _probe(tmp_path, PROBE.replace("{extra}", extra), {"helper.py": b"import os\nimport collections\n",
                  "broken.py": b"import os\n" + b"#" * (3 << 20) + b"\n"}) == [torch_preloaded] * 2


def _probe(tmp_path, script: str, files: dict[str, bytes] | None = None) -> list:
    """Run ``script`` (beside ``files``) on 2 workers; what each rank's probe wrote."""
    job, out = tmp_path / "job", tmp_path / "out"
    job.mkdir()
    out.mkdir()
    (job / "train.py").write_text(script)
    for name, data in (files or {}).items():
        (job / name).write_bytes(data)
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir",
                      str(tmp_path / "run"), str(job / "train.py"), str(out)], cwd=tmp_path, timeout=140)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"r{rank}.json").read_text()) for rank in (0, 1)]


def _soft(tmp_path, code: str, **files: str):
    from resilient.launcher.preload import _entry_scan, soft_needed

    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    (tmp_path / "train.py").write_text(code)
    names: set[str] = set()
    found, complete = _entry_scan(WorkerCommand(target=str(tmp_path / "train.py")), str(tmp_path), idents=names)
    return soft_needed(found, frozenset(names), complete)


def test_costly_soft_preloads_follow_what_the_program_uses(tmp_path):
    # torch alone: neither dynamo (an optimizer, DDP, FSDP2 or compile imports it) nor checkpointing
    assert _soft(tmp_path, "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n") \
        == frozenset()
    # an optimizer made inside a function of a local module: dynamo
    assert _soft(tmp_path, "import torch\nimport model\n",
                 model="import torch\ndef make(p):\n    return torch.optim.AdamW(p)\n") == {"torch._dynamo"}
    assert _soft(tmp_path, "from torch.nn.parallel import DistributedDataParallel as D\n") == {"torch._dynamo"}
    # resilient's checkpoint manager: DCP and the manager, not dynamo
    assert _soft(tmp_path, "import resilient\nck = resilient.CheckpointManager.from_env()\n") == {
        "torch.distributed.checkpoint", "resilient.checkpoint.save.manager"}
    # a framework may import anything; a read that is not complete knows nothing: every soft default
    assert _soft(tmp_path, "import torch\nimport lightning\n") is None
    (tmp_path / "broken.py").write_text("import x(\n")
    assert _soft(tmp_path, "import torch\nimport broken\n") is None


DYNAMO_PROBE = r'''
import sys
first = {m: m in sys.modules for m in ("torch", "torch._dynamo", "torch.distributed.checkpoint")}
import json, os  # noqa: E402
import torch  # noqa: E402,F401
{extra}
with open(os.path.join(sys.argv[1], "r" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(first, f)
'''


@pytest.mark.parametrize("extra, dynamo", [
    ("", False),  # torch only: the fork server skips dynamo and DCP
    ("opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)", True),
])
@pytest.mark.timeout(150)
def test_a_torch_only_program_starts_from_a_fork_server_without_dynamo(tmp_path, extra, dynamo):
    # no checkpointing named in either: DCP is skipped in both
    want = {"torch": True, "torch._dynamo": dynamo, "torch.distributed.checkpoint": False}
    assert _probe(tmp_path, DYNAMO_PROBE.replace("{extra}", extra)) == [want] * 2
