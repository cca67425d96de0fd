#!/usr/bin/env python
"""Train a DLRM-style click model with aps: embedding tables of 10^6 to 10^8 rows on the server.

The model is DLRM's (Naumov et al., 2019) in small: a bottom MLP over 13 dense
features, 8 categorical features looked up in 8 embedding tables
(``aps.torch.Embedding`` for the single-id features, ``aps.torch.EmbeddingBag``
for the multi-id ones), the pairwise dot products of the bottom MLP's output and
the 8 embeddings, and a top MLP over them and the bottom output, then a sigmoid
(the loss is ``binary_cross_entropy_with_logits``).

The tables declare 10^6 to 10^8 rows each (2.7 * 10^8 ids in all): the server makes
a row the first time an id is pushed and holds only those, so the workers and the
server stay small. Each step is one round trip: ``opt.step(prefetch=...)`` pushes
the dense gradient and the batch's gradient rows, and pulls the dense weights and
the next batch's rows. The rows are trained by the server with Adagrad
(``--table-optimizer``), the dense layers by the server's ``--optimizer``.

The data are synthetic and made on the fly, nothing is downloaded: batches laid
out as TorchRec's ``RandomRecDataset`` lays them out (13 normal dense features, a
fixed number of ids per feature, a seeded generator per worker), except that the
ids are Zipf-distributed (a few ids very often, as in click logs; each rank of the
Zipf law hashed to an id anywhere in the table's range) rather than uniform, and
that the labels are not coin flips but drawn from a fixed hidden "true" model
(a linear function of the dense features plus a fixed effect per id), so that
there is something to learn: the test AUC (on 4,096 held-out samples) climbs
from 0.5 to about 0.8 within the 600 steps of the default run (the hidden model's
own AUC is 0.87; the dense features alone give 0.66, so most of it is learnt in
the tables). The default run (4 workers, 3 epochs of 50 steps of 256 samples
each) trains in about 6 s on 2 cores, after the workers' start.

Under ``aps launch`` (which starts the server and sets ``APS_ADDRESS``, ``RANK``
and ``WORLD_SIZE``), 4 workers, asynchronous and stale-synchronous::

    aps launch --workers 4 --sync asp --optimizer adam --lr 0.003 examples/dlrm.py
    aps launch --workers 4 --sync ssp --staleness 2 --optimizer adam --lr 0.003 examples/dlrm.py

Each worker prints its loss and the test AUC after every epoch into its log
(``worker-RANK.log`` in the directory ``aps launch`` names). Against any server
(``aps serve --workers 2 --optimizer adam --lr 0.003``), one process per rank::

    python examples/dlrm.py --address tcp://HOST:7450 --rank 0 --workers 2

``bench/dlrm.py`` trains the same model against ``nn.EmbeddingBag(sparse=True)``
and torch.optim in one process.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import aps.torch

NUM_DENSE = 13


@dataclass(frozen=True)
class Feature:
    """A categorical feature: its table's name, declared rows and ids per sample."""

    name: str
    rows: int
    ids: int  # 1: one id per sample (aps.torch.Embedding); more: a bag (aps.torch.EmbeddingBag)
    mode: str = "mean"  # a bag's reduction


#: The 8 tables: 10^6 to 10^8 declared rows each, four single ids and four bags.
FEATURES = (
    Feature("user", 10**8, 1),
    Feature("item", 10**7, 1),
    Feature("advertiser", 10**6, 1),
    Feature("site", 2 * 10**6, 1),
    Feature("user_history", 10**8, 3, "mean"),
    Feature("item_tags", 5 * 10**6, 2, "sum"),
    Feature("query_terms", 5 * 10**7, 3, "mean"),
    Feature("device", 10**6, 2, "sum"),
)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic): a fixed, well-spread hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass
class Batch:
    dense: torch.Tensor  # (B, 13) float32
    ids: dict[str, torch.Tensor]  # by table: (B,) or (B, ids per sample) int64
    labels: torch.Tensor  # (B,) float32, 0 or 1


class ClickData:
    """Synthetic clicks: Zipf ids per table, labels from a fixed hidden model (the same for
    every ``seed``'s batches: ``task_seed`` fixes the task, the ``rng`` given to :meth:`batch`
    the samples)."""

    def __init__(self, features=FEATURES, *, zipf: float = 1.2, task_seed: int = 0,
                 dense_scale: float = 1.0, id_scale: float = 1.5, bias: float = -0.5) -> None:
        self.features, self.zipf = tuple(features), zipf
        task = np.random.default_rng([task_seed, 7])
        weights = task.standard_normal(NUM_DENSE)
        self.dense_weights = dense_scale * weights / np.linalg.norm(weights)
        self.salts = [np.uint64(s) for s in task.integers(0, 2**63, len(self.features))]
        self.id_scale, self.bias = id_scale, bias

    def draw_ids(self, rng: np.random.Generator, index: int, shape: tuple[int, ...]) -> np.ndarray:
        """Ids of feature ``index``: Zipf ranks (rank 1 the most frequent), each hashed to an id
        of the table's range."""
        ranks = rng.zipf(self.zipf, shape).astype(np.uint64)
        return (mix64(ranks ^ self.salts[index]) % np.uint64(self.features[index].rows)).astype(np.int64)

    def effect(self, index: int, ids: np.ndarray) -> np.ndarray:
        """The hidden model's fixed effect of each id of feature ``index``: uniform in
        (-id_scale, id_scale), a function of the id alone."""
        hashed = mix64(ids.astype(np.uint64) ^ self.salts[index] ^ np.uint64(0x5DEECE66D))
        return self.id_scale * (2.0 * (hashed >> np.uint64(11)).astype(np.float64) * 2.0**-53 - 1.0)

    def batch(self, rng: np.random.Generator, size: int) -> Batch:
        dense = rng.standard_normal((size, NUM_DENSE))
        logit = dense @ self.dense_weights + self.bias
        ids = {}
        for index, feature in enumerate(self.features):
            shape = (size,) if feature.ids == 1 else (size, feature.ids)
            drawn = self.draw_ids(rng, index, shape)
            effect = self.effect(index, drawn)
            logit += effect if feature.ids == 1 else effect.mean(axis=1)
            ids[feature.name] = torch.from_numpy(drawn)
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return Batch(torch.from_numpy(dense.astype(np.float32)), ids, torch.from_numpy(labels))


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embeddings, dot-product interaction, top MLP; ``forward`` returns logits.

    ``embeddings`` maps each feature's name to its module (aps's or torch's): the dense
    layers are made from ``seed`` alone, so two models of the same seed start alike."""

    def __init__(self, embeddings: dict[str, nn.Module], dim: int, *, bottom: tuple[int, ...] = (64,),
                 top: tuple[int, ...] = (64, 32), seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.bottom = mlp([NUM_DENSE, *bottom, dim], last_relu=True)
            vectors = len(embeddings) + 1
            self.top = mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_relu=False)
        self.embeddings = nn.ModuleDict(embeddings)
        rows, cols = torch.tril_indices(vectors, vectors, -1)
        self.register_buffer("pairs_i", rows, persistent=False)
        self.register_buffer("pairs_j", cols, persistent=False)

    def forward(self, dense: torch.Tensor, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(module(ids[name]) for name, module in self.embeddings.items())], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs_i, self.pairs_j]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def aps_embeddings(features=FEATURES, dim: int = 16, optimizer: str = "adagrad", lr: float = 0.05,
                   init: str = "normal:0.01") -> dict[str, nn.Module]:
    """The features' tables on the aps server, named after the features."""
    out: dict[str, nn.Module] = {}
    for feature in features:
        if feature.ids == 1:
            out[feature.name] = aps.torch.Embedding(feature.rows, dim, feature.name, optimizer=optimizer, lr=lr,
                                                    init=init)
        else:
            out[feature.name] = aps.torch.EmbeddingBag(feature.rows, dim, feature.name, mode=feature.mode,
                                                       optimizer=optimizer, lr=lr, init=init)
    return out


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve: the probability that a positive scores above a negative
    (ties count one half), from the ranks of the scores (Mann-Whitney U)."""
    labels = np.asarray(labels).astype(bool)
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(np.asarray(scores, np.float64), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse.reshape(-1)]  # 1-based, ties at their mean rank
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


@torch.no_grad()
def evaluate(model: nn.Module, batch: Batch) -> float:
    """The model's AUC on ``batch`` (no gradient, rows not recorded)."""
    was = model.training
    model.eval()
    try:
        return roc_auc(batch.labels.numpy(), model(batch.dense, batch.ids).numpy())
    finally:
        model.train(was)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="the server, tcp://HOST:PORT (default $APS_ADDRESS)")
    parser.add_argument("--rank", type=int, help="this worker's rank (default $RANK)")
    parser.add_argument("--workers", type=int, help="number of workers (default $WORLD_SIZE)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch, per worker (default 50)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--test-size", type=int, default=4096, help="held-out samples for the AUC (default 4096)")
    parser.add_argument("--dim", type=int, default=16, help="the embeddings' length (default 16)")
    parser.add_argument("--table-optimizer", default="adagrad", choices=("adagrad", "rowwise_adagrad", "adam", "sgd"))
    parser.add_argument("--table-lr", type=float, default=0.05, help="the rows' learning rate (default 0.05)")
    parser.add_argument("--zipf", type=float, default=1.2, help="the ids' Zipf exponent (default 1.2)")
    parser.add_argument("--seed", type=int, default=0, help="the task, the test set and the initial weights")
    args = parser.parse_args(argv)

    data = ClickData(zipf=args.zipf, task_seed=args.seed)
    model = DLRM(aps_embeddings(dim=args.dim, optimizer=args.table_optimizer, lr=args.table_lr), args.dim,
                 seed=args.seed)
    optimizer = aps.torch.Optimizer(model, args.address, args.rank, args.workers)
    rank = optimizer.worker.rank
    test = data.batch(np.random.default_rng([args.seed, 1]), args.test_size)  # the same on every worker
    stream = np.random.default_rng([args.seed, 2, rank])  # each worker its own samples
    batch = data.batch(stream, args.batch_size)
    start = time.monotonic()
    with optimizer:
        optimizer.prefetch(batch.ids)  # the first batch's rows; each step pulls the next one's
        for epoch in range(1, args.epochs + 1):
            total = 0.0
            for _ in range(args.steps):
                optimizer.zero_grad()
                loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.ids), batch.labels)
                loss.backward()
                batch = data.batch(stream, args.batch_size)
                optimizer.step(prefetch=batch.ids)  # one round trip: push everything, pull the next rows
                total += loss.item()
            optimizer.prefetch(test.ids)  # every table's test rows in one request
            auc = evaluate(model, test)
            optimizer.prefetch(batch.ids)
            print(f"rank {rank} epoch {epoch}: loss {total / max(args.steps, 1):.4f}, test AUC {auc:.4f}, "
                  f"weights version {optimizer.version}, {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
