"""The handshake of a connection (docs/protocol.md, "Authentication"): HELLO, then AUTH where
the server has a token, whose failures are throttled by who made them (a mixin of
:class:`aps.server.session.ServerSession`, which holds the state it reads)."""

from __future__ import annotations

import hmac
import os
from typing import TYPE_CHECKING, NoReturn

from ..errors import AuthenticationError, ServerOverloaded
from ..wire.protocol import (
    NONCE_BYTES,
    PROOF_BYTES,
    Header,
    Op,
    auth_proof,
    decode_claim,
    encode_hello,
    encode_hello_reply,
    host_identity,
)
from .admission import _auth_failures

if TYPE_CHECKING:
    import asyncio

    from .admission import StrangerGuard
    from .engine import Engine

__all__ = ["Handshake"]


class Handshake:
    """HELLO and AUTH, for :class:`aps.server.session.ServerSession`."""

    engine: Engine
    peer: str
    peer_key: str
    _auth_key: str | None
    unix_path: str
    _loop: asyncio.AbstractEventLoop
    _guard: StrangerGuard
    _token: bytes | None
    _authenticated: bool
    _hellos: int
    _lost: bool
    _server_nonce: bytes
    _client_nonce: bytes

    def _on_hello(self, header: Header, payload: memoryview, stream) -> None:
        if not self._authenticated:
            self._hellos += 1
            if self._hellos > 2:
                self._auth_failed("HELLO after HELLO without AUTH")
        self._client_nonce = bytes(payload)
        self._server_nonce = os.urandom(NONCE_BYTES)  # fresh for every HELLO: no proof is reused
        required = not self._authenticated
        self._reply(Op.HELLO_REPLY, payload=encode_hello_reply(required, self._server_nonce, host_identity(),
                                                              self.unix_path, self.engine.run_id,
                                                              self.engine.shard_description, self.engine.lineage_text))

    def _on_auth(self, header: Header, payload: memoryview, stream) -> None:
        if self._token is None:
            raise AuthenticationError("this server has no token (it was started without --token)")
        if not self._server_nonce or len(self._client_nonce) != NONCE_BYTES:
            self._auth_failed("AUTH without a HELLO carrying a nonce first")
        # Guesses are throttled by who makes them (AuthThrottle): a principal that has not
        # failed is checked at once; one that has waits its turn, longer and longer.
        if self._auth_key is None:
            self._auth_key = self._find_auth_key()
            if self._auth_key is None:  # its socket closed already: nothing is checked, nobody charged
                self.abort()
                return
        wait = self._guard.throttle.wait(self._auth_key, self._loop.time())
        proof = bytes(payload)
        if wait is None:
            self.engine.stats.auth["refused"] += 1
            _auth_failures.warning(self._loop.time(), "%s: refused an AUTH attempt: %s has too many waiting",
                                   self.peer, self._auth_key)
            self._fatal(ServerOverloaded(
                f"too many authentication attempts from {self._auth_key} after failed ones: try again later"),
                warn=False)
        elif wait > 0:
            self.engine.stats.auth["throttled"] += 1
            self._loop.call_later(wait, self._check_proof, proof)
        else:
            self._check_proof(proof)

    def _find_auth_key(self) -> str | None:
        """Whom this connection's failed AUTH attempts count against (see
        :func:`aps.server.peers.principal`; None: the peer is gone)."""
        return self.peer_key

    def _check_proof(self, payload: bytes) -> None:
        self._guard.throttle.checked(self._auth_key)
        if self._lost:
            return
        proof, claim = payload[:PROOF_BYTES], payload[PROOF_BYTES:]
        expected = auth_proof(self._token, "client", self._server_nonce, self._client_nonce, claim)
        if not hmac.compare_digest(expected, proof):
            self._guard.throttle.failed(self._auth_key, self._loop.time())
            try:
                self._auth_failed(f"a wrong token (from {self._auth_key})")
            except AuthenticationError as exc:
                self._fatal(exc, warn=False)
            return
        self._guard.throttle.succeeded(self._auth_key)
        engine = self.engine
        said = encode_hello(host_identity(), self.unix_path, engine.run_id, engine.shard_description,
                            engine.lineage_text)
        proof = auth_proof(self._token, "server", self._server_nonce, self._client_nonce, claim + said)
        self._server_nonce = b""  # one AUTH per nonce
        self._reply(Op.AUTH_REPLY, payload=proof + said)
        mismatch = self._not_me(decode_claim(claim))
        if mismatch is None:
            self._authenticated = True
            return
        # The token's holder means another server: its proof, relayed here, opens nothing. It
        # has the truth (proved) to tell why, and the connection closes.
        _auth_failures.warning(self._loop.time(), "%s: a proof meant for %s: not opened", self.peer, mismatch)
        self.close()

    def _not_me(self, claim: dict[str, str]) -> str | None:
        """What of a client's claim is not this server (None: all of it is, or it claims nothing)."""
        config, run = self.engine.config, claim.get("run")
        if run and run != self.engine.run_id:
            return f"run {run}"
        shard = claim.get("shard")
        if shard and shard != f"{config.shard}/{config.shards}":
            return f"shard {shard}"
        return None

    def _auth_failed(self, what: str) -> NoReturn:
        """The peer failed the handshake: log it (rate-limited, with its address), count it, refuse, close."""
        self.engine.stats.auth["failures"] += 1
        _auth_failures.warning(self._loop.time(), "%s: authentication failed: %s; closing the connection",
                               self.peer, what)
        raise AuthenticationError(
            f"authentication failed: {what}; the server needs its token (aps.Worker(token=...) or $APS_TOKEN)"
        )
