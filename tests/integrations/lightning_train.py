"""A Lightning DDP job the way a user writes it, plus the lines the integration adds."""

from __future__ import annotations

import argparse
import os
import time

import lightning.pytorch as L
import torch

from resilient.data import ResumableSampler
from resilient.integrations.lightning import ResilientCheckpoint, ResilientCheckpointIO, ResilientPreemption


def _rng() -> str:
    import hashlib

    return hashlib.md5(torch.get_rng_state().numpy().tobytes()).hexdigest()[:10]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.trace: str | None = None
        self.val_seconds = 0.0
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trace is not None:
            with open(os.path.join(self.trace, f"trace-{self.global_rank}.txt"), "a") as f:
                f.write(f"{self.global_step} {x.sum().item():.6f} {_rng()} "
                        f"{self.net[0].weight.sum().item():.8f} {self.trainer.optimizers[0].param_groups[0]['lr']} "
                        f"ep={self.current_epoch} bi={batch_idx} sched={self.lr_schedulers().last_epoch}\n")
        return torch.nn.functional.cross_entropy(self.net(x), y)

    # LIGHTNING_TRACE=1: data, RNG, weights, gradients and optimizer state per step, to find where two runs part
    def on_before_optimizer_step(self, optimizer):
        if self.trace is not None:
            st = optimizer.state.get(self.net[0].weight, {})
            with open(os.path.join(self.trace, f"trace-{self.global_rank}.txt"), "a") as f:
                f.write(f"  grad {self.net[0].weight.grad.sum().item():.8f} step {float(st.get('step', -1))} "
                        f"m {float(st['exp_avg'].sum()) if 'exp_avg' in st else 0:.8f}\n")

    def on_train_epoch_start(self):
        if self.trace is not None:
            with open(os.path.join(self.trace, f"trace-{self.global_rank}.txt"), "a") as f:
                f.write(f" epoch start {self.current_epoch} rng {_rng()}\n")

    def validation_step(self, batch, batch_idx):
        time.sleep(self.val_seconds)  # a real validation is many steps long
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    ap.add_argument("--val-seconds", type=float, default=0.5, help="time of one validation batch")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :4] * 3).argmax(1))
    sampler = ResumableSampler(data, seed=0)  # 96 samples / (8 × 2 ranks): epochs of 6 steps
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    ckpt = ResilientCheckpoint(sampler=sampler)
    validation = {}
    if args.val_every:
        validation = dict(val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                        max_steps=args.steps, **validation, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        plugins=[ResilientCheckpointIO()], callbacks=[ckpt, ResilientPreemption(ckpt)],
                        default_root_dir=args.out)
    model = Model()
    if os.environ.get("LIGHTNING_TRACE"):
        model.trace = args.out
        os.makedirs(args.out, exist_ok=True)
    if args.val_every:
        model.val_seconds = args.val_seconds
        val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:32], data.tensors[1][:32]), batch_size=8)
        trainer.fit(model, loader, val)
    else:
        trainer.fit(model, loader)
    trainer.save_checkpoint(os.path.join(args.out, "end.ckpt"))  # goes to our tiers too, from every rank
    if trainer.global_rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
        print(f"[train] done at step {trainer.global_step}, restored from {ckpt.restored_step}", flush=True)


if __name__ == "__main__":
    main()
