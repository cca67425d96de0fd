"""What every handler is and is handed (aps.server.requests.base).

Seams: :class:`Request`'s derived fields (``rid``, ``rows``, ``dense_reply``, ``weights_dtype``
for narrowed pulls) and :meth:`Request.end_intake` (an INIT's registration given back);
:func:`read_whole`'s limits and messages; :func:`check_gradient_dtype` (16-bit gradients over a
compressed transport only, the element size noted); :class:`Handler`'s defaults (``admit``: no
payload, or a small one read whole; ``more``: the rest dropped); the handler table."""

import pytest

from aps.errors import DTypeMismatch, MalformedFrame
from aps.layout import Layout
from aps.server.requests import HANDLERS, Handler, Request
from aps.server.requests.base import check_gradient_dtype, dtype_name, op_name, read_whole
from aps.server.requests.intake import InitIntake
from aps.server.requests.run import Shards
from aps.server.requests.training import Ping
from aps.wire.protocol import REQUEST_OPS, DType, Flag, Header, Op

from .conftest import FakeTransport


def header(op, *, flags=0, dtype=DType.FLOAT32, rid=5, length=0, clock=0, version=0):
    return Header(op, flags, dtype, rid, clock, version, length)


# Request ---------------------------------------------------------------------------------
def test_a_request_reads_its_id_and_op_from_its_header():
    request = Request(header(Op.PUSH, rid=41), HANDLERS[Op.PUSH])
    assert (request.rid, request.op, request.handler) == (41, Op.PUSH, HANDLERS[Op.PUSH])
    assert request.error is None and request.stream is None and request.intake is None and request.rows_at is None
    assert request.grad_shift == 2 and not request.dropped


@pytest.mark.parametrize("flags, dtype, rows, dense", [
    (0, DType.FLOAT32, False, True),
    (Flag.ROWS, DType.FLOAT32, True, True),  # a dense part and rows
    (Flag.ROWS, DType.NONE, True, False),  # rows alone: the reply carries no weights
    (0, DType.NONE, False, True),  # (no rows: the weights, whatever the dtype says)
])
def test_rows_and_dense_reply_follow_the_rows_flag_and_the_dtype(flags, dtype, rows, dense):
    request = Request(header(Op.PULL, flags=flags, dtype=dtype), HANDLERS[Op.PULL])
    assert request.rows is rows and request.dense_reply is dense


@pytest.mark.parametrize("op, flags, dtype, expected", [
    (Op.PULL, Flag.NARROW, DType.BFLOAT16, DType.BFLOAT16),
    (Op.PUSH_PULL, Flag.NARROW, DType.FLOAT16, DType.FLOAT16),
    (Op.PULL, 0, DType.BFLOAT16, DType.FLOAT32),  # not narrowed: the dtype is the gradient's, not the reply's
    (Op.PUSH_PULL, 0, DType.FLOAT16, DType.FLOAT32),
    (Op.PUSH, Flag.NARROW, DType.BFLOAT16, DType.FLOAT32),  # a push is answered without weights
    (Op.INIT, Flag.NARROW, DType.BFLOAT16, DType.FLOAT32),
])
def test_the_weights_dtype_is_the_requests_only_for_a_narrowed_pull(op, flags, dtype, expected):
    assert Request(header(op, flags=flags, dtype=dtype), HANDLERS[op]).weights_dtype == expected


def test_end_intake_lets_go_of_an_init_and_of_the_registration_it_held(engine, conn):
    """A registering INIT that ends before its values made it in: others may register now."""
    layout = Layout(("w",), ((4,),))
    request = Request(header(Op.INIT, length=64), HANDLERS[Op.INIT])
    intake = request.intake = InitIntake(16 << 10, conn.guard)
    budget = conn.guard.layout_free
    intake.next_piece(0)
    intake.next_piece(8 << 10)  # (a second piece is drawn from the layout budget)
    assert conn.guard.layout_free == budget - (8 << 10)
    assert engine.membership.claim_registration(layout, conn)
    intake.registering = True
    assert engine.membership.registering and not engine.membership.claim_registration(layout, object())
    request.end_intake(engine, conn)
    assert request.intake is None and intake.pieces == []
    assert conn.guard.layout_free == budget
    assert not engine.membership.registering and engine.membership.claim_registration(layout, object())


def test_end_intake_keeps_a_registration_it_does_not_hold(engine, conn):
    layout = Layout(("w",), ((4,),))
    other = object()
    assert engine.membership.claim_registration(layout, other)
    request = Request(header(Op.INIT, length=64), HANDLERS[Op.INIT])
    request.intake = InitIntake(64, conn.guard)  # (not registering: it joins the model another provides)
    request.end_intake(engine, conn)
    assert engine.membership.registering


# read_whole ---------------------------------------------------------------------------------
def test_read_whole_gives_room_for_exactly_the_payload():
    room = read_whole(header(Op.SHARDS, length=100), 1000)
    assert isinstance(room, memoryview) and len(room) == 100 and not room.readonly
    assert read_whole(header(Op.SHARDS, length=0), 1000) is None  # nothing to read
    assert read_whole(header(Op.PING, length=0), 0) is None


def test_read_whole_refuses_a_payload_where_none_is_carried():
    with pytest.raises(MalformedFrame, match=r"^PING carries no payload, got 3 bytes$"):
        read_whole(header(Op.PING, length=3), 0)


def test_read_whole_refuses_more_than_the_limit_and_less_than_the_least():
    with pytest.raises(MalformedFrame, match=r"^SHARDS carries 10 bytes at most, got 11$"):
        read_whole(header(Op.SHARDS, length=11), 10)
    assert len(read_whole(header(Op.AUTH, length=10), 10, 4)) == 10
    assert len(read_whole(header(Op.AUTH, length=4), 10, 4)) == 4
    with pytest.raises(MalformedFrame, match=r"got 3$"):
        read_whole(header(Op.AUTH, length=3), 10, 4)


def test_read_whole_names_an_unknown_op_by_its_code():
    with pytest.raises(MalformedFrame, match=r"^op 99 carries no payload"):
        read_whole(header(99, length=1), 0)
    assert op_name(99) == "op 99" and op_name(Op.PUSH) == "PUSH"
    assert dtype_name(DType.BFLOAT16) == "bfloat16" and dtype_name(42) == "unknown dtype code 42"


# check_gradient_dtype ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
def test_half_precision_gradients_cross_a_compressed_transport(dtype):
    request = Request(header(Op.PUSH, dtype=dtype), HANDLERS[Op.PUSH])
    check_gradient_dtype(FakeTransport(compressed=True), request)
    assert request.grad_shift == 1  # two bytes an element: the stream feeds whole elements


@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
def test_half_precision_gradients_are_refused_over_an_uncompressed_transport(dtype):
    request = Request(header(Op.PUSH, dtype=dtype), HANDLERS[Op.PUSH])
    with pytest.raises(DTypeMismatch, match=rf"^gradient dtype is {DType(dtype).name.lower()}; the model is float32 "
                                            r"\(16-bit gradients cross TCP only, not shm\)$"):
        check_gradient_dtype(FakeTransport(kind="shm", compressed=False), request)


@pytest.mark.parametrize("compressed", [True, False])
def test_float32_gradients_cross_any_transport_and_others_none(compressed):
    transport = FakeTransport(compressed=compressed)
    request = Request(header(Op.PUSH, dtype=DType.FLOAT32), HANDLERS[Op.PUSH])
    request.grad_shift = 0
    check_gradient_dtype(transport, request)
    assert request.grad_shift == 2
    for dtype in (DType.FLOAT64, DType.INT32, DType.NONE, 77):
        with pytest.raises(DTypeMismatch, match=r"the model is float32$"):  # (no word of TCP: no transport takes it)
            check_gradient_dtype(transport, Request(header(Op.PUSH, dtype=dtype), HANDLERS[Op.PUSH]))


# Handler ---------------------------------------------------------------------------------------
def test_a_handler_without_a_payload_admits_none_and_refuses_one(conn):
    ping = Ping()
    assert ping.payload_limit == 0 and not ping.carries_rows
    assert ping.admit(conn, Request(header(Op.PING), ping)) is None
    with pytest.raises(MalformedFrame, match="PING carries no payload, got 8 bytes"):
        ping.admit(conn, Request(header(Op.PING, length=8), ping))


def test_a_handler_with_a_small_payload_reads_it_whole_and_drops_nothing_more(conn):
    shards = Shards()
    request = Request(header(Op.SHARDS, length=20), shards)
    room = shards.admit(conn, request)
    assert len(room) == 20
    assert shards.more(conn, request, 20) is None  # (the default: whatever is left is dropped)
    with pytest.raises(MalformedFrame, match="at most"):
        shards.admit(conn, Request(header(Op.SHARDS, length=shards.payload_limit + 1), shards))


def test_a_handler_must_say_how_it_handles():
    class Half(Handler):
        op = Op.PING

    with pytest.raises(TypeError):
        Half()


def test_every_request_op_has_one_handler_of_its_own_and_no_reply_has_one():
    assert set(HANDLERS) == set(REQUEST_OPS)
    assert all(handler.op == op and isinstance(handler, Handler) for op, handler in HANDLERS.items())
    assert len({type(handler) for handler in HANDLERS.values()}) == len(HANDLERS)
    assert not {Op.PUSH_REPLY, Op.ERROR, Op.ALIVE} & set(HANDLERS)
    assert {op for op, handler in HANDLERS.items() if handler.carries_rows} == {Op.PULL, Op.PUSH, Op.PUSH_PULL}

