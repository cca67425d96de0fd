"""One run, one live server: before a server resumes a run from a checkpoint, it asks the
address the checkpoint's writer served at whether that run is still served there (a copy
of a live run's checkpoints, resumed elsewhere, would be a second server of one run, under
one run id). Workers check the other way round, at every connection: the server's lineage
must hold the incarnation that last served them (aps.client.core)."""

from __future__ import annotations

import hmac
import os
import socket
import time

from ..errors import APSError, ConfigurationError
from ..wire.net import parse_address
from ..wire.protocol import (
    HEADER_SIZE,
    NONCE_BYTES,
    PROOF_BYTES,
    Op,
    ServerInfo,
    auth_proof,
    decode_auth_reply,
    decode_hello_reply,
    pack_header,
    unpack_header,
)
from ..wire.tokens import find_token

__all__ = ["serving_run"]

#: Seconds the whole question may take (a live server on loopback answers in a millisecond).
PROBE_TIMEOUT_S = 2.0
#: The longest reply taken (a HELLO or AUTH reply is a few hundred bytes).
_REPLY_MAX = 16 << 10
_ANY = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def serving_run(
    address: object, token: bytes | None, claim: bytes = b"", timeout: float = PROBE_TIMEOUT_S
) -> ServerInfo | None:
    """What the server at ``address`` (``tcp://HOST:PORT``) says of itself, when one answers
    there and proves it knows ``token`` (or the token its user's file keeps for exactly that
    address, when the two users are one); None when none answers, it cannot be asked (TLS),
    it asks for no token or cannot prove one (nothing it says can be trusted), or it takes
    longer than ``timeout`` seconds in all. ``claim`` (the run and shard asked about) binds
    the proof: relayed to another server, it opens nothing there. ``token`` is proved only
    where the address comes from a checkpoint signed with it."""
    if not isinstance(address, str):
        return None
    try:
        parsed = parse_address(address)
    except (APSError, ValueError):
        return None
    if parsed.scheme != "tcp":
        return None
    host = _ANY.get(parsed.host, parsed.host)
    # The token its user's file keeps for exactly that address first (a server of this user's
    # that made its own; not another loopback name's), then this server's (one given to both).
    try:
        mine = find_token(host, parsed.port, other_loopback_names=False)
    except ConfigurationError:  # (a file another user could have written: not used)
        mine = None
    tokens = [t for t in dict.fromkeys((mine, token)) if t is not None]
    deadline = time.monotonic() + timeout
    for secret in tokens:
        try:
            info = _ask(host, parsed.port, secret, claim, deadline)
        except (OSError, APSError, ValueError):
            return None  # nothing answers there, or not as a server of ours does, in time
        if info is not None:
            return info
    return None


def _ask(host: str, port: int, secret: bytes, claim: bytes, deadline: float) -> ServerInfo | None:
    """HELLO and AUTH with ``secret``: what the server proved of itself, or None."""
    with socket.create_connection((host, port), timeout=_left(deadline)) as sock:
        nonce = os.urandom(NONCE_BYTES)
        op, payload = _exchange(sock, Op.HELLO, nonce, deadline)
        if op != Op.HELLO_REPLY:
            return None
        required, server_nonce, _ = decode_hello_reply(payload)
        if not required:
            return None  # (whoever it is proves nothing of what it says)
        proof = auth_proof(secret, "client", server_nonce, nonce, claim)
        op, payload = _exchange(sock, Op.AUTH, proof + claim, deadline)
        if op != Op.AUTH_REPLY:
            return None
        proof, info = decode_auth_reply(payload)
        said = payload[PROOF_BYTES:]
        proved = hmac.compare_digest(proof, auth_proof(secret, "server", server_nonce, nonce, claim + said))
        return info if proved else None


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the question took too long")
    return left


def _exchange(sock: socket.socket, op: int, payload: bytes, deadline: float) -> tuple[int, bytes]:
    sock.settimeout(_left(deadline))
    sock.sendall(pack_header(op, request_id=1, length=len(payload)) + payload)
    header = unpack_header(_read(sock, HEADER_SIZE, deadline), max_payload=_REPLY_MAX)
    return header.op, _read(sock, header.length, deadline)


def _read(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)
