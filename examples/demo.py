"""The main job: a real 2-worker training run under ``resilient-run`` with faults injected.

What happens (``make demo``):
  1. a real GCS API server starts on loopback (fake-gcs-server) as the persistent tier;
  2. ``resilient-run --standalone --nproc-per-node 2`` trains examples/train.py with a local tier,
     gs:// uploads, hang detection and up to 5 restarts;
  3. faults are injected from outside, driven by the run's own ledger:
       * rank 1 is SIGKILLed mid-run                    → exit detected, in-job restart, local restore
       * rank 0 is frozen with SIGSTOP                  → heartbeat timeout, restart, local restore
       * the local tier is wiped, then rank 0 SIGKILLed → restore falls back to the gs:// copy
  4. the goodput report is printed, the timeline drawn to RUN_DIR/goodput.png, the tiers listed.

SIGTERM, SIGHUP or Ctrl-C stop it cleanly: the run gets SIGTERM (then SIGKILL), the GCS server is stopped, and
no process the demo started is left behind.

    python examples/demo.py [--steps 400] [--run-dir runs/demo-...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TERM_TIMEOUT = 10.0  # the run's --term-timeout: how long its workers get after SIGTERM


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _descendants() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _stop_run(agent: subprocess.Popen, known: list) -> None:
    """SIGTERM the run, SIGKILL it after its own grace, then anything it started that outlived it."""
    import psutil

    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(TERM_TIMEOUT + 15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)
    left = []
    for proc in known + _descendants():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                left.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)


def tail_steps(ledger: Path, pos: int) -> tuple[int, list[dict]]:
    """New complete lines of the ledger since byte ``pos``."""
    if not ledger.exists():
        return pos, []
    with open(ledger, "rb") as f:
        f.seek(pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    out = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return pos + end, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    # the default action of SIGTERM/SIGHUP ends this process at once and orphans the run and the GCS server
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stopped)

    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    local = run_dir / "ckpt-local"

    from resilient.testing.gcs import LocalGCS

    gcs = LocalGCS(run_dir / "gcs-data")
    try:
        gcs.start()
        gcs.make_bucket("demo-bucket")
    except BaseException:  # a signal during start-up must not leave the server behind either
        gcs.stop()
        raise
    env = dict(os.environ, **gcs.env())
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "5",
           "--run-dir", str(run_dir), "--ckpt-local", str(local), "--ckpt-persistent", "gs://demo-bucket/run",
           "--ckpt-interval", "25", "--ckpt-persistent-every", "2", "--heartbeat-timeout", "3", "--tee", "3",
           "--term-timeout", str(TERM_TIMEOUT),
           "--local-ranks-filter", "0", str(ROOT / "examples" / "train.py"), "--steps", str(args.steps),
           "--step-sleep", "0.03"]
    print("$ " + " ".join(cmd[2:]), flush=True)
    try:
        agent = subprocess.Popen(cmd, env=env, cwd=ROOT)
    except BaseException:
        gcs.stop()
        raise

    # (attempt, step at which to strike, what to do)
    third = args.steps // 4
    plan = [(0, third, "kill"), (1, 2 * third, "freeze"), (2, 3 * third, "wipe+kill")]
    pids: dict[int, dict[int, int]] = {}
    ledger = run_dir / "events.jsonl"
    pos = 0
    deadline = time.monotonic() + args.timeout
    stopped: BaseException | None = None
    known: list = []
    next_scan = 0.0
    try:
        while agent.poll() is None:
            if time.monotonic() > deadline:
                print(f"demo: run did not finish within {args.timeout:.0f}s; stopping it", file=sys.stderr)
                agent.send_signal(signal.SIGTERM)
                agent.wait(60)
                break
            pos, events = tail_steps(ledger, pos)
            for ev in events:
                if ev["kind"] == "attempt_start":
                    pids[ev["attempt"]] = {int(r): p for r, p in ev["details"]["pids"].items()}
                if ev["kind"] != "step" or not plan:
                    continue
                attempt, at, what = plan[0]
                if ev["attempt"] == attempt and ev["details"]["step"] >= at and attempt in pids:
                    plan.pop(0)
                    if what == "kill":
                        print(f"\n>>> demo: SIGKILL rank 1 at step {ev['details']['step']}\n", flush=True)
                        os.kill(pids[attempt][1], signal.SIGKILL)
                    elif what == "freeze":
                        print(f"\n>>> demo: SIGSTOP rank 0 at step {ev['details']['step']} (a hang)\n", flush=True)
                        os.kill(pids[attempt][0], signal.SIGSTOP)
                    else:
                        print(f"\n>>> demo: wipe the local tier and SIGKILL rank 0 at step {ev['details']['step']}\n",
                              flush=True)
                        shutil.rmtree(local, ignore_errors=True)
                        os.kill(pids[attempt][0], signal.SIGKILL)
            if time.monotonic() >= next_scan:  # the run's processes, while they are still our descendants
                known, next_scan = _descendants() or known, time.monotonic() + 1.0
            time.sleep(0.05)  # polling a file the run appends to; the run itself never waits on us
        code = agent.wait()
    except (_Stopped, KeyboardInterrupt) as e:
        stopped = e
        code = 128 + (e.signum if isinstance(e, _Stopped) else signal.SIGINT)
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        try:
            _stop_run(agent, known)
        finally:
            gcs.stop()
    if stopped is not None:
        print(f"\ndemo: stopped by {stopped or 'SIGINT'}; the run and the GCS server were stopped", file=sys.stderr)
        return code
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the report and listing below stay interruptible
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    print(f"\nresilient-run exited with {code}\n", flush=True)
    report = [sys.executable, "-m", "resilient.cli", "goodput", str(run_dir), "--plot", str(run_dir / "goodput.png")]
    subprocess.run(report, check=False)
    subprocess.run([sys.executable, "-m", "resilient.cli", "ckpt", "ls", str(local / "node0") if (local / "node0").exists()
                    else str(local)], check=False)
    print(f"\nrun directory: {run_dir}\n  ledger: {ledger}\n  timeline: {run_dir / 'goodput.png'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
