"""The TCP transport, server side (aps.server.tcp.TcpTransport), over a fake asyncio transport.

Seams: ``connection_made`` (the peer's name, a write buffer whose high-water mark is 0, the
receiver asked to take the connection); ``send_weights`` (one frame: header, the slot's
bytes, the rows; the snapshot released at once when the socket took everything, else leased
until ``resume_writing`` says it has left, or the connection is lost; narrowed weights are
their own copy: released at once, the header saying their dtype); ``write_parts``;
``gradient_destination`` (the member's receive buffer, its size checked: PayloadSizeMismatch
and its message; with rows, at least its size); the rows in the frames."""


import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import PayloadSizeMismatch
from aps.server.connection import Connection
from aps.server.engine import Engine
from aps.server.tcp import TcpTransport
from aps.wire.protocol import HEADER_SIZE, DType, Flag, Header, Op, unpack_header

from .test_connection import FakeTransport, feed, init_frame


@pytest.fixture
def engine(loop):
    return Engine(ServerConfig(workers=1, sync="asp"))


class FakeSnap:
    """A lease on weights: its bytes, and how often it was released."""

    def __init__(self, values, version=3):
        self.array = np.asarray(values, np.float32)
        self.bytes = memoryview(self.array).cast("B")
        self.version = version
        self.released = 0

    def release(self):
        self.released += 1


class Refusing:
    """A receiver that takes no connection."""

    authenticated = True
    asked = 0

    def opened(self):
        self.asked += 1
        return False


def connect(engine):
    tcp = TcpTransport(engine.stats.traffic["tcp"], 0, lambda t: Connection(engine, t, 1 << 20, set()))
    sock = FakeTransport()
    limits = []
    sock.set_write_buffer_limits = lambda high=None, low=None: limits.append(high)
    tcp.connection_made(sock)
    assert limits == [0]  # (pause_writing/resume_writing: "something is unsent" / "everything left")
    return tcp, sock


def test_a_connection_is_named_by_its_peer_and_taken_by_its_receiver(engine):
    tcp, _ = connect(engine)
    assert tcp.peer == "127.0.0.1:9" and tcp.receiver in tcp.receiver.registry
    assert tcp.can_write() and not tcp.writing and tcp.kind == "tcp" and tcp.compressed


def test_the_receiver_is_asked_once_the_peer_is_known(loop):
    tcp = TcpTransport(Engine(ServerConfig(workers=1)).stats.traffic["tcp"], 0, lambda t: Refusing())
    assert tcp.receiver.asked == 0
    tcp.connection_made(FakeTransport())
    assert tcp.receiver.asked == 1 and tcp.peer == "127.0.0.1:9"


# send_weights and its leases ----------------------------------------------------------------------
def test_weights_leave_as_one_frame_and_their_snapshot_is_released_when_all_left(engine):
    tcp, sock = connect(engine)
    snap = FakeSnap(np.arange(4), version=5)
    before = tcp.traffic.bytes_out
    tcp.send_weights(Op.PULL_REPLY, 12, snap, 2, Flag.ROWS, 1, rows=(b"r" * 8,))
    header = unpack_header(sock.out)
    assert (header.op, header.request_id, header.clock, header.version, header.flags, header.live) == \
        (Op.PULL_REPLY, 12, 2, 5, Flag.ROWS, 1)
    assert header.dtype == DType.FLOAT32 and header.length == 16 + 8
    assert bytes(sock.out[HEADER_SIZE:]) == np.arange(4, dtype=np.float32).tobytes() + b"r" * 8
    assert tcp.traffic.bytes_out - before == HEADER_SIZE + 24
    assert snap.released == 1  # (the socket took it all: nothing holds the slot)


def test_a_snapshot_is_leased_until_its_reply_has_left(engine):
    tcp, sock = connect(engine)
    sock.buffered = 100  # the socket holds part of it
    snap = FakeSnap(np.ones(4))
    tcp.pause_writing()
    tcp.send_weights(Op.PULL_REPLY, 1, snap, 0, 0, 1)
    assert snap.released == 0 and tcp.writing
    sock.buffered = 0
    tcp.resume_writing()
    assert snap.released == 1 and not tcp.writing


def test_every_leased_snapshot_is_released_when_the_connection_is_lost(engine):
    tcp, sock = connect(engine)
    sock.buffered = 100
    snaps = [FakeSnap(np.ones(4)), FakeSnap(np.ones(4))]
    for snap in snaps:
        tcp.send_weights(Op.PULL_REPLY, 1, snap, 0, 0, 1)
    assert [snap.released for snap in snaps] == [0, 0]
    tcp.connection_lost(None)
    assert [snap.released for snap in snaps] == [1, 1] and tcp.receiver.lost


@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
def test_narrowed_weights_are_their_own_copy_and_hold_no_lease(engine, dtype):
    tcp, sock = connect(engine)
    sock.buffered = 100  # (even with bytes still unsent)
    snap = FakeSnap(np.ones(4), version=9)
    words = np.array([1, 2, 3, 4], np.uint16)
    tcp.send_weights(Op.PUSH_PULL_REPLY, 4, snap, 1, 0, 1, narrowed=words, dtype=dtype)
    header = unpack_header(sock.out)
    assert header.dtype == dtype and header.length == 8 and header.version == 9
    assert bytes(sock.out[HEADER_SIZE:]) == words.tobytes()
    assert snap.released == 1


def test_weights_not_narrowed_are_float32_whatever_is_asked(engine):
    tcp, sock = connect(engine)
    tcp.send_weights(Op.PULL_REPLY, 4, FakeSnap(np.ones(2)), 0, 0, 1, dtype=DType.BFLOAT16)
    assert unpack_header(sock.out).dtype == DType.FLOAT32 and unpack_header(sock.out).length == 8


def test_a_frame_in_parts_is_written_in_order(engine):
    tcp, sock = connect(engine)
    tcp.write_parts((b"head", memoryview(b"body"), b"tail"))
    assert bytes(sock.out) == b"headbodytail"


# gradient_destination ----------------------------------------------------------------------------
N = 16


@pytest.fixture
def member(engine, loop):
    tcp, _ = connect(engine)
    feed(tcp, init_frame(0, 1, N))
    return tcp, engine.roster.members[0]


def push_header(length, dtype=DType.FLOAT32, op=Op.PUSH):
    return Header(op, 0, dtype, 1, 0, 0, length)


def test_a_gradient_goes_straight_into_the_members_receive_buffer(member):
    tcp, m = member
    dest = tcp.gradient_destination(m, push_header(4 * N))
    assert len(dest) == 4 * N
    dest[:] = np.full(N, 2.0, np.float32).tobytes()
    assert (m.grad == 2).all()
    assert len(tcp.gradient_destination(m, push_header(2 * N, DType.BFLOAT16))) == 2 * N


@pytest.mark.parametrize("length, dtype, message", [
    (4 * N + 4, DType.FLOAT32, f"^gradient of {4 * N + 4} bytes; the registered model has {4 * N} bytes$"),
    (4 * N - 4, DType.FLOAT32, f"^gradient of {4 * N - 4} bytes; the registered model has {4 * N} bytes$"),
    (4 * N, DType.BFLOAT16, f"^gradient of {4 * N} bytes; the registered model has {2 * N} bytes as bfloat16$"),
])
def test_a_gradient_of_another_size_than_the_models_is_refused(member, length, dtype, message):
    tcp, m = member
    with pytest.raises(PayloadSizeMismatch, match=message):
        tcp.gradient_destination(m, push_header(length, dtype))


def test_a_gradient_with_rows_is_at_least_the_models(member):
    tcp, m = member
    assert len(tcp.gradient_destination(m, push_header(4 * N + 64), rows=True)) == 4 * N
    with pytest.raises(PayloadSizeMismatch, match=r"has 64 bytes and rows after them$"):
        tcp.gradient_destination(m, push_header(4 * N - 4), rows=True)


def test_rows_travel_in_the_frames(engine):
    tcp, _ = connect(engine)
    tcp.check_rows_frame(push_header(3), 0)  # (any length)
    payload = memoryview(b"rows")
    assert tcp.rows_payload(payload) is payload and tcp.gradient_buffer(None) is None
    parts, fds = tcp.reply_rows([np.ones((1, 3), np.float32), np.ones((2, 2), np.float32)])
    assert fds == () and [len(part) for part in parts] == [12, 4, 16]  # (each block padded to 8 bytes)
