"""The asyncio worker: :class:`AsyncWorker`, the same client as :class:`aps.Worker` for
asyncio programs: the same steps (:class:`aps.client.worker._Workers`, each server's in
:mod:`aps.client.steps`), run on the asyncio loop (:func:`aps.client.channel.arun`), TCP only.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigurationError
from .arguments import _check_transport
from .channel import AsyncChannel, arun
from .shards import _AsyncTurn, in_shard_order, server_addresses
from .steps import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_SERVER_TIMEOUT, Steps
from .worker import _Workers

__all__ = ["AsyncWorker"]


class AsyncWorker(_Workers):
    """The asyncio twin of :class:`aps.Worker`: same arguments, awaitable methods.

    Create it with ``await AsyncWorker.connect(address, rank, num_workers)``.
    It speaks TCP (``transport="auto"`` means TCP here): asyncio's socket
    calls cannot pass the file descriptors the shared-memory transport needs.
    A sharded model's shards get every request at once (one task each).
    """

    def __init__(self, channels: list[AsyncChannel]) -> None:  # see connect()
        self._setup(channels)
        self._lock = asyncio.Lock()  # one sharded request at a time

    @classmethod
    async def connect(
        cls,
        address: str | Sequence[str] | None = None,
        rank: int | None = None,
        num_workers: int | None = None,
        transport: str = "auto",
        *,
        connect_timeout: float | None = 30.0,
        timeout: float | None = None,
        heartbeat: float | None = 5.0,
        server_timeout: float | None = DEFAULT_SERVER_TIMEOUT,
        token: str | None = None,
        tls: bool | ssl.SSLContext | None = None,
        reconnect: bool = True,
        reconnect_timeout: float | None = DEFAULT_RECONNECT_TIMEOUT,
        compression: str | None = None,
        compress_pulls: bool = False,
    ) -> AsyncWorker:
        """Connect to the server (every shard's, at once) and return the worker."""
        _check_transport(transport)
        if transport == "shm":
            raise ConfigurationError("AsyncWorker speaks TCP only; use aps.Worker for shared memory")
        options = dict(
            connect_timeout=connect_timeout,
            timeout=timeout,
            heartbeat=heartbeat,
            server_timeout=server_timeout,
            token=token,
            tls=tls,
            reconnect=reconnect,
            reconnect_timeout=reconnect_timeout,
            compression=compression,
            compress_pulls=compress_pulls,
        )
        addresses = server_addresses(address)
        sharded = len(addresses) > 1
        tasks = [
            asyncio.ensure_future(AsyncChannel.open(one, rank, num_workers, "tcp", as_shard=sharded, **options))
            for one in addresses
        ]
        try:
            channels = list(await asyncio.gather(*tasks))
            return cls(in_shard_order(channels) if sharded else channels)
        except BaseException:
            # One failed, or the caller gave up (a timeout, a cancel): the others too, and
            # every connection that did open is closed (its heartbeat task stopped).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            opened = [task.result() for task in tasks if not task.cancelled() and task.exception() is None]
            await asyncio.gather(*(channel.close() for channel in opened), return_exceptions=True)
            raise

    @property
    def connected(self) -> bool:
        """Whether every server's connection is open (it is not between a loss and the rejoin)."""
        return all(channel._conn is not None for channel in self._channels)

    async def init(
        self, params: Mapping[str, Any], *, tables: Mapping[str, Any] | None = None, timeout: float | None = 300.0
    ) -> Mapping[str, np.ndarray]:
        """See :meth:`aps.Worker.init`."""
        return await arun(self._init(params, timeout, tables))

    async def pull(self, *, rows: Mapping[str, Any] | None = None, out: Mapping[str, np.ndarray] | None = None):
        """See :meth:`aps.Worker.pull`."""
        return await arun(self._pull(rows, out))

    async def pull_rows(
        self, table: str | Mapping[str, Any], ids: Any = None, *, out: Any = None, keep_version: bool = False
    ) -> Any:
        """See :meth:`aps.Worker.pull_rows`."""
        return await arun(self._pull_rows(table, ids, out, versioned=not keep_version))

    async def push_rows(self, table: str | Mapping[str, Any], ids: Any = None, grads: Any = None) -> None:
        """See :meth:`aps.Worker.push_rows`."""
        await arun(self._push_rows(table, ids, grads))

    async def push(
        self, grads: Mapping[str, np.ndarray] | np.ndarray, *, rows: Mapping[str, Any] | None = None
    ) -> None:
        """See :meth:`aps.Worker.push`."""
        await arun(self._push(grads, False, rows))

    async def push_pull(
        self,
        grads: Mapping[str, np.ndarray] | np.ndarray,
        *,
        rows: Mapping[str, Any] | None = None,
        pull_rows: Mapping[str, Any] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ):
        """See :meth:`aps.Worker.push_pull`."""
        return await arun(self._push(grads, True, rows, pull_rows, out))

    async def ping(self) -> int:
        """See :meth:`aps.Worker.ping`."""
        return await arun(self._ping())

    async def log(self, scalars: Mapping[str, Any], step: int | None = None, *, batch: Any = None) -> None:
        """See :meth:`aps.Worker.log`."""
        await arun(self._log(scalars, step, batch))

    async def claim(self, name: str, count: int = 1) -> int:
        """See :meth:`aps.Worker.claim`."""
        return await arun(self._claim(name, count))

    async def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """See :meth:`aps.Worker.set_hyperparameters`."""
        await arun(self._set_hyperparameters(groups))

    async def optimizer_state(self) -> dict[str, Any]:
        """See :meth:`aps.Worker.optimizer_state`."""
        return await arun(self._optimizer_state())

    async def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """See :meth:`aps.Worker.load_optimizer_state`."""
        return await arun(self._load_optimizer_state(state))

    async def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """See :meth:`aps.Worker.load_weights`."""
        return await arun(self._load_weights(params))

    async def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """See :meth:`aps.Worker.reconnect`."""
        return await arun(self._reconnect(timeout))

    async def close(self) -> None:
        """See :meth:`aps.Worker.close`."""
        await self._close()

    async def leave(self, *, finished: bool = False) -> None:
        """See :meth:`aps.Worker.leave`."""
        await self._close(finished)

    async def _close(self, finished: bool = False) -> None:
        if not self._closing:
            await arun(self._log_rest())
        self._closing = True
        await asyncio.gather(*(channel.close(finished) for channel in self._channels), return_exceptions=True)

    async def __aenter__(self) -> AsyncWorker:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _fan_out(self, call: Callable[[int, AsyncChannel, Any], Steps], in_turn: bool) -> list:
        """The EACH step: ``call``'s steps for every shard at once (one task each); their
        results in shard order, or the first failure once every shard finished."""
        events = [asyncio.Event() for _ in self._channels]
        turns = self._turns(
            in_turn, lambda position: _AsyncTurn(events[position - 1] if position else None, events[position])
        )

        async def one(index: int, channel: AsyncChannel):
            turn = turns[index]
            try:
                return await arun(call(index, channel, turn))
            finally:
                if turn is not None:
                    turn.done()

        async with self._lock:
            self._check_open()
            try:
                results = await asyncio.gather(
                    *(one(index, channel) for index, channel in enumerate(self._channels)), return_exceptions=True
                )
            finally:
                self._settle_clock()
        self._failed([result for result in results if isinstance(result, BaseException)])
        return results
