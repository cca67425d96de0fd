"""One worker of an aps run of aps.huggingface.Trainer, launched as the docs say (torchrun, or
``RANK=$rank WORLD_SIZE=2 python hf_launched.py OUT``; ``APS_ADDRESS`` names the server): trains
the tiny GPT-2 of hf_worker.py with SGD at a constant rate and writes OUT/RANK.npz (every
gradient it pushed, the weights it started from and ended with, in the server's layout) and
OUT/RANK.json (its rank and version, how transformers ran it). ``ARGS=transformers`` makes the
arguments transformers' own instead of aps.huggingface.TrainingArguments."""

import json
import os
import pathlib
import sys

import numpy as np
import torch
import transformers

import aps.huggingface
import hf_worker as hw

LR = 0.05


class Pushes(transformers.TrainerCallback):
    """Records what the worker pushes: its flat gradient buffer as each push reads it."""

    def __init__(self) -> None:
        self.worker = None
        self.grads: list[np.ndarray] = []
        self.initial = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.worker = worker = getattr(optimizer, "optimizer", optimizer).worker
        self.initial = worker.flat_weights.copy()  # (what init returned: version 0, no step taken yet)
        push_pull = worker.push_pull

        def recorded(*parts, **options):
            self.grads.append(worker.flat_grad.copy())
            return push_pull(*parts, **options)

        worker.push_pull = recorded


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    kind = aps.huggingface.TrainingArguments if os.environ.get("ARGS") != "transformers" \
        else transformers.TrainingArguments
    args = kind(output_dir=str(out / f"run-{os.environ['RANK']}"), per_device_train_batch_size=8, num_train_epochs=2,
                learning_rate=LR, lr_scheduler_type="constant", optim="sgd", seed=0, report_to=[],
                save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                remove_unused_columns=False)
    pushes = Pushes()
    trainer = aps.huggingface.Trainer(model=hw.model(), args=args, train_dataset=hw.Blocks(),
                                      data_collator=hw.collate, callbacks=[pushes])
    trainer.train()
    worker = pushes.worker
    rank = trainer.aps_rank
    np.savez(out / f"{rank}.npz", grads=np.stack(pushes.grads), initial=pushes.initial,
             final=worker.flat_weights.copy())
    (out / f"{rank}.json").write_text(json.dumps({
        "rank": rank, "workers": trainer.aps_workers, "version": worker.version, "lr": LR,
        "wrapped": type(trainer.model_wrapped).__name__, "world_size": trainer.args.world_size,
        "process_group": torch.distributed.is_available() and torch.distributed.is_initialized()}))
