"""The model the server holds: its weights table, its layout, the running sum of a round
and its embedding tables, made all at once when the first worker registers the model
(or a checkpoint is restored) and kept for the run.

A part of its own because everything else reads it and one moment makes it: membership
registers the model with the first worker's values, durability restores it from a
checkpoint, training and the loads compute on it. Making it whole or not at all (a
failure leaves the server without a model, as before) is this module's one rule; how
each piece updates lives with the piece (:mod:`aps.server.engine.table`,
:mod:`aps.server.engine.rows`, :mod:`aps.server.engine.jobs.updates`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import numpy as np

from ...config import ServerConfig, parse_compensation
from ...errors import LayoutMismatch, NonFiniteGradient, TableMismatch
from ...layout import Layout
from .compensation import Compensation
from .jobs.updates import Aggregate
from .lane import Offload
from .memory import TableMemory
from .narrowing import NarrowedWeights
from .optim import KernelThreads, default_kernel_threads, make_optimizer
from .rows import RowTable, Tables
from .sync import SyncPolicy
from .table import ParameterTable

__all__ = ["Model", "check_model"]

log = logging.getLogger("aps.server")


class Model:
    """The model's state (see the module docstring): None of it until registered.

    Args:
        config: the server's options (optimizer, compensation, table memory, kernel threads).
        policy: the sync policy (whether a running sum is kept; described in the log).
        kernels: the native module or its reference twin.
        allocate: allocator of the table's snapshot slots (None: heap blocks).
        background: runs slow preparations off the loop (16-bit weights for compressed pulls).
    """

    def __init__(
        self,
        config: ServerConfig,
        policy: SyncPolicy,
        kernels: ModuleType,
        allocate: Callable[..., object] | None = None,
        background: Offload | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        #: The native module or its reference twin: what the kernels run on.
        self.kernels = kernels
        self.table: ParameterTable | None = None
        self.layout: Layout | None = None
        #: The running sum of gradients (BSP, softsync), once the model exists.
        self.aggregate: Aggregate | None = None
        #: The bytes the tables' rows may take: --table-memory, or a share of the memory available now.
        self.table_memory = TableMemory.resolve(config.table_memory)
        #: The model's embedding tables: the rows pushed, by table name (aps.server.engine.rows).
        self.rows = Tables()
        #: The weights rounded to 16 bits for compressed pulls (off the loop when large).
        self.narrowed = NarrowedWeights(kernels, background)
        self._allocate = allocate

    @property
    def version(self) -> int:
        """The newest published version (0 before the model exists)."""
        return self.table.version if self.table is not None else 0

    @property
    def weights(self) -> np.ndarray | None:
        """The newest published weights (None before the model exists)."""
        return self.table.weights if self.table is not None else None

    def create(self, layout: Layout, values: np.ndarray) -> None:
        """Register the model of ``layout`` with ``values`` as its initial weights: its table,
        optimizer, compensation, running sum and embedding tables, everything allocated
        before anything is kept.

        Raises:
            NonFiniteGradient: ``values`` hold NaN or infinity (nothing made).
        """
        if not self.kernels.all_finite(values):
            raise NonFiniteGradient("the initial weights hold NaN or infinity")
        config = self.config
        optimizer = make_optimizer(
            config.optimizer,
            layout.numel,
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.eps,
            period=config.delayed_period,
            c=config.momentum_activation,
            kernels=self.kernels,
            threads=KernelThreads(config.kernel_threads or default_kernel_threads()),
        )
        # Everything is allocated before anything is kept: a failure (out of
        # memory) leaves the server without a model, as before.
        table = ParameterTable(layout, values, optimizer, self._allocate)
        kind, lam = parse_compensation(config.compensation)
        if kind != "none":
            try:
                table.compensation = Compensation(kind, lam, layout.numel, self.kernels)
            except BaseException:
                table.close()
                raise
        try:
            aggregate = Aggregate(layout.numel) if self.policy.aggregates else None
        except BaseException:
            table.close()
            raise
        self.table, self.layout, self.aggregate = table, layout, aggregate
        self.rows = Tables(
            ((name, RowTable(name, declared, kernels=self.kernels)) for name, declared in layout.tables),
            memory=self.table_memory,
            max_reply=config.max_frame_bytes,
        )
        log.info(
            "model registered: %d tensors, %d parameters (%.1f MiB); %s; %s",
            len(layout),
            layout.numel,
            layout.nbytes / (1 << 20),
            self.policy.describe(),
            optimizer.describe(),
        )

    def forget(self) -> None:
        """Let go of the model (a restore that did not fit): the server holds none again."""
        if self.table is not None:
            self.table.close()
        self.table = self.layout = self.aggregate = None
        self.rows = Tables()


def check_model(model: Layout, joining: Layout) -> None:
    """Raise unless a joining worker's model is the run's: its tensors (LayoutMismatch)
    and its tables (TableMismatch, naming the table and the field), saying what the server
    holds and what to do."""
    names = [name for name, _ in model.tables]
    tables = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    held = (
        f"this server holds another model already ({len(model)} tensors, {model.numel} parameters, "
        f"{f'tables {tables}' if tables else 'no tables'})"
    )
    try:
        model.require_same(joining, f"{held}; this model's tensors differ", f"{held}; this model's tables differ")
    except (LayoutMismatch, TableMismatch) as exc:
        raise type(exc)(
            f"{exc}. Start a fresh server (aps serve) for a new model; the workers of this "
            "server's run init with the model it holds"
        ) from None
