"""The shared-memory transport, server side (aps.server.shm.ShmTransport), over a Unix
socket pair: the worker's end is a plain socket in the test.

Seams: descriptors (``SCM_RIGHTS``) before the handshake are closed and fatal; more than a
request may carry are fatal; ``gradient_destination`` (a push is a bare header with the SHM
flag: refused without it, or with a payload but its rows; read in place, counted);
``gradient_buffer`` (an INIT needs its segment's descriptor); ``check_rows_frame`` (the frame
carries a rows reference, no more, no less); ``write`` (queued when the socket is full:
``writing`` until it has all left, then the receiver hears it, the frames in order, each
descriptor with its frame); ``send_weights`` (a slot named, its descriptor sent once, the
lease kept until the next weights reply or a LEAVE)."""

import asyncio
import os
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import ErrorCode, MalformedFrame
from aps.server.connection import Connection
from aps.server.engine import Engine
from aps.server.shm import ShmTransport
from aps.wire.protocol import HEADER_SIZE, DType, Flag, Header, Op, decode_error, decode_slot, unpack_header
from aps.wire.rows import ROWS_REF_BYTES
from aps.wire.segments import ANCILLARY_SPACE, fds_from, scm_rights

pytestmark = pytest.mark.skipif(not hasattr(socket, "SCM_RIGHTS") or not os.path.isdir("/proc/self/fd"),
                                reason="descriptors pass over Unix sockets (Linux)")


@pytest.fixture
def pair():
    server, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server.setblocking(False)
    yield server, worker
    worker.close()
    server.close()


def spin(loop, until, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.002))
    assert until()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Receiver:
    """The connection, as the transport tells it its events."""

    def __init__(self):
        self.authenticated = True
        self.buf = bytearray(1 << 16)
        self.arrived = 0
        self.drained = 0
        self.fatals = []
        self.lost = []

    def opened(self):
        return True

    def get_buffer(self):
        return memoryview(self.buf)

    def bytes_arrived(self, nbytes):
        self.arrived += nbytes

    def output_drained(self):
        self.drained += 1

    def fatal(self, exc, *, warn=True):
        self.fatals.append(exc)

    def connection_lost(self, exc):
        self.lost.append(exc)


def transport(server, engine=None, *, slots=lambda: set(), max_payload=1 << 20):
    engine = engine or Engine(ServerConfig(workers=1, sync="asp"))
    return ShmTransport(server, engine.stats.traffic["shm"], max_payload, slots, lambda t: Receiver())


def connection(server, token=None):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    return ShmTransport(server, engine.stats.traffic["shm"], 1 << 20, lambda: set(),
                        lambda t: Connection(engine, t, 1 << 20, set(), token=token)), engine


def read_frames(worker):
    """What the server sent, as far as it has come: frames and the descriptors with them."""
    worker.setblocking(False)
    data, fds = bytearray(), []
    while True:
        try:
            chunk, ancdata, _, _ = worker.recvmsg(1 << 16, ANCILLARY_SPACE)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
        fds += fds_from(ancdata)
    frames, pos = [], 0
    while pos + HEADER_SIZE <= len(data):
        header = unpack_header(data[pos : pos + HEADER_SIZE])
        frames.append((header, bytes(data[pos + HEADER_SIZE : pos + HEADER_SIZE + header.length])))
        pos += HEADER_SIZE + header.length
    return frames, fds


# Descriptors -------------------------------------------------------------------------------------
def test_descriptors_before_the_handshake_are_closed_and_fatal(loop, pair):
    server, worker = pair
    shm, _ = connection(server, token=b"k" * 32)
    r, w = os.pipe()
    baseline = open_fds()
    try:
        worker.sendmsg([b"\0"], scm_rights([r, w]))
        spin(loop, lambda: not shm.can_write())
        assert open_fds() == baseline - 1  # (the two received are closed, and the connection's socket)
        frames, _ = read_frames(worker)
        (header, payload), = frames
        code, message = decode_error(payload)
        assert header.op == Op.ERROR and code == ErrorCode.AUTHENTICATION
        assert message == "descriptors sent before the handshake" and shm.receiver.lost
    finally:
        os.close(r)
        os.close(w)


def test_a_strangers_descriptors_are_closed_at_once_whatever_its_connection_does(loop, pair):
    server, worker = pair
    shm = transport(server)
    shm.receiver.authenticated = False
    r, w = os.pipe()
    baseline = open_fds()
    try:
        worker.sendmsg([b"\0"], scm_rights([r, w]))
        spin(loop, lambda: shm.receiver.fatals)
        assert open_fds() == baseline and shm.can_write()  # (closed before the connection is)
        assert shm.receiver.arrived == 0  # (its byte is not read)
    finally:
        os.close(r)
        os.close(w)


def test_more_descriptors_than_a_request_carries_are_fatal(loop, pair):
    server, worker = pair
    shm, _ = connection(server)  # (no token: open at once)
    pipes = [os.pipe() for _ in range(3)]
    sent = [fd for pipe in pipes for fd in pipe][:5]
    baseline = open_fds()
    try:
        worker.sendmsg([b"\0"], scm_rights(sent))
        spin(loop, lambda: not shm.can_write())
        assert open_fds() == baseline - 1  # (the five received are closed, and the connection's socket)
        (header, payload), = read_frames(worker)[0]
        code, message = decode_error(payload)
        assert header.op == Op.ERROR and code == ErrorCode.MALFORMED_FRAME and "too many file descriptors" in message
    finally:
        for pipe in pipes:
            for fd in pipe:
                os.close(fd)


def test_a_descriptor_after_the_handshake_is_kept_for_the_request(loop, pair):
    server, worker = pair
    shm = transport(server)
    r, w = os.pipe()
    baseline = open_fds()
    try:
        worker.sendmsg([b"\0"], scm_rights([r]))
        spin(loop, lambda: shm.receiver.arrived == 1)
        assert not shm.receiver.fatals and open_fds() == baseline + 1  # (held for the request that claims it)
        shm.close()
        assert open_fds() == baseline - 1 and shm.receiver.lost == [None]  # (closed with the connection's socket)
    finally:
        os.close(r)
        os.close(w)


def test_an_init_needs_its_gradient_segments_descriptor(pair, loop):
    shm = transport(pair[0])
    with pytest.raises(MalformedFrame, match="needs the gradient segment's descriptor"):
        shm.gradient_buffer(SimpleNamespace(layout=SimpleNamespace(nbytes=64)))


# Gradients and rows --------------------------------------------------------------------------------
def push_header(flags, length=0, op=Op.PUSH):
    return Header(op, flags, DType.FLOAT32, 1, 0, 0, length)


def test_a_push_is_a_bare_header_with_the_shm_flag(pair, loop):
    shm = transport(pair[0])
    member = SimpleNamespace(grad=np.zeros(16, np.float32))
    before = shm.traffic.bytes_in
    assert shm.gradient_destination(member, push_header(Flag.SHM)) is None
    assert shm.traffic.bytes_in - before == 64  # (read in place from the worker's segment)
    for header in (push_header(0), push_header(0, op=Op.PUSH_PULL), push_header(Flag.SHM, 64)):
        with pytest.raises(MalformedFrame, match="a push carries no payload but its rows: set the SHM flag"):
            shm.gradient_destination(member, header)
    assert shm.gradient_destination(member, push_header(Flag.SHM | Flag.ROWS, ROWS_REF_BYTES), rows=True) is None
    with pytest.raises(MalformedFrame, match="set the SHM flag"):
        shm.gradient_destination(member, push_header(Flag.ROWS, ROWS_REF_BYTES), rows=True)


def test_a_request_with_rows_carries_a_rows_reference_exactly(pair, loop):
    shm = transport(pair[0])
    shm.check_rows_frame(push_header(Flag.ROWS, ROWS_REF_BYTES), 0)
    shm.check_rows_frame(push_header(Flag.ROWS, 64 + ROWS_REF_BYTES), 64)
    for length, at in ((ROWS_REF_BYTES + 8, 0), (ROWS_REF_BYTES - 8, 0), (ROWS_REF_BYTES, 8)):
        with pytest.raises(MalformedFrame, match=f"a {ROWS_REF_BYTES}-byte rows reference, not {length - at} bytes"):
            shm.check_rows_frame(push_header(Flag.ROWS, length), at)


# Writing ----------------------------------------------------------------------------------------------
def test_writes_queue_while_the_socket_is_full_and_leave_in_order(loop, pair):
    server, worker = pair
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    shm = transport(server)
    big = bytes(range(256)) * 4096  # 1 MiB: more than the socket holds
    shm.write(big)
    assert shm.writing and shm.unsent() > 0 and shm.receiver.drained == 0
    shm.write(b"after")  # (behind the first, not through it)
    assert shm.unsent() > len(b"after")
    got = bytearray()
    worker.setblocking(False)

    def drain():
        try:
            while True:
                chunk = worker.recv(1 << 16)
                if not chunk:
                    break
                got.extend(chunk)
        except BlockingIOError:
            pass
        return not shm.writing

    spin(loop, drain)
    drain()
    assert bytes(got) == big + b"after" and shm.unsent() == 0 and shm.receiver.drained == 1


def test_a_write_the_socket_takes_at_once_is_not_queued(loop, pair):
    server, worker = pair
    shm = transport(server)
    shm.write(b"small")
    assert not shm.writing and shm.unsent() == 0 and worker.recv(16) == b"small"


# Weights ----------------------------------------------------------------------------------------------
class FakeSegment:
    def __init__(self, sid):
        self.id, self.nbytes = sid, 256
        self.fds = []

    def read_only_fd(self):
        fd = os.open("/dev/null", os.O_RDONLY)
        self.fds.append(fd)
        return fd


class FakeSnap:
    def __init__(self, segment, version=1):
        self.segment, self.version = segment, version
        self.released = 0

    def release(self):
        self.released += 1


def test_weights_name_their_slot_and_keep_it_leased_until_the_next_reply(loop, pair):
    server, worker = pair
    first, second = FakeSegment(101), FakeSegment(102)
    shm = transport(server, slots=lambda: {101, 102})
    one, two, three = FakeSnap(first), FakeSnap(first, 2), FakeSnap(second, 3)
    try:
        shm.send_weights(Op.PULL_REPLY, 5, one, 0, 0, 1)
        assert one.released == 0  # (the worker copies out of the slot until its next request)
        shm.send_weights(Op.PULL_REPLY, 6, two, 0, 0, 1)
        assert one.released == 1 and two.released == 0
        shm.frame_arrived(push_header(0, op=Op.PUSH))  # (any other request: the lease stays)
        shm.send_weights(Op.PULL_REPLY, 7, three, 0, 0, 1)
        assert two.released == 1 and three.released == 0
        shm.frame_arrived(push_header(0, op=Op.LEAVE))
        assert three.released == 1
        frames, fds = read_frames(worker)
        assert [h.request_id for h, _ in frames] == [5, 6, 7] and all(h.flags & Flag.SHM for h, _ in frames)
        slots = [decode_slot(payload) for _, payload in frames]
        assert [(sid, fresh) for sid, _, fresh, _ in slots] == [(101, True), (101, False), (102, True)]
        assert len(fds) == 2  # (a slot's descriptor once)
        for fd in fds:
            os.close(fd)
    finally:
        for fd in first.fds + second.fds:
            os.close(fd)
