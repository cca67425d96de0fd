"""Hugging Face with aps against real servers: ``transformers.Trainer`` and ``accelerate``'s loop
with an ``aps.torch.Optimizer`` equal their own SGD bit for bit (one BSP worker, a warm-up
schedule, gradient accumulation and clipping as the Trainer does them);
``aps.huggingface.Trainer`` workers split the data and learn; checkpoints go through the
Trainer's own save and resume; misuse is refused clearly."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[hf]')")
torch = pytest.importorskip("torch")

import aps  # noqa: E402
import aps.huggingface  # noqa: E402
import aps.torch  # noqa: E402
from aps.cli.status import fetch_stats  # noqa: E402
from tests.trainers import run_worker_scripts  # noqa: E402

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "hf_worker.py"
_spec = importlib.util.spec_from_file_location("hf_worker", SCRIPT)
hw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hw)

SGD = ("--optimizer", "sgd", "--lr", "0.05")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    want, got = dict(a.named_parameters()), dict(b.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs"


def _train(model, args, optimizer) -> int:
    """Trains with the Trainer and a warm-up schedule; returns the optimizer steps taken."""
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=6)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=hw.Blocks(), data_collator=hw.collate,
                                   optimizers=(optimizer, schedule))
    trainer.train()
    return trainer.state.global_step


def test_the_trainer_with_an_aps_optimizer_equals_its_own_sgd(server_process, tmp_path):
    options = dict(gradient_accumulation_steps=2, max_grad_norm=0.5)
    plain = hw.model()
    steps = _train(plain, hw.arguments(str(tmp_path / "plain"), **options), torch.optim.SGD(plain.parameters(), lr=0.05))
    server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    served = hw.model()
    optimizer = aps.torch.Optimizer(served, server.address, lr=0.05)
    assert _train(served, hw.arguments(str(tmp_path / "aps"), **options), optimizer) == steps
    _same(plain, served)
    assert fetch_stats(server.address)["server"]["version"] == steps
    optimizer.close()


def test_accelerates_loop_with_an_aps_optimizer_equals_its_own_sgd(server_process):
    def train(model, optimizer):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        loader = torch.utils.data.DataLoader(hw.Blocks(), batch_size=8, collate_fn=hw.collate)
        schedule = transformers.get_linear_schedule_with_warmup(optimizer, 2, 10)
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()

    plain = hw.model()
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.05))
    server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    served = hw.model()
    optimizer = aps.torch.Optimizer(served, server.address, lr=0.05)
    train(served, optimizer)
    _same(plain, served)
    assert fetch_stats(server.address)["server"]["version"] == -(-len(hw.Blocks()) // 8) // 2
    optimizer.close()


@pytest.mark.slow  # (three processes training a transformer for ten epochs: about 40 s here)
def test_aps_trainer_workers_read_their_own_part_of_the_data_and_learn(server_process, tmp_path):
    workers = 2
    server = server_process("--workers", str(workers), "--sync", "asp", "--optimizer", "adamw", "--lr", "0.003")
    results = run_worker_scripts(SCRIPT, server.address, workers, tmp_path, timeout=300)
    size, half = len(hw.Blocks()), len(hw.Blocks()) // workers
    for epoch in range(10):
        parts = [set(r["seen"][epoch * half:(epoch + 1) * half]) for r in results]
        assert not parts[0] & parts[1] and len(parts[0] | parts[1]) == size, "each epoch split, each sample once"
    for r in results:
        # (from about ln 26; its last few, as ASP's order of updates moves one loss or another)
        assert sum(r["losses"][-3:]) / 3 < 0.75 * r["losses"][0], r["losses"]
    stats = fetch_stats(server.address)
    assert stats["warnings"] == [] and {"loss", "lr"} <= set(stats["workers"][1]["reported"]["scalars"])


def test_a_trainer_checkpoint_carries_the_servers_state_and_resumes_exactly(server_process, tmp_path):
    def trainer(address, out, **options):
        return aps.huggingface.Trainer(model=hw.model(), args=hw.arguments(str(out), optim="sgd", **options),
                                       train_dataset=hw.Blocks(), data_collator=hw.collate, aps_address=address)

    whole = trainer(server_process("--workers", "1", "--sync", "bsp", *SGD).address, tmp_path / "whole")
    whole.train()
    steps = whole.state.global_step
    first = trainer(server_process("--workers", "1", "--sync", "bsp", *SGD).address, tmp_path / "run",
                    save_strategy="steps", save_steps=steps // 2 - 1)
    first.train()
    checkpoint = tmp_path / "run" / f"checkpoint-{steps // 2 - 1}"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    assert state["aps"]["optimizer"] == "sgd" and state["aps"]["steps"] == steps // 2 - 1
    second = trainer(server_process("--workers", "1", "--sync", "bsp", *SGD).address, tmp_path / "again")
    second.train(resume_from_checkpoint=str(checkpoint))
    _same(whole.model, second.model)


def test_misuse_is_refused_saying_what_to_do(server_process, tmp_path):
    server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    with pytest.raises(aps.ConfigurationError, match="rank 3 is not one of 2"):
        aps.huggingface.Trainer(model=hw.model(), args=hw.arguments(str(tmp_path)), aps_rank=3, aps_workers=2)
    trainer = aps.huggingface.Trainer(model=hw.model(), args=hw.arguments(str(tmp_path), optim="adafactor"),
                                      train_dataset=hw.Blocks(), data_collator=hw.collate, aps_address=server.address)
    with pytest.raises(aps.ConfigurationError, match="SGD, Adam or AdamW"):
        trainer.train()
    trainer = aps.huggingface.Trainer(model=hw.model(), args=hw.arguments(str(tmp_path)), train_dataset=hw.Blocks(),
                                      data_collator=hw.collate, aps_address=server.address)
    with pytest.raises(aps.ConfigurationError, match="server's optimizer|server runs sgd"):
        trainer.train()  # (the Trainer's default is AdamW; this server runs SGD)
    trainer = aps.huggingface.Trainer(model=hw.model(), args=hw.arguments(str(tmp_path), optim="sgd"),
                                      train_dataset=hw.Blocks(), data_collator=hw.collate, aps_address=server.address,
                                      aps_rank=1, aps_workers=2)
    with pytest.raises(aps.APSError, match="1 worker|workers"):  # (the server was started for one)
        trainer.train()
