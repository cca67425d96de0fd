"""The connection (aps.server.connection) driven by hand through its TCP transport over a fake asyncio transport.

Seams: ``frame_buffer`` (the op looked up in the handler table: an unknown op, a reply's op,
rows on an op that carries none are refused, their payload dropped, and the connection goes
on); ``_serve`` (a handler's ServerError is the request's reply, any other failure an
internal error; MAX_BAD_FRAMES refused in a row close the connection); ``done`` (the next
frame waits until the reply has left); ``payload_progress`` (a streaming push fed as it
arrives); ``connection_lost`` (a request in the engine's lane finishes without its
connection). The handshake through a connection: tests/unit/server/requests/test_handshake.py."""

import asyncio

import numpy as np
import pytest

from aps.server.engine import Engine
from aps.config import ServerConfig
from aps.errors import ErrorCode
from aps.layout import Layout
from aps.wire.protocol import HEADER_SIZE, DType, Flag, Op, decode_error, encode_init, pack_header, unpack_header
from aps.server.connection import MAX_BAD_FRAMES, Connection
from aps.server.requests.training import Ping
from aps.server.tcp import TcpTransport


class FakeTransport:
    def __init__(self):
        self.out = bytearray()
        self.closed = False
        self.buffered = 0  # pretend this many bytes are still unsent

    def get_extra_info(self, key):
        return ("127.0.0.1", 9) if key == "peername" else None

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def write(self, data):
        self.out += data

    def writelines(self, parts):
        for part in parts:
            self.out += part

    def get_write_buffer_size(self):
        return self.buffered

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def replies(self):
        headers, pos = [], 0
        while pos < len(self.out):
            header = unpack_header(self.out[pos : pos + HEADER_SIZE])
            headers.append(header)
            pos += HEADER_SIZE + header.length
        return headers


def connect(engine, loop):
    conn = TcpTransport(engine.stats.traffic["tcp"], 0,
                        lambda transport: Connection(engine, transport, 1 << 30, set()))
    transport = FakeTransport()
    conn.connection_made(transport)
    return conn, transport


def feed(conn, data):
    view = memoryview(data)
    while len(view):
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        conn.buffer_updated(n)


def init_frame(rank, workers, n):
    layout = Layout(("w",), ((n,),))
    block = encode_init(rank, workers, layout)
    return pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, len(block), len(block) + 4 * n) + block + bytes(4 * n)


def push_frame(op, n, value=1.0, rid=2, version=0):
    payload = np.full(n, value, np.float32).tobytes()
    return pack_header(op, 0, DType.FLOAT32, rid, 0, version, len(payload)) + payload


def test_a_push_pull_finishing_after_its_connection_died_does_not_stall_others(loop, caplog):
    """The push commits (it was accepted), its reply has nowhere to go, and the
    other worker's push behind it in the lane is answered."""
    kernels = []
    engine = Engine(ServerConfig(workers=2, sync="asp", optimizer="adam"),
                    offload=lambda run, done: kernels.append((run, done)), offload_threshold=0)
    a, ta = connect(engine, loop)
    b, tb = connect(engine, loop)
    n = 64
    feed(a, init_frame(0, 2, n))
    feed(b, init_frame(1, 2, n))
    loop.run_until_complete(asyncio.sleep(0))  # rank 0's connection goes on reading after its init reply
    feed(a, push_frame(Op.PUSH_PULL, n))
    feed(b, push_frame(Op.PUSH_PULL, n))
    a.connection_lost(None)  # rank 0 dies while its push is in the lane
    while kernels:
        run, done = kernels.pop(0)
        done(run())
        loop.run_until_complete(asyncio.sleep(0))
    assert engine.version == 2 and engine.training.pushes == 2
    assert [h.op for h in tb.replies()] == [Op.INIT_REPLY, Op.PUSH_PULL_REPLY]
    assert 0 not in engine.roster.members and engine.idle
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "no internal error on the way"


def test_no_new_request_is_read_while_a_reply_is_still_leaving(loop):
    """A client that pipelines requests and reads nothing pins at most one reply."""
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    conn, transport = connect(engine, loop)
    n = 256
    feed(conn, init_frame(0, 1, n))
    transport.buffered = 1 << 20  # the client reads nothing: output piles up
    conn.pause_writing()
    pipelined = b"".join(push_frame(Op.PUSH, n, rid=10 + i) + pack_header(Op.PULL, request_id=100 + i) for i in range(20))
    feed(conn, pipelined)
    loop.run_until_complete(asyncio.sleep(0))
    assert [h.op for h in transport.replies()] == [Op.INIT_REPLY, Op.PUSH_REPLY]  # then it waits
    assert engine.model.table.slot_count <= 3
    transport.buffered = 0
    conn.resume_writing()  # the client caught up
    for _ in range(200):
        loop.run_until_complete(asyncio.sleep(0))
    assert len(transport.replies()) == 41
    assert engine.version == 20 and engine.model.table.slot_count <= 3


@pytest.mark.parametrize("threshold, streams", [(1 << 10, True), (0, False), (1 << 20, False)])
def test_stream_min_bytes_decides_which_gradients_are_applied_while_they_arrive(loop, threshold, streams):
    engine = Engine(ServerConfig(workers=1, sync="asp", lr=1.0, stream_min_bytes=threshold))
    conn, transport = connect(engine, loop)
    n = 4096  # 16 KiB
    feed(conn, init_frame(0, 1, n))
    frame = push_frame(Op.PUSH, n, value=1.0)
    feed(conn, frame[: HEADER_SIZE + 8 * 1024])  # half of the gradient has arrived
    assert (conn.receiver.request.stream is not None) == streams
    feed(conn, frame[HEADER_SIZE + 8 * 1024 :])
    loop.run_until_complete(asyncio.sleep(0))
    assert engine.version == 1 and (engine.weights == -1.0).all()  # the same update either way


def errors(transport):
    """The error frames sent: (request id, code, message)."""
    out, pos = [], 0
    while pos < len(transport.out):
        header = unpack_header(transport.out[pos : pos + HEADER_SIZE])
        if header.op == Op.ERROR:
            payload = transport.out[pos + HEADER_SIZE : pos + HEADER_SIZE + header.length]
            out.append((header.request_id, *decode_error(payload)))
        pos += HEADER_SIZE + header.length
    return out


def spin(loop, turns=50):
    for _ in range(turns):
        loop.run_until_complete(asyncio.sleep(0))


@pytest.mark.parametrize("op, flags, code, message", [
    (99, 0, ErrorCode.UNKNOWN_OP, "op code 99 is unknown, not a request"),
    (Op.PUSH_REPLY, 0, ErrorCode.UNKNOWN_OP, f"op code {int(Op.PUSH_REPLY)} is a reply, not a request"),
    (Op.PING, Flag.ROWS, ErrorCode.MALFORMED_FRAME, "PING carries no rows"),
    (Op.PING, 0, ErrorCode.MALFORMED_FRAME, "PING carries no payload, got 100 bytes"),
])
def test_a_refused_frame_is_answered_its_payload_dropped_and_the_connection_goes_on(loop, op, flags, code,
                                                                                    message):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    conn, transport = connect(engine, loop)
    feed(conn, pack_header(op, flags, 0, 5, 0, 0, 100) + bytes(100) + pack_header(Op.PING, request_id=6))
    spin(loop)
    assert errors(transport) == [(5, code, message)]
    assert [h.op for h in transport.replies()] == [Op.ERROR, Op.PING_REPLY] and not transport.closed


def test_a_handlers_unexpected_failure_is_an_internal_error(loop, monkeypatch, caplog):
    def broken(self, conn, request, payload):
        raise RuntimeError("boom")

    monkeypatch.setattr(Ping, "handle", broken)
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    conn, transport = connect(engine, loop)
    feed(conn, pack_header(Op.PING, request_id=3))
    spin(loop)
    assert errors(transport) == [(3, ErrorCode.INTERNAL, "internal error: boom")] and not transport.closed
    assert any("internal error handling PING" in r.getMessage() for r in caplog.records)


def test_too_many_refused_frames_in_a_row_close_the_connection(loop, caplog):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    conn, transport = connect(engine, loop)
    feed(conn, b"".join(pack_header(99, request_id=i) for i in range(MAX_BAD_FRAMES + 3)))
    spin(loop, 200)
    sent = errors(transport)
    assert len(sent) == MAX_BAD_FRAMES and transport.closed
    assert sent[-1][0] == 0  # (fatal: about the connection)
    assert sent[-1][2].endswith(f"({MAX_BAD_FRAMES} refused frames in a row: closing the connection)")


def test_an_answered_request_resets_the_count_of_refused_frames(loop):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    conn, transport = connect(engine, loop)
    bad = b"".join(pack_header(99, request_id=i) for i in range(MAX_BAD_FRAMES - 1))
    feed(conn, bad + pack_header(Op.PING, request_id=100) + bad)
    spin(loop, 200)
    assert len(errors(transport)) == 2 * (MAX_BAD_FRAMES - 1) and not transport.closed
