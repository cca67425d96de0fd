"""The asyncio worker: :class:`AsyncWorker`, the same client as :class:`aps.Worker` for
asyncio programs: the same steps (:class:`aps.client.verbs._Workers`, each server's in
:mod:`aps.client.steps`), run on the asyncio loop (:func:`aps.client.channel.arun`), TCP only.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import APSError, ConfigurationError
from .arguments import _check_transport
from .channel import AsyncChannel, arun
from .pipeline import Pipeline, check_pipeline, pipelines_allowed
from .shards import _AsyncTurn, check_fp16_range, in_shard_order, server_addresses
from .steps import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_SERVER_TIMEOUT, Steps
from .verbs import _Workers

__all__ = ["AsyncWorker"]

log = logging.getLogger("aps.worker")

#: Seconds close() waits for the answers to pipelined pushes before it leaves all the same.
CLOSE_FLUSH_S = 5.0


class AsyncWorker(_Workers):
    """The asyncio twin of :class:`aps.Worker`: same arguments, awaitable methods.

    Create it with ``await AsyncWorker.connect(address, rank, num_workers)``.
    It speaks TCP (``transport="auto"`` means TCP here): asyncio's socket
    calls cannot pass the file descriptors the shared-memory transport needs.
    A sharded model's shards get every request at once (one task each).

    With ``pipeline=N`` (N > 1), :meth:`push` returns once its gradient is sent, while
    fewer than N pushes are unanswered on each server's connection: the server answers
    them in order, and applies them one by one as they come. A refused push raises at the
    worker's next call (:meth:`flush` waits for every answer); every other call waits for
    the answers first. Under SSP and DSSP a push that finds the worker held at the gate
    waits there (the worker runs at most the bound ahead); BSP refuses a pipeline
    (ConfigurationError at connect). See docs/guide/start.md, "Pipelined pushes".
    """

    def __init__(self, channels: list[AsyncChannel]) -> None:  # see connect()
        self._setup(channels)
        self._lock = asyncio.Lock()  # one sharded request at a time
        self._pipelines = [pipeline for channel in channels if (pipeline := getattr(channel, "pipeline", None))]

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
        pipeline: int = 1,
    ) -> AsyncWorker:
        """Connect to the server (every shard's, at once) and return the worker (``pipeline``:
        how many pushes may be in flight on each server's connection; see the class)."""
        _check_transport(transport)
        depth = check_pipeline(pipeline)
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
            if depth > 1:
                for channel in channels:
                    refused = pipelines_allowed(channel.server_options)
                    if refused is not None:
                        raise ConfigurationError(f"pipeline={depth} at {channel.address}: {refused}")
                    channel.pipeline = Pipeline(channel, depth)
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
        await self.flush()
        return await arun(self._init(params, timeout, tables))

    async def pull(self, *, rows: Mapping[str, Any] | None = None, out: Mapping[str, np.ndarray] | None = None):
        """See :meth:`aps.Worker.pull`."""
        await self.flush()
        return await arun(self._pull(rows, out))

    async def pull_rows(
        self, table: str | Mapping[str, Any], ids: Any = None, *, out: Any = None, keep_version: bool = False
    ) -> Any:
        """See :meth:`aps.Worker.pull_rows`."""
        await self.flush()
        return await arun(self._pull_rows(table, ids, out, versioned=not keep_version))

    async def push_rows(self, table: str | Mapping[str, Any], ids: Any = None, grads: Any = None) -> None:
        """See :meth:`aps.Worker.push_rows`."""
        await self.flush()
        await arun(self._push_rows(table, ids, grads))

    async def push(
        self, grads: Mapping[str, np.ndarray] | np.ndarray, *, rows: Mapping[str, Any] | None = None
    ) -> None:
        """See :meth:`aps.Worker.push`; pipelined (``pipeline=N``): returns once sent."""
        if self._pipelines and rows is None:
            await self._pipelined_push(grads)
            return
        await self.flush()
        await arun(self._push(grads, False, rows))

    async def flush(self) -> None:
        """Wait until every pipelined push is answered; raise the first that was refused
        since the last call (or the loss of the server, if the worker could not get back to
        it). Nothing to do without ``pipeline``."""
        if not self._pipelines:
            return
        await asyncio.gather(*(pipeline.drain() for pipeline in self._pipelines))
        for pipeline in self._pipelines:
            pipeline.raise_failure()

    @property
    def in_flight(self) -> int:
        """Pipelined pushes sent and not answered yet (the most of any server's connection)."""
        return max((pipeline.in_flight for pipeline in self._pipelines), default=0)

    async def _pipelined_push(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> None:
        self._check_open()
        if self._one:
            await self._pipelines[0].push(grads)
            return
        for pipeline in self._pipelines:  # (an earlier refusal: raised before any shard takes this one)
            pipeline.raise_failure()
        # One sharded push at a time: the pieces lie in the worker's one gradient buffer until
        # every shard's pipeline has taken its own (copied into its frame).
        async with self._lock:
            pieces = self._gradient_pieces(grads)
            check_fp16_range(pieces, self._channels)
            results = await asyncio.gather(
                *(pipeline.push(piece) for pipeline, piece in zip(self._pipelines, pieces)), return_exceptions=True
            )
        self._failed([result for result in results if isinstance(result, BaseException)])

    async def push_pull(
        self,
        grads: Mapping[str, np.ndarray] | np.ndarray,
        *,
        rows: Mapping[str, Any] | None = None,
        pull_rows: Mapping[str, Any] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ):
        """See :meth:`aps.Worker.push_pull`."""
        await self.flush()
        return await arun(self._push(grads, True, rows, pull_rows, out))

    async def ping(self) -> int:
        """See :meth:`aps.Worker.ping`."""
        await self.flush()
        return await arun(self._ping())

    async def log(self, scalars: Mapping[str, Any], step: int | None = None, *, batch: Any = None) -> None:
        """See :meth:`aps.Worker.log`."""
        await self.flush()
        await arun(self._log(scalars, step, batch))

    async def pace(self, steps: int, seconds: float) -> tuple[float | None, float | None]:
        """See :meth:`aps.Worker.pace`."""
        await self.flush()
        return await arun(self._pace(steps, seconds))

    async def claim(self, name: str, count: int = 1) -> int:
        """See :meth:`aps.Worker.claim`."""
        await self.flush()
        return await arun(self._claim(name, count))

    async def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """See :meth:`aps.Worker.set_hyperparameters`."""
        await self.flush()
        await arun(self._set_hyperparameters(groups))

    async def optimizer_state(self) -> dict[str, Any]:
        """See :meth:`aps.Worker.optimizer_state`."""
        await self.flush()
        return await arun(self._optimizer_state())

    async def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """See :meth:`aps.Worker.load_optimizer_state`."""
        await self.flush()
        return await arun(self._load_optimizer_state(state))

    async def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """See :meth:`aps.Worker.load_weights`."""
        await self.flush()
        return await arun(self._load_weights(params))

    async def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """See :meth:`aps.Worker.reconnect`."""
        for pipeline in self._pipelines:
            await pipeline.drain()
            failure = pipeline.take_failure()  # (moot now: said, not raised)
            if failure is not None:
                log.warning("rank %s: before reconnect(): %s", self.rank, failure)
        return await arun(self._reconnect(timeout))

    async def close(self) -> None:
        """See :meth:`aps.Worker.close`."""
        await self._close()

    async def leave(self, *, finished: bool = False) -> None:
        """See :meth:`aps.Worker.leave`."""
        await self._close(finished)

    async def _close(self, finished: bool = False) -> None:
        if self._pipelines and not self._closing:
            for channel in self._channels:  # (a reconnect in progress gives up: no call waits on one)
                channel._closing = True
            try:
                await asyncio.wait_for(self.flush(), CLOSE_FLUSH_S)
            except (APSError, TimeoutError) as exc:  # closing all the same: say what the last pushes met
                log.warning("rank %s: closing with pipelined pushes refused, lost or unanswered: %r", self.rank, exc)
            for pipeline in self._pipelines:
                # Still unanswered (held at the gate, a silent server): given up, and the connection
                # dropped without a LEAVE, which would wait behind them (the server counts this worker
                # as disconnected).
                await pipeline.abandon()
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
