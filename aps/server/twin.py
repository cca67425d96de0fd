"""One run, one live server: before a server resumes a run from a checkpoint, it asks the
address the checkpoint's writer served at whether that run is still served there (a copy
of a live run's checkpoints, resumed elsewhere, would be a second server of one run, under
one run id). Workers check the other way round, at every connection: the server's lineage
must hold the incarnation that last served them (aps.client.core)."""

from __future__ import annotations

import hmac
import os
import socket

from ..errors import APSError
from ..wire.net import parse_address
from ..wire.protocol import (
    HEADER_SIZE,
    NONCE_BYTES,
    Op,
    ServerInfo,
    auth_proof,
    decode_auth_reply,
    decode_hello_reply,
    pack_header,
    unpack_header,
)
from ..wire.tokens import token_path

__all__ = ["serving_run"]

#: Seconds the question may take (the answer of a live server on loopback takes a millisecond).
PROBE_TIMEOUT_S = 2.0
_ANY = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def serving_run(address: object, token: bytes | None, timeout: float = PROBE_TIMEOUT_S) -> ServerInfo | None:
    """What the server at ``address`` (``tcp://HOST:PORT``) says of itself, when one answers
    there and proves it knows ``token`` (or the token its user's file keeps for that address,
    when the two users are one); None when none answers, it cannot be asked (TLS), or it
    cannot prove a token: nothing can be told of it. ``token`` is sent proofs of only where
    the address comes from a checkpoint signed with it (a forged address could relay them)."""
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
    # that made its own; not another loopback name's: a proof is worth something to whoever
    # can relay it to the server it belongs to), then this server's (one given to both).
    tokens = [t for t in dict.fromkeys((_token_of(host, parsed.port), token)) if t is not None]
    for secret in tokens or [None]:
        try:
            info = _ask(host, parsed.port, secret, timeout)
        except (OSError, APSError, ValueError):
            return None  # nothing answers there, or not as a server of ours does
        if info is not None:
            return info
    return None


def _token_of(host: str, port: int) -> bytes | None:
    try:
        with open(token_path(host, port), "rb") as held:
            info = os.fstat(held.fileno())
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                return None
            return held.read(4096).strip() or None
    except OSError:
        return None


def _ask(host: str, port: int, secret: bytes | None, timeout: float) -> ServerInfo | None:
    """HELLO (and AUTH with ``secret`` where asked): what the server says of itself, or None."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        nonce = os.urandom(NONCE_BYTES)
        op, payload = _exchange(sock, Op.HELLO, nonce)
        if op != Op.HELLO_REPLY:
            return None
        required, server_nonce, info = decode_hello_reply(payload)
        if not required:
            return info
        if secret is None:
            return None
        op, payload = _exchange(sock, Op.AUTH, auth_proof(secret, "client", server_nonce, nonce))
        if op != Op.AUTH_REPLY:
            return None
        proof, info = decode_auth_reply(payload)
        return info if hmac.compare_digest(proof, auth_proof(secret, "server", server_nonce, nonce)) else None


def _exchange(sock: socket.socket, op: int, payload: bytes) -> tuple[int, bytes]:
    sock.sendall(pack_header(op, request_id=1, length=len(payload)) + payload)
    header = unpack_header(_read(sock, HEADER_SIZE), max_payload=1 << 16)
    return header.op, _read(sock, header.length)


def _read(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)
