"""The worker's side of rows, without a server: a request's rows checked and put in table
order, split over shards and put back where the caller's ids were, sent again exactly as
first sent after a lost reply, and asked for again by the pull that finishes a call after
a rejoin."""

from __future__ import annotations

import numpy as np
import pytest

from aps.client.core import _ClientCore
from aps.client.recovery import _after_recovery
from aps.client.rowsets import rows_call, split
from aps.errors import InvalidIds
from aps.layout import Layout
from aps.tables import Table, shard_of
from aps.wire.protocol import DType, Flag, Op, unpack_header
from aps.wire.rows import decode_request_rows

TABLES = {"items": Table(rows=10**9, dim=4), "tags": Table(rows=100, dim=2)}
LAYOUT = Layout.from_arrays({"w": np.zeros(8, np.float32)}, TABLES)


def test_a_call_is_checked_and_in_table_order():
    call = rows_call(LAYOUT, {"tags": ([3], np.ones((1, 2))), "items": ([7, 7], np.ones((2, 4), np.float32))},
                     {"tags": [1, 2], "items": [5]}, None, dense=False)
    assert [s.table for s in call.push] == [0, 1] and [s.table for s in call.pull] == [0, 1]
    assert call.names == ["items", "tags"] and [o.shape for o in call.outs] == [(1, 4), (2, 2)]
    assert call.push[1].values.dtype == np.float32  # (float64 rows converted once)
    with pytest.raises(InvalidIds, match="unknown table 'nope'"):
        rows_call(LAYOUT, None, {"nope": [1]}, None, dense=False)
    with pytest.raises(InvalidIds, match="out names tables that are not pulled"):
        rows_call(LAYOUT, None, {"items": [1]}, {"tags": np.empty((1, 2), np.float32)}, dense=False)
    with pytest.raises(InvalidIds, match=r"an \(ids, grads\) pair"):
        rows_call(LAYOUT, {"items": [1]}, None, None, dense=False)


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_a_call_split_over_shards_puts_every_row_back_in_place(shards):
    ids = np.random.default_rng(shards).integers(0, 10**6, 300)  # (ids x 10 + 3 exact in float32)
    call = rows_call(LAYOUT, {"items": (ids, np.arange(1200, dtype=np.float32).reshape(300, 4))},
                     {"items": ids, "tags": [5, 5, 9]}, None, dense=False)
    parts = split(call, shards, every=True)
    assert len(parts.calls) == shards and all(part is not None for part in parts.calls)
    owner = shard_of(ids, shards)
    for shard, part in enumerate(parts.calls):
        (pushed,) = [s for s in part.push if s.table == 0] or [None]
        mine = owner == shard
        assert np.array_equal(pushed.ids, ids[mine]) and np.array_equal(pushed.values, call.push[0].values[mine])
        for name, out in zip(part.names, part.outs):  # what a shard would answer: its rows, as asked
            section = part.pull[part.names.index(name)]
            out[:] = section.ids[:, None] * 10.0 + np.arange(out.shape[1])
    parts.gather(call)
    assert np.array_equal(call.outs[0], ids[:, None] * 10.0 + np.arange(4))
    assert np.array_equal(call.outs[1], np.array([[50, 51], [50, 51], [90, 91]], np.float32))
    alone = split(rows_call(LAYOUT, None, {"tags": [1]}, None, dense=False), shards, every=False)
    assert sum(part is not None for part in alone.calls) == 1  # a pull of rows alone: its shard only


def test_a_push_with_rows_is_sent_again_exactly_as_first_sent():
    core = _ClientCore(0, 1)
    core.init_request({"w": np.zeros(8, np.float32)}, tables=TABLES)
    call = rows_call(core.layout, {"items": ([4, 4, 9], np.ones((3, 4), np.float32))}, {"tags": [1, 3]}, None,
                     dense=True)
    first = core.push_request(np.ones(8, np.float32), then_pull=True, rows=call)
    again = core.resend_push()
    head = unpack_header(first[0])
    assert head == unpack_header(again[0]) and head.flags & Flag.ROWS and head.dtype == DType.FLOAT32
    payload = b"".join(bytes(part) for part in first[1:])
    assert payload == b"".join(bytes(part) for part in again[1:]) and len(payload) == head.length
    pushed, pulled = decode_request_rows(payload[32:], LAYOUT.table_dims, True, True)
    assert pushed[0].ids.tolist() == [4, 4, 9] and pulled[0].ids.tolist() == [1, 3]


def test_a_pull_that_finishes_a_call_after_a_rejoin_asks_for_its_rows_again():
    core = _ClientCore(0, 1)
    core.init_request({"w": np.zeros(8, np.float32)}, tables=TABLES)
    core.begin_call()
    call = rows_call(core.layout, {"items": ([4], np.ones((1, 4), np.float32))}, {"tags": [7]}, None, dense=True)
    core.push_request(np.ones(8, np.float32), then_pull=True, rows=call)
    core.version = 0
    core._push = (*core._push[:3], 5, *core._push[4:])  # computed on version 5: the server came back older
    kind, request = _after_recovery(core, "push_pull", None)
    assert kind == "pull"
    frames = request()
    head = unpack_header(frames[0])
    assert head.op == Op.PULL and head.flags & Flag.ROWS and head.dtype == DType.FLOAT32
    _, pulled = decode_request_rows(b"".join(bytes(f) for f in frames[1:]), LAYOUT.table_dims, False, True)
    assert pulled[0].ids.tolist() == [7]


def test_a_reply_that_does_not_carry_what_was_asked_for_is_refused():
    from aps.errors import MalformedFrame
    from aps.wire.protocol import pack_header, unpack_header as unpack

    core = _ClientCore(0, 1)
    core.init_request({"w": np.zeros(8, np.float32)}, tables=TABLES)
    core.begin_call()
    core.pull_request(rows_call(core.layout, None, {"tags": [1]}, None, dense=False))
    rid = unpack_header(core.pull_request()[0]).request_id
    for flags, dtype in ((0, DType.FLOAT32), (int(Flag.ROWS), DType.FLOAT32)):  # no rows; dense weights too
        header = unpack(pack_header(Op.PULL_REPLY, flags, dtype, rid, 0, 0, 32 + 8))
        with pytest.raises(MalformedFrame, match="does not carry what was asked for"):
            core.frame_buffer(header)


def test_gradient_rows_that_are_not_finite_are_refused_before_anything_is_sent():
    from aps.errors import NonFiniteGradient

    with pytest.raises(NonFiniteGradient, match="nothing was sent"):
        rows_call(LAYOUT, {"items": ([1], np.full((1, 4), np.inf, np.float32))}, None, None, dense=False)


@pytest.mark.parametrize("versioned", [True, False])
def test_a_reply_of_rows_alone_sets_the_version_unless_asked_not_to(versioned):
    from aps.wire.protocol import pack_header, unpack_header as unpack

    core = _ClientCore(0, 1)
    core.init_request({"w": np.zeros(8, np.float32)}, tables=TABLES)
    core.begin_call()
    call = rows_call(core.layout, None, {"tags": [1, 2]}, None, dense=False)._replace(versioned=versioned)
    rid = unpack_header(core.pull_request(call)[0]).request_id
    header = unpack(pack_header(Op.PULL_REPLY, int(Flag.ROWS), DType.NONE, rid, 4, 9, 16))
    assert len(core.frame_buffer(header)) == 0
    part = core.frame_more(header, 0)
    part[:] = np.arange(4, dtype=np.float32).tobytes()
    core.frame_received(header, part)
    core.finish()
    assert call.outs[0].tolist() == [[0.0, 1.0], [2.0, 3.0]] and core.clock == 4
    assert core.version == (9 if versioned else 0)
