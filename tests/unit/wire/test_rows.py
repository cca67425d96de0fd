"""The wire format of embedding tables (aps.wire.rows): declarations and rows sections
round-trip, come back as views of the buffer, and any malformed input is refused with
MalformedFrame, never another error."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aps.errors import MalformedFrame
from aps.tables import Table
from aps.wire.rows import (
    MAX_TABLES,
    RowSection,
    decode_rows,
    decode_tables,
    encode_rows,
    encode_tables,
    rows_bytes,
)

TABLES = {"items": Table(rows=10**9, dim=3, optimizer="adagrad", lr=0.05),
          "users": Table(rows=50, dim=2, init="zeros", optimizer="adam"), "ünïcode": Table(rows=7, dim=1)}
DIMS = [3, 2, 1]


def joined(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def test_declarations_round_trip_in_order():
    block = b"head" + encode_tables(TABLES) + b"tail"
    tables, end = decode_tables(block, 4, 3)
    assert tables == TABLES and list(tables) == list(TABLES) and block[end:] == b"tail"
    assert decode_tables(b"", 0, 0) == ({}, 0)


def declaration(name: bytes, description: bytes) -> bytes:
    return struct.pack("<H", len(name)) + name + struct.pack("<I", len(description)) + description


@pytest.mark.parametrize(("block", "count", "message"), [
    (b"", MAX_TABLES + 1, "at most 1024"),
    (declaration(b"", b"{}"), 1, "name of 0 bytes"),
    (declaration(b"t", b"{}")[:-1], 1, "truncated"),
    (declaration(b"t", b"{not json"), 1, "cannot be parsed"),
    (declaration(b"t", json.dumps({"rows": 0, "dim": 1}).encode()), 1, "rows=0"),
    (declaration(b"t", json.dumps({"rows": 1, "dim": 1, "colour": 2}).encode()), 1, "unknown fields"),
    (declaration(b"t", b"[1, 2]"), 1, "JSON object"),
    (declaration(b"\xff", b"{}"), 1, "cannot be parsed"),
    (declaration(b"t", b"x" * 5000), 1, "at most 4096"),
    (2 * declaration(b"t", json.dumps(Table(rows=1, dim=1).describe()).encode()), 2, "declared twice"),
    (declaration(b"a/b", json.dumps(Table(rows=1, dim=1).describe()).encode()), 1, "holds a '/'"),
    (declaration(b"t", b"[" * 3000), 1, "cannot be parsed"),
    (declaration(b"t", b'{"rows": 1, "dim": 1, "lr": 1' + b"0" * 400 + b"}"), 1, "cannot be parsed"),
])
def test_bad_declarations_are_malformed_frames(block, count, message):
    with pytest.raises(MalformedFrame, match=message):
        decode_tables(block, 0, count)


@pytest.mark.parametrize("with_values", [True, False])
def test_a_rows_section_round_trips_as_views(with_values):
    rng = np.random.default_rng(0)
    sections = [RowSection(0, np.array([5, 10**8, 5], np.int64), rng.standard_normal((3, 3)).astype(np.float32)),
                RowSection(2, np.array([6], np.int64), np.ones((1, 1), np.float32))]
    wire = joined(encode_rows(sections, DIMS, with_values))
    assert len(wire) == rows_bytes({0: 3, 2: 1}, DIMS, with_values) and len(wire) % 8 == 0
    got = decode_rows(wire, DIMS, with_values)
    assert [s.table for s in got] == [0, 2]
    for mine, theirs in zip(got, sections):
        assert np.array_equal(mine.ids, theirs.ids)
        if with_values:
            assert np.array_equal(mine.values, theirs.values)
        else:
            assert mine.values is None
    buffer = bytearray(wire)
    assert np.shares_memory(decode_rows(buffer, DIMS, with_values)[0].ids, np.frombuffer(buffer, np.uint8))
    assert decode_rows(joined(encode_rows([], DIMS, True)), DIMS, True) == []


def section(*blocks: tuple[int, int], extra: bytes = b"", count: int | None = None, reserved: int = 0) -> bytes:
    head = struct.pack("<II", len(blocks) if count is None else count, reserved)
    return head + b"".join(struct.pack("<II", t, n) + b"\0" * (8 * n + 4 * n * DIMS[t] + (4 * n * DIMS[t]) % 8)
                           for t, n in blocks) + extra


@pytest.mark.parametrize(("wire", "message"), [
    (b"\0" * 4, "has no head"),
    (section(count=4), "names 4 tables; the model has 3"),
    (section(reserved=1), "names 0 tables"),
    (section((1, 1), (0, 1)), "table 0 out of order"),
    (section((1, 1), (1, 1)), "table 1 out of order"),
    (struct.pack("<II", 1, 0) + struct.pack("<II", 3, 1), "table 3 out of order or unknown"),
    (section((0, 2))[:-1], "2 ids need 48 bytes; the section has 47 left"),
    (section((0, 1), extra=b"\0" * 8), "of 48 bytes holds 40 bytes of rows"),
    (struct.pack("<II", 1, 0) + struct.pack("<II", 0, 2**32 - 1), "4294967295 ids need"),
    (struct.pack("<II", 2, 0) + struct.pack("<II", 0, 0), "truncated"),
])
def test_bad_rows_sections_are_malformed_frames(wire, message):
    with pytest.raises(MalformedFrame, match=message):
        decode_rows(wire, DIMS, True)


@given(st.binary(max_size=300), st.lists(st.integers(1, 5), min_size=0, max_size=4), st.booleans())
def test_garbage_never_raises_anything_but_a_malformed_frame(wire, dims, with_values):
    try:
        sections = decode_rows(wire, dims, with_values)
    except MalformedFrame:
        return
    assert rows_bytes({s.table: len(s.ids) for s in sections}, dims, with_values) == len(wire)


@given(st.binary(max_size=300), st.integers(0, 3))
def test_garbage_declarations_never_raise_anything_but_a_malformed_frame(block, count):
    try:
        decode_tables(block, 0, count)
    except MalformedFrame:
        pass


def test_what_cannot_be_encoded_is_refused_before_sending():
    ids = np.array([1], np.int64)
    with pytest.raises(ValueError, match="increasing order"):
        encode_rows([RowSection(1, ids, None), RowSection(0, ids, None)], DIMS, False)
    with pytest.raises(ValueError, match="vector of int64"):
        encode_rows([RowSection(0, ids.astype(np.int32), None)], DIMS, False)
    with pytest.raises(ValueError, match=r"float32 of shape \(1, 3\)"):
        encode_rows([RowSection(0, ids, np.ones((1, 2), np.float32))], DIMS, True)


def test_a_rows_reference_round_trips_and_a_bad_one_is_a_malformed_frame():
    from aps.wire.rows import ROWS_REF_BYTES, decode_rows_ref, encode_rows_ref

    assert decode_rows_ref(encode_rows_ref(100, 4096, True)) == (100, 4096, True)
    assert decode_rows_ref(encode_rows_ref(0, 0, False)) == (0, 0, False)
    assert len(encode_rows_ref(1, 2, False)) == ROWS_REF_BYTES
    for wire, message in [(encode_rows_ref(1, 2, False)[:-1], "of 23 bytes"),
                          (encode_rows_ref(5, 4, False), "of 5 bytes in a segment of 4"),
                          (struct.pack("<QQII", 1, 2, 2, 0), "unknown flags"),
                          (struct.pack("<QQII", 1, 2, 0, 9), "reserved 9")]:
        with pytest.raises(MalformedFrame, match=message):
            decode_rows_ref(wire)
