"""Start-up: the launcher starts its fork server before it imports torch (torch's import is the fork server's work,
and the launcher's own would only delay it), and torchrun's flags are accepted as torch's own parser defines them."""
import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from resilient.launcher.args import torchrun_parser
from tests.launcher.conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _comparable(a: argparse.Action) -> dict:
    return {"option_strings": list(a.option_strings), "default": a.default, "nargs": a.nargs,
            "choices": None if a.choices is None else list(a.choices), "required": a.required, "const": a.const,
            "env": type(a).__name__ in ("env", "_Env"), "flag_env": type(a).__name__ in ("check_env", "_CheckEnv")}


def test_every_torchrun_flag_is_accepted_as_torch_defines_it(monkeypatch):
    from torch.distributed.run import get_args_parser

    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    theirs = {a.dest: a for a in get_args_parser()._actions}
    ours = {a.dest: a for a in torchrun_parser()._actions}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"torchrun flags the launcher's copy lacks: {missing}"
    for dest, a in theirs.items():
        assert _comparable(ours[dest]) == _comparable(a), dest
        if a.type is not None and a.type not in (str, int, float):  # torchrun's comma-separated lists
            assert ours[dest].type("a,,b,c") == a.type("a,,b,c"), dest
        elif a.type is not None:
            assert ours[dest].type is a.type, dest


def test_pet_variables_reach_the_copied_flags(monkeypatch):
    monkeypatch.setenv("PET_RDZV_ID", "job7")
    monkeypatch.setenv("PET_STANDALONE", "1")
    args = torchrun_parser().parse_args(["train.py"])
    assert (args.rdzv_id, args.standalone) == ("job7", True)


# The launcher, run as the console script runs it; the audit hook sees the fork server's Popen before it happens,
# writes whether torch was imported by then, and ends the launcher there (nothing was started yet). The program is
# of the standard library only, so its server skips torch and is started by exec before the agent imports torch
# (a program that imports torch gets a server forked from the agent after its import: test_fork_server_inherited).
PROBE = textwrap.dedent("""
    import json, os, sys
    out = sys.argv[1]

    def hook(event, args):
        if event == "subprocess.Popen" and any("resilient.launcher.zygote" in str(a) for a in (args[1] or ())):
            with open(out, "w") as f:
                json.dump({"torch": "torch" in sys.modules,
                           "torch_modules": sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:5]}, f)
            os._exit(0)

    sys.addaudithook(hook)
    sys.argv = ["resilient-run", *sys.argv[2:]]
    from resilient.run import cli
    cli()
""")


@pytest.mark.timeout(60)
def test_a_server_without_torch_is_started_before_the_launcher_imports_torch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "seen.json"
    p = subprocess.run([sys.executable, str(probe), str(out), "--nnodes", "1", "--nproc-per-node", "2",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--max-restarts", "1",
                        "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "exit_code.py")],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=50)
    assert out.exists(), f"the launcher never started a fork server (rc {p.returncode}): {p.stderr[-2000:]}"
    seen = json.loads(out.read_text())
    assert not seen["torch"], f"the launcher imported torch before starting its fork server: {seen['torch_modules']}"
