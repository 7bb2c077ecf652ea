"""A torch-free worker for client/monitor tests (starts in ~50 ms). Configured by environment:
  T_STEPS, T_STEP_SLEEP (seconds per step), T_MARK_STEP/T_MARK_DIR (create rank<R>.step, wait for go),
  T_SECTION/T_SECTION_AT/T_SECTION_TIMEOUT/T_SECTION_SLEEP (one section at a step),
  T_SCALE_LOG (file the on_scale callback appends to), T_DP (dp_size), T_OUT (rank<R>.done after the loop),
  T_NO_CLIENT (never touch resilient: sleep T_STEP_SLEEP × T_STEPS and exit),
  T_SIGPIPE_DFL (restore the default SIGPIPE action, which kills on a write to a closed socket).
"""
import os
import sys
import time


def wait_for(path: str, timeout: float = 60.0) -> None:
    from tests._helpers.wait import wait_for as wait  # stdlib only: the worker still starts in ~50 ms

    wait(lambda: os.path.exists(path), timeout, path, interval=0.002)


def main() -> None:
    rank = int(os.environ["RANK"])
    n = int(os.environ.get("T_STEPS", "10"))
    dt = float(os.environ.get("T_STEP_SLEEP", "0.01"))
    if os.environ.get("T_NO_CLIENT"):
        time.sleep(n * dt)
        return
    import resilient

    if os.environ.get("T_SIGPIPE_DFL"):  # as scripts piping to `head` do: a write to a dead peer kills
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)

    scale_log = os.environ.get("T_SCALE_LOG")
    if scale_log:
        @resilient.on_scale
        def log(ev):
            with open(scale_log, "a") as f:
                f.write(f"{rank} {ev.old_world_size} {ev.new_world_size} {ev.old_dp_size} {ev.new_dp_size}\n")

    mark = int(os.environ.get("T_MARK_STEP", "-1"))
    mark_dir = os.environ.get("T_MARK_DIR", "")
    sect = os.environ.get("T_SECTION")
    sect_at = int(os.environ.get("T_SECTION_AT", "-1"))
    sect_timeout = float(os.environ["T_SECTION_TIMEOUT"]) if os.environ.get("T_SECTION_TIMEOUT") else None
    sect_sleep = float(os.environ.get("T_SECTION_SLEEP", "0"))
    dp = int(os.environ["T_DP"]) if os.environ.get("T_DP") else None
    for step in resilient.steps(0, n, dp_size=dp):
        if step == mark and mark_dir:
            open(os.path.join(mark_dir, f"rank{rank}.step"), "w").close()
            wait_for(os.path.join(mark_dir, "go"))
        time.sleep(dt)
        if sect and step == sect_at:
            with resilient.section(sect, timeout=sect_timeout):
                time.sleep(sect_sleep)
    out = os.environ.get("T_OUT")
    if out:
        open(os.path.join(out, f"rank{rank}.done"), "w").close()


if __name__ == "__main__":
    main()
