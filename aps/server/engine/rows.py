"""The embedding tables a server holds: rows made by their first push, found by id,
trained by a row-wise optimizer (docs/design/engine.md, "Embedding tables").

One :class:`RowTable` per table: an index from id to row (:class:`aps._core.RowIndex`:
open addressing over int64 keys, at most half full, 16 bytes a bucket) and a slab, one
float32 array of rows in the order their ids were first pushed, with the optimizer's
state in slabs of the same rows. The slab grows by doubling into ``np.empty`` arrays,
whose pages the kernel maps only when they are first written, so the process holds the
rows pushed, not the capacity. A pull keeps nothing: a row not held yet is read as its
initial values (:meth:`aps.tables.Table.initial_rows`, a function of its id alone), which
its first push starts from. Why not a dict of rows: an object per id (some 100 bytes)
and a Python step per id; here a batch's lookup is one native pass, and its rows are
gathered for a reply with one ``np.take``.

A push is a transaction: the ids and rows are checked, the gradient must be finite, the
distinct rows it touches are copied out (a new row's initial values made aside), the
kernel runs on the copies, and they are written back, the new rows added, only when every
new weight is finite. Room for the new rows (slab and index) is made before anything is
written, so that writing cannot fail half way. A refused push changes nothing.

The rows pushed are bounded by a limit (:class:`aps.server.engine.memory.TableMemory`: the
``--table-memory`` given, or by default half the memory available at start): a push that
would make rows past it evicts the least recently used rows of the tables declared
``evict=True``, or is refused (:class:`aps.errors.TableMemoryFull`) with nothing changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ... import _core
from ...errors import InvalidIds, NonFiniteGradient, TableMemoryFull
from ...tables import Table
from ...wire.rows import RowSection, decode_request_rows, padded, reply_rows_bytes
from .memory import TableMemory

__all__ = ["RowTable", "Tables"]


class RowTable:
    """The rows of one table a server holds, and their optimizer's state."""

    def __init__(self, name: str, table: Table, capacity: int = 0, kernels: Any = _core) -> None:
        self.name = name
        self.table = table
        self._kernels = kernels
        self._seed = table.row_seed(name)
        self._init = table.init_kind()
        # Nothing is made for a table before its first row (``capacity`` 0): a declaration
        # costs a server nothing, however many tables of however wide rows it names.
        self.index = kernels.RowIndex(capacity)
        self._rows = np.empty((capacity, table.dim), np.float32)
        self._state = {key: np.empty((capacity, width), np.float32) for key, width in table.state_per_row().items()}
        #: When each row was last touched (Tables.now at the time), for eviction; kept up to
        #: date only while ``evicts`` (a table that may evict, under a --table-memory limit).
        self._touched = np.zeros(capacity, np.int64)
        #: Scratch of a push's distinct rows (rows_distinct): one int32 a row, all 0 between
        #: calls (np.zeros: its pages are mapped only where rows were pushed).
        self._mark = np.zeros(capacity, np.int32)
        self.now = 0
        self.evicts = False
        #: Pushes applied (Adam's step count, for its bias correction).
        self.steps = 0
        #: Rows pulled and pushed since the process started (ids, duplicates counted), and evicted.
        self.rows_pulled = 0
        self.rows_pushed = 0
        self.rows_evicted = 0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        """The bytes the rows held take: their values and state, the index and scratch."""
        return len(self) * (self.table.row_bytes() + 4) + self.index.nbytes

    # Requests ---------------------------------------------------------------
    def pull(self, ids: Any, out: np.ndarray | None = None, checked: bool = False) -> np.ndarray:
        """The rows of ``ids`` (duplicates allowed, order kept) into ``out`` (a float32 array
        of shape ``(len(ids), dim)``) or a new array (``checked``: ``ids`` are this table's,
        int64 and contiguous, checked already): the rows held as they are, the others at
        their initial values, the values their first push starts from. Nothing is kept."""
        if not checked:
            ids = self.table.check_ids(self.name, ids)
        if out is None:
            out = np.empty((len(ids), self.table.dim), np.float32)
        elif out.dtype != np.float32 or out.shape != (len(ids), self.table.dim) or not out.flags.c_contiguous:
            raise InvalidIds(
                f"table {self.name!r}: out must be C-contiguous float32 of shape ({len(ids)}, {self.table.dim})"
            )
        rows = np.empty(len(ids), np.int64)
        missing = self.index.lookup(ids, rows, add=False)
        kernels = self._kernels
        if missing == len(ids):
            kernels.rows_init(out, ids, self._seed, *self._init)
        else:
            held = rows >= 0
            if self.evicts:
                self._touched[rows[held]] = self.now
            if missing:
                fresh = ~held
                initial = np.empty((missing, self.table.dim), np.float32)
                kernels.rows_init(initial, np.ascontiguousarray(ids[fresh]), self._seed, *self._init)
                rows[fresh] = rows[held][0]  # (any row held: gathered, then replaced)
            kernels.rows_gather(out, self._rows, rows)
            if missing:
                out[fresh] = initial
        self.rows_pulled += len(ids)
        return out

    def push(self, ids: Any, grads: Any, scale: float = 1.0) -> None:
        """Apply the gradient rows ``grads`` (one per id; a duplicate id's rows are summed,
        or for SGD applied one after the other, as torch applies a sparse gradient),
        times ``scale``."""
        ids = self.table.check_ids(self.name, ids)
        grads = self.table.check_rows(self.name, ids, grads)
        if not self._kernels.all_finite(grads.reshape(-1)):
            raise NonFiniteGradient(f"table {self.name!r}: the gradient rows hold NaN or infinity; nothing changed")
        self.commit(self.prepare(ids, grads, scale))

    def prepare(self, ids: np.ndarray, grads: np.ndarray, scale: float = 1.0) -> _Staged | None:
        """The first half of a push of checked ``ids`` and ``grads``: the new values of the
        rows it touches and of their state, computed aside (a row not held yet from its
        initial values and zero state), and room made for the rows it adds (:meth:`commit`
        writes them all). Raises NonFiniteGradient, with nothing changed, for a result that
        is not finite (a gradient that is not makes one; :meth:`push` and ``Tables.check``
        refuse it first). A push of several tables prepares each, then commits each."""
        if not len(ids):
            return None
        if scale != 1.0:
            grads = grads * np.float32(scale)
        table, kernels = self.table, self._kernels
        held = len(self)
        found = np.empty(len(ids), np.int64)
        added, index = None, None
        if self.index.lookup(ids, found, add=False):
            added = _place_new(ids, found, held)
            # Room first (allocations that may fail; nothing the table holds changes).
            self._make_room(held + len(added), held)
            index = self._index_with_room(held + len(added))
        # The distinct rows, in the order first named (one native pass, no sort), and each
        # entry's place among them.
        where = np.empty(len(found), np.int64)
        rows = kernels.rows_distinct(found, where, self._mark)
        compact = np.empty((len(rows), table.dim), np.float32)
        state = {key: np.empty((len(rows), slab.shape[1]), np.float32) for key, slab in self._state.items()}
        new = 0 if added is None else len(added)
        if new == len(rows):  # every row new (numbered in the order first named, as ``rows`` are)
            kernels.rows_init(compact, added, self._seed, *self._init)
            for values in state.values():
                values.fill(0.0)
        else:  # rows held: gathered (a new row's place, from row 0, is written after)
            source = rows if not new else np.where(rows < held, rows, 0)
            kernels.rows_gather(compact, self._rows, source)
            for key, slab in self._state.items():
                kernels.rows_gather(state[key], slab, source)
            if new and added is not None:
                fresh = rows >= held
                initial = np.empty((new, table.dim), np.float32)
                kernels.rows_init(initial, added[rows[fresh] - held], self._seed, *self._init)
                compact[fresh] = initial
                for values in state.values():
                    values[fresh] = 0.0
        if table.optimizer == "sgd":
            ok = kernels.rows_sgd(compact, where, grads, table.lr)
        else:
            summed = np.zeros_like(compact)
            kernels.rows_coalesce(summed, where, grads)
            if table.optimizer == "adam":
                ok = kernels.rows_adam(
                    compact,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    summed,
                    self.steps + 1,
                    table.lr,
                    table.betas[0],
                    table.betas[1],
                    table.eps,
                )
            else:
                ok = kernels.rows_adagrad(
                    compact, state["sum"].reshape(-1), summed, table.lr, table.eps, table.optimizer == "rowwise_adagrad"
                )
        if not ok:
            raise NonFiniteGradient(
                f"table {self.name!r}: the update would make a weight or its optimizer state infinite; nothing changed"
            )
        return _Staged(rows, compact, state, len(ids), added, index)

    def commit(self, staged: _Staged | None) -> None:
        """Write what :meth:`prepare` computed, the rows it adds first (cannot fail: their
        room is made)."""
        if staged is None:
            return
        kernels = self._kernels
        if staged.added is not None:
            held, index = len(self), staged.index if staged.index is not None else self.index
            index.lookup(staged.added, np.empty(len(staged.added), np.int64))  # rows held, held + 1...
            self.index = index
            self._touched[held : held + len(staged.added)] = self.now
        if self.evicts:
            self._touched[staged.rows] = self.now
        kernels.rows_scatter(self._rows, staged.values, staged.rows)
        for key, slab in self._state.items():
            kernels.rows_scatter(slab, staged.state[key], staged.rows)
        self.steps += 1
        self.rows_pushed += staged.pushed

    # Checkpoints ------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Copies of what a checkpoint keeps, in row order: ``ids``, ``rows`` and each
        state array (rows never pushed are not there)."""
        count = len(self)
        out = {"ids": self.index.ids(), "rows": self._rows[:count].copy()}
        out.update({key: slab[:count].copy() for key, slab in self._state.items()})
        return out

    @classmethod
    def restored(
        cls, name: str, table: Table, arrays: dict[str, np.ndarray], steps: int, kernels: Any = _core
    ) -> RowTable:
        """The table a checkpoint's :meth:`arrays` describe, exactly."""
        ids = np.ascontiguousarray(arrays["ids"], dtype=np.int64)
        expected = {"ids", "rows", *table.state_per_row()}
        if set(arrays) != expected:
            raise InvalidIds(f"table {name!r}: a checkpoint has {sorted(arrays)}, not {sorted(expected)}")
        for key, width in {"rows": table.dim, **table.state_per_row()}.items():
            if arrays[key].shape != (len(ids), width):
                raise InvalidIds(f"table {name!r}: {key} has shape {arrays[key].shape}, not ({len(ids)}, {width})")
        restored = cls(name, table, len(ids), kernels)
        table.check_ids(name, ids)
        rows = np.empty(len(ids), np.int64)
        if restored.index.lookup(ids, rows) != len(ids):
            raise InvalidIds(f"table {name!r}: a checkpoint names an id twice")
        restored._rows[: len(ids)] = arrays["rows"]
        for key, slab in restored._state.items():
            slab[: len(ids)] = arrays[key]
        restored.steps = int(steps)
        return restored

    # The index and the slab ------------------------------------------------
    def _held_rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids``, -1 where not held."""
        rows = np.empty(len(ids), np.int64)
        self.index.lookup(ids, rows, add=False)
        return rows

    def _index_with_room(self, count: int) -> Any:
        """None when the index takes ``count`` ids without growing, else a new index that
        does, holding the same ids at the same rows (made now: adding the ids cannot then
        fail for want of memory). An index that tells no size (the reference twin's) grows
        as it goes."""
        capacity = self.index.nbytes // 32  # (16 bytes a bucket, at most half of them full)
        if not capacity or count <= capacity:
            return None
        index = self._kernels.RowIndex(count)
        held = self.index.ids()
        index.lookup(held, np.empty(len(held), np.int64))
        return index

    def touch(self, ids: np.ndarray, pushed: bool = True) -> int:
        """Mark the rows of ``ids`` held touched now (so that no eviction takes them);
        returns how many rows a push of ``ids`` would make (the distinct ids not held; 0
        for a pull, which makes none)."""
        rows = self._held_rows(ids)
        self._touched[rows[rows >= 0]] = self.now
        if not pushed:
            return 0
        missing = ids[rows < 0]
        return len(np.unique(missing)) if len(missing) > 1 else len(missing)

    @property
    def row_cost(self) -> int:
        """What a row costs against --table-memory: its values and state, 32 bytes of the
        index (16 a bucket, at most half of them full; while the index doubles it may take up
        to 32 bytes a row more, which the limit does not count) and 4 of scratch (sized like
        the slab, mapped only where rows were pushed)."""
        return self.table.row_bytes() + 36

    def untouched_since(self, now: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows not touched at ``now`` and when each was last touched."""
        touched = self._touched[: len(self)]
        rows = np.flatnonzero(touched < now)
        return rows, touched[rows]

    def drop(self, rows: np.ndarray) -> None:
        """Evict ``rows``: the others kept in their order, the index made again for them
        (a row dropped and touched again starts from its initial values)."""
        count = len(self)
        keep = np.ones(count, bool)
        keep[rows] = False
        kept = int(keep.sum())
        ids = self.index.ids()[keep]
        self._rows[:kept] = self._rows[:count][keep]
        for slab in self._state.values():
            slab[:kept] = slab[:count][keep]
        self._touched[:kept] = self._touched[:count][keep]
        self.index = self._kernels.RowIndex(kept)
        self.index.lookup(ids, np.empty(kept, np.int64))
        self.rows_evicted += count - kept

    def _make_room(self, count: int, held: int) -> None:
        """Room for ``count`` rows, the ``held`` ones kept (doubling: a batch's new rows
        cost amortized constant time each)."""
        capacity = len(self._rows)
        if count <= capacity:
            return
        capacity = max(capacity, 64)
        while capacity < count:
            capacity *= 2
        # Everything made before anything is replaced: out of memory half way, the table is as it was.
        rows = _grown(self._rows, capacity, held)
        state = {key: _grown(slab, capacity, held) for key, slab in self._state.items()}
        touched = np.zeros(capacity, np.int64)
        touched[:held] = self._touched[:held]
        mark = np.zeros(capacity, np.int32)
        self._rows, self._state, self._touched, self._mark = rows, state, touched, mark


class Tables(dict):
    """The model's tables by name, in their declared order (a rows section names a table by
    its place in it), with what a request does across them: check its rows, read them,
    and push them as one transaction; and the rows of an open BSP/softsync round, kept
    until its aggregate update applies them, summed by id, once."""

    def __init__(
        self, *args: Any, limit: int = 0, memory: TableMemory | None = None, max_reply: int = 4 << 30, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        #: The most bytes of rows one reply may carry (a frame's limit).
        self.max_reply = max_reply
        self._round: dict[int, list[tuple[int, np.ndarray, np.ndarray, float]]] = {}  # table: (rank, ids, rows, scale)
        #: Where the limit came from (``--table-memory``, or the default).
        self.memory = memory if memory is not None else TableMemory(limit)
        #: The bytes the tables' rows may take, as :attr:`used` counts them (0: no limit).
        self.limit = limit = self.memory.limit
        self._now = 0  # requests checked so far: the clock of the rows' last touch
        for rows in self.values():
            rows.evicts = bool(limit) and rows.table.evict
        self._ordered()

    def __setitem__(self, name: str, rows: RowTable) -> None:  # (a table restored from a checkpoint)
        rows.evicts = bool(self.limit) and rows.table.evict
        super().__setitem__(name, rows)
        self._ordered()

    def _ordered(self) -> None:
        #: The tables in their declared order (a section names a table by its place), and
        #: each one's row length: kept, not made again at every request.
        self._order: list[RowTable] = list(self.values())
        self.dims: list[int] = [rows.table.dim for rows in self._order]

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.values())

    @property
    def used(self) -> int:
        """The bytes the rows held take as the limit counts them (:attr:`RowTable.row_cost`)."""
        return sum(len(rows) * rows.row_cost for rows in self.values())

    def intake(self, payload: Any, push: bool, pull: bool, fit: bool = True, shared: bool = False) -> tuple[list, list]:
        """A request's rows (aps.wire.rows: the sections it pushes and pulls), decoded and
        checked (:meth:`check`). ``shared``: ``payload`` lies in memory its sender may write
        again at any time (a shared-memory worker's rows segment): the ids are copied, so
        that the ids checked are the ids used; the gradient rows are read in place (each
        element once by the update kernel, which refuses one that is not finite, whenever
        it was written) and copied where kept (:meth:`accumulate`)."""
        pushed, pulled = decode_request_rows(payload, self.dims, push, pull)
        if shared:
            pushed = [RowSection(table, ids.copy(), values) for table, ids, values in pushed]
            pulled = [RowSection(table, ids.copy(), None) for table, ids, _ in pulled]
        self.check(pushed, pulled, fit)
        return pushed, pulled

    def check(self, pushed: list, pulled: list, fit: bool = True) -> None:
        """Refuse (InvalidIds, NonFiniteGradient, TableMemoryFull) a request's rows before
        anything is made of them; ``fit``: make room for them within the limit."""
        tables = self._order
        for table, ids, values in pushed:
            rows = tables[table]
            rows.table.check_ids(rows.name, ids)
            if not rows._kernels.all_finite(values.reshape(-1)):
                raise NonFiniteGradient(f"table {rows.name!r}: the gradient rows hold NaN or infinity; nothing changed")
        reply = 0
        for table, ids, _ in pulled:
            rows = tables[table]
            rows.table.check_ids(rows.name, ids)
            reply += 4 * len(ids) * rows.table.dim
        if reply > self.max_reply:
            raise InvalidIds(
                f"the rows asked for take {reply} bytes, over the {self.max_reply} a frame may carry "
                "(--max-frame-bytes): ask for fewer, or for each id once"
            )
        if self.limit and fit:  # (a push sent again, answered without applying it, is not fitted)
            self._now += 1
            for rows in tables:
                rows.now = self._now
            for table, ids, _ in pulled:  # (the rows it reads stay: a pull makes none)
                if tables[table].evicts:  # (a table that never evicts keeps no times)
                    tables[table].touch(ids, pushed=False)
            self._fit([(tables[table], ids) for table, ids, _ in pushed])

    def _fit(self, pushed: list[tuple[RowTable, np.ndarray]]) -> None:
        """Room within the limit (rows counted at their :attr:`RowTable.row_cost`) for the rows
        a request's push makes (its rows held are touched now, so they stay): the least
        recently used rows of the tables that may evict are dropped, down to seven eighths of
        the limit (an eviction pays for many requests); else TableMemoryFull, with nothing
        dropped. A request that makes no row (a pull, a push of rows held) always fits.
        Requests in flight (one per worker at most) may pass the limit by the rows they make,
        never more. The rows of a table that never evicts are looked up only when the push
        would not fit were every id it names a new row: then they are counted."""
        held = self.used
        need = sum(rows.touch(ids) * rows.row_cost for rows, ids in pushed if rows.evicts)
        others = [(rows, ids) for rows, ids in pushed if not rows.evicts]
        if held + need + sum(len(ids) * rows.row_cost for rows, ids in others) <= self.limit:
            return  # (fits however many rows it makes: the common case, costing no look-up)
        need += sum(rows.touch(ids) * rows.row_cost for rows, ids in others)
        if not need or held + need <= self.limit:
            return
        target = held + need - self.limit + self.limit // 8
        candidates = [(rows, *rows.untouched_since(self._now)) for rows in self.values() if rows.evicts]
        freeable = sum(len(found) * rows.row_cost for rows, found, _ in candidates)
        if freeable < held + need - self.limit:
            raise TableMemoryFull(
                f"the rows of the tables take {held} bytes of the {self.limit} --table-memory allows "
                f"({self.memory.source()}), and this push makes up to {need} more; "
                + (
                    "the tables that may evict (evict=True) have too few rows to give up"
                    if candidates
                    else "no table is declared evict=True"
                )
                + ": nothing changed. Start the server with a larger "
                "--table-memory SIZE (0: no limit), or declare the tables evict=True"
            )
        order = np.concatenate([touched for _, _, touched in candidates]).argsort(kind="stable")
        owner = np.concatenate([np.full(len(found), i) for i, (_, found, _) in enumerate(candidates)])[order]
        row = np.concatenate([found for _, found, _ in candidates])[order]
        sizes = np.array([rows.row_cost for rows, _, _ in candidates])[owner]
        count = int(np.searchsorted(np.cumsum(sizes), target)) + 1
        for i, (rows, _, _) in enumerate(candidates):
            mine = row[:count][owner[:count] == i]
            if len(mine):
                rows.drop(mine)

    def pull(self, pulled: list, room: Callable[[int], np.ndarray] | None = None) -> list[np.ndarray]:
        """The rows a request asked for, table after table (a row not held yet at its initial
        values, kept nowhere): in new arrays, or gathered straight into ``room(nbytes)`` (a
        reply's rows, each table's 8-aligned, as aps.wire.rows lays them out: a shared-memory
        reply segment)."""
        tables = self._order
        if room is None:
            return [tables[table].pull(ids, checked=True) for table, ids, _ in pulled]
        into = room(reply_rows_bytes(pulled, self.dims))
        out, at = [], 0
        for table, ids, _ in pulled:
            dim = self.dims[table]
            view = into[at : at + 4 * len(ids) * dim].view(np.float32).reshape(len(ids), dim)
            out.append(tables[table].pull(ids, view, checked=True))
            at += padded(view.nbytes)
        return out

    def prepare(self, pushed: list, scale: float = 1.0) -> list:
        """Every table's part of a push, computed aside (raises, with nothing changed, if any
        part is refused); :meth:`commit` writes them all."""
        tables = self._order
        return [(tables[table], tables[table].prepare(ids, values, scale)) for table, ids, values in pushed]

    @staticmethod
    def commit(staged: list) -> None:
        for rows, part in staged:
            rows.commit(part)

    # An open round (BSP, softsync) ------------------------------------------
    def kept(self, pushed: list) -> list:
        """A push's rows as a round keeps them: gradient rows read in place from a worker's
        shared segment (read-only views, which it may write again at any time) copied, and
        the copies checked (NonFiniteGradient: the copy is what the round would apply)."""
        out = []
        for section in pushed:
            values = section.values
            if not values.flags.writeable:
                values = values.copy()
                if not self._order[section.table]._kernels.all_finite(values.reshape(-1)):
                    raise NonFiniteGradient(
                        f"table {self._order[section.table].name!r}: the gradient rows hold "
                        "NaN or infinity; nothing changed"
                    )
                section = RowSection(section.table, section.ids, values)
            out.append(section)
        return out

    def accumulate(self, pushed: list, scale: float, first: bool, rank: int) -> None:
        """Keep ``rank``'s push's rows (as :meth:`kept` gives them) for the round's aggregate
        update (``first``: a new round)."""
        if first:
            self._round = {}
        for table, ids, values in pushed:
            self._round.setdefault(table, []).append((rank, ids, values, scale))

    def take_round(self, scale: float) -> list:
        """The open round's rows, each id's gradients summed in rank order (whatever order
        they arrived in: a round's update is the same every time), times their push's scale
        and ``scale``; the round is then empty."""
        parts, self._round = self._round, {}
        return [(table, *_merged(parts[table], scale)[:2]) for table in sorted(parts)]

    def forget_round(self) -> None:
        self._round = {}

    def open_round(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Copies of the open round's rows by table name, for a checkpoint: ids, gradient rows
        times their push's scale, and each one's rank, in rank order (as they are summed)."""
        names = list(self)
        return {names[table]: _merged(pushes, 1.0) for table, pushes in self._round.items()}

    def reopen_round(self, saved: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Take up the rows of the round a checkpoint caught open (see :meth:`open_round`):
        summed as they would have been."""
        names = list(self)
        self._round = {}
        for name, (ids, grads, ranks) in saved.items():
            rows = self._order[names.index(name)]
            ids = rows.table.check_ids(name, ids)
            grads = rows.table.check_rows(name, ids, grads)
            ranks = np.asarray(ranks, np.int64)
            if ranks.shape != ids.shape:
                raise InvalidIds(f"table {name!r}: an open round's ranks do not match its ids")
            cuts = np.flatnonzero(np.diff(ranks)) + 1
            self._round[names.index(name)] = [
                (int(part_ranks[0]), part_ids, part_grads, 1.0)
                for part_ids, part_grads, part_ranks in zip(
                    np.split(ids, cuts), np.split(grads, cuts), np.split(ranks, cuts)
                )
                if len(part_ids)
            ]


class _Staged(NamedTuple):
    """A prepared push of one table: its rows (slab positions), their new values and state;
    the ids it adds (in the order of their rows, from the rows held on; None: none) and the
    index with room for them (None: the table's has room)."""

    rows: np.ndarray
    values: np.ndarray
    state: dict[str, np.ndarray]
    pushed: int
    added: np.ndarray | None = None
    index: Any = None


def _place_new(ids: np.ndarray, rows: np.ndarray, held: int) -> np.ndarray:
    """Number the ids not held (``rows`` -1) ``held``, ``held + 1``... in the order first
    named, in ``rows``; returns them, each once, in that order."""
    fresh = np.flatnonzero(rows < 0)
    distinct, first, inverse = np.unique(ids[fresh], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    place = np.empty(len(distinct), np.int64)
    place[order] = np.arange(len(distinct))
    rows[fresh] = held + place[inverse.reshape(-1)]
    return np.ascontiguousarray(distinct[order])


def _merged(pushes: list, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A round's pushes of one table, in rank order (stable: a rank's in arrival order): their
    ids, their gradient rows times their push's scale and ``scale``, and each row's rank."""
    pushes = sorted(pushes, key=lambda push: push[0])
    ids = np.concatenate([ids for _, ids, _, _ in pushes])
    grads = np.concatenate(
        [values * np.float32(each * scale) if each * scale != 1.0 else values for _, _, values, each in pushes]
    )
    ranks = np.concatenate([np.full(len(ids), rank, np.int64) for rank, ids, _, _ in pushes])
    return ids, grads, ranks


def _grown(slab: np.ndarray, capacity: int, held: int) -> np.ndarray:
    out = np.empty((capacity, slab.shape[1]), np.float32)
    out[:held] = slab[:held]
    return out
