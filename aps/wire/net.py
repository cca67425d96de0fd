"""The network both ends share: server addresses (``tcp://HOST:PORT``, or
``tls://HOST:PORT`` for TCP with TLS), the TLS contexts (the server's from its
flags, a worker's from its options) and the socket options both ends of a TCP
connection set."""

from __future__ import annotations

import os
import socket
import ssl
from typing import NamedTuple

from ..errors import ConfigurationError

__all__ = [
    "SCHEMES",
    "Address",
    "client_context",
    "connect_failure",
    "format_address",
    "parse_address",
    "server_context",
    "set_keepalive",
    "set_nodelay",
]

SCHEMES = ("tcp", "tls")


class Address(NamedTuple):
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return format_address(self.host, self.port, self.scheme)


def format_address(host: str, port: int, scheme: str = "tcp") -> str:
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def parse_address(text: str) -> Address:
    """Parse ``tcp://host:port`` or ``tls://host:port`` (the scheme may be omitted: tcp;
    IPv6 hosts go in brackets)."""
    if not isinstance(text, str) or not text:
        raise ConfigurationError(f"invalid server address {text!r}: expected tcp://HOST:PORT")
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"unsupported address scheme {scheme!r} in {text!r}: expected tcp://HOST:PORT or tls://HOST:PORT"
        )
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or not tail.startswith(":"):
            raise ConfigurationError(f"invalid server address {text!r}: expected tcp://[IPV6]:PORT")
        port_text = tail[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon or not host:
            raise ConfigurationError(f"invalid server address {text!r}: expected tcp://HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigurationError(f"invalid port {port_text!r} in {text!r}: expected tcp://HOST:PORT") from None
    if not 0 < port <= 65535:
        raise ConfigurationError(f"port {port} out of range 1..65535 in {text!r}: expected tcp://HOST:PORT")
    return Address(scheme, host, port)


def connect_failure(host: str, exc: OSError) -> str:
    """Why a connection to (or a listener on) ``host`` failed, in words: a name that does not
    resolve is ``host not found: HOST``, not the resolver's bare error number."""
    if isinstance(exc, socket.gaierror):
        if exc.errno in _NOT_FOUND:
            return f"host not found: {host} (is the name right, and known to this machine's DNS or /etc/hosts?)"
        return f"cannot look up host {host}: {exc.strerror or exc}"
    return os.strerror(exc.errno) if exc.errno else str(exc)


#: What getaddrinfo says of a name no resolver knows (EAI_NODATA: the name has no address).
_NOT_FOUND = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name))


# TLS


def server_context(cert: str, key: str | None, ca: str | None) -> ssl.SSLContext:
    """TLS 1.2+ with the certificate (and key); client certificates required when ``ca`` is given."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
        if ca is not None:
            context.load_verify_locations(ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"cannot load the TLS certificate, key or CA: {exc}") from None
    return context


def client_context(tls: bool | ssl.SSLContext | None) -> ssl.SSLContext | None:
    """The context a worker connects with: ``tls`` itself when it is one; for True, the
    system's trusted CAs (or ``$APS_TLS_CA``), with ``$APS_TLS_CERT`` and ``$APS_TLS_KEY``
    as the worker's own certificate when set; None for plain TCP."""
    if isinstance(tls, ssl.SSLContext):
        return tls
    if not tls:
        return None
    try:
        context = ssl.create_default_context(cafile=os.environ.get("APS_TLS_CA") or None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if os.environ.get("APS_TLS_CERT"):
            context.load_cert_chain(os.environ["APS_TLS_CERT"], os.environ.get("APS_TLS_KEY") or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"cannot load $APS_TLS_CA, $APS_TLS_CERT or $APS_TLS_KEY: {exc}") from None
    return context


# Socket options


def set_nodelay(sock: socket.socket | None) -> None:
    """Send small frames at once (no Nagle delay); a no-op for non-TCP sockets."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def set_keepalive(sock: socket.socket | None, seconds: float | None) -> None:
    """Let the kernel find a peer whose host or network is gone within about ``seconds``.

    Keepalive probes after ``seconds / 2`` of silence (three, ``seconds / 6``
    apart) find a host that vanished while the connection was idle; the user
    timeout (``TCP_USER_TIMEOUT``) drops a connection whose sent data has gone
    unacknowledged for ``seconds``, so a write to a vanished host fails instead
    of being retried for about 15 minutes. A peer that is alive but stuck
    (stopped, or not reading) still acknowledges at the TCP level: the
    application's own deadlines catch that. A no-op for non-TCP sockets and
    for ``seconds`` None or 0.
    """
    if sock is None or not seconds or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", max(1, int(seconds / 2))),
        ("TCP_KEEPINTVL", max(1, int(seconds / 6))),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", max(1000, int(seconds * 1000))),
    ):
        if hasattr(socket, option):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
