"""Socket options both ends of a TCP connection set."""

from __future__ import annotations

import socket

__all__ = ["set_nodelay"]


def set_nodelay(sock: socket.socket | None) -> None:
    """Send small frames at once (no Nagle delay); a no-op for non-TCP sockets."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
