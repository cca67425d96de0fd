"""What a connection's handshake keeps across its requests (docs/protocol.md,
"Authentication"): the nonces said, whether the peer proved the token. The handlers of HELLO
and AUTH are in :mod:`aps.server.requests.handshake`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .admission import AuthThrottle

__all__ = ["Handshake"]


class Handshake:
    """One connection's handshake: what it said and proved so far.

    Args:
        token: the shared secret a peer must prove it knows before anything else is
            served; None: no authentication.
        throttle: the server's failed-AUTH throttle.
    """

    __slots__ = ("token", "authenticated", "server_nonce", "client_nonce", "hellos", "auth_key", "throttle")

    def __init__(self, token: bytes | None, throttle: AuthThrottle) -> None:
        self.token = token
        self.authenticated = token is None
        self.server_nonce = b""
        self.client_nonce = b""
        self.hellos = 0
        #: Whom failed AUTHs count against, found at the first.
        self.auth_key: str | None = None
        self.throttle = throttle

    @property
    def proved(self) -> bool:
        """The peer proved that it knows the server's token."""
        return self.token is not None and self.authenticated
