"""The handshake's handlers (aps.server.requests.handshake) and the state a connection keeps
of it (aps.server.handshake.Handshake).

Seams: ``Hello.admit`` (a nonce at most, read whole) and ``Hello.handle`` (a fresh server
nonce each time; whether the token is needed; HELLO after HELLO without AUTH refused);
``Auth.admit`` (a proof at least, a claim at most) and ``Auth.handle`` (no token; no HELLO
first; the peer gone; the throttle's turn, wait and refusal) and ``Auth.check`` (a wrong proof
closes and counts a failure; a right one is answered with the server's proof and opens the
connection; one nonce, one AUTH; a claim meant for another server is answered and closed);
``refuse`` (counted, AuthenticationError). Through a real Connection over a TcpTransport:
HELLO then AUTH, and a request before the handshake."""

import asyncio
import os

import pytest

from aps.config import ServerConfig
from aps.errors import AuthenticationError, ErrorCode, MalformedFrame, ServerOverloaded
from aps.server.admission import AuthThrottle
from aps.server.connection import Connection
from aps.server.engine import Engine
from aps.server.requests import HANDLERS, Request
from aps.server.requests.handshake import refuse
from aps.server.tcp import TcpTransport
from aps.wire.protocol import (
    HEADER_SIZE,
    MAX_CLAIM_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    Op,
    auth_proof,
    decode_auth_reply,
    decode_error,
    decode_hello_reply,
    encode_claim,
    unpack_header,
)
from tests.unit.server.test_connection import FakeTransport as FakeSocket
from tests.unit.server.test_connection import feed

from .conftest import FakeExchange, frame

TOKEN = b"t" * 32


@pytest.fixture
def shake(engine, loop):
    """An exchange with a server that has a token."""
    return FakeExchange(engine, loop, token=TOKEN)


def hello(conn, nonce=None):
    """HELLO with ``nonce``; the server's nonce from its reply."""
    nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
    conn.feed(frame(Op.HELLO, nonce))
    reply = conn.last
    assert reply.op == Op.HELLO_REPLY
    required, server_nonce, info = decode_hello_reply(reply.payload)
    return nonce, server_nonce, required, info


def auth(conn, proof, claim=b"", rid=9):
    conn.feed(frame(Op.AUTH, proof + claim, rid=rid))


# HELLO ----------------------------------------------------------------------------------------
def test_hello_reads_a_nonce_at_most(shake):
    handler = HANDLERS[Op.HELLO]
    assert len(handler.admit(shake, Request(unpack_header(frame(Op.HELLO, bytes(NONCE_BYTES))), handler))) == 32
    with pytest.raises(MalformedFrame, match="HELLO carries 32 bytes at most, got 33"):
        handler.admit(shake, Request(unpack_header(frame(Op.HELLO, bytes(NONCE_BYTES + 1))), handler))


def test_hello_says_the_token_is_needed_and_gives_a_fresh_nonce_each_time(shake):
    client, first, required, info = hello(shake)
    assert required and info is None  # (nothing said of the server before the token is proved)
    assert shake.handshake.client_nonce == client and shake.handshake.server_nonce == first
    assert len(first) == NONCE_BYTES and shake.last.rid == 7
    _, second, _, _ = hello(shake)
    assert second != first and shake.handshake.server_nonce == second


def test_without_a_token_hello_says_who_the_server_is(engine, conn):
    _, _, required, info = hello(conn)
    assert not required and info.unix_path == "/run/aps/test.sock" and info.run_id == engine.durability.run_id
    for _ in range(5):  # (not counted: the connection is open)
        hello(conn)
    assert engine.stats.auth["failures"] == 0


def test_a_third_hello_without_auth_closes_the_connection(engine, shake):
    hello(shake)
    hello(shake)
    shake.feed(frame(Op.HELLO, bytes(NONCE_BYTES)))
    assert shake.ops() == [Op.HELLO_REPLY, Op.HELLO_REPLY]
    assert isinstance(shake.fatals[0], AuthenticationError) and "HELLO after HELLO" in shake.fatals[0].message
    assert engine.stats.auth["failures"] == 1


# AUTH ---------------------------------------------------------------------------------------------
def test_auth_reads_a_proof_at_least_and_a_claim_at_most(shake):
    handler = HANDLERS[Op.AUTH]
    for length in (PROOF_BYTES, PROOF_BYTES + MAX_CLAIM_BYTES):
        room = handler.admit(shake, Request(unpack_header(frame(Op.AUTH, bytes(length))), handler))
        assert len(room) == length
    for length in (PROOF_BYTES - 1, PROOF_BYTES + MAX_CLAIM_BYTES + 1):
        with pytest.raises(MalformedFrame, match=f"got {length}$"):
            handler.admit(shake, Request(unpack_header(frame(Op.AUTH, bytes(length))), handler))


def test_a_right_proof_is_answered_with_the_servers_and_opens_the_connection(engine, shake):
    client, server, _, _ = hello(shake)
    claim = encode_claim(engine.durability.run_id, 0, 1)
    auth(shake, auth_proof(TOKEN, "client", server, client, claim), claim)
    reply = shake.last
    assert (reply.op, reply.rid) == (Op.AUTH_REPLY, 9)
    proof, info = decode_auth_reply(reply.payload)
    said = reply.payload[PROOF_BYTES:]
    assert proof == auth_proof(TOKEN, "server", server, client, claim + said)  # it binds the claim and what it says
    assert info.run_id == engine.durability.run_id and info.unix_path == "/run/aps/test.sock"
    assert shake.handshake.authenticated and shake.handshake.proved and not shake.closed
    assert engine.stats.auth["failures"] == 0


def test_a_wrong_proof_closes_the_connection_and_counts_a_failure(engine, shake):
    client, server, _, _ = hello(shake)
    auth(shake, auth_proof(b"another token of 32 bytes, wrong", "client", server, client))
    assert shake.ops() == [Op.HELLO_REPLY] and shake.closed
    assert isinstance(shake.fatals[0], AuthenticationError) and "a wrong token (from uid 1)" in shake.fatals[0].message
    assert not shake.handshake.authenticated and engine.stats.auth["failures"] == 1


def test_a_proof_of_the_servers_role_is_not_the_clients(engine, shake):
    client, server, _, _ = hello(shake)
    auth(shake, auth_proof(TOKEN, "server", server, client))
    assert shake.fatals and not shake.handshake.authenticated


def test_one_nonce_opens_one_auth(engine, shake):
    """The server's nonce is spent by a right AUTH: the same proof again is refused."""
    client, server, _, _ = hello(shake)
    proof = auth_proof(TOKEN, "client", server, client)
    auth(shake, proof)
    assert shake.handshake.server_nonce == b""
    auth(shake, proof)
    assert "AUTH without a HELLO" in shake.fatals[0].message and engine.stats.auth["failures"] == 1


def test_auth_before_hello_is_refused_and_counted(engine, shake):
    auth(shake, bytes(PROOF_BYTES))
    assert not shake.sent and "AUTH without a HELLO carrying a nonce first" in shake.fatals[0].message
    assert engine.stats.auth["failures"] == 1


def test_auth_after_a_hello_without_a_nonce_is_refused(engine, shake):
    hello(shake, nonce=b"")
    auth(shake, bytes(PROOF_BYTES))
    assert shake.fatals and engine.stats.auth["failures"] == 1


def test_auth_to_a_server_without_a_token_is_refused_and_not_counted(engine, conn):
    client, server, _, _ = hello(conn)
    auth(conn, auth_proof(TOKEN, "client", server, client))
    assert "has no token" in conn.fatals[0].message and engine.stats.auth["failures"] == 0


def test_a_claim_meant_for_another_server_is_answered_then_closed(engine, shake):
    """The token's holder proves itself, but meant another run: nothing is opened."""
    client, server, _, _ = hello(shake)
    claim = encode_claim("another-run", 0, 1)
    auth(shake, auth_proof(TOKEN, "client", server, client, claim), claim)
    assert shake.ops() == [Op.HELLO_REPLY, Op.AUTH_REPLY] and shake.closed and not shake.handshake.authenticated


def test_a_claim_of_another_shard_opens_nothing(engine, shake):
    client, server, _, _ = hello(shake)
    claim = encode_claim(engine.durability.run_id, 1, 2)
    auth(shake, auth_proof(TOKEN, "client", server, client, claim), claim)
    assert shake.closed and not shake.handshake.authenticated


def test_auth_from_a_peer_already_gone_checks_nothing_and_charges_nobody(engine, shake):
    hello(shake)
    shake.transport.key = None  # (its socket closed: whom it was cannot be told)
    auth(shake, bytes(PROOF_BYTES))
    assert shake.aborted and not shake.fatals and engine.stats.auth["failures"] == 0


def test_after_failures_an_auth_waits_its_turn(engine, shake, loop):
    """A principal that failed FREE times is checked only after a delay (throttled)."""
    throttle = shake.handshake.throttle
    for _ in range(AuthThrottle.FREE):
        throttle.failed("uid 1", loop.time())
    client, server, _, _ = hello(shake)
    auth(shake, auth_proof(TOKEN, "client", server, client))
    assert shake.ops() == [Op.HELLO_REPLY] and engine.stats.auth["throttled"] == 1  # not checked yet
    loop.run_until_complete(asyncio.sleep(AuthThrottle.BASE_S * 1.5))
    assert shake.ops() == [Op.HELLO_REPLY, Op.AUTH_REPLY] and shake.handshake.authenticated


def test_a_throttled_auth_whose_connection_went_away_is_not_answered(engine, shake, loop):
    throttle = shake.handshake.throttle
    for _ in range(AuthThrottle.FREE):
        throttle.failed("uid 1", loop.time())
    client, server, _, _ = hello(shake)
    auth(shake, auth_proof(TOKEN, "client", server, client))
    shake.gone = True
    loop.run_until_complete(asyncio.sleep(AuthThrottle.BASE_S * 1.5))
    assert shake.ops() == [Op.HELLO_REPLY] and not shake.handshake.authenticated


def test_an_auth_that_would_wait_too_long_is_refused_as_overload(engine, shake, loop):
    """Its principal's other connections already wait their turns, each longer."""
    throttle = shake.handshake.throttle
    for _ in range(AuthThrottle.FREE + 8):
        throttle.failed("uid 1", loop.time())
    while throttle.wait("uid 1", loop.time()) is not None:
        pass
    hello(shake)
    auth(shake, bytes(PROOF_BYTES))
    assert isinstance(shake.fatals[0], ServerOverloaded) and engine.stats.auth["refused"] == 1


def test_refuse_counts_and_raises(engine, shake):
    with pytest.raises(AuthenticationError, match="authentication failed: because; the server needs its token"):
        refuse(shake, "because")
    assert engine.stats.auth["failures"] == 1


# Through a connection -------------------------------------------------------------------------------
def connect(engine, token):
    conn = TcpTransport(engine.stats.traffic["tcp"], 0,
                        lambda transport: Connection(engine, transport, 1 << 20, set(), token=token))
    sock = FakeSocket()
    conn.connection_made(sock)
    return conn, sock


def frames(sock):
    out, pos = [], 0
    while pos < len(sock.out):
        header = unpack_header(sock.out[pos : pos + HEADER_SIZE])
        out.append((header, bytes(sock.out[pos + HEADER_SIZE : pos + HEADER_SIZE + header.length])))
        pos += HEADER_SIZE + header.length
    return out


def connection_hello(tcp, sock, loop):
    client = os.urandom(NONCE_BYTES)
    feed(tcp, frame(Op.HELLO, client, rid=1))
    loop.run_until_complete(asyncio.sleep(0))
    header, payload = frames(sock)[-1]
    assert header.op == Op.HELLO_REPLY
    return client, decode_hello_reply(payload)[1]


def test_hello_then_auth_through_a_connection_opens_it(loop):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    tcp, sock = connect(engine, TOKEN)
    client, server = connection_hello(tcp, sock, loop)
    feed(tcp, frame(Op.AUTH, auth_proof(TOKEN, "client", server, client), rid=2))
    loop.run_until_complete(asyncio.sleep(0))
    header, payload = frames(sock)[-1]
    assert (header.op, header.request_id) == (Op.AUTH_REPLY, 2)
    assert decode_auth_reply(payload)[0] == auth_proof(TOKEN, "server", server, client, payload[PROOF_BYTES:])
    assert tcp.receiver.authenticated and tcp.receiver.trusted
    feed(tcp, frame(Op.PING, rid=3))  # open: anything may be asked now
    loop.run_until_complete(asyncio.sleep(0))
    assert [h.op for h, _ in frames(sock)] == [Op.HELLO_REPLY, Op.AUTH_REPLY, Op.PING_REPLY] and not sock.closed


def test_a_wrong_proof_through_a_connection_closes_it_and_counts_a_failure(loop):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    tcp, sock = connect(engine, TOKEN)
    client, server = connection_hello(tcp, sock, loop)
    feed(tcp, frame(Op.AUTH, auth_proof(b"w" * 32, "client", server, client), rid=2))
    loop.run_until_complete(asyncio.sleep(0))
    header, payload = frames(sock)[-1]
    assert header.op == Op.ERROR and header.request_id == 0  # (fatal: about the connection, not the request)
    assert decode_error(payload)[0] == ErrorCode.AUTHENTICATION
    assert sock.closed and engine.stats.auth["failures"] == 1 and not tcp.receiver.authenticated


@pytest.mark.parametrize("op", [Op.PING, Op.INIT, Op.STATS])
def test_a_request_before_the_handshake_is_fatal(loop, op):
    engine = Engine(ServerConfig(workers=1, sync="asp"))
    tcp, sock = connect(engine, TOKEN)
    feed(tcp, frame(op, b"x" * 64 if op == Op.INIT else b""))
    header, payload = frames(sock)[0]
    assert header.op == Op.ERROR and decode_error(payload)[0] == ErrorCode.AUTHENTICATION
    assert f"a {op.name} request before the handshake" in decode_error(payload)[1]
    assert sock.closed and engine.stats.auth["failures"] == 1 and len(frames(sock)) == 1
