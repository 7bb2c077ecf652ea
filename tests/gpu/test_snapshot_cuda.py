"""Snapshots in node memory of a CUDA state, on a real GPU: the copy from the device into the mapped slot and the
restore back onto the device are bit-exact (plain tensors, bf16, a non-contiguous source, a 0-size tensor), and a
restart resumes from the snapshot rather than the older save on disk.

CUDA only: the CPU paths are tested in tests/checkpoint/test_snapshot.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from resilient.checkpoint import CheckpointManager

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tensors copied "
                                 "into node memory and back)"),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm"),
              pytest.mark.timeout(120)]


def test_cuda_state_snapshot_round_trip_is_bit_exact(tmp_path: Path) -> None:
    shm = Path(tempfile.mkdtemp(prefix="snap-test-gpu-", dir="/dev/shm"))
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        st = {"big": torch.randn(5 << 20, generator=g, device="cuda"),
              "h": torch.randn(129, 3, generator=g, device="cuda").to(torch.bfloat16),
              "t": torch.randn(6, 8, generator=g, device="cuda").t(), "z": torch.empty(0, 5, device="cuda")}
        with CheckpointManager(local=tmp_path / "ckpt", interval=5, peer=False, snapshot=1, snapshot_dir=shm) as ck:
            assert ck.restore({"m": st}) == 0
            for step in range(7):
                for v in st.values():
                    v.add_(1)
                ck.save(step, {"m": st})
            assert ck.wait(60) and ck.snapshot.flush(30)
        want = {k: v.clone() for k, v in st.items()}
        fresh = {k: torch.full_like(v, 7) for k, v in st.items()}
        with CheckpointManager(local=tmp_path / "ckpt", interval=5, peer=False, snapshot=1, snapshot_dir=shm) as ck:
            assert ck.restore({"m": fresh}) == 7
            assert ck.last_restore.tier == "snapshot"
        for k in want:
            assert fresh[k].device.type == "cuda" and torch.equal(fresh[k], want[k]), k
    finally:
        shutil.rmtree(shm, ignore_errors=True)
