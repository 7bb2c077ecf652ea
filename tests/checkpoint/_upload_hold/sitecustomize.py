"""The outage drill's upload hold (test_store_outage.py), in whichever process sends rank 0's upload.

Uploads' bytes go from the upload process (``--ckpt-upload-process on``, or ``auto`` on a node with cores to spare) or
from the training process's upload thread, so the hold cannot be patched into the training script alone: this
directory is put on ``PYTHONPATH`` for the drill's job, and every interpreter of it (launcher, agent, fork server, workers, upload
processes, which inherit the worker's ``RANK``) imports this file at start.

``DRILL_HOLD_UPLOAD=S``: on rank 0, right after its first ``.distcp`` file of step ``S`` reached the persistent
tier (or its first part, for a file the store composes from parts), the upload touches ``$DRILL_DIR/upload-in-flight`` and waits (at most ``DRILL_WAIT_S``, default 120 s) for
``store-killed``: the test kills the store with step ``S`` half uploaded, never before, never after.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _install() -> None:
    hold = int(os.environ.get("DRILL_HOLD_UPLOAD", "-1"))
    if hold < 0:
        return
    drill = Path(os.environ["DRILL_DIR"])
    wait_s = float(os.environ.get("DRILL_WAIT_S", "120"))
    from resilient.checkpoint.storage import tiers

    # the bounded tier's calls, not the store's: the hold is outside the bound on one call, which would otherwise
    # give the held call up while the store is still alive (and a retry would finish the step)
    orig_put, orig_write = tiers.BoundedTier.put_file, tiers.BoundedTier.write_bytes
    held: list[bool] = []

    def after(self, step, name):  # type: ignore[no-untyped-def]
        # RANK is read per call: the fork server imports this before any rank exists
        if os.environ.get("RANK") != "0" or held or step != hold or self.name != "persistent" \
                or ".distcp" not in name:  # a file, or a part of one the store composes
            return
        held.append(True)
        (drill / "upload-in-flight").touch()
        deadline = time.monotonic() + wait_s
        while not (drill / "store-killed").exists():
            if time.monotonic() > deadline:
                print(f"drill: store-killed did not appear within {wait_s:.0f} s; going on", file=sys.stderr,
                      flush=True)
                return
            time.sleep(0.01)

    def put_file(self, step, name, local_path):  # type: ignore[no-untyped-def]
        orig_put(self, step, name, local_path)
        after(self, step, name)

    def write_bytes(self, step, name, data):  # type: ignore[no-untyped-def]
        orig_write(self, step, name, data)  # a file of one part goes up in one request
        after(self, step, name)

    tiers.BoundedTier.put_file = put_file  # type: ignore[method-assign]
    tiers.BoundedTier.write_bytes = write_bytes  # type: ignore[method-assign]


_install()
