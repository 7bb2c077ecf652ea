"""``examples/ckpt_train.py`` with two gates for the persistent-store outage drill (test_store_outage.py).

The gates are files in ``$DRILL_DIR``; every wait on them is bounded (``DRILL_WAIT_S``, default 120 s).

* ``DRILL_HOLD_UPLOAD=S``: holds rank 0's upload of step ``S`` half done until the store is killed; that hold is
  in ``_upload_hold/sitecustomize.py``, since the upload may run in the upload process, not in this script.
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
