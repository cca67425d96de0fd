"""A blocking sharded worker's fan-out: each request's part for every shard at once, shard
0's in the calling thread and each other's in a thread of its own (:class:`aps.Worker`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from .channel import Channel, run
from .shards import _ShardThreads, _Turn, _Turnstile
from .steps import Steps

__all__ = ["ThreadedFanOut"]


class _ShardedWorker(Protocol):
    """What the fan-out uses of the worker it is mixed into (aps.client.worker)."""

    _channels: list[Channel]
    _pool: _ShardThreads | None
    _lock: threading.RLock

    def _turns(self, in_turn: bool, make: Callable[[int], Any]) -> list: ...

    def _check_open(self) -> None: ...

    def _settle_clock(self) -> None: ...

    def _failed(self, errors: list[BaseException]) -> None: ...


class ThreadedFanOut:
    """The EACH step of :class:`aps.Worker` (mixed into it: uses its channels, pool and lock)."""

    def _fan_out(self: _ShardedWorker, call: Callable[[int, Channel, Any], Steps], in_turn: bool) -> list:
        """The EACH step: ``call``'s steps for every shard at once, shard 0's in this thread
        and each other's in one of the pool's; raises the first failure after every shard
        finished (none is left half-way in its request)."""
        turnstile = _Turnstile()
        turns = self._turns(in_turn, lambda position: _Turn(turnstile, position))
        results: list = [None] * len(self._channels)

        def one(index: int, channel: Channel) -> None:
            turn = turns[index]
            try:
                results[index] = run(call(index, channel, turn))
            finally:
                if turn is not None:
                    turn.done()  # sent or failed: the next shard's turn

        with self._lock:
            self._check_open()
            for channel in self._channels:
                channel._interrupted = False
            pool = self._pool  # (there is one for K > 1 shards: the only fan-out there is)
            futures = [
                pool.submit(index, one, index, channel)
                for index, channel in enumerate(self._channels)
                if index and pool is not None
            ]
            errors: list[BaseException] = []
            try:
                try:
                    one(0, self._channels[0])
                except Exception as exc:
                    errors.append(exc)
                for future in futures:
                    try:
                        future.result()
                    except Exception as exc:
                        errors.append(exc)
            except BaseException:  # Ctrl-C: every shard's request ends, not the first one's only
                _interrupt(self._channels, futures)
                raise
            finally:
                self._settle_clock()
            self._failed(errors)
        return results


def _interrupt(channels: list[Channel], futures: list[Future]) -> None:
    """End the requests still running on the other shards (their connections are shut,
    as close() does, and the calls do not get back to their servers by themselves), and
    wait for their threads a little."""
    for channel in channels:
        channel._interrupted = True
        conn = channel._conn
        if conn is not None:
            conn.shutdown()
    for future in futures:
        try:
            future.result(timeout=5.0)
        except Exception:  # each ends with its connection's error
            pass
