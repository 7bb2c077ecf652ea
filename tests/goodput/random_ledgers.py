"""Random ledgers of every shape the calculator must account for: several launches into one run directory, attempts
with and without ATTEMPT_START, faults of each kind, restarts with rollbacks, saves with stalls and background
work (several ranks reporting the same save), restores, stragglers, waits for spares, clock offsets (some beyond a
day, some within the measurement's error), lost nodes, and the malformed: step records with no step, a step that is
not a number, negative or zero seconds, records naming no attempt or one never spawned, walls on a coarse grid so
that many events share an instant, and the whole list shuffled."""

from __future__ import annotations

import random

from resilient.events.api import Event, EventKind as K


def _ev(kind: K, wall: float, attempt: int | None = None, node: str = "n0", rank: int | None = None,
        details: dict | None = None, **d: object) -> Event:
    return Event(kind=kind, node=node, rank=rank, attempt=attempt, details={**(details or {}), **d}, wall=wall,
                 mono=wall)


def random_ledger(rng: random.Random) -> list[Event]:
    evs: list[Event] = []
    t = rng.choice([0.0, 1000.0, 1.7e9])
    nodes = ["a", "b", "c"][:rng.randint(1, 3)]
    step = 0
    grid = rng.choice([None, 0.5, 0.25])

    def q(x: float) -> float:
        return round(x / grid) * grid if grid else x

    for _ in range(rng.randint(1, 3)):
        for n in nodes:
            evs.append(_ev(K.RUN_START, q(t), node=n))
        att = 0
        for _ in range(rng.randint(1, 4)):
            t += rng.uniform(0, 2)
            if rng.random() < 0.9:
                for n in nodes:
                    evs.append(_ev(K.ATTEMPT_START, q(t + rng.uniform(0, 0.1)), attempt=att, node=n,
                                   world_size=rng.choice([2, 4, "x"])))
            if rng.random() < 0.3:
                evs.append(_ev(K.CKPT_RESTORE, q(t + 0.5), attempt=att, rank=0, step=step, seconds=rng.uniform(0, 1)))
            if rng.random() < 0.2:
                step = max(0, step - rng.randint(0, 20))
            for _ in range(rng.randint(0, 60)):
                odd = rng.random() < 0.1
                dur = rng.choice([rng.uniform(0.1, 1.0), 0.0, -0.1, 0.3]) if odd else rng.uniform(0.2, 0.4)
                t += max(dur, 0) + rng.choice([0, 0, 0.01, rng.uniform(0, 0.5)])
                det: dict = {"step": step, "seconds": dur}
                r = rng.random()
                if r < 0.03:
                    det = {"seconds": dur}
                elif r < 0.05:
                    det = {"step": "x", "seconds": dur}
                elif r < 0.06:
                    det = {"step": step, "seconds": "nan"}
                node = nodes[0] if rng.random() < 0.95 else rng.choice(nodes)
                named = att if rng.random() < 0.9 else rng.choice([None, att + 1, 99])
                evs.append(Event(kind=K.STEP, node=node, rank=0, attempt=named, details=det, wall=q(t), mono=t))
                if rng.random() < 0.15:
                    block = rng.uniform(0, 0.2)
                    w = q(t - rng.uniform(0, dur if dur > 0 else 0.1))
                    for rk in range(rng.randint(1, 2)):
                        evs.append(_ev(K.CKPT_SAVE, w, attempt=att, rank=rk, step=step, blocking_seconds=block))
                    if rng.random() < 0.8:
                        evs.append(_ev(K.CKPT_TIER_DONE, q(w + rng.uniform(0, 2)), attempt=att, rank=0, step=step,
                                       tier=rng.choice(["local", "peer"]), seconds=rng.uniform(0, 1.5)))
                    else:
                        evs.append(_ev(K.CKPT_TIER_FAILED, q(w + rng.uniform(0, 2)), attempt=att, rank=0, step=step,
                                       tier="local", error="x"))
                if rng.random() < 0.02:
                    evs.append(_ev(K.STRAGGLER, q(t), attempt=att, score=0.3))
                if rng.random() < 0.03:
                    evs.append(_ev(K.LOG, q(t), node=rng.choice(nodes), clock_offset=rng.choice([0.3, -0.2, 1e-4, 2e5]),
                                   clock_rtt=rng.choice([0.0, 0.001, 1.0])))
                step += 1
            t += rng.uniform(0, 1)
            r = rng.random()
            if r < 0.3:
                evs.append(_ev(K.WORKER_EXIT, q(t), attempt=att, exit_code=rng.choice([1, 0, -9]),
                               signal=rng.choice([None, "SIGKILL"])))
            elif r < 0.45:
                evs.append(_ev(K.HANG, q(t), attempt=att, last_heartbeat_age=rng.uniform(0, 3)))
            elif r < 0.55:
                evs.append(_ev(K.AGENT_LOST, q(t), node=rng.choice(nodes)))
            elif r < 0.65:
                evs.append(_ev(K.ACTION, q(t), attempt=att, action=rng.choice(["wait_for_spares", "restart", "wait"])))
                t += rng.uniform(0, 3)
                if rng.random() < 0.5:
                    evs.append(_ev(K.ACTION, q(t), attempt=att, action="hot_swap"))
            if rng.random() < 0.7:
                t += rng.uniform(0, 1)
                evs.append(_ev(K.RESTART, q(t), attempt=att, cause="worker_exit", detect_seconds=rng.uniform(0, 1),
                               details={"attempt": att + 1} if rng.random() < 0.8 else {}))
            if rng.random() < 0.2:
                evs.append(_ev(K.SCALE, q(t), attempt=att + 1, new_world_size=2))
            att += 1
        t += rng.uniform(0, 2)
        if rng.random() < 0.85:
            for n in nodes:
                if rng.random() < 0.9:
                    evs.append(_ev(K.RUN_END, q(t + rng.uniform(0, 0.2)), node=n, exit_code=rng.choice([0, 0, 1])))
        t += rng.uniform(0, 5)
    if rng.random() < 0.5:
        rng.shuffle(evs)
    return evs
