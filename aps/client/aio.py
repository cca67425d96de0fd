"""The asyncio worker: :class:`AsyncWorker`, the same client as :class:`aps.Worker` for
asyncio programs, over the same :class:`aps.client.core._ClientCore` (TCP only).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import (
    APSError,
    APSTimeoutError,
    AuthenticationError,
    ConfigurationError,
    RankTaken,
    ServerSilent,
)
from ..wire.net import client_context, parse_address
from ..wire.protocol import (
    Header,
    Op,
    ServerInfo,
    weights_digest,
)
from .arguments import (
    _check_heartbeat,
    _check_reconnect,
    _check_transport,
    _names_shards,
    _refuse_one_shard,
    _with_scheme,
)
from .channel import client_token, find_client_token, handshake_async, newer_token
from .core import _DROPPED, _ClientCore, _compression
from .recovery import _after_recovery, _Patience, _Reconnecting, _WaitingForServer
from .tcp import AsyncConnection, NoServerYet
from .worker import (
    _REJOIN_PATIENCE,
    ASYNC_AS_SHARD,
    ASYNC_SEND_TURN,
    DEFAULT_RECONNECT_TIMEOUT,
    DEFAULT_SERVER_TIMEOUT,
    _WorkerBase,
)

__all__ = ["AsyncWorker"]

log = logging.getLogger("aps.worker")


class AsyncWorker(_WorkerBase):
    """The asyncio twin of :class:`Worker`: same arguments, awaitable methods.

    Create it with ``await AsyncWorker.connect(address, rank, num_workers)``.
    It speaks TCP (``transport="auto"`` means TCP here): asyncio's socket
    calls cannot pass the file descriptors the shared-memory transport needs.
    """

    def __init__(
        self,
        conn: AsyncConnection,
        core: _ClientCore,
        address: str,
        timeout: float | None,
        connect_timeout: float | None,
        server_timeout: float | None = DEFAULT_SERVER_TIMEOUT,
    ) -> None:
        self._conn: AsyncConnection | None = conn
        self._core = core
        self.address = address
        self._parsed = parse_address(address)
        self.timeout = timeout
        self.server_timeout = server_timeout
        self._connect_timeout = connect_timeout
        self._lock = asyncio.Lock()  # one request at a time, heartbeats included
        self._last_io = time.monotonic()
        self._heartbeat: float | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._closed = False
        self.reconnect_timeout: float | None = 0
        self._closing = False
        self._as_shard = False  # one of a sharded worker's
        #: What the server said of itself in the handshake.
        self.server_info: ServerInfo | None = None

    @classmethod
    async def connect(
        cls,
        address: str,
        rank: int,
        num_workers: int,
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
        _check_transport(transport)
        narrow = _compression(compression, compress_pulls)
        if transport == "shm":
            raise ConfigurationError("AsyncWorker speaks TCP only; use aps.Worker for shared memory")
        if _names_shards(address):
            from .shards import AsyncShardedWorker

            return await AsyncShardedWorker.open(
                address, rank, num_workers, transport, connect_timeout=connect_timeout, timeout=timeout,
                heartbeat=heartbeat, server_timeout=server_timeout, token=token, tls=tls, reconnect=reconnect,
                reconnect_timeout=reconnect_timeout, compression=compression, compress_pulls=compress_pulls)
        if isinstance(address, (list, tuple)) and len(address) == 1:
            address = address[0]
        _check_heartbeat(heartbeat, server_timeout)
        retry = _check_reconnect(reconnect, reconnect_timeout)
        secret = client_token(token)
        parsed = _with_scheme(parse_address(address), tls)
        context = client_context(tls if tls is not None else parsed.scheme == "tls")
        core = _ClientCore(rank, num_workers)
        core.compression, core.compress_pulls = narrow, bool(compress_pulls)
        waiting = _WaitingForServer(core.rank, str(parsed), connect_timeout)
        while True:  # the first connection waits for a server still starting (see Worker._open_first)
            try:
                conn, info = await cls._open(parsed.host, parsed.port, connect_timeout, server_timeout, secret,
                                             context, core)
            except NoServerYet as exc:
                await asyncio.sleep(waiting.failed(exc))
            else:
                waiting.done()
                break
        worker = cls(conn, core, str(parsed), timeout, connect_timeout, server_timeout)
        worker.server_info = info
        worker._as_shard = ASYNC_AS_SHARD.get()
        worker._token, worker._tls = secret, context
        worker.reconnect_timeout = retry
        worker._heartbeat = heartbeat
        worker._start_heartbeat()
        return worker

    async def init(self, params: Mapping[str, Any], *, timeout: float | None = 300.0) -> Mapping[str, np.ndarray]:
        """See :meth:`Worker.init`."""
        try:
            await self._call("init", lambda: self._core.init_request(params), timeout, waiting=self._note_init_wait)
        except APSTimeoutError:
            raise self._init_timeout(timeout) from None
        self._note_joined(params)
        return self._core.weights

    async def pull(self) -> Mapping[str, np.ndarray]:
        await self._call("pull", lambda: self._core.pull_request())
        return self._core.weights

    async def push(self, grads) -> None:
        await self._call("push", lambda: self._core.push_request(grads, then_pull=False))

    async def push_pull(self, grads) -> Mapping[str, np.ndarray]:
        await self._call("push_pull", lambda: self._core.push_request(grads, then_pull=True))
        return self._core.weights

    async def ping(self) -> int:
        return (await self._call("ping", lambda: self._core.simple_request(Op.PING))).version

    async def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """See :meth:`Worker.set_hyperparameters`."""
        await self._send_hyperparameters(self._hyper_payload(groups))

    async def _check_hyperparameters(self, payload: bytes) -> None:
        """See :meth:`Worker._check_hyperparameters`."""
        await self._call("hyper", lambda: self._core.hyper_request(payload, check=True))

    async def _send_hyperparameters(self, payload: bytes) -> None:
        """See :meth:`Worker._send_hyperparameters`."""
        await self._call("hyper", lambda: self._core.hyper_request(payload))
        self._core.hyperparameters = payload

    async def _restore_hyperparameters(self, timeout: float | None) -> None:
        """See :meth:`Worker._restore_hyperparameters`."""
        payload = self._core.hyperparameters
        if payload is not None:
            await self._roundtrip(lambda: self._core.hyper_request(payload), timeout)

    async def _record_shard_runs(self, runs: list[str]) -> None:
        """See :meth:`Worker._record_shard_runs`."""
        await self._call("shards", lambda: self._core.shards_request(runs))

    async def _checkpoint_versions(self) -> list[int]:
        """See :meth:`Worker._checkpoint_versions`."""
        await self._call("rewind", lambda: self._core.rewind_request(None))
        return self._core.take_rewind_versions()

    async def _rewind(self, version: int, timeout: float | None) -> None:
        """See :meth:`Worker._rewind`."""
        await self._call("rewind", lambda: self._core.rewind_request(version))
        if not self._core.take_rewind().get("rewound"):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._core.version != version:
            if deadline is not None and time.monotonic() > deadline:
                raise APSTimeoutError(f"the server at {self.address} said it would rewind to version {version}, "
                                      f"but is at version {self._core.version} after {timeout:g} s")
            await self.ping()
            await asyncio.sleep(0.02)

    async def optimizer_state(self) -> dict[str, Any]:
        """See :meth:`Worker.optimizer_state`."""
        header = await self._call("state", lambda: self._core.state_request())
        return self._core.take_state(header)

    async def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """See :meth:`Worker.load_optimizer_state`."""
        head, arrays = self._state_payload(state)
        return await self._load_state(head, arrays)

    async def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """See :meth:`Worker.load_weights`."""
        values = self._weights_payload(params)
        return await self._load_weights(weights_digest((values,)), values)

    async def _check_weights(self, digest: bytes) -> None:
        """See :meth:`Worker._check_weights`."""
        await self._call("load_weights", lambda: self._core.load_weights_request(digest, None))

    async def _load_weights(self, digest: bytes, values: np.ndarray) -> bool:
        """See :meth:`Worker._load_weights`."""
        header = await self._call("load_weights", lambda: self._core.load_weights_request(digest, values))
        self._weights_taken(values)
        return not header.flags & _DROPPED

    async def _check_state(self, head: bytes) -> None:
        """See :meth:`Worker._check_state`."""
        await self._call("load_state", lambda: self._core.load_state_request(head, [], check=True))

    async def _load_state(self, head: bytes, arrays: list[np.ndarray]) -> bool:
        """See :meth:`Worker._load_state`."""
        header = await self._call("load_state", lambda: self._core.load_state_request(head, arrays))
        return not header.flags & _DROPPED

    async def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """See :meth:`Worker.reconnect`."""
        deadline = time.monotonic() + _REJOIN_PATIENCE
        while True:
            async with self._lock:
                self._disconnect()
                self._conn = await self._reopen()
            try:
                await self._roundtrip(lambda: self._core.init_request(None, rejoin=True), timeout,
                                      waiting=self._note_init_wait)
                await self._restore_hyperparameters(timeout)
                weights = self._core.weights
            except APSTimeoutError:
                raise self._init_timeout(timeout) from None
            except RankTaken:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
                continue
            self._start_heartbeat()
            return weights

    async def close(self) -> None:
        self._closed = self._closing = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None
        if self._lock.locked() and self._conn is not None:
            self._conn.close()  # another task is in a call (reconnecting, or held): end its wait
        async with self._lock:
            pass
        if self._conn is None:
            return
        if self._core.joined:
            try:
                await self._roundtrip(lambda: self._core.simple_request(Op.LEAVE), 5.0)
            except APSError:
                pass
        conn = self._conn
        self._disconnect()
        if conn is not None:
            await conn.aclose()

    async def __aenter__(self) -> AsyncWorker:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, kind: str, request, timeout: float | None = ..., *, waiting=None) -> Header | None:
        """See :meth:`Worker._call`."""
        self._core.begin_call()
        while True:
            try:
                return await self._roundtrip(request, timeout, waiting=waiting)
            except APSError as exc:
                if not self._reconnects(kind, exc):
                    raise
                await self._recover(exc)
            kind, request = _after_recovery(self._core, kind, request, self.address, self._as_shard,
                                            (self.server_options or {}).get("sync"))
            if kind is None:
                return None

    async def _recover(self, lost: BaseException) -> None:
        """See :meth:`Worker._recover`."""
        attempt = _Reconnecting(self, lost, self.reconnect_timeout)
        while True:
            try:
                async with self._lock:
                    self._disconnect(lost)
                    attempt.check_closed()
                    self._conn = await self._reopen()
                    attempt.check_closed()
                try:
                    await self._roundtrip(lambda: self._core.init_request(None, rejoin=True), attempt.remaining(),
                                          waiting=self._note_init_wait)
                except APSTimeoutError as exc:
                    raise self._rejoin_timeout(attempt, exc) from None
                await self._restore_hyperparameters(attempt.remaining())
                break
            except APSError as exc:
                lost = exc
                await asyncio.sleep(attempt.failed(exc))
        attempt.done()
        self._start_heartbeat()

    async def _reopen(self) -> AsyncConnection:
        token = ASYNC_AS_SHARD.set(self._as_shard)
        try:
            conn, self.server_info = await self._open(self._parsed.host, self._parsed.port, self._connect_timeout,
                                                      self.server_timeout, self._token, self._tls, self._core)
        finally:
            ASYNC_AS_SHARD.reset(token)
        return conn

    async def _roundtrip(self, request, timeout: float | None = ..., *, waiting=None) -> Header:
        if timeout is ...:
            timeout = self.timeout
        async with self._lock:
            conn, core = self._conn, self._core
            if conn is None:
                raise self._disconnected()
            buffers = request()  # under the lock: its request id is the one the reply will carry
            turn = ASYNC_SEND_TURN.get()  # a sharded worker's order of sending to its shards
            try:
                if turn is not None:
                    await turn.wait()
                await conn.send(buffers)
                if turn is not None:
                    turn.done()
                if waiting is None:
                    await conn.receive(core.reader, core.has_reply, timeout, self.server_timeout)
                else:
                    await self._receive_patiently(conn, timeout, waiting)
            except BaseException as exc:
                # Interrupted mid-request (an error, a timeout, cancellation):
                # the stream is no longer in step with the server, so drop it.
                self._disconnect(exc)
                raise
            finally:
                self._last_io = time.monotonic()
            try:
                return core.finish()
            except APSError as exc:
                if core.connection_lost:
                    self._disconnect(exc)
                raise

    async def _receive_patiently(self, conn, timeout: float | None, waiting) -> None:
        """See :meth:`Worker._receive_patiently`."""
        patience = _Patience(timeout, waiting)
        while True:
            try:
                return await conn.receive(
                    self._core.reader, self._core.has_reply, patience.next_wait(), self.server_timeout
                )
            except ServerSilent:
                raise
            except APSTimeoutError:
                if patience.expired():
                    raise

    @staticmethod
    async def _open(host: str, port: int, connect_timeout, server_timeout, token, tls,
                    core) -> tuple[AsyncConnection, ServerInfo]:
        conn = await AsyncConnection.open(host, port, connect_timeout, server_timeout, tls)
        try:
            secret, found = find_client_token(token, host, port)
            try:
                info = await handshake_async(conn, secret, connect_timeout, found=found)
            except AuthenticationError:
                secret = newer_token(secret, found, host, port)  # a restarted server's new token
                if secret is None:
                    raise
                conn.close()
                conn = await AsyncConnection.open(host, port, connect_timeout, server_timeout, tls)
                info = await handshake_async(conn, secret, connect_timeout, found=True)
            core.check_run(info.run_id, str(conn.address))
            if not ASYNC_AS_SHARD.get():
                _refuse_one_shard(info, str(conn.address))
        except BaseException:
            conn.close()
            raise
        return conn, info

    def _start_heartbeat(self) -> None:
        """Start the heartbeat task, unless there is none to run or it still runs."""
        task = self._heartbeat_task
        if self._heartbeat is None or self._closed or (task is not None and not task.done()):
            return
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats(self._heartbeat))

    async def _heartbeats(self, interval: float) -> None:
        try:
            while self._conn is not None:
                await asyncio.sleep(interval / 2)
                if not self._lock.locked() and time.monotonic() - self._last_io >= interval:
                    await self._roundtrip(lambda: self._core.simple_request(Op.PING), max(interval, 1.0) * 6)
        except APSError as exc:
            log.warning("rank %d: heartbeat failed: %s", self.rank, exc)
