"""``--ckpt-interval auto`` against the best fixed interval, on a simulated failure process.

Failures arrive as a Poisson process in wall time (mean time between failures M). Training runs a
fixed amount of work; every save blocks training for the save cost; a failure loses the work since the
last completed save and costs a restart (failures during a restart are possible). Step and save times
are noisy. The same failure times (common random numbers, several seeds) are replayed against:

* every fixed interval of a geometric sweep from 1 to 10,000 steps, refined around the best one;
* ``auto``: :class:`resilient.goodput.interval.IntervalTuner` with its default 6 h prior, fed the
  simulated step times, save costs and interruptions as the checkpointer feeds it.

Goodput = useful step time ÷ wall time. Prints a table; writes bench/results/interval.json.
Usage: python bench/interval.py [--quick]   (--quick: a smoke run, too few failures to judge the 1% claim)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilient.goodput.interval import IntervalTuner  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer seeds and a shorter horizon")
    ap.add_argument("--failures", type=float, default=30.0, help="horizon, in expected failures per run")
    args = ap.parse_args()
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
    out = Path(__file__).resolve().parent / "results" / "interval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "params": {"step_seconds": STEP_S, "save_seconds": SAVE_S, "restart_seconds": RESTART_S, "noise": NOISE,
                   "seeds": len(seeds), "horizon_failures": horizon, "prior_mtbf_seconds": IntervalTuner().prior_mtbf_s},
        "rows": rows, "auto_within_1pct": ok, "elapsed_seconds": elapsed,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
