"""``--ckpt-interval auto`` against the best fixed interval, on a simulated failure process.

Failures arrive as a Poisson process in wall time (mean time between failures M). Training runs a
fixed amount of work; every save blocks training for the save cost; a failure loses the work since the
last completed save and costs a restart (failures during a restart are possible). Step and save times
are noisy. The same failure times (common random numbers, several seeds) are replayed against:

* every fixed interval of a geometric sweep from 1 to 10,000 steps, refined around the best one;
* ``auto``: :class:`resilient.checkpoint.save.interval.IntervalTuner` with its default 6 h prior, fed the
  simulated step times, save costs and interruptions as the checkpointer feeds it.

Goodput = useful step time ÷ wall time.

Then the same question on real runs on this machine (``--real``, on by default): the 2-rank job of
tests/goodput/ckpt_train.py (a 12 MiB state on the local tier) under ``resilient-run``, rank 1 SIGKILLed at
seeded steps (exponential gaps, the same schedule for every configuration), once per fixed interval of a
sweep and once with ``--ckpt-interval auto`` (its prior MTBF set to the schedule's true mean through
``RESILIENT_CKPT_PRIOR_MTBF``; the tuner charges a save its blocking time plus its interference, learnt
from the ledger). Goodput is read from each run's ledger with the honest calculator: the report's goodput,
and the same after the launch (wall time from the first step's start: a launch costs the same to every
configuration and only dilutes the differences). Goal: auto within 2% of the best fixed interval.

Prints tables; writes bench/results/interval.json.
Usage: python bench/interval.py [--quick] [--no-sim] [--no-real] [--seeds N] [--snapshot auto|off] [--out FILE]
(--quick: a smoke run, too few failures to judge the claims)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resilient.checkpoint.save.interval import PRIOR_MTBF_ENV, IntervalTuner  # noqa: E402

STEP_S = 10.0  # mean step time
SAVE_S = 15.0  # mean blocking cost of a save
RESTART_S = 180.0  # detection + restart + restore
NOISE = 0.1  # relative spread of step and save times
TUNER_KW: dict = {}
MTBFS_H = (0.5, 1.0, 3.0, 6.0, 24.0)


class Fixed:
    def __init__(self, k: int):
        self.k = k

    def interval(self) -> int:
        return self.k

    def steps(self, k: int, rng: random.Random) -> float:
        # k noisy steps: the sum's spread shrinks as 1/sqrt(k); no per-step work needed
        return k * STEP_S * (1 + rng.gauss(0, NOISE / math.sqrt(k)))

    def saved(self, seconds: float) -> None:
        pass

    def interrupted(self, partial_steps: int, rng: random.Random) -> None:
        pass


class Auto(Fixed):
    def __init__(self) -> None:
        super().__init__(0)
        self.tuner = IntervalTuner(**TUNER_KW)  # default prior: 6 h, whatever the true MTBF is
        self.trace: list[int] = []

    def interval(self) -> int:
        k = self.tuner.interval_steps()
        self.trace.append(k)
        return k

    def steps(self, k: int, rng: random.Random) -> float:
        total = 0.0
        for _ in range(k):
            s = STEP_S * (1 + rng.gauss(0, NOISE))
            self.tuner.observe_step(s)
            total += s
        return total

    def saved(self, seconds: float) -> None:
        self.tuner.observe_save(seconds)

    def interrupted(self, partial_steps: int, rng: random.Random) -> None:
        for _ in range(partial_steps):  # the lost steps were still uptime
            self.tuner.observe_step(STEP_S * (1 + rng.gauss(0, NOISE)))
        self.tuner.observe_interruption()


def simulate(policy: Fixed, mtbf: float, work_steps: int, seed: int) -> dict:
    fail_rng = random.Random(seed)  # failure times: identical for every policy
    noise_rng = random.Random(seed + 10_000)
    t = 0.0
    next_fail = fail_rng.expovariate(1 / mtbf)
    done = 0
    failures = 0
    saves = 0
    give_up = 50 * work_steps * STEP_S  # an interval far above the MTBF may never get a save through
    while done < work_steps and t < give_up:
        k = min(policy.interval(), work_steps - done)
        # the chunk: k steps, then a save (the last chunk ends the job without one)
        t_steps = policy.steps(k, noise_rng)
        t_save = SAVE_S * (1 + noise_rng.gauss(0, NOISE)) if done + k < work_steps else 0.0
        if t + t_steps + t_save <= next_fail:
            t += t_steps + t_save
            done += k
            if t_save:
                saves += 1
                policy.saved(t_save)
            continue
        partial = int(min(k, max(0.0, next_fail - t) / STEP_S))
        t = next_fail
        failures += 1
        policy.interrupted(partial, noise_rng)
        t += RESTART_S
        next_fail = t - RESTART_S + fail_rng.expovariate(1 / mtbf)
        while next_fail < t:  # failed again while restarting: restart again
            failures += 1
            policy.interrupted(0, noise_rng)
            t = next_fail + RESTART_S
            next_fail = next_fail + fail_rng.expovariate(1 / mtbf)
    return {"goodput": done * STEP_S / t, "wall": t, "failures": failures, "saves": saves}


def mean_goodput(make, mtbf: float, work_steps: int, seeds: list[int]) -> tuple[float, list]:
    runs = [simulate(make(), mtbf, work_steps, s) for s in seeds]
    return sum(r["goodput"] for r in runs) / len(runs), runs


def sweep(mtbf: float, work_steps: int, seeds: list[int]) -> tuple[int, float, int]:
    grid = sorted({max(1, round(1.25 ** i)) for i in range(0, 42)} | {10000})
    scores = {k: mean_goodput(lambda k=k: Fixed(k), mtbf, work_steps, seeds)[0] for k in grid}
    best = max(scores, key=scores.get)
    fine = sorted({max(1, round(best * 1.03 ** i)) for i in range(-9, 10)} - set(scores))
    for k in fine:
        scores[k] = mean_goodput(lambda k=k: Fixed(k), mtbf, work_steps, seeds)[0]
    best = max(scores, key=scores.get)
    return best, scores[best], len(scores)


# ------------------------------------------------------------------------------------------ real runs
JOB = ROOT / "tests" / "goodput" / "ckpt_train.py"
REAL_ENV = {"STATE_MB": "12", "HIDDEN": "768", "BATCH": "768", "OMP_NUM_THREADS": "1"}


def fault_schedule(seed: int, steps: int, mean_gap: float) -> list[int]:
    """Steps at which rank 1 is killed, one per attempt (attempt i dies at the i-th), exponential gaps."""
    rng = random.Random(seed)
    out, at = [], 0.0
    while True:
        at += max(1.0, rng.expovariate(1 / mean_gap))
        if at >= steps - 1:
            return out
        out.append(int(at))


def real_run(interval: str, seed: int, steps: int, kills: list[int], prior_mtbf_s: float, work: Path,
             snapshot: str = "auto") -> dict:
    from resilient.goodput.calculator import report_for_run
    from resilient.drill.spec import FaultHow, WorkerFault, plan_env

    run_dir = Path(tempfile.mkdtemp(prefix=f"iv{interval}-s{seed}-", dir=work))
    faults = plan_env(*(WorkerFault(FaultHow.KILL, rank=1, step=k, attempt=i) for i, k in enumerate(kills)))
    env = dict(os.environ, **REAL_ENV, STEPS=str(steps), **(faults if kills else {}))
    env[PRIOR_MTBF_ENV] = str(prior_mtbf_s)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(len(kills) + 2), "--run-dir", str(run_dir), "--ckpt-local", str(run_dir / "ckpt"),
           "--ckpt-interval", interval, "--ckpt-snapshot", snapshot, str(JOB)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900,
                          start_new_session=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace")[-2000:]
        raise RuntimeError(f"interval {interval} seed {seed}: resilient-run exited {proc.returncode}:\n{tail}")
    rep = report_for_run(run_dir)
    a0 = rep.attempts[0]
    first_start = a0.start + a0.badput_seconds.get("startup", 0.0) if a0.steps else rep.start_wall
    # the launch (interpreter, torch import, first rendezvous, first-step warm-up) is the same for all
    launch = max(0.0, min(rep.wall_seconds, first_start - rep.start_wall))
    chosen = None
    from resilient.events import read_events

    ivs = [e.details for e in read_events(run_dir) if e.kind.value == "ckpt_interval"]
    if ivs:
        chosen = ivs[-1].get("interval")
    return {"interval": interval, "seed": seed, "goodput": rep.goodput,
            "goodput_after_launch": rep.productive_seconds / max(1e-9, rep.wall_seconds - launch),
            "wall_seconds": rep.wall_seconds, "elapsed_seconds": elapsed, "restarts": rep.restarts,
            "badput_seconds": rep.badput_seconds, "clean_step_seconds": a0.clean_step_seconds,
            "auto_final_interval": chosen,
            "auto_inputs": ivs[-1].get("inputs") if ivs else None}


def real_sweep(seeds: list[int], steps: int, mean_gap: float, fixed: list[int], snapshot: str = "auto") -> dict:
    work = Path(tempfile.mkdtemp(prefix="resilient-interval-bench-"))
    runs: list[dict] = []
    # a step's time on this machine, for the prior: one short run without faults or saves
    probe = real_run(str(steps + 1), -1, 60, [], 3600.0, work, snapshot)
    step_s = probe["clean_step_seconds"] or 0.03
    prior = mean_gap * step_s
    print(f"real runs: clean step {step_s * 1000:.1f} ms; a kill every {mean_gap:.0f} steps on average "
          f"(MTBF prior for auto: {prior:.1f} s); {steps} steps per run; intervals {fixed} and auto; snapshots "
          f"{snapshot}")
    for seed in seeds:
        kills = fault_schedule(seed, steps, mean_gap)
        for iv in [*map(str, fixed), "auto"]:
            r = real_run(iv, seed, steps, kills, prior, work, snapshot)
            r["kills"] = kills
            runs.append(r)
            print(f"  seed {seed} interval {iv:>4}: goodput {r['goodput']:.3f} (after launch "
                  f"{r['goodput_after_launch']:.3f}), {r['restarts']} restarts, wall {r['wall_seconds']:.1f} s"
                  + (f", auto chose {r['auto_final_interval']}" if iv == "auto" else ""), flush=True)
    table = []
    for iv in [*map(str, fixed), "auto"]:
        mine = [r for r in runs if r["interval"] == iv]
        table.append({"interval": iv, "goodput": statistics.mean(r["goodput"] for r in mine),
                      "goodput_after_launch": statistics.mean(r["goodput_after_launch"] for r in mine),
                      "checkpoint_interference": statistics.mean(r["badput_seconds"]["checkpoint_interference"]
                                                                 for r in mine),
                      "checkpoint_save_stall": statistics.mean(r["badput_seconds"]["checkpoint_save_stall"]
                                                               for r in mine),
                      "wasted_progress": statistics.mean(r["badput_seconds"]["wasted_progress"] for r in mine),
                      "wall_seconds": statistics.mean(r["wall_seconds"] for r in mine)})
    fixed_rows = [t for t in table if t["interval"] != "auto"]
    auto = table[-1]
    best = max(fixed_rows, key=lambda t: t["goodput_after_launch"])
    best_run = max(fixed_rows, key=lambda t: t["goodput"])
    print(f"{'interval':>8} {'goodput':>8} {'after launch':>12} {'interference s':>14} {'stall s':>8} "
          f"{'wasted s':>8} {'wall s':>7}")
    for t in table:
        print(f"{t['interval']:>8} {t['goodput']:>8.4f} {t['goodput_after_launch']:>12.4f} "
              f"{t['checkpoint_interference']:>14.3f} {t['checkpoint_save_stall']:>8.3f} {t['wasted_progress']:>8.3f} "
              f"{t['wall_seconds']:>7.1f}")
    ratio = auto["goodput_after_launch"] / best["goodput_after_launch"]
    ratio_run = auto["goodput"] / best_run["goodput"]
    print(f"auto / best fixed ({best['interval']}): {ratio:.4f} after launch, {ratio_run:.4f} whole run "
          f"(best fixed by whole-run goodput: {best_run['interval']}); goal >= 0.98: "
          f"{'yes' if ratio >= 0.98 else 'NO'}")
    return {"params": {"steps": steps, "mean_steps_between_kills": mean_gap, "seeds": seeds, "fixed": fixed,
                       "clean_step_seconds_probe": step_s, "prior_mtbf_seconds": prior, "snapshot": snapshot,
                       **REAL_ENV},
            "table": table, "best_fixed_interval": best["interval"], "auto_vs_best_after_launch": ratio,
            "auto_vs_best_whole_run": ratio_run, "auto_within_2pct": ratio >= 0.98, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer seeds and a shorter horizon")
    ap.add_argument("--failures", type=float, default=30.0, help="horizon, in expected failures per run")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulation")
    ap.add_argument("--no-real", action="store_true", help="skip the real runs")
    ap.add_argument("--seeds", type=int, default=1, help="fault schedules of the real runs")
    ap.add_argument("--steps", type=int, default=400, help="steps per real run")
    ap.add_argument("--mean-gap", type=float, default=120.0, help="real runs: mean steps between kills")
    ap.add_argument("--fixed", default="5,10,20,40,80", help="real runs: fixed intervals to sweep")
    ap.add_argument("--snapshot", default="auto", help="real runs: --ckpt-snapshot (auto, as users get it; off: "
                    "every kill falls back to the disk tier, the case Young/Daly alone is about)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/interval.json)")
    args = ap.parse_args()
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "interval.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    real = old.get("real")
    if not args.no_real:
        real = real_sweep(list(range(1 if args.quick else args.seeds)), 150 if args.quick else args.steps,
                          args.mean_gap if not args.quick else 60.0, [int(x) for x in args.fixed.split(",")],
                          args.snapshot)
    if args.no_sim:
        old["real"] = real
        out.write_text(json.dumps(old, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    seeds = list(range(3 if args.quick else 12))
    horizon = args.failures / (2 if args.quick else 1)
    rows = []
    t_start = time.perf_counter()
    for mtbf_h in MTBFS_H:
        mtbf = mtbf_h * 3600
        work_steps = int(horizon * mtbf / STEP_S)
        best_k, best_gp, n_tried = sweep(mtbf, work_steps, seeds)
        autos: list[Auto] = []

        def make_auto() -> Auto:
            autos.append(Auto())
            return autos[-1]

        auto_gp, runs = mean_goodput(make_auto, mtbf, work_steps, seeds)
        young_daly = math.sqrt(2 * SAVE_S * mtbf) - SAVE_S
        finals = [a.trace[-1] for a in autos]
        rows.append({
            "mtbf_hours": mtbf_h, "work_steps": work_steps, "seeds": len(seeds),
            "failures_per_run": sum(r["failures"] for r in runs) / len(runs),
            "best_fixed_interval": best_k, "best_fixed_goodput": best_gp, "fixed_intervals_tried": n_tried,
            "auto_goodput": auto_gp, "auto_final_interval_median": sorted(finals)[len(finals) // 2],
            "young_daly_interval": young_daly / STEP_S,
            "auto_vs_best": auto_gp / best_gp,
        })
    elapsed = time.perf_counter() - t_start

    hdr = (f"{'MTBF':>6} {'fails/run':>9} {'best fixed':>10} {'goodput':>8} {'auto (final)':>12} "
           f"{'goodput':>8} {'auto/best':>9} {'Young/Daly':>10}")
    print(f"step {STEP_S:.0f} s, save {SAVE_S:.0f} s blocking, restart {RESTART_S:.0f} s; "
          f"{len(seeds)} seeds; auto starts from a 6 h prior")
    print(hdr)
    for r in rows:
        print(f"{r['mtbf_hours']:>5.1f}h {r['failures_per_run']:>9.1f} {r['best_fixed_interval']:>10d} "
              f"{r['best_fixed_goodput']:>8.4f} {r['auto_final_interval_median']:>12d} {r['auto_goodput']:>8.4f} "
              f"{r['auto_vs_best']:>9.4f} {r['young_daly_interval']:>10.1f}")
    ok = all(r["auto_vs_best"] >= 0.99 for r in rows)
    print(f"auto within 1% of the best fixed interval for every MTBF: {'yes' if ok else 'NO'} ({elapsed:.1f} s)")
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "interval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "params": {"step_seconds": STEP_S, "save_seconds": SAVE_S, "restart_seconds": RESTART_S, "noise": NOISE,
                   "seeds": len(seeds), "horizon_failures": horizon, "prior_mtbf_seconds": IntervalTuner().prior_mtbf_s},
        "rows": rows, "auto_within_1pct": ok, "elapsed_seconds": elapsed, "real": real,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
