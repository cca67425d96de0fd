"""The flat layout of a model: named float32 tensors laid end to end.

At ``init`` the named tensors are placed one after another in a single
float32 vector, in the order the first worker gave them. The server keeps and
updates that vector; workers keep one flat weight buffer and one flat gradient
buffer and expose each tensor as a view into them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .errors import DTypeMismatch, LayoutMismatch, TableMismatch
from .tables import Table

__all__ = ["Layout", "line_aligned", "shard_bounds"]

#: Shard boundaries fall on multiples of this many elements (64 bytes: whole cache lines).
SHARD_ALIGN = 16

_MAX_NAME_BYTES = 0xFFFF
_MAX_NDIM = 32
_MAX_NUMEL = 1 << 40  # 4 TiB of float32: beyond any single server


@dataclass(frozen=True)
class Layout:
    """Names and shapes of a model's tensors, in flat order.

    Attributes:
        names: tensor names, in flat order.
        shapes: one shape tuple per name.
        tables: the model's embedding tables, ``(name, Table)`` pairs in their order
            (rows pulled and pushed by id beside the flat vector; see :mod:`aps.tables`).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    tables: tuple[tuple[str, Table], ...] = ()
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ValueError("names and shapes differ in length")
        if len(set(self.names)) != len(self.names):
            raise LayoutMismatch("tensor names must be unique")
        sizes, offsets, offset = [], [], 0
        for name, shape in zip(self.names, self.shapes):
            if not name or len(name.encode("utf-8")) > _MAX_NAME_BYTES:
                raise LayoutMismatch(f"tensor name {name!r} is empty or too long")
            if len(shape) > _MAX_NDIM or any(int(d) < 0 for d in shape):
                raise LayoutMismatch(f"tensor {name!r} has an invalid shape {shape}")
            size = math.prod(int(d) for d in shape)  # Python ints: no wrap-around
            offsets.append(offset)
            sizes.append(size)
            offset += size
            if offset > _MAX_NUMEL:
                raise LayoutMismatch(f"the model has more than {_MAX_NUMEL} parameters")
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "sizes", tuple(sizes))
        tables = tuple((str(name), table) for name, table in self.tables)
        if len({name for name, _ in tables}) != len(tables):
            raise TableMismatch("table names must be unique")
        for name, table in tables:
            if not name or len(name.encode("utf-8")) > 255 or "/" in name or not isinstance(table, Table):
                raise TableMismatch(f"table {name!r}: a name of 1 to 255 bytes without '/', and an aps.Table")
        object.__setattr__(self, "tables", tables)

    @classmethod
    def from_arrays(cls, params: Mapping[str, ArrayLike], tables: Mapping[str, Table] | None = None) -> Layout:
        """The layout of a mapping of name to array-like, in the mapping's order (and of
        ``tables``, a mapping of name to :class:`aps.tables.Table`, in theirs)."""
        shapes = []
        for value in params.values():
            shapes.append(tuple(int(d) for d in np.shape(value)))
        return cls(tuple(str(n) for n in params), tuple(shapes), tuple((tables or {}).items()))

    def dense(self) -> Layout:
        """This layout without its tables."""
        return Layout(self.names, self.shapes) if self.tables else self

    @property
    def table_dims(self) -> list[int]:
        """Each table's row length, in the tables' order (a rows section names them by place)."""
        return [table.dim for _, table in self.tables]

    @property
    def numel(self) -> int:
        """Number of float32 elements in the flat vector."""
        return (self.offsets[-1] + self.sizes[-1]) if self.names else 0

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def __len__(self) -> int:
        return len(self.names)

    def shard(self, index: int, shards: int) -> Layout:
        """The layout shard ``index`` of ``shards`` holds: the pieces of the tensors that
        fall in its range of the flat vector (see :func:`shard_bounds`), in flat order.
        A whole tensor keeps its name and shape; a tensor cut at a boundary becomes a
        flat piece named ``NAME[START:END]`` (elements of the flattened tensor), so every
        party derives the same pieces from the same layout, and the pieces of all the
        shards, in order, are the flat vector."""
        start, end = shard_bounds(self.numel, shards)[index : index + 2]
        names, shapes = [], []
        for name, shape, offset, size in zip(self.names, self.shapes, self.offsets, self.sizes):
            low, high = max(start, offset), min(end, offset + size)
            empty_here = size == 0 and (start <= offset < end or offset == end == self.numel)
            if low >= high and not empty_here:
                continue
            if (low, high) == (offset, offset + size):
                names.append(name)
                shapes.append(shape)
            else:
                names.append(f"{name}[{low - offset}:{high - offset}]")
                shapes.append((high - low,))
        return Layout(tuple(names), tuple(shapes), self.tables)  # every shard holds rows of every table

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Each tensor as a view (shaped like the tensor) into the flat vector ``flat``."""
        return {
            name: flat[offset : offset + size].reshape(shape)
            for name, shape, offset, size in zip(self.names, self.shapes, self.offsets, self.sizes)
        }

    def flatten_into(self, params: Mapping[str, ArrayLike], flat: np.ndarray) -> None:
        """Copy ``params`` into ``flat`` (float32, converting as needed), checking names and shapes."""
        self.check(params, what="init values", strict_dtype=False)
        for name, offset, size in zip(self.names, self.offsets, self.sizes):
            flat[offset : offset + size] = np.asarray(params[name], dtype=np.float32).reshape(-1)

    def check(self, tensors: Mapping[str, ArrayLike], *, what: str = "gradients", strict_dtype: bool = True) -> None:
        """Raise LayoutMismatch or DTypeMismatch unless ``tensors`` matches this layout.

        ``strict_dtype``: every tensor must be a floating-point array (float32 goes as
        it is; float16 and float64 are converted to the model's float32 by the caller)."""
        if len(tensors) != len(self.names) or any(name not in tensors for name in self.names):
            self._raise_name_mismatch(tensors.keys(), what)
        for name, shape in zip(self.names, self.shapes):
            value = tensors[name]
            got = tuple(np.shape(value))
            if got != shape:
                raise LayoutMismatch(f"{what}: tensor {name!r} has shape {got}, the model's is {shape}")
            if strict_dtype:
                check_floating(getattr(value, "dtype", None), f"{what}: tensor {name!r}")

    def _raise_name_mismatch(self, names: Iterable[str], what: str) -> None:
        given = list(names)
        mine, theirs = set(self.names), set(given)
        missing = [n for n in self.names if n not in theirs]
        extra = [n for n in given if n not in mine]
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise LayoutMismatch(f"{what}: tensor names differ from the model's: {'; '.join(parts)}")

    def difference(self, other: Layout) -> str | None:
        """None when the tensors are the same, else a sentence naming the first difference
        (the tables are :meth:`tables_difference`'s)."""
        if self.names == other.names and self.shapes == other.shapes:
            return None
        if self.names != other.names:  # linear in the number of tensors, whatever they hold
            mine, theirs = set(self.names), set(other.names)
            if mine == theirs:
                return "the same tensor names in a different order"
            missing = [n for n in self.names if n not in theirs]
            extra = [n for n in other.names if n not in mine]
            return f"tensor names differ (missing {missing[:5]}, unexpected {extra[:5]})"
        for name, my_shape, their_shape in zip(self.names, self.shapes, other.shapes):
            if my_shape != their_shape:
                return f"tensor {name!r} has shape {their_shape}, the model's is {my_shape}"
        return "layouts differ"

    def require_same(self, other: Layout, tensors: str, tables: str) -> None:
        """Raise unless ``other`` is this model: LayoutMismatch (``tensors: difference``)
        when its tensors differ, TableMismatch (``tables: difference``, naming the table and
        the field) when its tables do."""
        if (difference := self.difference(other)) is not None:
            raise LayoutMismatch(f"{tensors}: {difference}")
        if (difference := self.tables_difference(other)) is not None:
            raise TableMismatch(f"{tables}: {difference}")

    def tables_difference(self, other: Layout) -> str | None:
        """None when the tables are the same, else a sentence naming the first difference
        (a table and its field)."""
        if self.tables == other.tables:
            return None
        mine, theirs = dict(self.tables), dict(other.tables)
        if list(mine) != list(theirs):
            missing = [n for n in mine if n not in theirs]
            extra = [n for n in theirs if n not in mine]
            if not missing and not extra:
                return "the same tables in a different order"
            return f"tables differ (missing {missing[:5]}, unexpected {extra[:5]})"
        for name, table in mine.items():
            difference = table.difference(name, theirs[name])
            if difference is not None:
                return difference
        return "tables differ"


def shard_bounds(numel: int, shards: int) -> tuple[int, ...]:
    """Where ``shards`` contiguous ranges of a flat vector of ``numel`` float32 elements
    begin and end: ``shards + 1`` offsets, shard ``i`` holding ``[b[i], b[i + 1])``. The
    ranges are as equal in bytes as SHARD_ALIGN-element boundaries allow; every party
    (each shard, each worker) computes them the same way from the layout alone."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if numel < shards * SHARD_ALIGN and shards > 1:
        raise LayoutMismatch(
            f"a model of {numel} parameters is too small for {shards} shards (at least {SHARD_ALIGN} each)"
        )
    inner = [min(numel, round(numel * i / shards / SHARD_ALIGN) * SHARD_ALIGN) for i in range(1, shards)]
    return (0, *inner, numel)


def check_floating(dtype: DTypeLike | None, what: str) -> None:
    """Raise DTypeMismatch unless ``dtype`` is a real floating-point dtype.

    float32 is the model's own; other floating dtypes (numpy's default float64,
    float16) are converted to it where they are copied, as ``torch.optim`` users
    and numpy users expect. Integers, booleans, complex numbers and objects are
    refused: converting them would hide a bug in the caller."""
    if dtype == np.float32:
        return
    if dtype is None or not np.issubdtype(dtype, np.floating):
        raise DTypeMismatch(
            f"{what} is {dtype}, the model is float32: pass floating-point arrays (convert with .astype(np.float32))"
        )


def line_aligned(numel: int) -> np.ndarray:
    """A zeroed float32 vector whose first element starts a 64-byte cache line.

    numpy starts its large arrays 16 bytes into a page; an update kernel's
    streaming stores into such an output write every 512-byte tile as eight
    lines and two halves, and a half line written around the cache costs a
    read of the line after all (Adam at 64 MiB: about a fifth slower). The
    server's slots and optimizer state are made with this.
    """
    raw = np.zeros(numel + SHARD_ALIGN, np.float32)
    skip = (-(raw.ctypes.data // 4)) % SHARD_ALIGN
    return raw[skip : skip + numel]
