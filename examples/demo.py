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

    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    local = run_dir / "ckpt-local"

    from resilient.testing.gcs import LocalGCS

    gcs = LocalGCS(run_dir / "gcs-data").start()
    gcs.make_bucket("demo-bucket")
    env = dict(os.environ, **gcs.env())
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "5",
           "--run-dir", str(run_dir), "--ckpt-local", str(local), "--ckpt-persistent", "gs://demo-bucket/run",
           "--ckpt-interval", "25", "--ckpt-persistent-every", "2", "--heartbeat-timeout", "3", "--tee", "3",
           "--local-ranks-filter", "0", str(ROOT / "examples" / "train.py"), "--steps", str(args.steps),
           "--step-sleep", "0.03"]
    print("$ " + " ".join(cmd[2:]), flush=True)
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT)

    # (attempt, step at which to strike, what to do)
    third = args.steps // 4
    plan = [(0, third, "kill"), (1, 2 * third, "freeze"), (2, 3 * third, "wipe+kill")]
    pids: dict[int, dict[int, int]] = {}
    ledger = run_dir / "events.jsonl"
    pos = 0
    deadline = time.monotonic() + args.timeout
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
            time.sleep(0.05)  # polling a file the run appends to; the run itself never waits on us
        code = agent.wait()
    finally:
        if agent.poll() is None:
            agent.kill()
        gcs.stop()
    print(f"\nresilient-run exited with {code}\n", flush=True)
    report = [sys.executable, "-m", "resilient.cli", "goodput", str(run_dir), "--plot", str(run_dir / "goodput.png")]
    subprocess.run(report, check=False)
    subprocess.run([sys.executable, "-m", "resilient.cli", "ckpt", "ls", str(local / "node0") if (local / "node0").exists()
                    else str(local)], check=False)
    print(f"\nrun directory: {run_dir}\n  ledger: {ledger}\n  timeline: {run_dir / 'goodput.png'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
