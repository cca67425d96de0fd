"""TLS for TCP connections: the server's context from its flags, a worker's from its options."""

from __future__ import annotations

import os
import ssl

from ..errors import ConfigurationError

__all__ = ["client_context", "server_context"]


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
