"""Marks itself ready, then waits; records the signal it gets (or ignores SIGTERM if asked)."""
import os
import signal
import sys
import time

out, mode = sys.argv[1], sys.argv[2]


def on_term(signum, _frame):
    with open(os.path.join(out, f"got_{os.environ['RANK']}"), "w") as f:
        f.write(signal.Signals(signum).name)
    if mode != "ignore":
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f".ready_{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f".ready_{os.environ['RANK']}"), os.path.join(out, f"ready_{os.environ['RANK']}"))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    signal.pause() if hasattr(signal, "pause") else time.sleep(1)
