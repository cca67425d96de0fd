"""What the client connections of both transports share: sending views, errors, one-off
requests, the handshake and the token."""

from __future__ import annotations

import hmac
import os
import socket
import time
from collections.abc import Callable, Generator, Sequence

from ..errors import (
    APSConnectionError,
    APSError,
    APSTimeoutError,
    AuthenticationError,
    ConfigurationError,
    MalformedFrame,
    NotPrimary,
    ServerError,
    ServerOverloaded,
    ServerSilent,
    ServerUnproven,
    error_from_code,
)
from ..wire.protocol import (
    NONCE_BYTES,
    PROOF_BYTES,
    Header,
    Op,
    ServerInfo,
    auth_proof,
    decode_auth_reply,
    decode_error,
    decode_hello_reply,
    pack_header,
)
from ..wire.tokens import find_token, token_dir, token_path
from ..wire.framing import FrameReader
from ..wire.net import parse_address
from ..wire.segments import scm_rights

__all__ = [
    "IOV_MAX",
    "BlockingSocket",
    "ClientSocket",
    "advance",
    "client_token",
    "exchange",
    "exchange_async",
    "find_client_token",
    "newer_token",
    "handshake",
    "handshake_async",
]

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

    def _silent(self, idle: float | None) -> ServerSilent:
        return ServerSilent(
            f"the server at {self.address} has sent nothing for {idle:g} s while a reply was due: "
            "it hung, or its host or the network is gone"
        )

    def _next_wait(self, deadline: float | None, now: float, timeout: float | None, idle: float | None):
        """How long the next read may wait: the silence allowed, cut to the time left."""
        if deadline is None:
            return idle
        remaining = deadline - now
        if remaining <= 0:
            raise self._no_reply(timeout)
        return remaining if idle is None else min(idle, remaining)

    def _waited_out(self, deadline: float | None, now: float, timeout: float | None, idle: float | None):
        """A read timed out: the whole wait (APSTimeoutError) or the server's silence (ServerSilent)."""
        return self._no_reply(timeout) if deadline is not None and now >= deadline else self._silent(idle)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """End the connection under a thread blocked on it (its call raises APSConnectionError)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class BlockingSocket(ClientSocket):
    """A connected blocking socket driving a FrameReader: what ``aps.Worker`` talks
    through, over TCP or a Unix socket.

    Raises APSConnectionError when the connection drops, and APSTimeoutError
    when a wait runs out.
    """

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        sock.settimeout(None)
        self._timeout: float | None = None

    def send(self, buffers: Sequence, fds: Sequence[int] = ()) -> None:
        """Send every buffer (bytes or byte views), in order, with vectored writes (no
        joining); ``fds`` travel with the first byte (Unix sockets only)."""
        sock = self.sock
        ancillary = scm_rights(fds)
        try:
            if len(buffers) <= IOV_MAX:
                sent = sock.sendmsg(buffers, ancillary)
                if sent == sum(map(len, buffers)):
                    return
                views = advance([memoryview(b).cast("B") for b in buffers], sent)
            else:
                views = [memoryview(b).cast("B") for b in buffers if len(b)]
                views = advance(views, sock.sendmsg(views[:IOV_MAX], ancillary))
            while views:
                views = advance(views, sock.sendmsg(views[:IOV_MAX]))
        except TimeoutError:
            raise APSTimeoutError("sending to the server timed out") from None
        except OSError as exc:
            raise self._lost(exc) from None

    def receive(
        self, reader: FrameReader, done: Callable[[], bool], timeout: float | None = None, idle: float | None = None
    ) -> None:
        """Read into ``reader`` until ``done()``: for at most ``timeout`` seconds in all
        (APSTimeoutError), and with at most ``idle`` seconds without a byte (ServerSilent)."""
        sock = self.sock
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not done():
                wait = self._next_wait(deadline, time.monotonic(), timeout, idle)  # the whole wait is bounded
                if wait != self._timeout:  # settimeout costs a system call: only on change
                    sock.settimeout(wait)
                    self._timeout = wait
                try:
                    nbytes = self._recv_into(reader.get_buffer())
                except TimeoutError:
                    raise self._waited_out(deadline, time.monotonic(), timeout, idle) from None
                if not nbytes:
                    raise self._closed_by_server()
                reader.buffer_updated(nbytes)
        except APSError:  # ours already (timeouts, a closed connection)
            raise
        except OSError as exc:
            raise self._lost(exc) from None

    def _recv_into(self, buffer: memoryview) -> int:
        return self.sock.recv_into(buffer)


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
        if header.op == Op.ALIVE:  # the server holds the request and says it is alive
            return
        self.header, self.payload = header, bytes(payload)


def exchange(conn, op: int, timeout: float | None, payload: bytes = b"") -> tuple[Header, bytes]:
    """Send one request on a blocking connection and return its reply; raises the
    server's error if the reply is an error frame."""
    reply = _OneReply()
    conn.send([pack_header(op, request_id=1, length=len(payload)), payload])
    conn.receive(FrameReader(reply), lambda: reply.header is not None, timeout)
    return _checked(reply, op)


async def exchange_async(conn, op: int, timeout: float | None, payload: bytes = b"") -> tuple[Header, bytes]:
    """:func:`exchange` on an asyncio connection."""
    reply = _OneReply()
    await conn.send([pack_header(op, request_id=1, length=len(payload)), payload])
    await conn.receive(FrameReader(reply), lambda: reply.header is not None, timeout)
    return _checked(reply, op)


def _checked(reply: _OneReply, op: int) -> tuple[Header, bytes]:
    header = reply.header
    if header is None:  # (the receive returns once it came)
        raise MalformedFrame(f"no reply to request op {op}")
    if header.op == Op.ERROR:
        raise error_from_code(*decode_error(reply.payload))
    if header.op != op | Op.REPLY:
        raise MalformedFrame(f"reply op {header.op} to request op {op}")
    return header, reply.payload


# The handshake (docs/protocol.md, Handshake): one generator of requests for the
# blocking and the asyncio drivers, so the logic exists once.
_Steps = Generator[tuple[int, bytes], bytes, ServerInfo]


def _handshake_steps(token: bytes | None, address: str, found: bool, claim: bytes = b"") -> _Steps:
    if token is None and not found:
        token, found = find_client_token(None, address)
    client_nonce = os.urandom(NONCE_BYTES)
    try:
        hello = yield Op.HELLO, client_nonce
    except NotPrimary:
        raise  # (a backup names its primary: where the token must be proved all the same)
    except ServerError as exc:
        raise _unproven(exc, token, address) from None
    _, server_nonce, info = decode_hello_reply(hello)
    if info is not None:  # (the server said who it is at once: it asks for no token)
        # A server that asks for no token cannot prove it knows this one: it may be anybody's
        # (another user's server on the port of one of this user's that is gone, whose token
        # file is still there). A worker that holds a token trains only where it is proved.
        if token is not None and found:
            raise ServerUnproven(
                f"the server at {address} asks for no token, so it cannot prove it is the server whose token "
                f"file this worker found ({token_file_of(address)}): that server is gone, and whoever listens "
                "on its port now may be anybody. Refused; if you trust this server, delete that file"
            )
        if token is not None:
            raise ServerUnproven(
                f"the server at {address} asks for no token, so it cannot prove it knows the one this worker "
                "has: it may not be the server you meant (start it with --token, or give the worker no token)"
            )
        return info
    if token is None:
        raise AuthenticationError(
            f"the server at {address} needs a token: pass token= or set $APS_TOKEN (a server this user started "
            f"on loopback without one has its own, in {token_dir()}, found there by itself)"
        )
    try:
        reply = yield Op.AUTH, auth_proof(token, "client", server_nonce, client_nonce, claim) + claim
    except AuthenticationError:
        raise  # (the server's answer to the proof: the wrong token, or another server's)
    except ServerError as exc:
        raise _unproven(exc, token, address) from None
    proof, info = decode_auth_reply(reply)
    said = bytes(memoryview(reply)[PROOF_BYTES:])
    if not hmac.compare_digest(proof, auth_proof(token, "server", server_nonce, client_nonce, claim + said)):
        raise ServerUnproven(f"the server at {address} could not prove it knows the token: refused")
    return info


def _unproven(exc: ServerError, token: bytes | None, address: str) -> ServerError:
    """An error frame in the handshake, before the server proved it knows the token: with a
    token in hand, what such a server says is worth nothing (ServerUnproven: a worker that
    reconnects waits for its real server); without one, it is the server's error."""
    if token is None or isinstance(exc, ServerOverloaded):  # (a busy server: it is tried again anyway)
        return exc
    return ServerUnproven(
        f"the server at {address} answered the handshake with an error before it proved it knows "
        f"the token ({exc}): refused"
    )


def token_file_of(address: str) -> str:
    """The token file a server of this user at ``address`` (``tcp://HOST:PORT``) writes."""
    try:
        parsed = parse_address(address)
    except ConfigurationError:
        return token_dir()
    return token_path(parsed.host, parsed.port)


def client_token(token: str | bytes | None) -> bytes | None:
    """A client's token: as given, else ``$APS_TOKEN``, else none."""
    if token is None:
        token = os.environ.get("APS_TOKEN") or None
    if token is None or isinstance(token, bytes):
        return token
    if not isinstance(token, str) or not token:
        raise ConfigurationError("token must be a non-empty string")
    return token.encode("utf-8")


def find_client_token(token: bytes | None, address: str, port: int | None = None) -> tuple[bytes | None, bool]:
    """The token to prove at ``address`` (``tcp://HOST:PORT``, or a host and ``port``),
    and whether it was looked up rather than given: ``token`` when given, else the token
    file a server of this user wrote for that address (see :mod:`aps.wire.tokens`), else None."""
    if token is not None:
        return token, False
    if port is None:
        scheme, sep, rest = address.partition("://")
        if not sep or scheme not in ("tcp", "tls"):
            return None, False
        host, _, text = rest.rpartition(":")
        try:
            port = int(text)
        except ValueError:
            return None, False
    else:
        host = address
    return find_token(host, port), True


def newer_token(token: bytes | None, found: bool, host: str, port: int) -> bytes | None:
    """After a refused handshake with a token from a file: the file's token if it has
    changed since (a server restarted on the port wrote its own between the read and the
    handshake), else None (the refusal stands)."""
    if not found:
        return None
    fresh = find_token(host, port)
    return fresh if fresh is not None and fresh != token else None


def handshake(
    conn, token: bytes | None, timeout: float | None, *, found: bool = False, claim: bytes = b""
) -> ServerInfo:
    """HELLO, and AUTH when the server asks for a token (each side proves it knows
    it; the token never crosses the wire). Returns what the server says of itself
    (:class:`aps.wire.protocol.ServerInfo`). Raises AuthenticationError.

    ``token`` None: the token file of the server's address, if there is one
    (:func:`find_client_token`); ``found``: ``token`` was looked up in such a file, not
    given (what a refusal then says). ``claim``: the run and shard this client means to
    reach (:func:`aps.wire.protocol.encode_claim`), which its proof vouches for: a proof
    relayed to another server opens nothing there."""
    steps = _handshake_steps(token, conn.address, found, claim)
    request = next(steps)
    while True:
        op, payload = request
        try:
            try:
                _, payload = exchange(conn, op, timeout, payload)
            except ServerError as exc:  # (the steps say what it means)
                request = steps.throw(exc)
            else:
                request = steps.send(payload)
        except StopIteration as done:
            return done.value


async def handshake_async(
    conn, token: bytes | None, timeout: float | None, *, found: bool = False, claim: bytes = b""
) -> ServerInfo:
    """:func:`handshake` on an asyncio connection."""
    steps = _handshake_steps(token, str(conn.address), found, claim)
    request = next(steps)
    while True:
        op, payload = request
        try:
            try:
                _, payload = await exchange_async(conn, op, timeout, payload)
            except ServerError as exc:  # (the steps say what it means)
                request = steps.throw(exc)
            else:
                request = steps.send(payload)
        except StopIteration as done:
            return done.value
