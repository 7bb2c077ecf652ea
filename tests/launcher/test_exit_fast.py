"""The worker's and the launcher's exit (exit_safety.finish, on by default): a run that ends right after its last
save, without closing its checkpointer, loses nothing by skipping the interpreter's finalisation: every ledger
line, the final step committed on every tier, a file the script left open, a thread it left running. Workers
forked by the fork server and workers started as fresh interpreters (spawn) end the same way."""

import pytest

from resilient.events import read_events
from tests.launcher.conftest import run_launcher

SCRIPT = r'''
import os, sys, threading, time
import torch
import torch.distributed as dist
import resilient

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = resilient.CheckpointManager.from_env(interval=3, persistent_every=1)
state = {"model": model, "optim": opt}
for step in resilient.steps(ckpt.restore(state), 6):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(step, state)
out = sys.argv[1]
rank = os.environ["RANK"]
notes = open(os.path.join(out, f"notes{rank}.txt"), "w")  # left open: finalisation would have flushed it
notes.write("last line\n")
started = threading.Event()


def late() -> None:  # a non-daemon thread the script leaves running: the exit waits for it, as Python's does
    started.set()
    time.sleep(0.3)
    with open(os.path.join(out, f"late{rank}.txt"), "w") as f:
        f.write("done")


threading.Thread(target=late).start()
started.wait(10)


class _Finalised:  # its __del__ runs only in the interpreter's finalisation, which the fast exit skips
    def __init__(self, path):
        self.path = path

    def __del__(self):
        open(self.path, "w").close()


_mark = _Finalised(os.path.join(out, f"finalised{rank}.txt"))
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launch", ["fork-server", "spawn"])
def test_a_run_that_ends_right_after_its_last_save_loses_nothing(tmp_path, launch):
    out, run, local, pers = tmp_path / "out", tmp_path / "run", tmp_path / "local", tmp_path / "pers"
    out.mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--worker-launch", launch,
                      "--run-dir", str(run),
                      "--ckpt-local", str(local), "--ckpt-persistent", f"file://{pers}", "--ckpt-persistent-every", "1",
                      str(tmp_path / "train.py"), str(out)], cwd=tmp_path, timeout=140,
                     env={"RESILIENT_FAST_EXIT": "1"})
    assert r.returncode == 0, r.stderr
    events = [e.to_json() for e in read_events(run)]  # every writer's file: the workers' steps and saves are not the agent's
    kinds = [e["kind"] for e in events]
    assert kinds[-1] == "run_end" and events[-1]["details"]["exit_code"] == 0, kinds[-3:]
    assert {e["details"]["step"] for e in events if e["kind"] == "step"} == set(range(6))
    # the final step (5), saved just before the script ended, committed on both tiers
    done = {(e["details"]["step"], e["details"]["tier"]) for e in events if e["kind"] == "ckpt_tier_done"}
    assert {(5, "local"), (5, "persistent")} <= done, sorted(done)
    for rank in (0, 1):
        assert (out / f"notes{rank}.txt").read_text() == "last line\n"
        assert (out / f"late{rank}.txt").read_text() == "done"
        assert not (out / f"finalised{rank}.txt").exists()  # ended by the fast exit, not by finalisation
    # and complete on disk on every tier (the commit marker is written last)
    for tier in (local, pers):
        assert list(tier.rglob("step_00000005/COMMITTED")), sorted(str(p) for p in tier.rglob("*"))


def test_the_exit_flushes_every_kind_of_open_file_it_finds(tmp_path):
    # _flush_open_files picks file objects by their types' MRO (each type checked once): the io module's own
    # classes, a text layer over a buffered one, and a user's subclass of io.IOBase are all found and flushed
    import io

    from resilient.worker.exit_safety import _flush_open_files

    class Notes(io.IOBase):  # a user's file-like class that buffers in Python
        def __init__(self, path):
            self.path, self.pending = path, []

        def writable(self):
            return True

        def write(self, s):
            self.pending.append(s)

        def flush(self):
            with open(self.path, "a") as f:
                f.write("".join(self.pending))
            self.pending = []

    binary = open(tmp_path / "b.bin", "wb")
    text = open(tmp_path / "t.txt", "w")
    notes = Notes(tmp_path / "n.txt")
    try:
        binary.write(b"bytes")
        text.write("text")
        notes.write("notes")
        _flush_open_files()
        assert (tmp_path / "b.bin").read_bytes() == b"bytes"
        assert (tmp_path / "t.txt").read_text() == "text"
        assert (tmp_path / "n.txt").read_text() == "notes"
    finally:
        binary.close()
        text.close()
        notes.pending = []
