"""The rows of one request, as a worker builds them: which tables, which ids, which gradient
rows, and where the rows asked for land (docs/design/engine.md, "Embedding tables").

A :class:`RowsCall` is what the caller asked, checked and in the model's table order; the
protocol core sends it (aps.wire.rows) and receives the rows straight into its ``outs``.
A sharded worker splits it by :func:`aps.tables.shard_of` into one call a shard
(:func:`split`), and puts each shard's rows back where the caller's ids were
(:meth:`Split.gather`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .. import _core
from ..errors import InvalidIds, NonFiniteGradient
from ..layout import Layout
from ..tables import shard_of
from ..wire.rows import RowSection

__all__ = ["RowsCall", "Split", "rows_call", "split"]


class RowsCall(NamedTuple):
    """One request's rows: ``push`` sections (ids and gradient rows), ``pull`` sections (ids),
    ``outs`` (where each pulled section's rows go) and ``dense`` (the request also pushes or
    pulls the dense part). ``versioned``: a reply of rows alone sets the worker's version
    (False: the version stays that of the dense weights it holds)."""

    push: list[RowSection]
    pull: list[RowSection]
    outs: list[np.ndarray]
    dense: bool
    names: list[str]  # the pulled sections' table names, in order
    versioned: bool = True


def rows_call(
    layout: Layout,
    push: Mapping[str, Any] | None,
    pull: Mapping[str, Any] | None,
    out: Mapping[str, np.ndarray] | None,
    dense: bool,
) -> RowsCall:
    """Check what a caller asked (tables known, ids int64 in range, gradient rows of the
    table's shape, ``out`` arrays of the right shape) and put it in table order.

    Raises:
        InvalidIds: an unknown table, bad ids or rows, a bad ``out`` (nothing is sent).
        NonFiniteGradient: gradient rows holding NaN or infinity (nothing is sent).
    """
    places = {name: (index, table) for index, (name, table) in enumerate(layout.tables)}

    def find(name: Any):
        if not isinstance(name, str) or name not in places:
            known = ", ".join(repr(n) for n in places) or "none"
            raise InvalidIds(f"unknown table {name!r} (the model's tables: {known})")
        return places[name]

    pushed = []
    for name, pair in (push or {}).items():
        index, table = find(name)
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidIds(f"table {name!r}: rows to push are an (ids, grads) pair")
        ids = table.check_ids(name, pair[0])
        values = table.check_rows(name, ids, pair[1])
        if not _core.all_finite(values.reshape(-1)):  # (refused here: a sharded push is then sent to no shard)
            raise NonFiniteGradient(f"table {name!r}: the gradient rows hold NaN or infinity; nothing was sent")
        pushed.append(RowSection(index, ids, values))
    pulled, outs, names = [], [], []
    for name, ids in sorted((pull or {}).items(), key=lambda item: find(item[0])[0]):
        index, table = find(name)
        ids = table.check_ids(name, ids)
        target = None if out is None else out.get(name)
        if target is None:
            target = np.empty((len(ids), table.dim), np.float32)
        elif (
            not isinstance(target, np.ndarray)
            or target.dtype != np.float32
            or target.shape != (len(ids), table.dim)
            or not target.flags.c_contiguous
            or not target.flags.writeable
        ):
            raise InvalidIds(
                f"table {name!r}: out must be a writable C-contiguous float32 array of shape ({len(ids)}, {table.dim})"
            )
        pulled.append(RowSection(index, ids, None))
        outs.append(target)
        names.append(name)
    if out is not None and (extra := set(out) - set(names)):
        raise InvalidIds(f"out names tables that are not pulled: {sorted(extra)}")
    pushed.sort(key=lambda section: section.table)
    return RowsCall(pushed, pulled, outs, dense, names)


class Split(NamedTuple):
    """A call split over K shards: one call a shard (None: nothing for it to do), and where
    each shard's pulled rows go back in the caller's arrays."""

    calls: list[RowsCall | None]
    places: list[list[np.ndarray]]  # per shard, per pulled section: the caller's positions

    def gather(self, whole: RowsCall) -> None:
        """Put every shard's pulled rows where the caller's ids were (into ``whole.outs``)."""
        for call, places in zip(self.calls, self.places):
            if call is None:
                continue
            for name, rows, where in zip(call.names, call.outs, places):
                whole.outs[whole.names.index(name)][where] = rows


def split(call: RowsCall, shards: int, every: bool) -> Split:
    """``call`` over ``shards`` servers by :func:`shard_of`. ``every``: each shard gets a call
    (a push: every shard counts the iteration), else only those holding some id."""
    calls: list[list] = [[[], [], []] for _ in range(shards)]
    places: list[list[np.ndarray]] = [[] for _ in range(shards)]
    for section in call.push:
        values = section.values
        assert values is not None  # (a pushed section holds its gradient rows: rows_call)
        owner = shard_of(section.ids, shards)
        for shard in range(shards):
            mask = owner == shard
            if mask.any():
                calls[shard][0].append(RowSection(section.table, section.ids[mask], values[mask]))
    for section, name, whole in zip(call.pull, call.names, call.outs):
        owner = shard_of(section.ids, shards)
        for shard in range(shards):
            where = np.flatnonzero(owner == shard)
            if len(where):
                ids = section.ids[where]
                calls[shard][1].append(RowSection(section.table, ids, None))
                calls[shard][2].append((name, np.empty((len(ids), whole.shape[1]), np.float32)))
                places[shard].append(where)
    out: list[RowsCall | None] = []
    for push, pull, outs in calls:
        if not (every or call.dense or push or pull):
            out.append(None)
            continue
        out.append(
            RowsCall(push, pull, [array for _, array in outs], call.dense, [name for name, _ in outs], call.versioned)
        )
    return Split(out, places)
