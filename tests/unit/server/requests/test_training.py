"""The requests of training (aps.server.requests.training): PING, INIT, PULL, PUSH,
PUSH_PULL, LEAVE and the weights replies they end with.

Seams: ``Ping.handle`` (the version); ``Init.admit`` (refused before anything is read: a
second INIT, a dtype, a payload or layout block of the wrong size; only the block's first
piece is made), ``Init.more`` (the block in pieces as it arrives; room for the values only
when this worker registers the model, else they are dropped; a join that cannot be is refused
before the values), ``Init.handle`` (the engine's join, the SEATED notice before the reply,
ANY_RANK without SEAT, the registration given back when it fails); ``check_narrowing``
(Pull.admit, PushPull.admit); ``gradient_destination`` (Push.admit, PushPull.admit: before
INIT, the dtype, the transport's destination, a streaming push); ``Pull.handle``,
``Push.handle``, ``PushPull.handle`` (the engine call and the reply: op, request id, clock,
version, DROPPED); ``reply_weights`` (narrowed to 16 bits); ``Leave.handle``."""

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import (
    DTypeMismatch,
    LayoutMismatch,
    MalformedFrame,
    NonFiniteGradient,
    NotInitialized,
    OutOfOrder,
    PayloadSizeMismatch,
    RankOutOfRange,
    ServerOverloaded,
    WorkerCountMismatch,
)
from aps.layout import Layout
from aps.server.engine import Engine
from aps.server.requests import HANDLERS, Request
from aps.server.requests.base import check_gradient_dtype
from aps.server.requests.intake import InitIntake
from aps.wire.protocol import ANY_RANK, DType, Flag, Op, decode_seated, encode_init, pack_header, unpack_header

from .conftest import Error, FakeExchange, FakeTransport, Notice, Reply, Weights, frame, init_frame, join, push_frame

N = 64


def admit(conn, data):
    """The header of frame ``data`` arrives: its request, and where ``admit`` puts its payload."""
    header = unpack_header(data)
    request = Request(header, HANDLERS[header.op])
    return request, request.handler.admit(conn, request)


def bf16(values):
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # (exact for these values)


# PING ----------------------------------------------------------------------------------------
def test_ping_says_the_models_version(conn, engine):
    conn.feed(frame(Op.PING, rid=3))
    assert conn.sent == [Reply(Op.PING_REPLY, 3, version=0)] and conn.dones == [True]
    join(conn, N)
    conn.feed(push_frame(Op.PUSH, N))
    conn.feed(frame(Op.PING, rid=4))
    assert conn.last == Reply(Op.PING_REPLY, 4, version=1) and engine.version == 1


# INIT: admit ------------------------------------------------------------------------------------
def test_init_admits_only_the_first_piece_of_its_layout_block(conn):
    data = init_frame(N)
    request, room = admit(conn, data)
    block = unpack_header(data).version
    assert isinstance(request.intake, InitIntake) and len(room) == block  # (a small block: one piece)
    assert request.intake.values is None and not request.intake.registering


@pytest.mark.parametrize("change, error, message", [
    (dict(dtype=DType.FLOAT16), DTypeMismatch, "initial weights dtype is float16"),
    (dict(length=8), MalformedFrame, "INIT payload of 8 bytes is too short"),
    (dict(version=12), MalformedFrame, "a multiple of 8"),  # the block's length: not 8-aligned
    (dict(version=8), MalformedFrame, "INIT layout block of 8 bytes"),  # shorter than its head
    (dict(version=1 << 30), MalformedFrame, "INIT layout block of"),  # longer than the payload
])
def test_init_is_refused_before_anything_is_read(conn, change, error, message):
    data = init_frame(N)
    fields = unpack_header(data)._replace(**change)
    header = pack_header(fields.op, fields.flags, fields.dtype, fields.request_id, fields.clock, fields.version,
                         fields.length)
    with pytest.raises(error, match=message):
        admit(conn, header)


def test_a_second_init_on_a_connection_is_out_of_order(conn):
    join(conn, N)
    with pytest.raises(OutOfOrder, match="already joined as rank 0"):
        admit(conn, init_frame(N))
    conn.feed(init_frame(N, rid=5))
    assert conn.sent == [Error(5, conn.last.exc)] and isinstance(conn.last.exc, OutOfOrder)


# INIT: more ------------------------------------------------------------------------------------
def test_a_large_layout_block_is_read_in_pieces_as_it_arrives(conn, engine):
    layout = Layout(tuple(f"tensor_with_a_long_name_{i:05d}" for i in range(5000)), ((1,),) * 5000)
    block = len(encode_init(0, 1, layout))
    assert block > 2 * InitIntake.PIECE
    conn.feed(init_frame(0, layout=layout), piece=4096)
    pieces = [*range(InitIntake.PIECE, block, InitIntake.PIECE), block]  # (then the values)
    assert conn.asked[: len(pieces)] == pieces
    assert conn.last.op == Op.INIT_REPLY and engine.model.table.numel == 5000


def test_a_layout_block_past_the_servers_budget_is_refused_and_counted(conn, engine):
    layout = Layout(tuple(f"tensor_with_a_long_name_{i:05d}" for i in range(5000)), ((1,),) * 5000)
    conn.guard.layout_free = InitIntake.PIECE  # (what other INITs being read left of it)
    conn.feed(init_frame(0, layout=layout), piece=4096)
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, ServerOverloaded)
    assert conn.asked[:2] == [InitIntake.PIECE, 2 * InitIntake.PIECE]  # (the second piece drawn, the third refused)
    assert conn.guard.layout_free == InitIntake.PIECE and engine.stats.strangers["layout_refused"] == 1
    assert not engine.membership.registering and engine.model.table is None


def test_the_first_worker_registers_the_model_its_values_read_in_place(conn, engine):
    values = np.arange(N, dtype=np.float32)
    data = init_frame(N, values=values)
    block = unpack_header(data).version
    conn.feed(data[: 40 + block + 4])  # the block and a few values
    intake = conn.request.intake
    assert intake.registering and engine.membership.registering
    assert intake.values is not None and intake.values.shape == (N,) and intake.values[0] == 0
    conn.feed(data[40 + block + 4 :])
    assert isinstance(conn.last, Weights) and np.array_equal(conn.last.weights, values)
    assert np.array_equal(engine.weights, values)


def test_values_are_dropped_when_another_worker_registers_the_model(loop):
    """Rank 1's INIT arrives while rank 0's values are on their way: rank 1's are read and
    dropped (no room is made for them), and the model is rank 0's."""
    engine = Engine(ServerConfig(workers=2, sync="asp"))
    first, second = FakeExchange(engine, loop), FakeExchange(engine, loop)
    ones = init_frame(N, rank=0, workers=2, values=np.ones(N))
    block = unpack_header(ones).version
    first.feed(ones[: 40 + block])
    assert first.request.intake.registering
    second.feed(init_frame(N, rank=1, workers=2, values=np.full(N, 2.0)))
    assert second.asked == [block] and not second.request.intake.registering
    assert not second.sent  # (waits for the model)
    first.feed(ones[40 + block :])
    for conn in (first, second):
        assert conn.last.op == Op.INIT_REPLY and (conn.last.weights == 1).all()


def test_values_are_dropped_when_the_model_exists(loop):
    engine = Engine(ServerConfig(workers=2, sync="asp"))
    first, second = FakeExchange(engine, loop), FakeExchange(engine, loop)
    first.feed(init_frame(N, rank=0, workers=2, values=np.ones(N)))
    second.feed(init_frame(N, rank=1, workers=2, values=np.full(N, 5.0), rid=2))
    assert second.last.op == Op.INIT_REPLY and (second.last.weights == 1).all() and second.member.rank == 1
    assert not engine.membership.registering


@pytest.mark.parametrize("kwargs, error", [
    (dict(rank=3), RankOutOfRange),
    (dict(workers=2), WorkerCountMismatch),  # (the worker count of another run)
])
def test_a_join_that_cannot_be_is_refused_before_its_values(conn, engine, kwargs, error):
    conn.feed(init_frame(N, **kwargs))
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, error)
    assert conn.request.intake is None and not engine.membership.registering and engine.model.table is None


def test_values_of_the_wrong_size_are_refused(conn, engine):
    data = init_frame(N)
    block = unpack_header(data).version
    short = pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, block, block + 4 * N - 4) + data[40 : 40 + block + 4 * N - 4]
    conn.feed(short)
    assert isinstance(conn.last.exc, PayloadSizeMismatch) and "its layout needs 256" in conn.last.exc.message
    assert not engine.membership.registering and engine.model.table is None


def test_a_layout_other_than_the_models_is_refused_before_its_values(loop):
    engine = Engine(ServerConfig(workers=2, sync="asp"))
    first, second = FakeExchange(engine, loop), FakeExchange(engine, loop)
    first.feed(init_frame(N, workers=2))
    second.feed(init_frame(N + 1, rank=1, workers=2, rid=4))
    assert isinstance(second.last, Error) and isinstance(second.last.exc, LayoutMismatch) and second.last.rid == 4
    assert second.member is None and 1 not in engine.roster.members


def test_an_init_without_values_before_the_model_is_told_to_send_them(conn, engine):
    conn.feed(init_frame(N, with_values=False))
    assert isinstance(conn.last.exc, NotInitialized) and "send them" in conn.last.exc.message


# INIT: handle -------------------------------------------------------------------------------------
def test_init_joins_and_is_answered_with_the_weights(conn, engine):
    conn.feed(init_frame(N, values=np.full(N, 3.0), rid=11))
    reply = conn.last
    assert (reply.op, reply.rid, reply.version, reply.flags, reply.dtype) == (Op.INIT_REPLY, 11, 0, 0, DType.FLOAT32)
    assert (reply.weights == 3).all() and conn.member is engine.roster.members[0] and conn.dones == [True]
    assert conn.request.intake is None


def test_seat_asks_for_a_seated_notice_before_the_reply(loop):
    engine = Engine(ServerConfig(workers="2:3", sync="asp"))
    first, second = FakeExchange(engine, loop), FakeExchange(engine, loop)
    first.feed(init_frame(N, rank=ANY_RANK, workers=3, flags=Flag.SEAT, rid=1))
    assert not first.sent  # (it waits for the quorum)
    second.feed(init_frame(N, rank=ANY_RANK, workers=3, flags=Flag.SEAT, rid=2))
    seated = {}
    for conn in (first, second):
        assert conn.ops() == [Op.SEATED, Op.INIT_REPLY] and isinstance(conn.sent[0], Notice)
        rank, least, most = decode_seated(conn.sent[0].payload)
        assert rank == conn.member.rank and (least, most) == (2, 3)
        seated[rank] = conn
    assert sorted(seated) == [0, 1]


def test_any_rank_without_seat_is_refused_and_gives_the_registration_back(conn, engine):
    conn.feed(init_frame(N, rank=ANY_RANK))
    assert isinstance(conn.last.exc, MalformedFrame) and "Flag.SEAT" in conn.last.exc.message
    assert conn.member is None and not engine.membership.registering and engine.model.table is None
    join(conn, N)  # (another INIT may register it now)


# PULL ------------------------------------------------------------------------------------------
def test_pull_before_init_is_refused(conn):
    conn.feed(frame(Op.PULL, rid=2))
    assert isinstance(conn.last.exc, NotInitialized) and conn.last.rid == 2


def test_pull_answers_with_the_weights_and_their_version(conn, engine):
    join(conn, N, values=np.full(N, 2.0))
    conn.feed(push_frame(Op.PUSH, N, 0.5))
    conn.feed(frame(Op.PULL, rid=8))
    reply = conn.last
    assert (reply.op, reply.rid, reply.version, reply.flags) == (Op.PULL_REPLY, 8, 1, 0)
    assert (reply.weights == 1.5).all() and reply.narrowed is None


@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
def test_a_narrowed_pull_is_answered_in_16_bits(conn, dtype):
    join(conn, N, values=np.full(N, 1.5))
    conn.feed(frame(Op.PULL, flags=Flag.NARROW, dtype=dtype, rid=8))
    reply = conn.last
    assert reply.op == Op.PULL_REPLY and reply.dtype == dtype and reply.narrowed.dtype == np.uint16
    expected = bf16(np.full(N, 1.5)) if dtype == DType.BFLOAT16 else np.full(N, 1.5, np.float16).view(np.uint16)
    assert np.array_equal(reply.narrowed, expected)


@pytest.mark.parametrize("op", [Op.PULL, Op.PUSH_PULL])
def test_narrowing_is_16_bits_and_over_tcp_only(conn, engine, loop, op):
    join(conn, N)
    with pytest.raises(DTypeMismatch, match="a narrowed pull is BFLOAT16 or FLOAT16, not float32"):
        admit(conn, frame(op, flags=Flag.NARROW, dtype=DType.FLOAT32))
    shm = FakeExchange(engine, loop, FakeTransport(kind="shm", compressed=False))
    shm.member = conn.member
    with pytest.raises(DTypeMismatch, match="narrowed weights cross TCP only, not shm"):
        admit(shm, frame(op, flags=Flag.NARROW, dtype=DType.BFLOAT16))


def test_a_pull_carries_no_payload_without_rows(conn):
    join(conn, N)
    with pytest.raises(MalformedFrame, match="PULL carries no payload, got 8 bytes"):
        admit(conn, frame(Op.PULL, bytes(8)))


# PUSH, PUSH_PULL ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [Op.PUSH, Op.PUSH_PULL])
def test_a_push_before_init_is_refused_before_anything_is_read(conn, op):
    with pytest.raises(NotInitialized, match=f"{op.name} before a successful INIT"):
        admit(conn, push_frame(op, N))
    assert not conn.transport.destinations


def test_a_push_goes_where_the_transport_says(conn):
    join(conn, N)
    request, room = admit(conn, push_frame(Op.PUSH, N))
    assert conn.transport.destinations == [(Op.PUSH, 4 * N, False)]
    assert len(room) == 4 * N and request.grad_shift == 2 and request.stream is None
    request, room = admit(conn, push_frame(Op.PUSH, N // 2, dtype=DType.BFLOAT16))  # (2 bytes an element)
    assert len(room) == 2 * N and request.grad_shift == 1


def test_a_push_of_another_dtype_is_refused(conn):
    join(conn, N)
    with pytest.raises(DTypeMismatch, match="gradient dtype is float64"):
        admit(conn, push_frame(Op.PUSH, N, dtype=DType.FLOAT64))
    assert not conn.transport.destinations


def test_a_large_push_is_applied_while_it_arrives(loop):
    engine = Engine(ServerConfig(workers=1, sync="asp", lr=1.0, stream_min_bytes=1024))
    conn = FakeExchange(engine, loop)
    join(conn, 1024)
    request, _ = admit(conn, push_frame(Op.PUSH, 1024))
    assert request.stream is not None
    request.stream.abort()
    request, _ = admit(conn, push_frame(Op.PUSH, 16))  # (under stream_min_bytes: not worth it)
    assert request.stream is None


def test_push_is_answered_with_the_version_it_made(conn, engine):
    join(conn, N)
    conn.feed(push_frame(Op.PUSH, N, 2.0, rid=21, clock=0))
    assert conn.last == Reply(Op.PUSH_REPLY, 21, clock=1, version=1, flags=0)
    assert (engine.weights == -2).all() and conn.dones == [True]


def test_push_pull_is_answered_with_the_weights_after_its_push(conn, engine):
    join(conn, N)
    conn.feed(push_frame(Op.PUSH_PULL, N, 1.0, rid=22))
    reply = conn.last
    assert (reply.op, reply.rid, reply.version, reply.clock, reply.flags) == (Op.PUSH_PULL_REPLY, 22, 1, 1, 0)
    assert (reply.weights == -1).all() and len(conn.sent) == 1


@pytest.mark.parametrize("op, reply_op", [(Op.PUSH, Op.PUSH_REPLY), (Op.PUSH_PULL, Op.PUSH_PULL_REPLY)])
def test_a_dropped_push_says_so(loop, op, reply_op):
    """Beyond --staleness-cutoff: dropped, the weights unchanged, the reply flagged DROPPED."""
    engine = Engine(ServerConfig(workers=1, sync="asp", lr=1.0, staleness_cutoff=1))
    conn = FakeExchange(engine, loop)
    join(conn, N)
    for rid in (1, 2):
        conn.feed(push_frame(Op.PUSH, N, rid=rid, version=rid - 1))
    conn.feed(push_frame(op, N, rid=3, version=0))  # computed on version 0, the model is at 2
    assert conn.last.op == reply_op and conn.last.flags == Flag.DROPPED and conn.last.rid == 3
    assert engine.version == 2 and (engine.weights == -2).all()


def test_a_gradient_that_is_not_finite_is_refused(conn, engine):
    join(conn, N)
    conn.feed(push_frame(Op.PUSH, N, float("nan"), rid=5))
    assert isinstance(conn.last, Error) and conn.last.rid == 5 and engine.version == 0


# LEAVE -----------------------------------------------------------------------------------------
def test_leave_ends_the_membership(conn, engine):
    join(conn, N)
    conn.feed(frame(Op.LEAVE, flags=Flag.FINISHED, rid=30))
    assert conn.last == Reply(Op.LEAVE_REPLY, 30) and conn.member is None and 0 not in engine.roster.members
    conn.feed(frame(Op.LEAVE, rid=31))
    assert isinstance(conn.last.exc, NotInitialized)


# Quantized pushes -------------------------------------------------------------------------------
def _quantized(values: np.ndarray, dtype: int) -> tuple[bytes, np.ndarray]:
    from aps.wire.quantized import quantize

    payload, decoded = quantize(values, dtype)
    return payload.tobytes(), decoded


@pytest.mark.parametrize("dtype", [DType.INT8Q, DType.INT4Q])
def test_a_quantized_push_is_applied_as_its_decoded_values(conn, engine, dtype):
    n = 1000  # (four blocks, the last short)
    join(conn, n)
    values = np.random.default_rng(int(dtype)).standard_normal(n).astype(np.float32)
    payload, decoded = _quantized(values, dtype)
    request, room = admit(conn, frame(Op.PUSH, payload, dtype=dtype, rid=21))
    assert len(room) == len(payload) and request.stream is None
    conn.feed(frame(Op.PUSH, payload, dtype=dtype, rid=22))
    assert conn.last == Reply(Op.PUSH_REPLY, 22, clock=1, version=1, flags=0)
    np.testing.assert_array_equal(engine.weights, -decoded)  # (lr 1, SGD)


@pytest.mark.parametrize("scale, error, message", [
    (0.0, MalformedFrame, "scale 2 .* is 0.0"), (-1.0, MalformedFrame, "scale 2 .* is -1.0"),
    (np.inf, NonFiniteGradient, "scale 2 .* is inf.*changed nothing"),
    (np.nan, NonFiniteGradient, "scale 2 .* is nan.*changed nothing"),
])
def test_a_quantized_push_with_a_scale_not_finite_and_above_0_is_refused_and_changes_nothing(
    conn, engine, scale, error, message
):
    n = 1000
    join(conn, n)
    payload, _ = _quantized(np.ones(n, np.float32), DType.INT8Q)
    scales = bytearray(payload)
    scales[8:12] = np.float32(scale).tobytes()
    conn.feed(frame(Op.PUSH_PULL, bytes(scales), dtype=DType.INT8Q, rid=23))
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, error) and conn.last.rid == 23
    assert __import__("re").search(message, conn.last.exc.message), conn.last.exc.message
    assert engine.version == 0 and not engine.weights.any()
    conn.feed(frame(Op.PUSH, payload, dtype=DType.INT8Q, rid=24))  # (and the connection serves on)
    assert conn.last.op == Op.PUSH_REPLY and engine.version == 1


def test_a_quantized_push_over_shared_memory_or_with_rows_is_refused(loop, engine):
    shm = FakeExchange(engine, loop, FakeTransport(kind="shm", compressed=False))
    join(shm, 1000)
    payload, _ = _quantized(np.ones(1000, np.float32), DType.INT4Q)
    with pytest.raises(DTypeMismatch, match="quantized gradients cross TCP only, not shm"):
        admit(shm, frame(Op.PUSH, payload, dtype=DType.INT4Q))
    request = Request(unpack_header(frame(Op.PUSH, payload, dtype=DType.INT8Q, flags=Flag.ROWS)), HANDLERS[Op.PUSH])
    with pytest.raises(DTypeMismatch, match="a push with rows carries a float32 gradient, not int8q"):
        check_gradient_dtype(FakeTransport(), request)


def test_a_large_quantized_push_is_applied_whole_once_its_scales_are_checked(loop):
    engine = Engine(ServerConfig(workers=1, sync="asp", lr=1.0, stream_min_bytes=1024))
    conn = FakeExchange(engine, loop)
    join(conn, 4096)
    payload, _ = _quantized(np.ones(4096, np.float32), DType.INT8Q)
    request, _ = admit(conn, frame(Op.PUSH, payload, dtype=DType.INT8Q))
    assert len(payload) >= 1024 and request.stream is None
    request, _ = admit(conn, push_frame(Op.PUSH, 4096))  # (float32 of the same model: streamed)
    assert request.stream is not None
    request.stream.abort()
