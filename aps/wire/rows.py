"""The wire format of embedding tables: their declarations, and sections of rows by id.

Both are parsed by both ends and by nothing else; every count and size a peer declares is
checked against the limits and against the bytes that are really there before anything is
made of it, and a decoder returns views into the buffer it was given (no copy of ids or
rows). Any malformed input raises :class:`aps.errors.MalformedFrame`.

**Declarations** (a model's tables, in its order): per table, u16 name length, the UTF-8
name, u32 description length, then the description: :meth:`aps.tables.Table.describe` as
UTF-8 JSON.

**A rows section** (one request's or reply's rows): u32 number of tables named, u32
reserved (0); per table named, in increasing table order: u32 table index (its place in
the model's declarations), u32 number of ids n, then n int64 ids (little-endian), then,
where the section carries values, n rows of the table's ``dim`` float32 values, then 4
bytes of zero padding when n x dim is odd, so that every block starts 8-aligned. The ids
and rows of a table follow its head at once, so a section is read in one pass, and its
length is known from its heads alone.

**Over shared memory** the rows do not cross the socket: a request's rows part (its
sections) lies at the start of the worker's rows segment, a reply's rows at the start of
the server's reply segment of that connection, and the frame carries a **rows reference**
in their place: u64 length (the bytes of rows from the segment's start), u64 the segment's
bytes, u32 flags (bit 0: the segment's memfd comes with this frame, to be mapped in place
of the one before), u32 reserved (0).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import ConfigurationError, MalformedFrame
from ..tables import Table

__all__ = [
    "MAX_TABLES",
    "ROWS_REF_BYTES",
    "RowSection",
    "decode_request_rows",
    "decode_rows",
    "decode_rows_ref",
    "decode_tables",
    "encode_rows",
    "encode_rows_ref",
    "encode_tables",
    "padded",
    "reply_rows_bytes",
    "reply_rows_parts",
    "rows_bytes",
]

#: At most this many tables a model, and this many bytes of one table's description.
MAX_TABLES = 1024
MAX_DESCRIPTION_BYTES = 4096
MAX_TABLE_NAME_BYTES = 255
_NAME = struct.Struct("<H")
_DESCRIPTION = struct.Struct("<I")
_SECTION = struct.Struct("<II")
_BLOCK = struct.Struct("<II")
_REF = struct.Struct("<QQII")
#: The bytes of a rows reference (shared memory: the rows are in a segment, see above).
ROWS_REF_BYTES = _REF.size
_REF_HAS_FD = 1


def encode_tables(tables: Mapping[str, Table]) -> bytes:
    """The declarations of ``tables``, in their order."""
    if len(tables) > MAX_TABLES:
        raise ConfigurationError(f"a model has at most {MAX_TABLES} tables, not {len(tables)}")
    parts = []
    for name, table in tables.items():
        raw = name.encode("utf-8")
        described = json.dumps(table.describe(), sort_keys=True, separators=(",", ":")).encode("utf-8")
        if not raw or len(raw) > MAX_TABLE_NAME_BYTES or "/" in name or len(described) > MAX_DESCRIPTION_BYTES:
            raise ConfigurationError(f"table name {name!r} is empty, over {MAX_TABLE_NAME_BYTES} bytes or holds a '/'")
        parts += [_NAME.pack(len(raw)), raw, _DESCRIPTION.pack(len(described)), described]
    return b"".join(parts)


def decode_tables(view: Any, offset: int, count: int) -> tuple[dict[str, Table], int]:
    """``count`` declarations from ``view`` at ``offset``: the tables and where they end."""
    view = memoryview(view)
    if count > MAX_TABLES:
        raise MalformedFrame(f"{count} tables declared; at most {MAX_TABLES} are accepted")
    tables: dict[str, Table] = {}
    try:
        for _ in range(count):
            (name_len,) = _NAME.unpack_from(view, offset)
            offset += _NAME.size
            if name_len == 0 or name_len > MAX_TABLE_NAME_BYTES:
                raise MalformedFrame(f"a table name of {name_len} bytes (1 to {MAX_TABLE_NAME_BYTES})")
            name = _take(view, offset, name_len).decode("utf-8")
            if "/" in name:
                raise MalformedFrame(f"table name {name!r} holds a '/'")
            offset += name_len
            (size,) = _DESCRIPTION.unpack_from(view, offset)
            offset += _DESCRIPTION.size
            if size > MAX_DESCRIPTION_BYTES:
                raise MalformedFrame(f"table {name!r}: a description of {size} bytes; at most {MAX_DESCRIPTION_BYTES}")
            described = json.loads(_take(view, offset, size).decode("utf-8"))
            offset += size
            if name in tables:
                raise MalformedFrame(f"table {name!r} is declared twice")
            tables[name] = Table.from_description(described)
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError, RecursionError, ConfigurationError) as exc:
        # (json's errors and a description's bad fields are ValueErrors: the peer's fault)
        raise MalformedFrame(f"table declarations cannot be parsed: {exc}") from None
    return tables, offset


def _take(view: memoryview, offset: int, size: int) -> bytes:
    if offset + size > len(view):
        raise MalformedFrame("table declarations are truncated")
    return bytes(view[offset : offset + size])


class RowSection(NamedTuple):
    """One table's part of a rows section: views into the buffer it was read from."""

    table: int
    ids: np.ndarray  # int64, (n,)
    values: np.ndarray | None  # float32, (n, dim), where the section carries values


def _block_bytes(count: int, dim: int, with_values: bool) -> int:
    values = 4 * count * dim if with_values else 0
    return _BLOCK.size + 8 * count + values + (-values % 8)


def rows_bytes(counts: Mapping[int, int], dims: Sequence[int], with_values: bool) -> int:
    """The length of a section naming ``counts[table]`` ids of each table."""
    return _SECTION.size + sum(_block_bytes(n, dims[t], with_values) for t, n in counts.items())


def encode_rows(sections: Sequence[RowSection], dims: Sequence[int], with_values: bool) -> list:
    """A rows section as buffers to send (the ids and rows themselves, not copies).

    Raises:
        ValueError: tables out of order or unknown, ids not int64, rows of the wrong shape.
    """
    out: list = [_SECTION.pack(len(sections), 0)]
    previous = -1
    for table, ids, values in sections:
        if not previous < table < len(dims):
            raise ValueError(f"table {table}: sections name known tables, each once, in increasing order")
        previous = table
        ids = np.ascontiguousarray(ids)
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise ValueError(f"table {table}: ids are a vector of int64")
        out.append(_BLOCK.pack(table, len(ids)))
        out.append(ids.data.cast("B"))
        if with_values:
            values = np.ascontiguousarray(values)
            if values.dtype != np.float32 or values.shape != (len(ids), dims[table]):
                raise ValueError(f"table {table}: rows are float32 of shape ({len(ids)}, {dims[table]})")
            out.append(values.data.cast("B"))
            if values.nbytes % 8:
                out.append(b"\0" * 4)
    return out


def decode_rows(payload: Any, dims: Sequence[int], with_values: bool) -> list[RowSection]:
    """The sections of a rows section that fills ``payload`` exactly (``dims``: each
    declared table's row length). Linear in the number of tables named; no copy."""
    view = memoryview(payload).cast("B")
    sections, end = _decode(view, 0, dims, with_values)
    if end != len(view):
        raise MalformedFrame(f"a rows section of {len(view)} bytes holds {end} bytes of rows")
    return sections


def decode_request_rows(
    payload: Any, dims: Sequence[int], push: bool, pull: bool
) -> tuple[list[RowSection], list[RowSection]]:
    """The rows part of a request (Flag.ROWS): a section of ids and gradient rows where the
    request pushes, then a section of ids where it pulls, filling ``payload`` exactly."""
    view = memoryview(payload).cast("B")
    pushed, end = _decode(view, 0, dims, True) if push else ([], 0)
    pulled, end = _decode(view, end, dims, False) if pull else ([], end)
    if end != len(view):
        raise MalformedFrame(f"the rows of a request take {end} bytes; it carries {len(view)}")
    return pushed, pulled


def reply_rows_bytes(sections: Sequence[RowSection], dims: Sequence[int]) -> int:
    """The length of the rows a reply carries for the pulled ``sections``: each table's
    rows in the order asked, float32, each block padded to 8 bytes (no heads: the asker
    knows what it asked)."""
    return sum(padded(4 * len(ids) * dims[table]) for table, ids, _ in sections)


def reply_rows_parts(rows: Sequence[np.ndarray]) -> list:
    """The buffers of a reply's rows (see :func:`reply_rows_bytes`), the arrays themselves."""
    out: list = []
    for array in rows:
        if array.nbytes:
            out.append(array.data.cast("B"))
        if array.nbytes % 8:
            out.append(_PAD)
    return out


_PAD = bytes(4)


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to 8: where the next block of a reply's rows begins."""
    return nbytes + (-nbytes % 8)


def _decode(view: memoryview, offset: int, dims: Sequence[int], with_values: bool) -> tuple[list[RowSection], int]:
    try:
        count, reserved = _SECTION.unpack_from(view, offset)
    except struct.error:
        raise MalformedFrame(f"a rows section of {len(view) - offset} bytes has no head") from None
    if reserved or count > len(dims):
        raise MalformedFrame(f"a rows section names {count} tables; the model has {len(dims)}")
    offset += _SECTION.size
    previous, out = -1, []
    for _ in range(count):
        if offset + _BLOCK.size > len(view):
            raise MalformedFrame("a rows section is truncated")
        table, n = _BLOCK.unpack_from(view, offset)
        if not previous < table < len(dims):
            raise MalformedFrame(
                f"a rows section names table {table} out of order or unknown (the model has {len(dims)})"
            )
        previous = table
        size = _block_bytes(n, dims[table], with_values)
        if offset + size > len(view):
            raise MalformedFrame(f"table {table}: {n} ids need {size} bytes; the section has {len(view) - offset} left")
        start = offset + _BLOCK.size
        ids = np.frombuffer(view, np.int64, n, start)
        values = None
        if with_values:
            values = np.frombuffer(view, np.float32, n * dims[table], start + 8 * n).reshape(n, dims[table])
        out.append(RowSection(table, ids, values))
        offset += size
    return out, offset


def encode_rows_ref(length: int, segment_bytes: int, has_fd: bool) -> bytes:
    """A rows reference: ``length`` bytes of rows at the start of a segment of
    ``segment_bytes``, whose memfd comes with the frame when ``has_fd``."""
    return _REF.pack(length, segment_bytes, _REF_HAS_FD if has_fd else 0, 0)


def decode_rows_ref(payload: Any) -> tuple[int, int, bool]:
    """``(length, segment_bytes, has_fd)`` of a rows reference that fills ``payload``."""
    view = memoryview(payload).cast("B")
    if len(view) != _REF.size:
        raise MalformedFrame(f"a rows reference of {len(view)} bytes; it takes {_REF.size}")
    length, size, flags, reserved = _REF.unpack_from(view)
    if flags & ~_REF_HAS_FD or reserved:
        raise MalformedFrame(f"a rows reference with unknown flags {flags:#x} or reserved {reserved}")
    if length > size:
        raise MalformedFrame(f"a rows reference of {length} bytes in a segment of {size}")
    return length, size, bool(flags & _REF_HAS_FD)
