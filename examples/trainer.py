"""remat inside transformers' Trainer: one line, driven by a budget.

    python examples/trainer.py

A tiny GPT-2 (random weights) trains for a few steps on random tokens. `remat.enable` plans the
step at the first training call, on the batch Trainer passes, under half the activation memory
of the plain step; Trainer, its optimizer, scheduler and evaluation run unchanged.
"""

from __future__ import annotations

import logging

import torch
import transformers

import remat


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 16, seq: int = 32) -> None:
        self.ids = torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # remat says what it planned
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)

    # instead of model.gradient_checkpointing_enable(); time_limit_s bounds each plan (30 s default)
    model = remat.enable(model, budget="50%", time_limit_s=2)

    args = transformers.TrainingArguments(
        output_dir="/tmp/remat-trainer", max_steps=4, per_device_train_batch_size=4,
        logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    print("eval loss", round(trainer.evaluate(Tokens(n=4))["eval_loss"], 3))


if __name__ == "__main__":
    main()
