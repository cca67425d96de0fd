"""The rows of a request and of its reply (aps.server.requests.rows), as PULL, PUSH and
PUSH_PULL use them over a transport that carries rows in its frames.

Seams: ``rows_destination`` (before INIT, a model without tables, too short for rows; a dense
part goes where a push's goes, the rows' offset noted, the transport's rows rule asked);
``rows_room`` (room made only when the rows begin); ``request_rows`` (the rows pushed,
checked; the ones pulled kept on the member); ``rows_of_reply`` (rows beside the weights, or
alone as the whole reply with the model's version; failures reading or sending them are the
reply)."""

import numpy as np
import pytest

from aps.errors import InternalServerError, InvalidIds, MalformedFrame, NotInitialized, ServerOverloaded
from aps.layout import Layout
from aps.server.requests import HANDLERS, Request
from aps.server.requests.rows import request_rows, rows_destination, rows_of_reply, rows_room
from aps.tables import Table
from aps.wire.protocol import DType, Flag, Op, pack_header, unpack_header
from aps.wire.rows import RowSection, encode_rows

from .conftest import Error, Reply, Weights, frame, join

N, DIM = 16, 4
LAYOUT = Layout(("w",), ((N,),), tables=(("items", Table(rows=100, dim=DIM, init="zeros", lr=1.0)),))


def pushed(ids, value=1.0):
    ids = np.asarray(ids, np.int64)
    return b"".join(bytes(part) for part in encode_rows([RowSection(0, ids, np.full((len(ids), DIM), value,
                                                                                     np.float32))], [DIM], True))


def pulled(ids):
    return b"".join(bytes(part) for part in encode_rows([RowSection(0, np.asarray(ids, np.int64), None)], [DIM],
                                                        False))


def rows_frame(op, rows, *, dense=None, rid=5, version=0):
    """A request with rows (Flag.ROWS): ``dense`` its dense gradient first (dtype NONE: none)."""
    payload = (b"" if dense is None else np.asarray(dense, np.float32).tobytes()) + rows
    dtype = DType.NONE if dense is None else DType.FLOAT32
    return pack_header(op, Flag.ROWS, dtype, rid, 0, version, len(payload)) + payload


def admit(conn, data):
    header = unpack_header(data)
    request = Request(header, HANDLERS[header.op])
    return request, rows_destination(conn, request)


@pytest.fixture
def member(conn):
    join(conn, N, layout=LAYOUT)
    return conn.member


class FakeSnap:
    version = 7

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


# rows_destination ------------------------------------------------------------------------------
def test_rows_before_init_are_refused(conn):
    with pytest.raises(NotInitialized, match="PULL before a successful INIT"):
        admit(conn, rows_frame(Op.PULL, pulled([1])))


def test_rows_of_a_model_without_tables_are_refused(conn):
    join(conn, N)
    with pytest.raises(InvalidIds, match="the model declares no tables"):
        admit(conn, rows_frame(Op.PULL, pulled([1])))


def test_a_request_too_short_for_its_rows_is_refused(conn, member):
    with pytest.raises(MalformedFrame, match="PULL with rows of 4 bytes: its rows need 8 at least"):
        admit(conn, pack_header(Op.PULL, Flag.ROWS, DType.NONE, 1, 0, 0, 4))
    with pytest.raises(MalformedFrame, match=f"PUSH with rows of {4 * N} bytes"):  # (its dense part alone)
        admit(conn, pack_header(Op.PUSH, Flag.ROWS, DType.FLOAT32, 1, 0, 0, 4 * N))


def test_a_push_with_rows_puts_its_dense_part_where_a_push_goes(conn, member):
    request, room = admit(conn, rows_frame(Op.PUSH, pushed([1, 2]), dense=np.ones(N)))
    assert len(room) == 4 * N and request.rows_at == 4 * N
    assert conn.transport.destinations == [(Op.PUSH, 4 * N + len(pushed([1, 2])), True)]
    assert conn.transport.rows_frames == [4 * N]  # (the transport's rule on the rows asked)


@pytest.mark.parametrize("op", [Op.PULL, Op.PUSH])
def test_rows_alone_begin_at_once(conn, member, op):
    request, room = admit(conn, rows_frame(op, pulled([1]) if op == Op.PULL else pushed([1])))
    assert request.rows_at == 0 and len(room) == 0 and not conn.transport.destinations
    assert conn.transport.rows_frames == [0]


def test_a_pull_with_a_dense_reply_reads_no_dense_part(conn, member):
    request, _ = admit(conn, rows_frame(Op.PULL, pulled([1]), dense=[]))  # (dtype FLOAT32: the weights too)
    assert request.rows_at == 0 and request.dense_reply and not conn.transport.destinations


# rows_room ------------------------------------------------------------------------------------
def test_room_for_rows_is_made_when_they_begin_and_not_before():
    header = unpack_header(pack_header(Op.PUSH, Flag.ROWS, DType.FLOAT32, 1, 0, 0, 64 + 40))
    request = Request(header, HANDLERS[Op.PUSH])
    assert rows_room(request, 0) is None  # (not admitted: no rows offset)
    request.rows_at = 64
    assert rows_room(request, 32) is None
    room = rows_room(request, 64)
    assert room.nbytes == 40 and not room.readonly


# request_rows -----------------------------------------------------------------------------------
def test_a_request_without_rows_has_none_and_forgets_the_last_ones(conn, member):
    member.rows_wanted, member.rows_out = ["asked"], ["read"]
    request = Request(unpack_header(frame(Op.PULL)), HANDLERS[Op.PULL])
    assert request_rows(conn, member, request, memoryview(b"")) == []
    assert member.rows_wanted is None and member.rows_out is None


def test_the_rows_pushed_are_returned_and_the_rows_pulled_kept_on_the_member(conn, member):
    rows = pushed([3, 4], 2.0) + pulled([9])
    request = Request(unpack_header(rows_frame(Op.PUSH_PULL, rows)), HANDLERS[Op.PUSH_PULL])
    sections = request_rows(conn, member, request, memoryview(rows))
    assert [list(section.ids) for section in sections] == [[3, 4]] and (sections[0].values == 2).all()
    assert [list(section.ids) for section in member.rows_wanted] == [[9]]


def test_ids_out_of_the_table_are_refused_before_anything_is_made_of_them(conn, member, engine):
    conn.feed(rows_frame(Op.PUSH, pushed([100]), rid=6))
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, InvalidIds) and conn.last.rid == 6
    assert engine.version == 0


# Through the handlers: rows beside the weights, and alone --------------------------------------------
def test_pushed_rows_are_applied_and_pulled_rows_answered_alone(conn, member, engine):
    conn.feed(rows_frame(Op.PUSH, pushed([3, 5], 1.0), rid=8))
    assert conn.last == Reply(Op.PUSH_REPLY, 8, clock=1, version=1, flags=0)
    conn.feed(rows_frame(Op.PULL, pulled([3, 7]), rid=9))
    reply = conn.last
    assert isinstance(reply, Reply) and (reply.op, reply.rid) == (Op.PULL_REPLY, 9)
    assert reply.flags == Flag.ROWS and reply.dtype == DType.NONE and reply.version == engine.version
    rows = np.frombuffer(reply.payload, np.float32).reshape(2, DIM)
    assert (rows[0] == -1).all() and (rows[1] == 0).all()  # id 3 pushed once at lr 1; id 7 never


def test_pulled_rows_follow_the_weights_in_a_dense_reply(conn, member):
    conn.feed(rows_frame(Op.PUSH_PULL, pushed([2], 0.5) + pulled([2]), dense=np.ones(N), rid=10))
    reply = conn.last
    assert isinstance(reply, Weights) and reply.op == Op.PUSH_PULL_REPLY and reply.flags == Flag.ROWS
    assert (reply.weights == -1).all() and (np.frombuffer(reply.rows, np.float32) == -0.5).all()


def test_rows_that_cannot_be_sent_are_the_replys_error(conn, member):
    conn.transport.rows_error = OSError("no room for a segment")
    conn.feed(rows_frame(Op.PULL, pulled([1]), rid=11))
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, InternalServerError)
    assert "sending the rows failed: no room for a segment" in conn.last.exc.message
    conn.transport.rows_error = ServerOverloaded("busy")
    conn.feed(rows_frame(Op.PULL, pulled([1]), rid=12))
    assert isinstance(conn.last.exc, ServerOverloaded) and conn.last.rid == 12  # (a ServerError as it is)


def test_rows_that_could_not_be_read_are_the_replys_error(conn, member):
    request = Request(unpack_header(rows_frame(Op.PULL, pulled([1]), rid=13)), HANDLERS[Op.PULL])
    member.rows_out = MemoryError("out of memory")
    snap = FakeSnap()
    assert rows_of_reply(conn, request, Op.PULL_REPLY, snap, 0, 0) is None
    assert snap.released == 1 and member.rows_out is None
    assert conn.last.rid == 13 and "reading the rows failed: MemoryError: out of memory" in conn.last.exc.message


def test_rows_beside_the_weights_are_handed_back_to_be_sent_with_them(conn, member):
    request = Request(unpack_header(rows_frame(Op.PULL, pulled([1]), dense=[])), HANDLERS[Op.PULL])
    member.rows_out = [np.full((1, DIM), 3.0, np.float32)]
    snap = FakeSnap()
    rows, fds = rows_of_reply(conn, request, Op.PULL_REPLY, snap, 0, 0)
    assert fds == () and (np.frombuffer(b"".join(bytes(p) for p in rows), np.float32) == 3).all()
    assert snap.released == 0 and not conn.sent  # (the weights reply sends them, and releases the snapshot)


def test_rows_alone_say_the_snapshots_version_and_release_it(conn, member):
    request = Request(unpack_header(rows_frame(Op.PULL, pulled([1]), rid=14)), HANDLERS[Op.PULL])
    member.rows_out = [np.full((1, DIM), 3.0, np.float32)]
    snap = FakeSnap()
    assert rows_of_reply(conn, request, Op.PULL_REPLY, snap, 4, Flag.DROPPED) is None
    assert snap.released == 1
    reply = conn.last
    assert (reply.op, reply.rid, reply.version, reply.clock) == (Op.PULL_REPLY, 14, 7, 4)
    assert reply.flags == Flag.ROWS | Flag.DROPPED and reply.dtype == DType.NONE and len(reply.payload) == 4 * DIM
