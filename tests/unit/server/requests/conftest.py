"""What the handler tests share.

- :class:`FakeExchange`: the connection as a handler sees it (the
  :class:`aps.server.requests.base.Exchange` protocol) over a real
  :class:`~aps.server.engine.Engine`; it records what it is asked to send (replies, weights,
  errors, notices) in order, and whether the request was done, closed or aborted.
- :class:`FakeTransport`: the :class:`aps.server.transport.Transport` protocol, recording what
  the handlers ask of it (gradient destinations, rows frames checked).
- :meth:`FakeExchange.feed`: a frame through the real frame parser
  (:class:`aps.wire.framing.FrameReader`), in pieces of a chosen size, to the handler of its
  op: ``admit`` when its header arrives, ``more`` as its bytes do, ``handle`` once it is whole
  (a ServerError is the request's reply, as a connection makes it).
- ``loop``, ``engine``, ``conn``: a fresh event loop, an engine of one worker (asp, lr 1),
  and a fake exchange over it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import AuthenticationError, NotInitialized, ServerError
from aps.layout import Layout
from aps.server.admission import StrangerGuard
from aps.server.engine import Engine
from aps.server.handshake import Handshake
from aps.server.requests import HANDLERS, Request
from aps.wire.framing import FrameReader
from aps.wire.protocol import HEADER_SIZE, DType, Op, encode_init, pack_header, unpack_header
from aps.wire.rows import reply_rows_parts


@dataclass
class Reply:
    """A small reply (or a frame in parts) the handler sent."""

    op: int
    rid: int
    clock: int = 0
    version: int = 0
    flags: int = 0
    payload: bytes = b""
    dtype: int = 0


@dataclass
class Weights:
    """A weights reply (Exchange.reply_weights): what the snapshot held when it was sent."""

    op: int
    rid: int
    clock: int
    version: int
    flags: int
    dtype: int
    weights: np.ndarray
    rows: bytes = b""
    narrowed: np.ndarray | None = None


@dataclass
class Error:
    rid: int
    exc: ServerError
    op: int = Op.ERROR


@dataclass
class Notice:
    op: int
    payload: bytes = b""


class FakeTransport:
    """The Transport protocol, as TCP would answer it (``compressed``, ``kind``: say otherwise)."""

    def __init__(self, *, kind: str = "tcp", compressed: bool = True) -> None:
        self.kind, self.compressed = kind, compressed
        self.peer, self.peer_key = "fake:1", "uid 1"
        self.rows_shared = False
        self.rows_room = None
        self.writing = False
        self.closed = False
        self.key: str | None = "uid 1"  # whom failed AUTHs count against (None: the peer is gone)
        self.destinations: list[tuple[int, int, bool]] = []  # (op, length, rows) of gradient_destination
        self.rows_frames: list[int] = []  # rows_at of each check_rows_frame
        self.rows_error: Exception | None = None  # raised by reply_rows when set
        self.written: list[bytes] = []

    def can_write(self) -> bool:
        return not self.closed

    def write(self, data, fds=()) -> None:
        self.written.append(bytes(data))

    def write_parts(self, parts, fds=()) -> None:
        self.written.append(b"".join(bytes(part) for part in parts))

    def unsent(self) -> int:
        return 0

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def auth_key(self) -> str | None:
        return self.key

    def gradient_destination(self, member, header, rows=False):
        self.destinations.append((header.op, header.length, rows))
        return member.receive_gradient(header.dtype)

    def gradient_buffer(self, request):
        return None

    def check_rows_frame(self, header, rows_at) -> None:
        self.rows_frames.append(rows_at)

    def rows_payload(self, payload):
        return payload

    def reply_rows(self, read):
        if self.rows_error is not None:
            raise self.rows_error
        return tuple(reply_rows_parts(read)), ()

    def send_weights(self, *args, **kwargs) -> None:
        raise AssertionError("the fake exchange answers weights itself")

    def frame_arrived(self, header) -> None: ...

    def reply_left(self) -> None: ...

    def release_leases(self) -> None: ...


class FakeExchange:
    """The Exchange protocol over a real engine (see the module docstring).

    ``sent``: what the handlers sent, in order (:class:`Reply`, :class:`Weights`,
    :class:`Error`, :class:`Notice`); ``dones``: each ``done(ok)``; ``fatals``: the errors
    that closed the connection.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, transport: FakeTransport | None = None,
                 token: bytes | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.member = None
        self.transport = transport or FakeTransport()
        self.traffic = engine.stats.traffic["tcp"]
        self.guard = StrangerGuard()
        self.handshake = Handshake(token, self.guard.throttle)
        self.unix_path = "/run/aps/test.sock"
        self.sent: list = []
        self.dones: list[bool] = []
        self.fatals: list[ServerError] = []
        self.closed = self.aborted = self.gone = False
        self.request: Request | None = None  # the request fed last (feed)
        self.asked: list[int] = []  # the offsets ``more`` was asked at (feed)
        self._reader = FrameReader(self, max_payload=1 << 30)

    # Exchange -----------------------------------------------------------------
    @property
    def peer(self) -> str:
        return "fake:1"

    @property
    def lost(self) -> bool:
        return self.gone

    def require_member(self):
        if self.member is None:
            raise NotInitialized("request before a successful INIT")
        return self.member

    def can_reply(self) -> bool:
        return not self.closed

    def reply(self, request, op, *, clock=0, version=0, flags=0, payload=b"") -> None:
        if self.can_reply():
            self.sent.append(Reply(int(op), request.rid, clock, version, int(flags), bytes(payload)))
        self.done()

    def reply_parts(self, parts, nbytes, fds=()) -> None:
        frame = b"".join(bytes(part) for part in parts)
        assert len(frame) == nbytes, "reply_parts is told the frame's length"
        header = unpack_header(frame)
        assert header.length == nbytes - HEADER_SIZE
        self.sent.append(Reply(header.op, header.request_id, header.clock, header.version, header.flags,
                               frame[HEADER_SIZE:], header.dtype))
        self.done()

    def reply_weights(self, request, op, snap, clock, flags, rows, fds, narrowed=None) -> None:
        self.sent.append(Weights(int(op), request.rid, clock, snap.version, int(flags), request.weights_dtype,
                                 snap.array.copy(), b"".join(bytes(part) for part in rows),
                                 None if narrowed is None else narrowed.copy()))
        snap.release()
        self.done()

    def fail(self, request, exc) -> None:
        self.sent.append(Error(request.rid, exc))
        self.done(ok=False)

    def done(self, ok: bool = True) -> None:
        self.dones.append(ok)

    def fatal(self, exc, *, warn=True) -> None:
        self.fatals.append(exc)
        self.closed = True

    def notice(self, op, payload=b"") -> None:
        self.sent.append(Notice(int(op), bytes(payload)))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    # Reading --------------------------------------------------------------------
    def ops(self) -> list[int]:
        return [item.op for item in self.sent]

    @property
    def last(self):
        return self.sent[-1]

    def feed(self, data: bytes, piece: int = 1 << 30) -> Request | None:
        """Feed ``data`` (frames) through the frame parser, at most ``piece`` bytes a read; the
        last request made."""
        view = memoryview(data)
        while len(view):
            buf = self._reader.get_buffer()
            n = min(len(buf), len(view), piece)
            buf[:n] = view[:n]
            view = view[n:]
            self._reader.buffer_updated(n)
        return self.request

    # The frame parser's handler (as aps.server.connection.Connection, without its turns) ----------
    def frame_buffer(self, header):
        handler = HANDLERS.get(header.op)
        assert handler is not None, f"op {header.op} has no handler"
        request = self.request = Request(header, handler)
        self.asked = []
        try:
            return handler.admit(self, request)
        except ServerError as exc:
            request.error = exc
            return None

    def frame_more(self, header, got):
        self.asked.append(got)
        request = self.request
        if request.error is not None:
            return None
        try:
            return request.handler.more(self, request, got)
        except ServerError as exc:
            request.error = exc
            return None

    def frame_received(self, header, payload) -> None:
        request = self.request
        if request.error is not None:
            request.end_intake(self.engine, self)
            self.fail(request, request.error)
            return
        try:
            request.handler.handle(self, request, payload)
        except AuthenticationError as exc:
            self.fatal(exc, warn=False)
        except ServerError as exc:
            self.fail(request, exc)


# Frames ------------------------------------------------------------------------------------
def frame(op: int, payload: bytes = b"", *, flags: int = 0, dtype: int = 0, rid: int = 7, clock: int = 0,
          version: int = 0) -> bytes:
    return pack_header(op, flags, dtype, rid, clock, version, len(payload)) + payload


def init_frame(n: int, *, rank: int = 0, workers: int = 1, values: np.ndarray | None = None, flags: int = 0,
               rid: int = 1, layout: Layout | None = None, with_values: bool = True) -> bytes:
    layout = layout or Layout(("w",), ((n,),))
    block = encode_init(rank, workers, layout)
    if with_values:
        values = np.zeros(layout.numel, np.float32) if values is None else values.astype(np.float32)
        data = block + values.tobytes()
    else:
        data = block
    return pack_header(Op.INIT, flags, DType.FLOAT32, rid, 0, len(block), len(data)) + data


def push_frame(op: int, n: int, value: float = 1.0, *, rid: int = 2, version: int = 0, clock: int = 0,
               flags: int = 0, dtype: int = DType.FLOAT32) -> bytes:
    payload = np.full(n, value, np.float32).tobytes()
    return pack_header(op, flags, dtype, rid, clock, version, len(payload)) + payload


def join(conn: FakeExchange, n: int, values: np.ndarray | None = None, **kwargs) -> None:
    """``conn`` joins (INIT) a model of ``n`` weights; its INIT_REPLY is checked and forgotten."""
    conn.feed(init_frame(n, values=values, **kwargs))
    assert conn.member is not None and conn.ops()[-1] == Op.INIT_REPLY, conn.sent
    conn.sent.clear()
    conn.dones.clear()


# Fixtures ------------------------------------------------------------------------------------
@pytest.fixture
def engine(loop):
    return Engine(ServerConfig(workers=1, sync="asp", lr=1.0))


@pytest.fixture
def conn(engine, loop):
    return FakeExchange(engine, loop)

