"""Who is at the other end of a connection, for what a connection may cost and whom its
failed handshakes count against (:class:`aps.server.admission.AuthThrottle`): a peer on this
host by its user, a remote one by its address.

A peer on this host reaches the server from a loopback address (any of 127/8: every local
user may send from any of them) or from one of the host's own; its user is the owner of its
end of the connection, which the kernel tells by the connection's four addresses
(``sock_diag``, what ``ss -e`` asks; ``/proc/net/tcp`` where that is not there). Only a live
socket counts: one its process has closed (TIME_WAIT, or orphaned and still closing) has no
owner left, and the table shows such sockets as root's.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

__all__ = ["GONE", "principal", "tcp_peer_uid"]

#: :func:`tcp_peer_uid`'s answer for a peer whose socket is closed already (no owner left).
GONE = -1

# linux/sock_diag.h, linux/inet_diag.h: one socket asked for by its four addresses.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBxI")  # inet_diag_req_v2: family, protocol, extensions, (pad), states
_SOCKID = struct.Struct(">HH16s16s")  # inet_diag_sockid: source port, destination port, addresses (then if, cookie)
_SOCKID_TAIL = struct.Struct("=III")  # its interface and cookie (INET_DIAG_NOCOOKIE: any)
# inet_diag_msg: family, state, timer, retrans, (id), expires, queues, uid, inode
_MESSAGE = struct.Struct("=BBBB48xIIIII")
_NO_COOKIE = 0xFFFFFFFF


def principal(peer: object, local: object) -> str | None:
    """Whom a TCP connection from ``peer`` to ``local`` (socket addresses) counts as: a peer
    on this host by its user (``uid N``), a remote IPv4 peer by its address, an IPv6 one by its
    /64 (what one host is given); None when the peer is on this host and its socket is closed
    already (it is gone: nothing it asked for is answered)."""
    if not isinstance(peer, tuple) or not isinstance(local, tuple):
        return str(peer)
    address = _address(peer[0])
    if address is None:
        return str(peer[0])
    if address.is_loopback or address == _address(local[0]):  # (a peer on this host, by any of its addresses)
        uid = tcp_peer_uid(peer, local)
        if uid == GONE:
            return None
        return f"uid {uid}" if uid is not None else str(address)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def tcp_peer_uid(peer: tuple, local: tuple) -> int | None:
    """The uid of the process that owns the other end of the TCP connection from ``peer`` to
    ``local``, when that end is on this host; :data:`GONE` when it is there but closed (no
    owner left); None when nothing can be told (not Linux, or neither way of asking works)."""
    try:
        return _ask_kernel(peer, local)
    except OSError:
        return _read_table(peer, local)


def _address(host: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _as_v6(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    if isinstance(address, ipaddress.IPv4Address):
        return b"\0" * 10 + b"\xff\xff" + address.packed  # as a dual-stack socket holds it
    return address.packed


def _ask_kernel(peer: tuple, local: tuple) -> int:
    """The peer's socket asked of the kernel by its four addresses (``sock_diag``): its
    owner's uid, or GONE. Raises OSError when the kernel cannot be asked."""
    theirs, mine = _address(peer[0]), _address(local[0])
    if theirs is None or mine is None:
        raise OSError(errno.EINVAL, "not an IP address")
    families = [(socket.AF_INET6, _as_v6(theirs), _as_v6(mine))]
    if isinstance(theirs, ipaddress.IPv4Address) and isinstance(mine, ipaddress.IPv4Address):
        families.insert(0, (socket.AF_INET, theirs.packed.ljust(16, b"\0"), mine.packed.ljust(16, b"\0")))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(1.0)
        for family, source, destination in families:
            request = (
                _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
                + _SOCKID.pack(peer[1], local[1], source, destination)
                + _SOCKID_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
            )
            diag.send(_NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request)
            answer = diag.recv(8192)
            _, kind, _, _, _ = _NLMSG.unpack_from(answer)
            if kind == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", answer, _NLMSG.size)
                if code == -errno.ENOENT:
                    continue  # not a socket of this family
                raise OSError(-code, "sock_diag refused the question")
            if kind != _SOCK_DIAG_BY_FAMILY or len(answer) < _NLMSG.size + _MESSAGE.size:
                raise OSError(errno.EPROTO, "sock_diag answered something else")
            _, _, _, _, _, _, _, uid, inode = _MESSAGE.unpack_from(answer, _NLMSG.size)
            return uid if inode else GONE  # (TIME_WAIT, orphaned: no process holds it)
    return GONE  # (asked in every family: no such socket, it is closed and gone)


def _read_table(peer: tuple, local: tuple) -> int | None:
    """:func:`tcp_peer_uid` from ``/proc/net/tcp`` and ``tcp6`` (every socket of the network
    namespace, one line each: its addresses, state, owner and inode)."""
    theirs, mine = _address(peer[0]), _address(local[0])
    if theirs is None or mine is None:
        return None
    wanted = []
    if isinstance(theirs, ipaddress.IPv4Address) and isinstance(mine, ipaddress.IPv4Address):
        wanted.append(("/proc/net/tcp", _hex(theirs.packed, peer[1]), _hex(mine.packed, local[1])))
    wanted.append(("/proc/net/tcp6", _hex(_as_v6(theirs), peer[1]), _hex(_as_v6(mine), local[1])))
    read = False
    for path, source, destination in wanted:
        try:
            with open(path, "rb") as table:
                read = True
                for line in table:
                    fields = line.split()
                    if len(fields) > 9 and fields[1] == source and fields[2] == destination:
                        return int(fields[7]) if int(fields[9]) else GONE
        except (OSError, ValueError):
            continue
    return GONE if read else None


def _hex(packed: bytes, port: int) -> bytes:
    """An address and port as ``/proc/net/tcp`` writes them: the address's 32-bit words in the
    host's byte order, in hexadecimal, then the port."""
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return ("".join(f"{word:08X}" for word in words) + f":{port:04X}").encode()
