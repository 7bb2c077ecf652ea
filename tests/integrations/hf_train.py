"""A transformers.Trainer job the way a user writes it (a tiny GPT-2 from a config, token ids, no download),
with the integration's Trainer in place of ``Trainer``."""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from resilient.integrations.hf import ResilientTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class SlowTokens(Tokens):
    """An evaluation set that takes its time (a real evaluation is many steps long)."""

    def __init__(self, n: int, length: int, vocab: int, seconds: float) -> None:
        super().__init__(n, length, vocab)
        self.seconds = seconds

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(self.seconds)
        return super().__getitem__(i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    ap.add_argument("--eval-seconds", type=float, default=0.5, help="time to read one evaluation sample")
    args = ap.parse_args()
    evaluation = {}
    if args.eval_every:
        evaluation = dict(eval_strategy="steps", eval_steps=args.eval_every, per_device_eval_batch_size=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                              learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, seed=0,
                              save_strategy="no", report_to=[], logging_strategy="no", disable_tqdm=True,
                              use_cpu=True, dataloader_num_workers=0, ddp_backend="gloo", **evaluation)
    trainer = ResilientTrainer(model=model, args=targs, train_dataset=Tokens(48, 16, 64),  # 6 steps an epoch
                               eval_dataset=SlowTokens(8, 16, 64, args.eval_seconds) if args.eval_every else None)
    trainer.train()
    if trainer.args.process_index == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.pt"))
        print(f"[train] done at step {trainer.state.global_step}, restored from {trainer.restored_step}", flush=True)


if __name__ == "__main__":
    main()
