"""A whole trainer checkpoint (dotted keys, lists, empty containers, optimizer state) round-trips through the
manager with no restore template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import resilient
from resilient.integrations import _state


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_trainer_checkpoint_round_trips_without_template(tmp_path: Path) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(3, 2))
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    o.step()
    sd = {"state_dict": m.state_dict(), "optimizer_states": [o.state_dict()], "epoch": 3,
          "loops": {"empty": {}, "mixed": [1, {"a": torch.ones(1)}], "tuple": (1, 2)}, "1": "digit key"}
    with resilient.CheckpointManager(local=tmp_path, interval=1) as ck:
        ck.save(0, {"x": _state.pack(sd), "rng": _state.rng_state()}, force=True)
        ck.wait(timeout=60)
    want_rng = _state.rng_state()
    torch.rand(3)  # move the generator on: restore must bring it back
    with resilient.CheckpointManager(local=tmp_path, interval=1) as ck:
        target = {"x": _state.empty_packed(), "rng": _state.rng_state()}
        assert ck.restore(target) == 1
    assert _eq(sd, _state.unpack(target["x"]))
    _state.set_rng_state(target["rng"])
    assert torch.equal(torch.get_rng_state(), want_rng["torch"])
