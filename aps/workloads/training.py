"""The built-in training example: a small CNN on a bundled dataset, one aps worker.

``aps launch --example mnist`` runs it on every worker; ``aps compare`` and
``aps demo`` use :func:`train` in their worker processes. It is a standard
PyTorch loop with :class:`aps.torch.Optimizer` in place of ``torch.optim``::

    python -m aps.workloads --address tcp://HOST:7450 --rank 0 --workers 4 --epochs 3

(address, rank and worker count default to ``APS_ADDRESS``, ``RANK`` and
``WORLD_SIZE``, as ``aps launch`` and ``torchrun`` set them).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from torch.nn import functional as F

from ..errors import ConfigurationError, NonFiniteGradient
from ..torch import LocalSGD, Optimizer, Pacer
from .data import DATASETS, Dataset, load, shard
from .models import accuracy, make_model

__all__ = ["main", "train"]


def train(
    dataset: Dataset,
    address: str | None,
    rank: int | None,
    workers: int | None,
    *,
    batch_size: int = 32,
    epochs: float | None = None,
    deadline: float | None = None,
    duration: float | None = None,
    seed: int = 0,
    data_seed: int | None = None,
    pacer: Pacer | None = None,
    on_epoch=None,
    stop_on_divergence: bool = False,
    transport: str = "auto",
    compression: str | None = None,
    compress_pulls: bool = False,
    local: tuple[int, bool, float, float] | None = None,
) -> dict:
    """Train on this worker's shard until ``epochs`` are done, the monotonic
    ``deadline`` passes, or ``duration`` seconds after every worker joined.

    Returns ``{"rank", "iterations", "version", "diverged"}``. ``on_epoch(epoch,
    optimizer, model)`` is called after each pass over the shard. ``seed`` sets
    the initial weights and, unless ``data_seed`` is given, the order in which
    the shard is visited. When the
    server refuses a gradient as non-finite (the training diverged), this
    raises :class:`aps.errors.NonFiniteGradient`, or with
    ``stop_on_divergence`` stops and reports ``"diverged": True``.
    ``transport``, ``compression`` and ``compress_pulls`` go to the worker
    (see :class:`aps.Worker`). ``local``: local SGD instead, ``(H, dynamic, inner lr, inner
    momentum)``: :class:`aps.torch.LocalSGD` with an inner ``torch.optim.SGD``.
    """
    model = make_model(dataset.side, seed=seed)
    optimizer: Optimizer | LocalSGD
    if local is None:
        optimizer = Optimizer(
            model,
            address,
            rank,
            workers,
            pacer=pacer,
            transport=transport,
            compression=compression,
            compress_pulls=compress_pulls,
        )
    else:
        if compress_pulls:
            raise ConfigurationError("local SGD compresses its pushes only (no compress_pulls)")
        every, dynamic, inner_lr, inner_momentum = local
        inner = torch.optim.SGD(model.parameters(), lr=inner_lr, momentum=inner_momentum)
        optimizer = LocalSGD(
            model,
            inner,
            every=every,
            dynamic=dynamic,
            address=address,
            rank=rank,
            num_workers=workers,
            transport=transport,
            compression=compression,
        )
    paced = pacer if local is not None else None  # (aps.torch.Optimizer paces its own steps)
    rank, workers = optimizer.worker.rank, optimizer.worker.num_workers
    assert rank is not None and workers is not None  # the worker has joined: its init gave it both
    if duration is not None:  # the clock starts when everyone has joined
        deadline = min(deadline or math.inf, time.monotonic() + duration)
    x, y = shard(dataset, rank, workers)
    rng = np.random.default_rng(1000 * (seed if data_seed is None else data_seed) + 1 + rank)
    steps_per_epoch = max(1, len(y) // batch_size)
    total = None if epochs is None else round(epochs * steps_per_epoch)
    iterations = 0
    diverged = False
    try:
        while (total is None or iterations < total) and (deadline is None or time.monotonic() < deadline):
            if iterations % steps_per_epoch == 0:
                order = torch.from_numpy(rng.permutation(len(y)))
            start = (iterations % steps_per_epoch) * batch_size
            batch = order[start : start + batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            if paced is not None:
                paced.wait()
            try:
                optimizer.step()
            except NonFiniteGradient:
                if not stop_on_divergence:
                    raise
                diverged = True
                break
            iterations += 1
            if paced is not None:
                paced.restart()
            if on_epoch is not None and iterations % steps_per_epoch == 0:
                on_epoch(iterations // steps_per_epoch, optimizer, model)
        return {"rank": rank, "iterations": iterations, "version": optimizer.worker.version, "diverged": diverged}
    finally:
        optimizer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aps.workloads", description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="the server (default $APS_ADDRESS)")
    parser.add_argument("--rank", type=int, help="this worker's rank (default $RANK)")
    parser.add_argument("--workers", type=int, help="number of workers (default $WORLD_SIZE)")
    parser.add_argument("--dataset", default="mnist", choices=DATASETS)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dataset = load(args.dataset, seed=args.seed)
    start = time.monotonic()

    def report(epoch, optimizer, model) -> None:
        if optimizer.worker.rank == 0:
            acc = accuracy(model, dataset.x_test, dataset.y_test)
            print(
                f"epoch {epoch}: test accuracy {acc:.3f}, version {optimizer.version}, "
                f"{time.monotonic() - start:.1f} s",
                flush=True,
            )

    result = train(
        dataset,
        args.address,
        args.rank,
        args.workers,
        batch_size=args.batch_size,
        epochs=args.epochs,
        seed=args.seed,
        on_epoch=report,
    )
    print(f"rank {result['rank']}: {result['iterations']} iterations", flush=True)
    return 0
