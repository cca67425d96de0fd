"""The rows side of aps.torch without a server (a stand-in worker answering each id's row
as ``id * 10 + column``): a model's embeddings bound to one optimizer, their forwards
served from a prefetch or pulled, each pull of rows leaving the worker's version alone,
and a step's one request carrying the gradient rows and the next batch's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aps
from aps.errors import ConfigurationError
from aps.torch.embedding import TableRows

DIM = 3


class RowsWorker:
    """Records what is asked of it; a table's row of ``id`` is ``id * 10 + [0, 1, 2]``."""

    def __init__(self) -> None:
        self.pulls: list[tuple[tuple, dict]] = []
        self.pushes: list[tuple[tuple, dict]] = []

    @staticmethod
    def rows(ids) -> np.ndarray:
        return np.asarray(ids, np.float32)[:, None] * 10 + np.arange(DIM, dtype=np.float32)

    def pull_rows(self, table, ids=None, *, out=None, keep_version=False):
        self.pulls.append(((table, ids), {"keep_version": keep_version}))
        if isinstance(table, dict):
            return {name: self.rows(wanted) for name, wanted in table.items()}
        return self.rows(ids)

    def push_pull(self, grads, *, rows=None, pull_rows=None, out=None):
        self.pushes.append(((grads,), {"rows": rows, "pull_rows": pull_rows}))
        if pull_rows is None:
            return {}
        return {}, {name: self.rows(ids) for name, ids in pull_rows.items()}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = aps.torch.Embedding(1000, DIM, "items")
        self.tags = aps.torch.EmbeddingBag(100, DIM, mode="sum")  # (its table: its name in the model)

    def forward(self, items: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.items(items).sum(1) + self.tags(tags)


def bound() -> tuple[Net, RowsWorker, TableRows]:
    net, worker = Net(), RowsWorker()
    return net, worker, TableRows(net, worker, torch.device("cpu"))


def test_the_models_embeddings_are_its_tables():
    net, _, rows = bound()
    assert list(rows.tables) == ["items", "tags"] and net.tags.table == "tags"
    specs = rows.specs
    assert specs is not None and (specs["items"].rows, specs["items"].dim) == (1000, DIM)
    assert TableRows(None, RowsWorker(), torch.device("cpu")).specs is None
    with pytest.raises(ConfigurationError, match=r"bound to another aps\.torch\.Optimizer"):
        TableRows(net, RowsWorker(), torch.device("cpu"))


def test_a_prefetch_serves_the_next_forwards_in_one_request():
    net, worker, rows = bound()
    items, tags = torch.tensor([[5, 7], [7, 9]]), torch.tensor([[1, 2]])
    rows.prefetch({"items": items, "tags": tags})
    assert len(worker.pulls) == 1
    (asked, _), options = worker.pulls[0]
    assert {name: ids.tolist() for name, ids in asked.items()} == {"items": [5, 7, 9], "tags": [1, 2]}
    assert options == {"keep_version": True}  # (the model's dense weights are the last step's)
    out = net(items, tags)
    assert len(worker.pulls) == 1  # both forwards took the prefetched rows
    expected = torch.from_numpy(RowsWorker.rows([5, 7]).sum(0) + RowsWorker.rows([1, 2]).sum(0))
    assert torch.equal(out[0], expected)
    net.items(torch.tensor([8]))  # an id not prefetched: pulled for this forward alone
    assert worker.pulls[-1] == (("items", [8]), {"keep_version": True})
    pulled = worker.pulls[-1][0][1]
    assert isinstance(pulled, np.ndarray) and pulled.tolist() == [8]


def test_a_step_pushes_the_rows_used_and_pulls_the_next_batchs_in_one_request():
    net, worker, rows = bound()
    grads = np.zeros(4, np.float32)
    net(torch.tensor([[5, 5]]), torch.tensor([[1]])).sum().backward()  # (each table's rows pulled)
    assert len(worker.pulls) == 2
    rows.push_pull(grads, {"items": [3]})
    ((sent,), asked) = worker.pushes[-1]
    assert sent is grads and list(asked["pull_rows"]) == ["items"]
    ids, gradient = asked["rows"]["items"]
    assert ids.tolist() == [5, 5] and gradient.tolist() == [[1.0] * DIM] * 2  # one row per occurrence
    assert asked["rows"]["tags"][0].tolist() == [1]
    net.items(torch.tensor([3]))  # the step's pulled rows serve the next forward
    assert len(worker.pulls) == 2
    rows.forget()
    assert net.items.used == [] and net.tags.used == []
    rows.push_pull(grads, None)  # nothing used, nothing asked: the dense step alone
    assert worker.pushes[-1] == ((grads,), {"rows": None, "pull_rows": None})
    net.items(torch.tensor([3]))  # (what the last step pulled is gone)
    assert len(worker.pulls) == 3


def test_a_forward_without_its_optimizer_says_how_to_make_one():
    with pytest.raises(ConfigurationError, match="make the optimizer from the model"):
        aps.torch.Embedding(10, DIM)(torch.tensor([1]))
