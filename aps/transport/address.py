"""Server addresses: ``tcp://HOST:PORT``, or ``tls://HOST:PORT`` for TCP with TLS."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ConfigurationError

__all__ = ["SCHEMES", "Address", "format_address", "parse_address"]

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
        raise ConfigurationError(f"unsupported address scheme {scheme!r} in {text!r}: expected tcp://HOST:PORT "
                                 "or tls://HOST:PORT")
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
