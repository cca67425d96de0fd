"""aps.torch.Embedding and EmbeddingBag against torch's own sparse embeddings, with a real
aps serve process: one BSP worker trains a model of dense layers and aps embeddings exactly
as torch trains the same model with ``nn.Embedding(sparse=True)`` and torch.optim (the rows'
SGD bit for bit, Adagrad and Adam to float rounding), duplicate ids in a batch included."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import aps  # noqa: E402
import aps.torch  # noqa: E402

torch.sparse.check_sparse_tensor_invariants.disable()  # (torch warns unless a program chooses)

ROWS, DIM, LR = 40, 6, 0.1


class Net(nn.Module):
    """A click model in miniature: two tables (one bag), a dense head over their rows."""

    def __init__(self, items: nn.Module, tags: nn.Module) -> None:
        super().__init__()
        self.items, self.tags = items, tags
        torch.manual_seed(0)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, items, tags, offsets, weights):
        bag = self.tags(tags, offsets, per_sample_weights=weights)
        return self.head(torch.cat([self.items(items).sum(1), bag], 1)).squeeze(1)


def batch(step: int):
    rng = np.random.default_rng(step)
    items = torch.from_numpy(rng.integers(0, 12, (8, 3)))  # (duplicates within the batch)
    tags = torch.from_numpy(rng.integers(0, ROWS, 20))
    offsets = torch.tensor([0, 3, 3, 7, 10, 14, 15, 18])
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, 20).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 2, 8).astype(np.float32))
    return items, tags, offsets, weights, y


TORCH_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=LR, eps=1e-10),
    "adam": lambda params: torch.optim.SparseAdam(params, lr=LR),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["pulled", "prefetched"])
def test_one_bsp_worker_equals_torch_sparse_embeddings(server_process, transport, optimizer, prefetch):
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR))
    ours = Net(aps.torch.Embedding(ROWS, DIM, "items", optimizer=optimizer, lr=LR),
               aps.torch.EmbeddingBag(ROWS, DIM, "tags", mode="sum", optimizer=optimizer, lr=LR))
    steps = 8
    with aps.torch.Optimizer(ours, server.address, 0, 1, transport=transport) as opt:
        initial = opt.worker.pull_rows({"items": np.arange(ROWS), "tags": np.arange(ROWS)})
        theirs = Net(nn.Embedding(ROWS, DIM, sparse=True), nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True))
        with torch.no_grad():
            theirs.items.weight.copy_(torch.from_numpy(initial["items"]))
            theirs.tags.weight.copy_(torch.from_numpy(initial["tags"]))
            theirs.head.load_state_dict(ours.head.state_dict())
        sparse = TORCH_OPTIMIZERS[optimizer]([theirs.items.weight, theirs.tags.weight])
        dense = torch.optim.SGD(theirs.head.parameters(), lr=LR)
        if prefetch:
            first = batch(0)
            opt.prefetch({"items": first[0], "tags": first[1]})
        for step in range(steps):
            items, tags, offsets, weights, y = batch(step)
            for model, optimizers in ((ours, [opt]), (theirs, [sparse, dense])):
                for o in optimizers:
                    o.zero_grad()
                F.binary_cross_entropy_with_logits(model(items, tags, offsets, weights), y).backward()
            following = batch(step + 1)
            opt.step(prefetch={"items": following[0], "tags": following[1]} if prefetch else None)
            sparse.step()
            dense.step()
        rows = opt.worker.pull_rows({"items": np.arange(ROWS), "tags": np.arange(ROWS)})
        assert opt.version == steps
    for name in ("items", "tags"):
        expected = getattr(theirs, name).weight.detach().numpy()
        if optimizer == "sgd":
            np.testing.assert_array_equal(rows[name], expected)
        else:
            np.testing.assert_allclose(rows[name], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.head.weight.detach().numpy(), theirs.head.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_a_prefetch_pulls_every_table_in_one_request(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    model = Net(aps.torch.Embedding(ROWS, DIM, "items"), aps.torch.EmbeddingBag(ROWS, DIM, "tags", mode="mean"))
    with aps.torch.Optimizer(model, server.address, 0, 1) as opt:
        items, tags, offsets, weights, y = batch(0)
        expected = model(items, tags, offsets, None).detach()
        opt.zero_grad()
        calls = []
        pull_rows = opt.worker.pull_rows
        opt.worker.pull_rows = lambda *args, **kwargs: calls.append(args) or pull_rows(*args, **kwargs)
        opt.prefetch({"items": items, "tags": tags})
        assert len(calls) == 1 and set(calls[0][0]) == {"items", "tags"}
        assert torch.equal(model(items, tags, offsets, None).detach(), expected)
        assert len(calls) == 1  # the forward took the prefetched rows
        model(items[:, :1] + 13, tags, offsets, None)  # ids not prefetched: asked for
        assert len(calls) == 2
        assert opt.worker.version == 0  # (the forwards' pulls leave the version of the dense weights held)


def test_an_embedding_needs_its_optimizer_and_a_table_of_its_own(server_process):
    lonely = aps.torch.Embedding(10, 4, "items")
    with pytest.raises(aps.ConfigurationError, match="aps.torch.Optimizer"):
        lonely(torch.tensor([1]))
    server = server_process("--workers", "1", "--sync", "asp")
    twice = Net(aps.torch.Embedding(ROWS, DIM, "same"), aps.torch.EmbeddingBag(ROWS, DIM, "same"))
    with pytest.raises(aps.ConfigurationError, match="table 'same'"):
        aps.torch.Optimizer(twice, server.address, 0, 1)


def test_the_table_is_named_after_the_module_when_not_named(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    model = Net(aps.torch.Embedding(ROWS, DIM), aps.torch.EmbeddingBag(ROWS, DIM))
    with aps.torch.Optimizer(model, server.address, 0, 1) as opt:
        assert [name for name, _ in opt.worker.layout.tables] == ["items", "tags"]
        assert model.items.table == "items"


def test_grad_scaler_is_refused_with_aps_embeddings(server_process):
    """GradScaler unscales and checks the param groups only: the rows would go scaled and
    unchecked, so the step says so instead of training on them."""
    server = server_process("--workers", "1", "--sync", "asp")
    model = Net(aps.torch.Embedding(ROWS, DIM, "items"), aps.torch.EmbeddingBag(ROWS, DIM, "tags", mode="sum"))
    with aps.torch.Optimizer(model, server.address, 0, 1) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        items, tags, offsets, weights, y = batch(0)
        before = opt.worker.pull_rows("items", np.arange(12))
        scaler.scale(F.binary_cross_entropy_with_logits(model(items, tags, offsets, weights), y)).backward()
        with pytest.raises(aps.ConfigurationError, match="GradScaler does not see the rows"):
            scaler.step(opt)
        assert np.array_equal(opt.worker.pull_rows("items", np.arange(12)), before) and opt.version == 0


def test_a_model_with_torchs_own_sparse_embedding_keeps_working(server_process, transport):
    """nn.Embedding(sparse=True) left in a model trains as a dense tensor of the server's, as
    torch.optim.SGD trains it (to rounding: a duplicate id's gradients are summed into the
    dense gradient first): a user swaps modules when they want rows by id, not loops."""
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR))
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    theirs = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    theirs.load_state_dict(ours.state_dict())
    reference = torch.optim.SGD(theirs.parameters(), lr=LR)
    with aps.torch.Optimizer(ours, server.address, 0, 1, transport=transport) as opt:
        for step in range(4):
            x = torch.tensor([[1, 2], [2, 3], [step, 9]])
            for model, optimizer in ((ours, opt), (theirs, reference)):
                optimizer.zero_grad()
                model(x).square().sum().backward()
                optimizer.step()
    for mine, expected in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(mine.detach(), expected.detach(), rtol=1e-6, atol=1e-6)
