"""A tiny GPT-2 made from a config (no downloads) and text made here, as the Hugging Face tests
train it (tests/integration/test_huggingface.py); run as a script, one worker of an aps run
with aps.huggingface.Trainer: writes its losses and the samples it trained on, as JSON."""

import json
import sys

import torch
import transformers

TEXT = ("the quick brown fox jumps over the lazy dog. a parameter server holds the weights; "
        "workers push gradients and pull weights. ") * 12
VOCAB = sorted(set(TEXT))
BLOCK = 32


class Blocks(torch.utils.data.Dataset):
    """The text, a character a token, cut into blocks (each sample knows its index)."""

    def __init__(self) -> None:
        ids = torch.tensor([VOCAB.index(c) for c in TEXT])
        self.blocks = ids[: len(ids) // BLOCK * BLOCK].view(-1, BLOCK)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block, "index": torch.tensor(index)}


def model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(VOCAB), n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def collate(samples: list[dict]) -> dict:
    """Batches the blocks; the indices go to SEEN (the model takes no such input)."""
    SEEN.extend(int(s["index"]) for s in samples)
    return {"input_ids": torch.stack([s["input_ids"] for s in samples]),
            "labels": torch.stack([s["labels"] for s in samples])}


SEEN: list[int] = []


def arguments(out: str, **options) -> transformers.TrainingArguments:
    settings = dict(output_dir=out, per_device_train_batch_size=8, num_train_epochs=2, learning_rate=0.05,
                    seed=0, report_to=[], save_strategy="no", logging_steps=4, use_cpu=True,
                    disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    settings.update(options)
    return transformers.TrainingArguments(**settings)


if __name__ == "__main__":
    import aps.huggingface

    address, rank, workers, out = sys.argv[1:5]
    losses = []

    class Losses(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trainer = aps.huggingface.Trainer(
        model=model(), args=arguments(out + ".d", num_train_epochs=10, learning_rate=1e-2, logging_steps=2),
        train_dataset=Blocks(),
        data_collator=collate, callbacks=[Losses()], aps_address=address, aps_rank=int(rank),
        aps_workers=int(workers))
    trainer.train()
    with open(out, "w") as file:
        json.dump({"losses": losses, "seen": SEEN}, file)
