"""Worker for the compile-cache tests: compiles a tiny model, saves the caches, then carries out the
``RESILIENT_FAULTS`` plan for "step 3" (the tests SIGKILL it there in attempt 0).

Each attempt gets an empty local Inductor cache directory (as a replacement node would), so a cache hit in
attempt 1 can only come from what ``resilient.compile_cache`` kept in the run directory. Writes the
Inductor/AOTAutograd cache counters of each attempt to RUN_DIR/counters-<attempt>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

run_dir = Path(os.environ["RESILIENT_RUN_DIR"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(run_dir / f"local-inductor-{attempt}")

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from resilient import compile_cache  # noqa: E402
from resilient.drill.worker import maybe_fail  # noqa: E402


def main() -> None:
    use_cache = os.environ.get("CC_DISABLE") != "1"
    cc = compile_cache.enable() if use_cache else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fn = torch.compile(model)
    for step in range(3):
        fn(torch.randn(8, 16))
        if step == 0 and cc is not None:
            cc.maybe_save()
    (run_dir / f"counters-{attempt}.json").write_text(json.dumps(
        {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
        | {"restored": bool(cc and cc.restored)}))
    sys.stdout.flush()
    maybe_fail(3)  # after the three compiled steps


if __name__ == "__main__":
    main()
