"""What a connection may cost before it is a worker: strangers' share of the event loop
(:class:`StrangerGuard`), failed AUTH attempts by who made them (:class:`AuthThrottle`), and
warnings about floods of them (:class:`RateLimitedLog`). :class:`Connections` holds a
server's connections and what they share."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["AuthThrottle", "Connections", "RateLimitedLog", "StrangerGuard"]

log = logging.getLogger("aps.server")


class Waiting(Protocol):
    """A connection holding a stranger's request for its turn (:class:`StrangerGuard`)."""

    @property
    def peer_key(self) -> str: ...

    @property
    def lost(self) -> bool: ...

    loop: asyncio.AbstractEventLoop

    def serve_parked(self) -> None: ...


#: Strangers (connections that have not joined as workers) get at most this share of the
#: event loop's time for their requests, all of them together; members' frames go first.
STRANGER_SHARE = 0.10
#: ... and may run ahead of it by this many seconds (a burst), or behind by as many.
STRANGER_BURST_S = 0.05
#: Requests of strangers served in one turn before the loop looks at its sockets again.
STRANGERS_PER_TURN = 8
#: Bytes of INIT layout blocks being read, all connections together, beyond each one's
#: first piece (a layout block costs what its sender has sent, and the sum is bounded).
LAYOUT_BUDGET = 32 << 20
#: Seconds after a stranger's memory is let go before freed heap is handed back to the OS.
TRIM_AFTER_S = 1.0


class AuthThrottle:
    """Failed AUTH attempts, by who made them (:func:`aps.server.peers.principal`: a local user
    by uid, a remote peer by address), and all of them together.

    A principal that has not failed is checked at once, always: nobody else's failures
    delay or refuse it (another user of the host guessing on loopback shares its address
    with every local worker, not its uid). After :attr:`FREE` failures a principal's
    attempts wait their turn, exponentially longer (from :attr:`BASE_S`, at most
    :attr:`MAX_DELAY_S`; the turns of its parallel connections are taken one after the
    other, each waiting as if those before it failed); an attempt that would wait more than
    :attr:`MAX_WAIT_S` is refused. And once
    all principals together have failed more than the server's budget (:attr:`BURST`,
    refilled at :attr:`RATE` a second), every attempt of a principal that has failed also
    takes a turn of the server's, :attr:`RATE` a second for all of them at once: guessing
    from many addresses is no faster than from one, past their first few tries. A success
    forgets the principal's failures; a principal is forgotten :attr:`FORGET_S` after its
    last failure, and at most :attr:`MAX_PEERS` are remembered (the least recently failed
    go first), so the table's memory is bounded."""

    FREE = 3
    BASE_S = 0.1
    MAX_DELAY_S = 2.0
    MAX_WAIT_S = 5.0  # (below the default --handshake-timeout, which closes a stranger still waiting)
    BURST = 32
    RATE = 10.0
    FORGET_S = 600.0
    MAX_PEERS = 4096

    class _Peer:
        __slots__ = ("failures", "pending", "next_at", "last")

        def __init__(self) -> None:
            self.failures = 0
            self.pending = 0  # attempts given a turn and not yet checked
            self.next_at = self.last = 0.0

    def __init__(self) -> None:
        self._peers: OrderedDict[str, AuthThrottle._Peer] = OrderedDict()
        self._credit = float(self.BURST)  # failures all principals may still have before turns are the server's
        self._refilled = 0.0
        self._server_next_at = 0.0

    def __len__(self) -> int:
        return len(self._peers)

    def _delay(self, failures: int) -> float:
        if failures < self.FREE:
            return 0.0
        return min(self.BASE_S * 2 ** (failures - self.FREE), self.MAX_DELAY_S)

    def _get(self, key: str, now: float) -> AuthThrottle._Peer | None:
        peer = self._peers.get(key)
        if peer is not None and now - peer.last > self.FORGET_S:
            del self._peers[key]
            return None
        return peer

    def _refill(self, now: float) -> float:
        self._credit = min(float(self.BURST), self._credit + (now - self._refilled) * self.RATE)
        self._refilled = now
        return self._credit

    def wait(self, key: str, now: float) -> float | None:
        """Seconds an attempt of ``key`` arriving now waits before it is checked (its turn is
        taken), or None when that would be more than :attr:`MAX_WAIT_S` (refuse it)."""
        peer = self._get(key, now)
        if peer is None or peer.failures == 0:
            return 0.0
        at = max(now, peer.next_at)
        server_turn = self._refill(now) <= 0
        if server_turn:
            at = max(at, self._server_next_at)
        if at - now > self.MAX_WAIT_S:
            return None
        # The attempts already waiting count as failures: guesses sent in parallel wait as
        # long as guesses sent one after the other.
        peer.next_at = at + self._delay(peer.failures + peer.pending)
        peer.pending += 1
        if server_turn:
            self._server_next_at = at + 1.0 / self.RATE
        return at - now

    def failed(self, key: str, now: float) -> None:
        peer = self._get(key, now)
        if peer is None:
            while len(self._peers) >= self.MAX_PEERS:
                self._peers.popitem(last=False)
            peer = self._peers[key] = self._Peer()
        self._peers.move_to_end(key)
        peer.failures += 1
        peer.last = now
        peer.next_at = max(peer.next_at, now + self._delay(peer.failures))
        self._refill(now)
        self._credit = max(-float(self.BURST), self._credit - 1)

    def checked(self, key: str) -> None:
        """An attempt of ``key`` that :meth:`wait` gave a turn was checked (or given up)."""
        peer = self._peers.get(key)
        if peer is not None and peer.pending > 0:
            peer.pending -= 1

    def succeeded(self, key: str) -> None:
        """``key`` proved the token: its failures were typos, or a token since replaced."""
        self._peers.pop(key, None)

    def failures(self, key: str, now: float) -> int:
        peer = self._get(key, now)
        return 0 if peer is None else peer.failures


class StrangerGuard:
    """What the strangers of one server may cost, all of them together (see
    docs/design/server.md, "Strangers"): a share of the loop's time for their requests
    (served after members', in turn), a budget for the layout blocks being read,
    the failed-AUTH throttle, and memory handed back to the OS after they go."""

    def __init__(self) -> None:
        self.layout_free = LAYOUT_BUDGET
        self.throttle = AuthThrottle()
        # the requests waiting their turn, by whom they come from (served round-robin: one
        # user's or address's flood waits behind its own, not in front of another's)
        self._waiting: OrderedDict[str, deque[Waiting]] = OrderedDict()
        self._credit = STRANGER_BURST_S
        self._refilled = time.perf_counter()
        self._turn: asyncio.Handle | None = None
        self._trim: asyncio.TimerHandle | None = None

    def _refill(self) -> float:
        now = time.perf_counter()
        self._credit = min(STRANGER_BURST_S, self._credit + (now - self._refilled) * STRANGER_SHARE)
        self._refilled = now
        return now

    def may_serve_now(self) -> bool:
        """True when a stranger's request may be served at once (nobody waits, credit is left)."""
        if self._waiting:
            return False
        self._refill()
        return self._credit > 0

    def charge(self, seconds: float) -> None:
        self._credit = max(-STRANGER_BURST_S, self._credit - seconds)

    def enqueue(self, conn: Waiting) -> None:
        """``conn`` holds a request for its turn."""
        self._waiting.setdefault(conn.peer_key, deque()).append(conn)
        self._schedule(conn.loop)

    def _next(self) -> Waiting:
        """The next request's connection: the first of the principal whose turn it is."""
        key, queue = next(iter(self._waiting.items()))
        conn = queue.popleft()
        if queue:
            self._waiting.move_to_end(key)
        else:
            del self._waiting[key]
        return conn

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._turn is not None or not self._waiting:
            return
        self._refill()
        if self._credit > 0:
            self._turn = loop.call_soon(self._serve, loop)  # after the callbacks ready now: members' I/O
        else:
            self._turn = loop.call_later(-self._credit / STRANGER_SHARE + 1e-3, self._serve, loop)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._turn = None
        served = 0
        while self._waiting and served < STRANGERS_PER_TURN:
            started = self._refill()
            if self._credit <= 0:
                break
            conn = self._next()
            if conn.lost:
                continue
            served += 1
            conn.serve_parked()
            self.charge(time.perf_counter() - started)
        self._schedule(loop)

    def released(self, loop: asyncio.AbstractEventLoop) -> None:
        """A stranger's buffers were let go: hand freed heap back to the OS soon (once for many)."""
        if self._trim is None and _malloc_trim is not None:
            self._trim = loop.call_later(TRIM_AFTER_S, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        _malloc_trim(0)


class ReplyGate(Protocol):
    """What holds a reply until a failover can no longer take it back (a replica set's primary:
    :class:`aps.server.replicas.Replicator`)."""

    def hold(self, send: Callable[[], None]) -> None:
        """Call ``send`` once every backup holds the state as of now (maybe at once)."""


class Connections(set):
    """The open connections of one server, and what they share (:attr:`guard`, :attr:`replication`)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.guard = StrangerGuard()
        #: Replies wait here until the backups hold what they tell; None: sent at once.
        self.replication: ReplyGate | None = None


def _find_malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere): freed memory in the middle of the heap is
    kept by the allocator for reuse unless it is asked to give it back."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


class RateLimitedLog:
    """Warnings about events that come in floods (refused connections, accept
    failures): at most ``limit`` per ``window`` seconds, then one summary."""

    def __init__(self, limit: int = 5, window: float = 60.0, logger: logging.Logger | None = None) -> None:
        self.limit, self.window = limit, window
        self._log = logger or log
        self._since, self._count, self._dropped = float("-inf"), 0, 0

    def warning(self, now: float, message: str, *args) -> None:
        if now - self._since >= self.window:
            if self._dropped:
                self._log.warning("... and %d more like it in the last %.0f s", self._dropped, now - self._since)
            self._since, self._count, self._dropped = now, 0, 0
        if self._count < self.limit:
            self._count += 1
            self._log.warning(message, *args)
        else:
            self._dropped += 1


_refusals = RateLimitedLog()
_auth_failures = RateLimitedLog()
# Warnings about connections that have not joined (strangers, probes, fuzzers), all of them
# together: many connections must not flood the log any more than one may.
_strangers = RateLimitedLog(limit=50)
