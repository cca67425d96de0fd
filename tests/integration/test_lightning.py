"""PyTorch Lightning with aps (``Trainer(strategy=aps.lightning.Strategy(...))``) against
real servers: one BSP worker equals Lightning's own SGD bit for bit, several ASP worker
processes split the data and learn (also launched as the docs say: ``RANK=$rank WORLD_SIZE=2
python ...`` and torchrun), checkpoints carry the server's state through Lightning's own
mechanism, and misuse is refused clearly."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[lightning]')")
torch = pytest.importorskip("torch")

import aps  # noqa: E402
import aps.lightning  # noqa: E402
from aps.cli.status import fetch_stats  # noqa: E402
from tests.trainers import launch_workers, run_worker_scripts  # noqa: E402

pytestmark = [
    # Lightning's advice for this small CPU run (loader workers, few batches): not what is tested.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    # Lightning 2.6 on torch 2.14 (its pytree use): not aps's.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "lightning_worker.py"
_spec = importlib.util.spec_from_file_location("lightning_worker", SCRIPT)
lw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lw)

SGD = ("--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9")


def _parameters(module) -> dict:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("options", [{}, {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5}],
                         ids=["plain", "accumulated-and-clipped"])
def test_one_bsp_worker_equals_lightning_with_its_own_sgd(server_process, options):
    plain = lw.Digits()  # (with the sampler Lightning gives a worker of one: the strategy's is that)
    lw.trainer(epochs=2, **options).fit(plain, lw.loader(as_one_of=1))
    server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    served = lw.Digits()
    lw.trainer(aps.lightning.Strategy(server.address), epochs=2, **options).fit(served, lw.loader())
    want, got = _parameters(plain), _parameters(served)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs"
    assert served.seen == plain.seen, "the same samples in the same order (a sampler of one worker)"
    stats = fetch_stats(server.address)
    batches = len(lw.loader())
    steps = batches // 3 + (batches % 3 > 0) if options else batches  # (Lightning steps at an epoch's end too)
    assert stats["server"]["version"] == 2 * steps
    reported = stats["workers"][0]["reported"]
    assert {"loss", "lr", "train_loss"} <= set(reported["scalars"]), "each step's loss and lr reach the server"
    assert reported["scalars"]["lr"]["value"] == pytest.approx(0.05), "the scheduler's second epoch"


@pytest.mark.slow  # (three processes, each importing Lightning: 10 to 20 s)
def test_asp_workers_read_their_own_part_of_the_data_and_learn(server_process, tmp_path):
    workers = 2
    server = server_process("--workers", str(workers), "--sync", "asp", *SGD)
    results = run_worker_scripts(SCRIPT, server.address, workers, tmp_path, timeout=240)
    size = len(lw.loader().dataset)
    for epoch in range(4):  # each epoch, the two workers' samples are the dataset, each once
        per_epoch = [r["seen"][epoch * (size // workers): (epoch + 1) * (size // workers)] for r in results]
        assert not set(per_epoch[0]) & set(per_epoch[1])
        assert len(set(per_epoch[0]) | set(per_epoch[1])) == size
    assert all(r["accuracy"] > 0.85 for r in results), [r["accuracy"] for r in results]
    assert fetch_stats(server.address)["warnings"] == [], "no two ranks on the same batches"


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # (resumed there)
def test_a_checkpoint_carries_the_servers_state_and_resumes_exactly(server_process, tmp_path):
    whole_server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    whole = lw.Digits()
    lw.trainer(aps.lightning.Strategy(whole_server.address), epochs=2).fit(whole, lw.loader())

    first_server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = lw.Digits()
    lw.trainer(aps.lightning.Strategy(first_server.address), epochs=1, enable_checkpointing=True,
               callbacks=[checkpoints]).fit(first, lw.loader())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = saved["optimizer_states"][0]
    assert state["aps"]["optimizer"] == "sgd" and state["aps"]["steps"] == len(lw.loader())
    assert all("momentum_buffer" in s for s in state["state"].values()), "the server's momentum"

    # A new server: Lightning's resume loads the weights and the server's state into it.
    second_server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    second = lw.Digits()
    again = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    lw.trainer(aps.lightning.Strategy(second_server.address), epochs=2, enable_checkpointing=True,
               callbacks=[again]).fit(second, lw.loader(), ckpt_path=tmp_path / "last.ckpt")
    for name, value in _parameters(whole).items():
        assert torch.equal(value, dict(second.named_parameters())[name]), f"{name} differs after the resume"


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_local_sgd_steps_the_modules_optimizer_locally_and_syncs_every_h_steps(server_process, tmp_path):
    """local_every=3: the module's own SGD (its scheduler too) steps locally, the worker syncs
    every third step with the server, whose optimizer is the outer one (here SGD of learning
    rate 1: the worker's own progress, applied), and the checkpoint holds the inner optimizer's
    state, the steps and the anchor."""
    server = server_process("--workers", "1", "--sync", "bsp", "--optimizer", "sgd", "--lr", "1")
    module = lw.Digits()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    lw.trainer(aps.lightning.Strategy(server.address, local_every=3), epochs=2, enable_checkpointing=True,
               callbacks=[checkpoints]).fit(module, lw.loader(shuffle=True))
    steps = 2 * len(lw.loader())
    assert fetch_stats(server.address)["server"]["version"] == steps // 3  # one outer step a sync
    assert lw.accuracy(module) > 0.8, lw.accuracy(module)
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["optimizer_states"][0]
    assert state["steps"] == steps and state["syncs"] == steps // 3 and state["every"] == 3
    assert state["inner"]["param_groups"][0]["lr"] == pytest.approx(0.025), "the module's scheduler, twice"
    assert set(state["anchor"]) == {name for name, _ in module.named_parameters()}
    with pytest.raises(aps.ConfigurationError, match="every must be a whole number"):
        lw.trainer(aps.lightning.Strategy(server.address, local_every=0), epochs=1).fit(lw.Digits(), lw.loader())


def test_misuse_is_refused_saying_what_to_do(server_process):
    server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    with pytest.raises(aps.ConfigurationError, match="SGD, Adam or AdamW"):
        lw.trainer(aps.lightning.Strategy(server.address), epochs=1).fit(lw.Digits("rmsprop"), lw.loader())
    with pytest.raises(aps.ConfigurationError, match="runs sgd"):
        lw.trainer(aps.lightning.Strategy(server.address), epochs=1).fit(lw.Digits("adam", lr=1e-3), lw.loader())
    with pytest.raises(aps.ConfigurationError, match="rank 2 is not one of 2"):
        aps.lightning.Strategy(server.address, rank=2, num_workers=2)
    with pytest.raises(aps.APSError, match="1 worker|workers"):  # the server was started for one
        lw.trainer(aps.lightning.Strategy(server.address, rank=1, num_workers=2, init_timeout=5),
                   epochs=1).fit(lw.Digits(), lw.loader())


def test_the_strategy_reads_its_rank_and_server_from_the_launcher(monkeypatch):
    monkeypatch.setenv("APS_ADDRESS", "tcp://127.0.0.1:1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    strategy = aps.lightning.Strategy()
    assert (strategy.global_rank, strategy.world_size) == (1, 3)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 1}
    assert strategy.cluster_environment.global_rank() == 1 and strategy.cluster_environment.world_size() == 3
    assert aps.lightning.Strategy(rank=0, num_workers=2).world_size == 2, "what is given comes first"
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(aps.ConfigurationError, match="WORLD_SIZE"):
        aps.lightning.Strategy()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(aps.ConfigurationError, match="rank 1 is not one of 1"):
        aps.lightning.Strategy()


@pytest.mark.slow  # (two processes importing Lightning, each launch: about 10 s here)
@pytest.mark.parametrize("how", ["env", "torchrun"])
def test_workers_launched_as_the_docs_say_take_their_ranks_from_the_launcher(server_process, tmp_path, how):
    server = server_process("--workers", "2", "--sync", "asp", *SGD)
    launch_workers(SCRIPT, server.address, 2, tmp_path, how, timeout=240)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["workers"]) for r in results] == [(0, 2), (1, 2)]
    size = len(lw.loader().dataset)
    assert not set(results[0]["seen"]) & set(results[1]["seen"]), "each its own part of the epoch"
    assert len(set(results[0]["seen"]) | set(results[1]["seen"])) == size
    stats = fetch_stats(server.address)
    assert [w["pushes"] > 0 for w in stats["workers"]] == [True, True] and stats["warnings"] == []
