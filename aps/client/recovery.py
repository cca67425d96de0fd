"""Getting back to a lost server: which errors a worker recovers from, how long it waits
between attempts (capped exponential backoff with jitter), what it says while it waits, and
what is left of the call in flight once it has rejoined (docs/protocol.md, Reconnecting).
The same for the blocking and the asyncio worker: only the sleep differs.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..errors import (
    APSConnectionError,
    APSTimeoutError,
    AuthenticationError,
    RankTaken,
    RunChanged,
    ServerUnproven,
    ShuttingDown,
)
from ..wire.protocol import describe_join_progress
from .tcp import NoServerYet

if TYPE_CHECKING:
    from .core import _ClientCore

__all__: list[str] = []

log = logging.getLogger("aps.worker")

_FIRST_WAIT_NOTE = 5.0  # seconds init waits in silence before it says what it waits for
_WAIT_NOTE_EVERY = 30.0  # and then how often it says it again
_RETRY_NOTE_EVERY = 30.0  # how often a worker that keeps failing to reconnect says so


def _recoverable(exc: BaseException) -> bool:
    """A lost connection that trying again may cure (not a refused token, not another run, not
    a server that shut down for good: one that cannot be resumed, docs/protocol.md). A server
    that cannot prove it knows the token (ServerUnproven) is somebody else on the lost server's
    port: the real one may come back there."""
    if isinstance(exc, ShuttingDown) and not exc.resumable:
        return False
    if isinstance(exc, ServerUnproven):
        return True
    return isinstance(exc, APSConnectionError) and not isinstance(exc, (AuthenticationError, RunChanged))


@dataclass(frozen=True)
class Backoff:
    """When to try again: ``eager_wait_s`` apart (jittered) for the first ``eager_s`` seconds,
    then waits that double from ``first_s`` up to ``cap_s``, each drawn in [half, all] of its
    value, so that many workers that lost one server do not all knock at once."""

    eager_s: float
    eager_wait_s: float
    first_s: float
    cap_s: float

    def wait(self, elapsed: float, attempt: int) -> float:
        """Seconds before the next attempt, ``elapsed`` seconds in; ``attempt`` counts the
        attempts since the eager phase ended."""
        if elapsed < self.eager_s:
            return random.uniform(self.eager_wait_s / 2, self.eager_wait_s)
        delay = min(self.cap_s, self.first_s * 2 ** min(attempt, 16))
        return random.uniform(delay / 2, delay)


#: Back to a lost server: for the first 5 s (a server restarting takes about one) an attempt
#: every 0.1-0.2 s (a refused connection costs the server nothing), then from 0.2 s up to 5 s.
RECONNECT = Backoff(eager_s=5.0, eager_wait_s=0.2, first_s=0.2, cap_s=5.0)
#: A first connection refused while its server starts: a server started at the same moment
#: listens within a second, so from 50 ms up to half a second.
FIRST_CONNECT = Backoff(eager_s=0.0, eager_wait_s=0.0, first_s=0.05, cap_s=0.5)


class _Retrying:
    """Attempts against a deadline (``timeout`` seconds from now; None: none) on a :class:`Backoff`."""

    def __init__(self, schedule: Backoff, timeout: float | None) -> None:
        self.schedule, self.timeout = schedule, timeout
        self.start = time.monotonic()
        self.deadline = None if timeout is None else self.start + timeout
        self.attempt = 0  # attempts failed since the eager phase ended

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def next_wait(self) -> float:
        """Seconds to wait before the next attempt (never past the deadline)."""
        elapsed = time.monotonic() - self.start
        wait = self.schedule.wait(elapsed, self.attempt)
        if elapsed >= self.schedule.eager_s:
            self.attempt += 1
        remaining = self.remaining()
        return wait if remaining is None else min(wait, remaining)


class _LostChannel(Protocol):
    """What a recovery reads of the channel it brings back to its server (one server's steps,
    aps.client.steps): who it is, where, whether it was closed meanwhile, its protocol core."""

    address: str
    _closing: bool
    _core: _ClientCore

    @property
    def rank(self) -> int | None: ...

    def _disconnect(self, reason: BaseException | None = None) -> None: ...


class _Reconnecting(_Retrying):
    """One recovery: the deadline, the attempts, and what is said about them."""

    def __init__(self, worker: _LostChannel, lost: BaseException, timeout: float | None) -> None:
        super().__init__(RECONNECT, timeout)
        self.worker, self.lost = worker, lost
        self._note_at = self.start + _RETRY_NOTE_EVERY
        self._unproven_said = False
        log.warning(
            "rank %s: lost the server at %s (%s); reconnecting%s (to stop waiting: Ctrl-C, or "
            "reconnect_timeout= of the worker, reconnect=False not to wait at all)",
            worker.rank,
            worker.address,
            lost,
            " with no time limit" if timeout is None else f" for up to {timeout:g} s",
        )

    def check_closed(self) -> None:
        """Raise if the worker was closed meanwhile (from another thread or task)."""
        if self.worker._closing:
            self.worker._disconnect()
            raise APSConnectionError(f"rank {self.worker.rank}: the worker was closed while it reconnected")

    def failed(self, exc: BaseException) -> float:
        """An attempt failed with ``exc``: raise if it cannot be cured or time is up; else the seconds to wait."""
        self.check_closed()
        # A handshake refused while reconnecting, either way (the server there cannot prove it
        # knows the token, or it does not take this worker's): after a server dies, anybody
        # may take its port, and must not be able to end its workers by doing so. They wait
        # for the real one, within the reconnect's time.
        squatted = isinstance(exc, AuthenticationError) and self.worker._core.ever_joined
        if not (_recoverable(exc) or squatted or isinstance(exc, (RankTaken, APSTimeoutError))):
            raise exc
        now = time.monotonic()
        if self.expired():
            raise APSConnectionError(
                f"rank {self.worker.rank}: could not get back to the server at {self.worker.address} within "
                f"{now - self.start:.0f} s (reconnect_timeout): {exc}"
            ) from exc
        if squatted and not self._unproven_said:
            self._unproven_said = True  # (said once: it may squat the port for long)
            log.warning(
                "rank %s: refused the server now at %s: %s; waiting for the real one",
                self.worker.rank,
                self.worker.address,
                exc,
            )
        if now >= self._note_at:
            self._note_at = now + _RETRY_NOTE_EVERY
            log.warning(
                "rank %s: still reconnecting to %s after %.0f s: %s",
                self.worker.rank,
                self.worker.address,
                now - self.start,
                exc,
            )
        return self.next_wait()

    def done(self) -> None:
        core = self.worker._core
        log.warning(
            "rank %s: back at %s after %.1f s (version %d, clock %d)",
            self.worker.rank,
            self.worker.address,
            time.monotonic() - self.start,
            core.version,
            core.clock,
        )


class _WaitingForServer(_Retrying):
    """A worker's first connection to a server that does not listen yet (it is still
    starting: torchrun and job schedulers start workers and server together).

    Each refused attempt asks :meth:`failed` how long to wait before the next, up to
    ``connect_timeout`` seconds in all (None: no limit); the first refusal is said once
    (WARNING, ``aps.worker``), the last raises the refusal with the time waited. Used
    by the blocking and the asyncio worker alike: only the sleep differs."""

    def __init__(self, rank: int | None, address: str, timeout: float | None) -> None:
        super().__init__(FIRST_CONNECT, timeout)
        self.rank, self.address = rank, address
        self.refused = 0

    def failed(self, exc: NoServerYet) -> float:
        """Seconds to wait before trying again; raises APSConnectionError when time is up."""
        if self.expired():
            raise APSConnectionError(
                f"{exc} (waited {time.monotonic() - self.start:.1f} s for the server, "
                f"connect_timeout={self.timeout:g}): is `aps serve` running, and is this its worker address?"
            ) from None
        if self.refused == 0:
            limit = "with no limit" if self.timeout is None else f"for up to {self.timeout:g} s (connect_timeout)"
            log.warning("rank %s: no server at %s yet (%s); waiting for it %s", self.rank, self.address, exc, limit)
        self.refused += 1
        return self.next_wait()

    def done(self) -> None:
        if self.refused:
            log.info(
                "rank %s: the server at %s answered after %.1f s",
                self.rank,
                self.address,
                time.monotonic() - self.start,
            )


def _after_recovery(
    core: _ClientCore,
    kind: str,
    request,
    address: str = "",
    as_shard: bool = False,
    sync: str | None = None,
    *,
    fragment: bool = False,
):
    """What finishes a call of ``kind`` once its worker has rejoined: ``(kind, request)``,
    or ``(None, None)`` when nothing is left to send. ``sync``: the server's policy;
    ``fragment``: the server is the shard of one fragment of streaming local SGD."""
    if kind == "init":
        return None, None  # the rejoin was the init
    if core.reseated:
        core.reseated = False
        if kind in ("push", "push_pull") and core.has_pending_push:
            # Its old rank's server-side record (docs/protocol.md, "Duplicates") is not this seat's:
            # sent again, a push applied before the connection went would be applied twice.
            log.warning(
                "rank %s: the gradient in flight when the connection went is not sent again under the new "
                "rank (the server may have applied it before); going on from the server's weights",
                core.rank,
            )
            core.forget_push(dropped=True)  # (as far as this worker can know: last_push_dropped)
            return ("pull", core.pull_request) if kind == "push_pull" else (None, None)
    if kind in ("push", "push_pull"):
        # (sent or not: a push built after the rejoin says the weights it was computed on)
        if core.pending_push_version > core.version:
            if as_shard and sync not in (None, "bsp"):
                # docs/algorithms.md, "Sharded resume": sent all the same, so that this shard
                # drops it and counts its iteration, as the other shards count it.
                _note_dropped_after_resume(core, address, as_shard, sent=True, fragment=fragment)
                return kind, core.resend_push
            _note_dropped_after_resume(core, address, as_shard, fragment=fragment)
            return ("pull", core.pull_request) if kind == "push_pull" else (None, None)
        if core.has_pending_push:
            return kind, core.resend_push
    return kind, request


def _note_dropped_after_resume(
    core: _ClientCore, address: str, as_shard: bool, sent: bool = False, fragment: bool = False
) -> None:
    """The server came back older than the weights the push in flight was computed on
    (``sent``: it goes to the shard all the same, which drops it and counts its iteration;
    ``fragment``: the shard holds one fragment of streaming local SGD, synced on its own)."""
    if sent:
        log.warning(
            "rank %s: the shard at %s resumed from a checkpoint at version %d, before the weights this "
            "gradient was computed on (version %d): it drops %s and counts the iteration%s",
            core.rank,
            address,
            core.version,
            core.pending_push_version,
            "this fragment's pseudo-gradient" if fragment else "its piece of the gradient",
            "" if fragment else ", as the other shards do (they keep theirs)",
        )
        return
    if fragment:
        # (each fragment's shard syncs on its own: the others are not taken back with it)
        log.warning(
            "rank %s: the shard at %s resumed from a checkpoint at version %d, before the global weights "
            "this fragment's pseudo-gradient was computed on (version %d): it is dropped, and this fragment "
            "goes on from that shard's weights (the other fragments keep theirs)",
            core.rank,
            address,
            core.version,
            core.pending_push_version,
        )
    elif as_shard:
        # docs/algorithms.md, "Sharded resume": the other shards keep what they applied (or, under
        # BSP, come back to one round with it).
        log.warning(
            "rank %s: the shard at %s resumed from a checkpoint at version %d, before the weights this "
            "gradient was computed on (version %d): its piece of the gradient is dropped there (the "
            "other shards keep theirs; under BSP every shard then goes back to one round, if they have "
            "checkpoints of one)",
            core.rank,
            address,
            core.version,
            core.pending_push_version,
        )
    else:
        log.warning(
            "rank %s: the server resumed from a checkpoint at version %d, before the weights this gradient "
            "was computed on (version %d): the gradient is dropped, and the updates made after that "
            "checkpoint are lost; going on from the server's weights and clock (%d)",
            core.rank,
            core.version,
            core.pending_push_version,
            core.clock,
        )
    core.forget_push(dropped=True)


class _Patience:
    """A long wait cut into slices, so that the waiter can say what it waits for:
    ``waiting(seconds so far)`` is called after a few seconds, then every half
    minute, until ``timeout`` (None: no end). A receive that times out at the
    end of a slice leaves any partly read frame in the reader, to be finished
    by the next slice."""

    def __init__(self, timeout: float | None, waiting) -> None:
        self._waiting = waiting
        self._start = time.monotonic()
        self._deadline = None if timeout is None else self._start + timeout
        self._note_at = self._start + _FIRST_WAIT_NOTE

    def next_wait(self) -> float:
        """Seconds the next slice may wait."""
        until = self._note_at if self._deadline is None else min(self._note_at, self._deadline)
        return max(until - time.monotonic(), 1e-3)

    def expired(self) -> bool:
        """A slice ran out: True when the whole wait did; otherwise says what we wait for, when due."""
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline:
            return True
        if now >= self._note_at:
            self._waiting(now - self._start)
            self._note_at = now + _WAIT_NOTE_EVERY
        return False


def _describe_progress(progress: tuple[int, int, list[int]] | None) -> str:
    if progress is None:
        return "the server has not said who joined yet"
    return describe_join_progress(*progress)
