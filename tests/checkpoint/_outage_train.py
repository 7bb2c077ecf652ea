"""``examples/ckpt_train.py`` with two gates for the persistent-store outage drill (test_store_outage.py).

The gates are files in ``$DRILL_DIR``; every wait on them is bounded (``DRILL_WAIT_S``, default 120 s).

* ``DRILL_HOLD_UPLOAD=S``: on rank 0, right after its first ``.distcp`` file of step ``S`` reached the
  persistent tier, the upload touches ``upload-in-flight`` and waits for ``store-killed``: the test kills
  the store with step ``S`` half uploaded, never before, never after.
* ``DRILL_PERSISTENT_TIMEOUT_S=S``: the bound on one call to the persistent store (``persistent_timeout_s``).
* ``DRILL_GATES=G:FILE[,G:FILE...]``: at step ``G`` every rank touches ``at-<G>-<rank>`` and waits for
  ``FILE``. The outage drill holds training at step 8 until the store is dead (so that the next saves
  happen during the outage, however fast training is) and at step 16 until it is back (so that the run is
  still going when the store returns, as a long run would be). Between gates training runs freely.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRILL = Path(os.environ["DRILL_DIR"])
WAIT_S = float(os.environ.get("DRILL_WAIT_S", "120"))


def _wait_for(name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not (DRILL / name).exists():
        if time.monotonic() > deadline:
            print(f"drill: {name} did not appear within {WAIT_S:.0f} s; going on", file=sys.stderr, flush=True)
            return
        time.sleep(0.01)


def _install() -> None:
    rank = int(os.environ.get("RANK", "0"))
    hold = int(os.environ.get("DRILL_HOLD_UPLOAD", "-1"))
    if hold >= 0 and rank == 0:
        from resilient.checkpoint.storage import tiers

        # the bounded tier's calls, not the store's: the hold is outside the bound on one call, which would
        # otherwise give the held call up while the store is still alive (and a retry would finish the step)
        orig_put, orig_write = tiers.BoundedTier.put_file, tiers.BoundedTier.write_bytes
        held: list[bool] = []

        def after(self, step, name):  # type: ignore[no-untyped-def]
            if step == hold and self.name == "persistent" and name.endswith(".distcp") and not held:
                held.append(True)
                (DRILL / "upload-in-flight").touch()
                _wait_for("store-killed")

        def put_file(self, step, name, local_path):  # type: ignore[no-untyped-def]
            orig_put(self, step, name, local_path)
            after(self, step, name)

        def write_bytes(self, step, name, data):  # type: ignore[no-untyped-def]
            orig_write(self, step, name, data)  # a file of one part goes up in one request
            after(self, step, name)

        tiers.BoundedTier.put_file = put_file  # type: ignore[method-assign]
        tiers.BoundedTier.write_bytes = write_bytes  # type: ignore[method-assign]
    bound = os.environ.get("DRILL_PERSISTENT_TIMEOUT_S")
    if bound:
        # the bound on one call to the store (default 30 s): what a call to the killed store waits before it is given
        # up; the drill's calls move a few KiB to a store on loopback, so a shorter bound only shortens the outage
        from resilient.checkpoint.save.manager import CheckpointManager

        orig_from_env = CheckpointManager.from_env.__func__  # type: ignore[attr-defined]

        def from_env(cls, **overrides):  # type: ignore[no-untyped-def]
            return orig_from_env(cls, **{"persistent_timeout_s": float(bound), **overrides})

        CheckpointManager.from_env = classmethod(from_env)  # type: ignore[method-assign,assignment]
    gates = {int(g): f for g, f in (x.split(":") for x in os.environ.get("DRILL_GATES", "").split(",") if x)}
    if gates:
        from resilient.checkpoint.save.manager import CheckpointManager

        orig_save = CheckpointManager.save

        def save(self, step, state, force=False):  # type: ignore[no-untyped-def]
            if step in gates:
                (DRILL / f"at-{step}-{rank}").touch()
                _wait_for(gates[step])
            return orig_save(self, step, state, force)

        CheckpointManager.save = save  # type: ignore[method-assign]


def main() -> int:
    spec = importlib.util.spec_from_file_location("ckpt_train", REPO / "examples" / "ckpt_train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _install()
    return int(mod.main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
