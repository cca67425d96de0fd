"""What a trainer's step reports to the server (:meth:`aps.Worker.log`), for the integrations.

:class:`Reporter` turns one training step's loss, learning rate and the scalars the
trainer has (Lightning's ``callback_metrics``, the Hugging Face Trainer's logs) into one
``worker.log`` call, with a digest of the step's batch (by which the server tells two
ranks reading the same data). Names the server cannot take (beyond its 32 a worker, or
with other characters than ``A-Z a-z 0-9 _ . : / -``) are left out, said once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..client.logbook import MAX_NAMES
from ..client.worker import Worker
from ..wire.scalars import check_scalar_name

__all__ = ["Reporter", "first_tensor"]

log = logging.getLogger("aps.torch")


def first_tensor(batch: Any, depth: int = 0) -> torch.Tensor | None:
    """The first tensor of a batch (itself, or in a tuple, list or dict, as loaders yield
    them): what its digest is taken of (see :func:`aps.client.logbook.batch_digest`)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if depth > 3:
        return None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


class Reporter:
    """One worker's step reports: ``step(global_step, loss=..., lr=..., metrics=..., batch=...)``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._names: set[str] = set()
        self._refused: set[str] = set()

    def step(
        self,
        step: int,
        *,
        loss: Any = None,
        lr: float | torch.Tensor | None = None,
        metrics: Mapping[str, Any] | None = None,
        batch: Any = None,
    ) -> None:
        scalars: dict[str, float] = {}
        if isinstance(loss, Mapping):
            loss = loss.get("loss")
        value = _scalar(loss)
        if value is not None:
            scalars["loss"] = value
        if lr is not None:
            scalars["lr"] = float(lr)
        for name, metric in (metrics or {}).items():
            value = _scalar(metric)
            if value is not None and name not in scalars and self._takes(name):
                scalars[name] = value
        self._names.update(scalars)
        self.worker.log(scalars, step=int(step), batch=first_tensor(batch))

    def _takes(self, name: str) -> bool:
        if name in self._names:
            return True
        if name in self._refused:
            return False
        try:
            check_scalar_name(name)
            if len(self._names) >= MAX_NAMES - 2:  # (room kept for the loss and the learning rate)
                raise ValueError(f"the server keeps {MAX_NAMES} scalars a worker")
        except ValueError as exc:
            self._refused.add(name)
            log.warning("rank %s: %r is not reported to the server: %s", self.worker.rank, name, exc)
            return False
        return True


def _scalar(value: Any) -> float | None:
    """``value`` as one float when it is one number (a 0-d or one-element tensor, a number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.detach().float().item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
