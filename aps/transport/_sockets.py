"""Socket options both ends of a TCP connection set."""

from __future__ import annotations

import socket

__all__ = ["set_keepalive", "set_nodelay"]


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
