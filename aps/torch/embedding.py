"""Embedding tables held by an aps server, as drop-in PyTorch modules.

::

    model = DLRM(..., embeddings=[aps.torch.Embedding(10**8, 64, table="items", optimizer="adagrad")])
    opt = aps.torch.Optimizer(model, "tcp://ps-host:7450")  # declares the model's tables
    for batch in loader:
        opt.zero_grad()
        loss_fn(model(batch), batch.y).backward()
        opt.step()  # the dense gradient and the batch's rows, in one request

A module holds no weights: its forward pulls the rows of the batch's distinct ids from
the server (or takes them from :meth:`aps.torch.Optimizer.prefetch`, one request for every
table), and keeps a leaf of the rows it used, one per occurrence of an id, as
``nn.Embedding(sparse=True)`` makes its gradient; ``opt.step()`` pushes those gradient rows
with the dense gradient. The rows are trained on the server by the table's own row-wise
optimizer (:class:`aps.Table`), whatever the dense part's is. The optimizer holds the
model's modules in a :class:`TableRows`, which they are bound to: the rows pulled ahead,
and the one request of a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..client.worker import Worker
from ..errors import ConfigurationError
from ..tables import Table

__all__ = ["Embedding", "EmbeddingBag", "TableRows", "bind_tables", "distinct_ids"]


class _Rows(torch.nn.Module):
    """What both modules share: the table, the optimizer it is bound to, the rows used."""

    def __init__(self, num_embeddings: int, embedding_dim: int, table: str | None, **spec: Any) -> None:
        super().__init__()
        self.table = table
        self.spec = Table(rows=num_embeddings, dim=embedding_dim, **spec)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._bound: TableRows | None = None  # (set by aps.torch.Optimizer)
        #: Rows used since the last step: (ids, one per occurrence; the leaf of their rows).
        self.used: list[tuple[np.ndarray, torch.Tensor]] = []

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}, optimizer={self.spec.optimizer!r}"

    def _bind(self, rows: TableRows, name: str) -> None:
        if self._bound is not None and self._bound is not rows:
            raise ConfigurationError(f"table {name!r} is bound to another aps.torch.Optimizer already")
        self._bound, self.table = rows, name

    def _occurrences(self, ids: torch.Tensor) -> torch.Tensor:
        """A leaf of the rows of ``ids`` (flat), one per occurrence; recorded for the step when
        gradients are on."""
        bound = self._bound
        if bound is None or self.table is None:
            raise ConfigurationError(
                "an aps.torch embedding trains with aps.torch.Optimizer(model, ...): make the "
                "optimizer from the model that holds it before the first forward"
            )
        if ids.dtype not in (torch.int64, torch.int32):
            raise ConfigurationError(f"table {self.table!r}: ids are int64 or int32, not {ids.dtype}")
        flat = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
        distinct, inverse = np.unique(flat, return_inverse=True)
        rows = torch.from_numpy(bound.rows_of(self.table, distinct))
        leaf = rows[torch.from_numpy(inverse.reshape(-1))].to(bound.device)
        if torch.is_grad_enabled() and self.training:
            leaf.requires_grad_()
            self.used.append((flat, leaf))
        return leaf

    def _gradient_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The ids and gradient rows of the forwards since the last step (None: none had a gradient)."""
        used, self.used = self.used, []
        parts = [(ids, leaf.grad) for ids, leaf in used if leaf.grad is not None]
        if not parts:
            return None
        ids = np.concatenate([ids for ids, _ in parts])
        grads = torch.cat([grad for _, grad in parts]).to("cpu", torch.float32)
        return ids, grads.contiguous().numpy()


class Embedding(_Rows):
    """``torch.nn.Embedding`` whose rows live in an aps table: ``num_embeddings`` ids (up to
    2**63; a row exists on the server once pushed) of ``embedding_dim`` values.

    Args:
        num_embeddings: the number of ids, as ``nn.Embedding``'s.
        embedding_dim: the length of a row.
        table: the table's name on the server (default: the module's name in the model).
        init: how a row starts (see :class:`aps.Table`); ``"normal:1.0"``, as
            ``nn.Embedding`` initializes.
        **spec: the rest of the table: ``optimizer``, ``lr``, ``eps``, ``betas``, ``seed``,
            ``evict`` (see :class:`aps.Table`).

    ``forward(input)`` takes int64 (or int32) ids of any shape and returns their rows with
    one more dimension of ``embedding_dim``, as ``nn.Embedding``; its gradient is pushed by
    the optimizer's next ``step()`` (duplicates summed by the server, as a sparse gradient
    is coalesced; SGD applies them in order, as ``torch.optim.SGD`` does).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        table: str | None = None,
        *,
        init: str = "normal:1.0",
        **spec: Any,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, table, init=init, **spec)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = self._occurrences(input)
        return rows.view(*input.shape, self.embedding_dim)


class EmbeddingBag(_Rows):
    """``torch.nn.EmbeddingBag`` whose rows live in an aps table: the sum, mean or max of
    each bag's rows, with ``per_sample_weights`` (mode ``"sum"``), ``offsets`` or 2-D input,
    as ``nn.EmbeddingBag`` takes them. Arguments as :class:`Embedding`, and ``mode``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        table: str | None = None,
        *,
        mode: str = "mean",
        include_last_offset: bool = False,
        init: str = "normal:1.0",
        **spec: Any,
    ) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ConfigurationError(f"mode is 'sum', 'mean' or 'max', not {mode!r}")
        super().__init__(num_embeddings, embedding_dim, table, init=init, **spec)
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = self._occurrences(input)
        positions = torch.arange(rows.shape[0], device=rows.device)
        if input.dim() == 2:
            positions = positions.view(input.shape)
        return F.embedding_bag(
            positions,
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )


def bind_tables(model: torch.nn.Module | None, rows: TableRows) -> dict[str, _Rows]:
    """The model's aps embeddings by table name (their own, or their name in the model),
    bound to ``rows``."""
    tables: dict[str, _Rows] = {}
    if model is None:
        return tables
    for name, module in model.named_modules():
        if isinstance(module, _Rows):
            table = module.table or name
            if table in tables:
                raise ConfigurationError(f"two aps embeddings of the model use table {table!r}: name each its own")
            module._bind(rows, table)
            tables[table] = module
    return tables


def distinct_ids(ids: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """``{table: ids}`` with each table's ids sorted, each once."""
    if ids is None:
        return {}
    if not isinstance(ids, Mapping):
        raise ConfigurationError("prefetch takes a mapping of table name to ids")
    out = {}
    for name, values in ids.items():
        if isinstance(values, torch.Tensor):
            values = values.detach().to("cpu", torch.int64).numpy()
        out[name] = np.unique(np.asarray(values).reshape(-1))
    return out


class TableRows:
    """The aps embeddings of ``model`` (None: none), bound to one optimizer of ``worker``:
    the rows their forwards read, pulled ahead (:meth:`prefetch`) or now (:meth:`rows_of`),
    and the gradient rows of those forwards, pushed by the step's request (:meth:`push_pull`).

    Every pull of rows alone leaves the worker's version as it is: the version of the dense
    weights it holds (the last step's), which its next push says (docs/guide/tables.md).

    Raises:
        ConfigurationError: two embeddings name the same table, or one is bound to another
            optimizer already.
    """

    def __init__(self, model: torch.nn.Module | None, worker: Worker, device: torch.device) -> None:
        self.worker, self.device = worker, device
        #: The model's aps embeddings by table name.
        self.tables = bind_tables(model, self)
        #: Rows pulled ahead (prefetch, or the last step's pull_rows), by table: (sorted ids, rows).
        self._prefetched: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def specs(self) -> dict[str, Table] | None:
        """The tables to declare at the worker's ``init`` (None: the model has none)."""
        return {name: module.spec for name, module in self.tables.items()} or None

    def prefetch(self, ids: Mapping[str, Any]) -> None:
        """Pull the rows of ``ids`` (``{table: ids}``) of every table in one request, for the
        next forwards (kept until the next step)."""
        wanted = distinct_ids(ids)
        pulled = self.worker.pull_rows(wanted, keep_version=True) if wanted else {}
        self._prefetched = {name: (wanted[name], pulled[name]) for name in wanted}

    def rows_of(self, table: str, distinct: np.ndarray) -> np.ndarray:
        """The rows of ``distinct`` (sorted, each once) of ``table``: prefetched, or pulled now."""
        kept = self._prefetched.get(table)
        if kept is not None and len(distinct):
            ids, rows = kept
            at = np.minimum(np.searchsorted(ids, distinct), len(ids) - 1)
            if len(ids) and np.array_equal(ids[at], distinct):
                return rows[at]
        return self.worker.pull_rows(table, distinct, keep_version=True)

    def forget(self) -> None:
        """Forget the rows the forwards used since the last step (their gradients too)."""
        for module in self.tables.values():
            module.used = []

    def push_pull(self, grads: Mapping[str, np.ndarray] | np.ndarray, prefetch: Mapping[str, Any] | None) -> None:
        """The step's one round trip: the dense gradient ``grads``, the gradient rows of the
        forwards since the last step, and the rows of ``prefetch`` (``{table: ids}``: the next
        batch's), kept for the next forwards; the weights land in the worker's buffers."""
        rows = {name: used for name, module in self.tables.items() if (used := module._gradient_rows()) is not None}
        ahead = distinct_ids(prefetch)
        self._prefetched = {}
        if rows or ahead:
            _, pulled = self.worker.push_pull(grads, rows=rows, pull_rows=ahead)
            self._prefetched = {name: (ahead[name], pulled[name]) for name in ahead}
        else:
            self.worker.push_pull(grads)
