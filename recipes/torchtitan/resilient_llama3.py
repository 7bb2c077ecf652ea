"""torchtitan config registry: a small Llama 3 for a first run under ``resilient-run`` on GPU machines.

torchtitan 0.3.0 reads its configuration from Python functions (``--module M --config F``), not from TOML
files; this module is such a registry. Put its directory on ``PYTHONPATH`` and run, from a torchtitan
checkout (the debug model's tokenizer and ``c4_test`` data are read from its ``tests/assets``)::

    resilient-run --nproc-per-node 8 --max-restarts 3 -m torchtitan.train \
        --module resilient_llama3 --config llama3_small

Any field can still be overridden on the command line (``--training.steps 1000``).
"""

from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel, llama3_8b
from torchtitan.trainer import Trainer


def _resilient(config: Trainer.Config, *, interval: int) -> Trainer.Config:
    # torchtitan's own DCP checkpoints are what a restarted attempt resumes from (it loads the newest step of
    # checkpoint.folder at start): save them asynchronously, often enough that a restart loses little
    ckpt = config.checkpoint
    ckpt.enable = True
    ckpt.folder = "checkpoint"  # under --dump_folder; put that on the node's local SSD
    ckpt.interval = interval
    ckpt.async_mode = "async"  # the training loop waits only for the copy to host memory
    ckpt.keep_latest_k = 3
    ckpt.last_save_model_only = False  # the last step is a full checkpoint too: a rerun resumes from it
    return config


def llama3_small() -> Trainer.Config:
    """The debug-sized Llama 3 (6 layers, dim 256, 2048-token vocabulary): a minute on one GPU."""
    config = llama3_debugmodel()
    config.training.steps = 200
    config.training.seq_len = 512
    config.training.local_batch_size = 8
    return _resilient(config, interval=20)


def llama3_8b_resilient() -> Trainer.Config:
    """Llama 3.1 8B as torchtitan configures it, checkpointing every 100 steps (its assets: see the README)."""
    return _resilient(llama3_8b(), interval=100)
