"""``aps.torch.Optimizer`` called as ``torch.optim.SGD`` is: the learning rate in second place
(the server from ``APS_ADDRESS``), ``momentum=`` on a server started without ``--momentum``
(its buffers made when first asked for, and kept in checkpoints), and a single process with
neither ``RANK`` nor ``WORLD_SIZE`` set as rank 0 of 1. Real ``aps serve`` processes."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

import aps  # noqa: E402
import aps.torch  # noqa: E402
from aps import workloads  # noqa: E402
from aps.cli.checkpoint import request_checkpoint  # noqa: E402
from aps.testing.workers import digits_batches  # noqa: E402

LR, MOMENTUM, BATCH, STEPS = 0.05, 0.9, 16, 8


def train(model, opt, steps: int = STEPS) -> None:
    for step in range(steps):
        x, y = digits_batches(0, 1, step, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.fixture
def alone(monkeypatch):
    """A script run by hand: no RANK, no WORLD_SIZE."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


def test_the_torch_optim_call_trains_as_torch_optim_does(server_process, transport, alone, tmp_path):
    """``torch.optim.SGD(model.parameters(), args.lr, momentum=0.9)`` with ``aps.torch.Optimizer``
    in its place, against a plain ``aps serve --workers 1`` (no --momentum): the same weights,
    bit for bit; the momentum buffers are the server's now, and its checkpoints keep them."""
    reference = workloads.make_model(8, seed=0)
    train(reference, torch.optim.SGD(reference.parameters(), LR, momentum=MOMENTUM))

    server = server_process("--workers", "1", "--sync", "bsp", "--checkpoint-dir", str(tmp_path))
    alone.setenv("APS_ADDRESS", server.address)
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model.parameters(), LR, momentum=MOMENTUM, model=model, transport=transport) as opt:
        assert (opt.worker.rank, opt.worker.num_workers) == (0, 1)
        assert [(g["lr"], g["momentum"]) for g in opt.param_groups] == [(LR, MOMENTUM)]
        train(model, opt)
        assert opt.version == STEPS
        state = opt.worker.optimizer_state()
        assert list(state["arrays"]) == ["momentum_buffer"] and state["steps"] == STEPS
        written = request_checkpoint(server.address)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_array_equal(mine.detach().numpy(), theirs.detach().numpy())

    # The checkpoint holds the buffers, and a server resumed from it (still without
    # --momentum) holds them again: the run goes on with its momentum.
    saved = aps.load_checkpoint(written["path"])
    names = [n for n, _ in model.named_parameters()]
    assert {f"momentum_buffer/{name}" for name in names} <= set(saved.state)
    server.stop()
    resumed = server_process("--workers", "1", "--sync", "bsp", "--resume", written["path"])
    with aps.Worker(resumed.address, 0, 1, transport="tcp") as worker:
        worker.init({n: p.detach().numpy() for n, p in model.named_parameters()})
        again = worker.optimizer_state()
    assert again["steps"] == STEPS and list(again["arrays"]) == ["momentum_buffer"]
    np.testing.assert_array_equal(again["arrays"]["momentum_buffer"], state["arrays"]["momentum_buffer"])


def test_the_address_by_keyword_with_the_learning_rate_in_place(server_process, alone):
    server = server_process("--workers", "1", "--sync", "asp")
    alone.delenv("APS_ADDRESS", raising=False)
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model.parameters(), 0.1, address=server.address, transport="tcp") as opt:
        assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.0
        train(model, opt, 2)
        assert opt.version == 2
    # today's calls keep working: the address (rank, worker count) in place
    server = server_process("--workers", "1", "--sync", "asp")
    with aps.torch.Optimizer(model, server.address, 0, 1, transport="tcp", lr=0.2) as opt:
        assert opt.param_groups[0]["lr"] == 0.2


def test_what_cannot_be_read_as_torchs_call_is_refused_before_connecting(alone):
    model = workloads.make_model(8, seed=0)
    alone.setenv("APS_ADDRESS", "tcp://127.0.0.1:9")  # nothing listens: refused before trying
    with pytest.raises(aps.ConfigurationError, match="after the learning rate, give momentum= and torch's other"):
        aps.torch.Optimizer(model.parameters(), 0.1, 0.9)
    with pytest.raises(aps.ConfigurationError, match="the learning rate is given twice"):
        aps.torch.Optimizer(model.parameters(), 0.1, lr=0.2)
    with pytest.raises(aps.ConfigurationError, match="address is given twice"):
        aps.torch.Optimizer(model, "tcp://127.0.0.1:9", address="tcp://127.0.0.1:9")


def test_a_single_process_facing_a_server_of_several_workers_is_told_what_to_set(server_process, alone):
    server = server_process("--workers", "2", "--sync", "asp")
    alone.setenv("APS_ADDRESS", server.address)
    model = workloads.make_model(8, seed=0)
    with pytest.raises(aps.ConfigurationError, match="neither RANK nor WORLD_SIZE is set .* expects 2 workers"):
        aps.torch.Optimizer(model.parameters(), 0.1)
    from aps.cli.status import fetch_stats

    assert fetch_stats(server.address)["server"]["live"] == 0  # it did not join as a worker
