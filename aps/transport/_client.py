"""What the client connections of both transports share: sending views, errors, one-off requests."""

from __future__ import annotations

import socket

from ..errors import APSConnectionError, APSTimeoutError, MalformedFrame, error_from_code
from ..protocol import Header, Op, decode_error, pack_header
from .framing import FrameReader

__all__ = ["IOV_MAX", "ClientSocket", "advance", "exchange"]

#: Buffers one ``sendmsg`` call may take.
IOV_MAX = 1024


def advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """The part of ``views`` still to send after ``sent`` bytes went."""
    index = 0
    while sent and index < len(views):
        size = len(views[index])
        if sent >= size:
            sent -= size
            index += 1
        else:
            views[index] = views[index][sent:]
            sent = 0
    return views[index:]


class ClientSocket:
    """What both client drivers share: the socket, its errors, closing."""

    sock: socket.socket
    address: str

    def _lost(self, exc: OSError) -> APSConnectionError:
        return APSConnectionError(f"lost the connection to {self.address}: {exc.strerror or exc}")

    def _closed_by_server(self) -> APSConnectionError:
        return APSConnectionError(f"the server at {self.address} closed the connection")

    def _no_reply(self, timeout: float | None) -> APSTimeoutError:
        return APSTimeoutError(f"no reply from {self.address} within {timeout} s")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _OneReply:
    """FrameHandler collecting a single small reply."""

    _LIMIT = 64 << 20

    def __init__(self) -> None:
        self.header: Header | None = None
        self.payload = b""

    def frame_buffer(self, header: Header) -> memoryview:
        if header.length > self._LIMIT:
            raise MalformedFrame(f"reply of {header.length} bytes to a control request")
        return memoryview(bytearray(header.length))

    def frame_received(self, header: Header, payload: memoryview) -> None:
        self.header, self.payload = header, bytes(payload)


def exchange(conn, op: int, timeout: float | None) -> tuple[Header, bytes]:
    """Send one payload-less request on ``conn`` and return its reply; raises the
    server's error if the reply is an error frame."""
    reply = _OneReply()
    conn.send([pack_header(op, request_id=1)])
    conn.receive(FrameReader(reply), lambda: reply.header is not None, timeout)
    if reply.header.op == Op.ERROR:
        raise error_from_code(*decode_error(reply.payload))
    if reply.header.op != op | Op.REPLY:
        raise MalformedFrame(f"reply op {reply.header.op} to request op {op}")
    return reply.header, reply.payload
