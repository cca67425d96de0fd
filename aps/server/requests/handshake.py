"""The handshake (docs/protocol.md, "Authentication"): HELLO, then AUTH where the server has a
token, whose failures are throttled by who made them.

A connection holds one :class:`aps.server.handshake.Handshake`, the state its handshake keeps
across requests (the nonces, whether the peer proved the token); :class:`Hello` and
:class:`Auth` are the handlers of its two ops, and :func:`refuse` ends a failed one.
"""

from __future__ import annotations

import hmac
import os
from typing import TYPE_CHECKING, NoReturn

from ...errors import AuthenticationError, ServerOverloaded
from ...wire.protocol import (
    MAX_CLAIM_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    Op,
    auth_proof,
    decode_claim,
    encode_hello,
    encode_hello_reply,
    host_identity,
)
from ..admission import _auth_failures
from .base import Handler

if TYPE_CHECKING:
    from ..engine import Engine
    from .base import Exchange, Request

__all__ = ["HANDLERS", "Auth", "Hello", "refuse"]


def refuse(conn: Exchange, what: str) -> NoReturn:
    """The peer failed the handshake: log it (rate-limited, with its address), count it,
    raise the AuthenticationError that closes the connection."""
    conn.engine.stats.auth["failures"] += 1
    _auth_failures.warning(conn.loop.time(), "%s: authentication failed: %s; closing the connection", conn.peer, what)
    raise AuthenticationError(
        f"authentication failed: {what}; the server needs its token (aps.Worker(token=...) or $APS_TOKEN)"
    )


class Hello(Handler):
    """HELLO: the server says who it is, whether it needs the token, and a fresh nonce."""

    op = Op.HELLO
    payload_limit = NONCE_BYTES

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        shake, engine = conn.handshake, conn.engine
        if not shake.authenticated:
            shake.hellos += 1
            if shake.hellos > 2:
                refuse(conn, "HELLO after HELLO without AUTH")
        shake.client_nonce = bytes(payload)
        shake.server_nonce = os.urandom(NONCE_BYTES)  # fresh for every HELLO: no proof is reused
        conn.reply(
            request,
            Op.HELLO_REPLY,
            payload=encode_hello_reply(
                not shake.authenticated,
                shake.server_nonce,
                host_identity(),
                conn.unix_path,
                engine.durability.run_id,
                engine.durability.shard_description,
                engine.durability.lineage_text,
            ),
        )


class Auth(Handler):
    """AUTH: the peer proves it knows the token (and says which run and shard it means); the
    server proves it back. Guesses are throttled by who makes them (AuthThrottle): a principal
    that has not failed is checked at once; one that has waits its turn, longer and longer."""

    op = Op.AUTH
    payload_limit = PROOF_BYTES + MAX_CLAIM_BYTES
    payload_min = PROOF_BYTES

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        shake, engine = conn.handshake, conn.engine
        if shake.token is None:
            raise AuthenticationError("this server has no token (it was started without --token)")
        if not shake.server_nonce or len(shake.client_nonce) != NONCE_BYTES:
            refuse(conn, "AUTH without a HELLO carrying a nonce first")
        if shake.auth_key is None:
            shake.auth_key = conn.transport.auth_key()
            if shake.auth_key is None:  # its socket closed already: nothing is checked, nobody charged
                conn.abort()
                return
        key = shake.auth_key
        wait = shake.throttle.wait(key, conn.loop.time())
        proof = bytes(payload)
        if wait is None:
            engine.stats.auth["refused"] += 1
            _auth_failures.warning(
                conn.loop.time(), "%s: refused an AUTH attempt: %s has too many waiting", conn.peer, key
            )
            conn.fatal(
                ServerOverloaded(f"too many authentication attempts from {key} after failed ones: try again later"),
                warn=False,
            )
        elif wait > 0:
            engine.stats.auth["throttled"] += 1
            conn.loop.call_later(wait, self.check, conn, request, proof)
        else:
            self.check(conn, request, proof)

    def check(self, conn: Exchange, request: Request, payload: bytes) -> None:
        """Check a proof, its turn come."""
        shake, engine = conn.handshake, conn.engine
        key, token = shake.auth_key, shake.token
        assert key is not None and token is not None
        shake.throttle.checked(key)
        if conn.lost:
            return
        proof, claim = payload[:PROOF_BYTES], payload[PROOF_BYTES:]
        expected = auth_proof(token, "client", shake.server_nonce, shake.client_nonce, claim)
        if not hmac.compare_digest(expected, proof):
            shake.throttle.failed(key, conn.loop.time())
            try:
                refuse(conn, f"a wrong token (from {key})")
            except AuthenticationError as exc:
                conn.fatal(exc, warn=False)
            return
        shake.throttle.succeeded(key)
        said = encode_hello(
            host_identity(),
            conn.unix_path,
            engine.durability.run_id,
            engine.durability.shard_description,
            engine.durability.lineage_text,
        )
        proof = auth_proof(token, "server", shake.server_nonce, shake.client_nonce, claim + said)
        shake.server_nonce = b""  # one AUTH per nonce
        conn.reply(request, Op.AUTH_REPLY, payload=proof + said)
        mismatch = _not_me(engine, decode_claim(claim))
        if mismatch is None:
            shake.authenticated = True
            return
        # The token's holder means another server: its proof, relayed here, opens nothing. It
        # has the truth (proved) to tell why, and the connection closes.
        _auth_failures.warning(conn.loop.time(), "%s: a proof meant for %s: not opened", conn.peer, mismatch)
        conn.close()


def _not_me(engine: Engine, claim: dict[str, str]) -> str | None:
    """What of a client's claim is not this server (None: all of it is, or it claims nothing)."""
    config, run = engine.config, claim.get("run")
    if run and run != engine.durability.run_id:
        return f"run {run}"
    shard = claim.get("shard")
    if shard and shard != f"{config.shard}/{config.shards}":
        return f"shard {shard}"
    return None


#: This module's handlers (aps.server.requests.HANDLERS gathers them).
HANDLERS = (Hello(), Auth())
