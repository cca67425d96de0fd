"""Replica sets: a primary that acknowledges only what its backups hold, and a backup
that takes over when the primary is gone (docs/replicas.md).

Every replica of a set is started the same way (``aps serve --replicas A,B
--advertise A --coordinator etcd://...``). :class:`ReplicaSet` asks the
coordinator (:mod:`aps.server.coordinator`) which it is: the first to write the
set's record is primary; the others are backups (:class:`Standby`) until the
primary is lost.

What is shipped is the state, whole: at each *capture* (a job of the update
lane, so between two updates) the checkpoint's manifest and arrays, the very
ones ``--checkpoint-dir`` writes, go to every backup. A reply that a failover
could take back (any reply but PING's, STATS' and errors) is held until every
listed backup has acknowledged a capture taken after it was made, so a backup
that takes over holds every update a worker was told of. Captures are grouped:
while one is on its way, the replies made meanwhile wait for the next one.
Taking over is resuming from that state: the same path as ``--resume``, which
keeps every sync policy, the tables, the compensation, the seats (the
duplicate rule) and elastic membership exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..checkpoint import checkpoint_name, next_sequence, write_checkpoint
from ..checkpoint.format import _coerce_layout
from ..errors import APSError, ConfigurationError, ErrorCode, NotPrimary, ServerError
from ..wire.net import parse_address
from ..wire.protocol import HEADER_SIZE, Op, encode_error, pack_header, unpack_header
from .checkpointer import checkpoint_arrays
from .coordinator import Coordinator, CoordinatorUnavailable, Record
from .engine.lane import CallJob
from .replica_link import (
    ACK,
    BEAT,
    BYE,
    STAT,
    LinkRefused,
    accept_primary,
    connect_backup,
    decode_ack,
    decode_state,
    encode_ack,
    encode_state,
    read_frame,
    write_frame,
)

if TYPE_CHECKING:
    from ..config import ServerConfig
    from .engine import Engine

__all__ = ["ReplicaSet", "Replicator", "SetRetired", "Standby"]

log = logging.getLogger("aps.server")

_RETRY_S = 0.25  # between attempts to reach a backup, or the coordinator
_HANDSHAKE_S = 5.0
_WORKER_FIRST_S = 0.05  # how long a backup waits for a new connection to speak first (a worker's HELLO)


def _peers(config: ServerConfig) -> tuple[str, list[str]]:
    """This replica's address and the others'."""
    assert config.replicas is not None
    replicas = [a.strip() for a in config.replicas.split(",") if a.strip()]
    me = config.advertise or f"{config.host}:{config.port}"
    if me not in replicas:
        raise ConfigurationError(
            f"--advertise {me} is not one of --replicas {config.replicas}: give each replica the whole list "
            "and its own address in it as --advertise"
        )
    return me, [a for a in replicas if a != me]


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    future.set_exception(exc)


def _host_port(address: str) -> tuple[str, int]:
    parsed = parse_address(address if "://" in address else f"tcp://{address}")
    assert parsed.port is not None
    return parsed.host, parsed.port


class SetRetired(APSError):
    """The primary retired the replica set (its run is over): this backup stops instead of taking over."""


class ReplicaSet:
    """This replica's place in its set: primary or backup, and the changes of the record."""

    def __init__(self, config: ServerConfig, token: bytes) -> None:
        if config.coordinator is None:
            raise ConfigurationError("--replicas needs --coordinator etcd://HOST:PORT: who is primary is decided there")
        self.config = config
        self.token = token
        self.me, self.others = _peers(config)
        self.coordinator = Coordinator(config.coordinator, config.replica_set)
        self.record: Record | None = None
        self.failovers = 0

    async def take_role(self, key: bytes | None) -> str | None:
        """Become primary: at once when the set has none, else after serving as a backup
        until the primary is lost. Returns the checkpoint to resume from (what this replica
        held as a backup), or None (a new primary, with the run's own --resume)."""
        while True:
            try:
                record = await self.coordinator.read()
                if record is None or (record.primary == self.me and not record.backups):
                    # No set yet; or this replica was its primary, and no backup can take over.
                    won = await self.coordinator.swap(0 if record is None else record.term, Record(self.me))
                    if won is not None:
                        self.record = won
                        log.info("replica set %s: primary at term %d", self.config.replica_set, won.term)
                        return None
                    continue
            except CoordinatorUnavailable as exc:
                log.warning(
                    "replica set %s: the coordinator cannot be asked (%s); trying again", self.config.replica_set, exc
                )
                await asyncio.sleep(_RETRY_S * 4)
                continue
            standby = Standby(self, key)
            try:
                path = await standby.run()
            except BaseException:  # (retired, or the process stops: nothing asks etcd any more)
                await self.coordinator.close()
                raise
            self.failovers += 1
            return path

    def replicator(self, engine: Engine, on_deposed: Callable[[str], None]) -> Replicator:
        assert self.record is not None, "a replicator is made for a primary"
        return Replicator(self, engine, on_deposed)


class _Link:
    """One connected backup."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address, self.reader, self.writer = address, reader, writer
        self.heard = time.monotonic()
        self.sent = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Replicator:
    """The primary's side (see the module docstring): captures, ships, and holds replies."""

    def __init__(self, replica_set: ReplicaSet, engine: Engine, on_deposed: Callable[[str], None]) -> None:
        self.set = replica_set
        self.config = replica_set.config
        self.engine = engine
        self.on_deposed = on_deposed
        record = replica_set.record
        assert record is not None
        #: Backups that hold every acknowledged update (the record's), and those on their way
        #: to it (acknowledged replies wait for them too): the addresses replies wait for.
        self.listed: set[str] = set(record.backups)
        self.joining: dict[str, int] = {}  # address -> the first capture that makes it whole
        self.acked: dict[str, int] = {}
        self.links: dict[str, _Link] = {}
        self._next = 1  # the number of the next capture
        self._pending: list[tuple[int, Callable[[], None]]] = []
        self._wanted = asyncio.Event()
        self._progress = asyncio.Event()
        self._record_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self.deposed = False
        self.closing = False
        self.captures = 0
        self.capture_seconds = 0.0

    # Replies -------------------------------------------------------------------
    @property
    def gated(self) -> set[str]:
        return self.listed | set(self.joining)

    def hold(self, send: Callable[[], None]) -> None:
        """Call ``send`` once every listed backup holds the state as of now."""
        if self.deposed:
            return  # never: a deposed primary answers nothing more (its connections are closing)
        if not self.gated:
            send()
            return
        self._pending.append((self._next, send))
        self._wanted.set()

    def _release(self, number: int | None) -> None:
        keep: list[tuple[int, Callable[[], None]]] = []
        ready: list[tuple[int, Callable[[], None]]] = []
        for need, send in self._pending:
            (ready if number is None or need <= number else keep).append((need, send))
        self._pending = keep
        for _, send in ready:
            try:
                send()
            except Exception:  # one connection's failure must not keep the others' replies
                log.exception("a reply held for replication failed")

    def status(self) -> dict:
        return {
            "role": "primary",
            "term": self.set.record.term if self.set.record else 0,
            "listed": sorted(self.listed),
            "joining": sorted(self.joining),
            "connected": sorted(self.links),
            "lag": {a: self._next - 1 - self.acked.get(a, 0) for a in sorted(self.gated)},
            "captures": self.captures,
            "capture_seconds": round(self.capture_seconds, 6),
            "held_replies": len(self._pending),
            "took_over": self.set.failovers,
        }

    # Running -------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._ship())] + [
            loop.create_task(self._keep_linked(address)) for address in self.set.others
        ]

    async def close(self, *, retire: bool = False) -> None:
        """Stop replicating: the links close, and a listed backup takes over (a primary stopped
        on purpose, say by its pod's eviction, hands its shard over). ``retire``: the run is
        over (``aps slurm`` once its workers are done): the backups are told to stop too (BYE)."""
        self.closing = True  # (from now on a link that goes unlists nobody: the record stays)
        if retire:
            for link in list(self.links.values()):
                with contextlib.suppress(Exception):
                    write_frame(link.writer, BYE)
                    await asyncio.wait_for(link.writer.drain(), _HANDSHAKE_S)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for link in list(self.links.values()):
            link.close()
        await self.set.coordinator.close()

    async def _keep_linked(self, address: str) -> None:
        said = False
        while not self.deposed:
            try:
                host, port = _host_port(address)
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _HANDSHAKE_S)
            except (OSError, TimeoutError) as exc:
                if not said:
                    log.info("replica set: backup %s cannot be reached yet (%s)", address, exc)
                    said = True
                await asyncio.sleep(_RETRY_S)
                continue
            record = self.set.record
            assert record is not None
            try:
                await connect_backup(
                    reader,
                    writer,
                    self.set.token,
                    {"set": self.config.replica_set, "primary": self.set.me, "term": record.term},
                    _HANDSHAKE_S,
                )
            except LinkRefused as exc:
                log.warning("replica set: backup %s refused the link: %s", address, exc)
                writer.close()
                await asyncio.sleep(_RETRY_S * 4)
                continue
            said = False
            link = self.links[address] = _Link(address, reader, writer)
            log.info("replica set: linked to backup %s", address)
            self._wanted.set()  # it needs the state
            try:
                await self._read_acks(link)
            finally:
                if self.links.get(address) is link:
                    del self.links[address]
                link.close()
                log.warning("replica set: the link to backup %s is gone", address)
                if address in self.gated and not self.deposed and not self.closing:
                    await self._drop(address)

    async def _read_acks(self, link: _Link) -> None:
        beat = self.config.failover_timeout / 4
        loop = asyncio.get_running_loop()

        async def beats() -> None:
            while True:
                await asyncio.sleep(beat)
                if time.monotonic() - link.sent >= beat:
                    write_frame(link.writer, BEAT)
                    link.sent = time.monotonic()
                if time.monotonic() - link.heard > self.config.replica_timeout:
                    log.warning(
                        "replica set: backup %s said nothing for %.1f s (--replica-timeout)",
                        link.address,
                        self.config.replica_timeout,
                    )
                    link.close()
                    return

        beating = loop.create_task(beats())
        try:
            while True:
                kind, body = await read_frame(link.reader)
                link.heard = time.monotonic()
                if kind == ACK:
                    self._acked(link.address, decode_ack(body))
        except (asyncio.IncompleteReadError, ConnectionError, LinkRefused, OSError):
            return
        finally:
            beating.cancel()

    def _acked(self, address: str, number: int) -> None:
        if number <= self.acked.get(address, 0):
            return
        self.acked[address] = number
        if address not in self.listed:
            mark = self.joining.get(address)
            if mark is None:
                # It holds a whole state: from now on replies wait for it too, and once it holds a
                # capture taken after this, it holds every update ever acknowledged: list it.
                self.joining[address] = self._next
                self._wanted.set()
            elif number >= mark:
                asyncio.get_running_loop().create_task(self._list(address))
        self._progress.set()

    async def _ship(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.deposed:
            await self._wanted.wait()
            self._wanted.clear()
            if not self.links and not self._pending:
                continue
            number = self._next
            self._next += 1
            captured: asyncio.Future = loop.create_future()
            self.engine.lane.submit(
                CallJob(functools.partial(self._capture_into, captured), functools.partial(_set_exception, captured))
            )
            try:
                manifest, arrays = await captured
            except Exception:
                log.exception("replica set: capturing the state failed; trying again")
                self._wanted.set()
                await asyncio.sleep(_RETRY_S)
                continue
            parts = encode_state(number, manifest, arrays)
            for link in list(self.links.values()):
                if link.writer.transport.get_write_buffer_size() > 0:
                    # Still reading an earlier state: each one is whole, so it skips to a newer one
                    # once it has drained (what the primary holds for a slow backup stays bounded).
                    continue
                try:
                    write_frame(link.writer, STAT, *parts)
                    link.sent = time.monotonic()
                except Exception:
                    link.close()
            await self._settle(number)
            if self.joining or any(need > number for need, _ in self._pending):
                self._wanted.set()

    async def _settle(self, number: int) -> None:
        """Wait until every gated backup holds capture ``number`` (dropping those that do
        not in time), then send the replies it covers."""
        deadline = time.monotonic() + self.config.replica_timeout
        while not self.deposed:
            behind = [a for a in self.gated if self.acked.get(a, 0) < number]
            if not behind:
                self._release(number)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for address in behind:
                    log.warning(
                        "replica set: backup %s did not hold capture %d within %.1f s (--replica-timeout): "
                        "it leaves the set",
                        address,
                        number,
                        self.config.replica_timeout,
                    )
                    link = self.links.pop(address, None)
                    if link is not None:
                        link.close()
                    await self._drop(address)
                deadline = time.monotonic() + self.config.replica_timeout
                continue
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)

    def _capture_into(self, future: asyncio.Future) -> None:
        future.set_result(self._capture())

    def _capture(self) -> tuple[dict | None, dict[str, np.ndarray]]:
        """(A job of the lane: between two updates.) The state, copied."""
        started = time.perf_counter()
        engine = self.engine
        table = engine.model.table
        if table is None:
            return None, {}
        manifest, sources = engine.durability.checkpoint_state()
        snapshot = table.snapshot()
        try:
            arrays = {"weights": snapshot.array.copy()}
        finally:
            snapshot.release()
        arrays.update((f"state:{name}", np.array(a, copy=True)) for name, a in sources.items())
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return manifest, arrays

    # The record ------------------------------------------------------------------
    async def _change(self, backups: set[str], why: str) -> bool:
        """Write the record with ``backups`` listed; False: deposed. Tries until the coordinator answers."""
        async with self._record_lock:
            while not self.deposed:
                record = self.set.record
                assert record is not None
                try:
                    won = await self.set.coordinator.swap(
                        record.term, Record(self.set.me, tuple(sorted(backups)), 0, record.detail)
                    )
                except CoordinatorUnavailable as exc:
                    log.warning("replica set: cannot record that %s yet (%s); replies wait", why, exc)
                    await asyncio.sleep(_RETRY_S)
                    continue
                if won is None:
                    self._deposed(f"the record changed under term {record.term} while it recorded that {why}")
                    return False
                self.set.record = won
                self.listed = set(won.backups)
                log.info("replica set: %s (term %d; backups %s)", why, won.term, ", ".join(won.backups) or "none")
                return True
        return False

    async def _list(self, address: str) -> None:
        if address in self.listed or address not in self.joining:
            return
        if await self._change(self.listed | {address}, f"backup {address} holds the whole state"):
            self.joining.pop(address, None)
            self._progress.set()

    async def _drop(self, address: str) -> None:
        self.joining.pop(address, None)
        if address in self.listed:
            await self._change(self.listed - {address}, f"backup {address} left the set")
            if not self.listed:
                log.error(
                    "replica set %s: running without backups: a crash of this primary now loses what its "
                    "last checkpoint does not hold",
                    self.config.replica_set,
                )
        self._progress.set()

    def _deposed(self, why: str) -> None:
        self.deposed = True
        self._pending.clear()
        log.error("replica set: this primary was deposed (%s): it stops without answering what it holds", why)
        self.on_deposed(why)


class Standby:
    """A backup (see the module docstring): holds the primary's newest state, and takes
    over when it is lost."""

    def __init__(self, replica_set: ReplicaSet, key: bytes | None) -> None:
        self.set = replica_set
        self.config = replica_set.config
        self.key = key
        self.held: tuple[int, dict | None, dict[str, np.ndarray]] | None = None
        self.held_from: str | None = None
        self.link: asyncio.StreamWriter | None = None
        self.heard = 0.0
        self.lost_at: float | None = None
        self.retired = False

    async def run(self) -> str | None:
        host, port = self.config.host, self.config.port
        server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        print(f"aps: backup of replica set {self.config.replica_set} on {self.set.me}", flush=True)
        log.info("replica set %s: backup %s, waiting for its primary", self.config.replica_set, self.set.me)
        try:
            while True:
                await asyncio.sleep(self.config.failover_timeout / 4)
                if self.retired:
                    raise SetRetired(f"replica set {self.config.replica_set}: its primary retired it (the run is over)")
                if self.link is not None and time.monotonic() - self.heard > self.config.failover_timeout:
                    await asyncio.sleep(0.05)  # (a backup that was stopped itself reads what waited for it first)
                if self.link is not None and time.monotonic() - self.heard > self.config.failover_timeout:
                    log.warning(
                        "replica set: the primary %s said nothing for %.2f s (--failover-timeout)",
                        self.held_from,
                        self.config.failover_timeout,
                    )
                    self._lose()
                if self.lost_at is not None and self.held is not None:
                    path = await self._take_over()
                    if path is not None:
                        return path
        finally:
            server.close()
            if self.link is not None:
                self.link.close()

    def _lose(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.lost_at is None:
            self.lost_at = time.monotonic()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A primary waits for this backup's greeting; a worker speaks first (its HELLO): it is
        # told where the primary is (NOT_PRIMARY), and follows.
        try:
            first = await asyncio.wait_for(reader.readexactly(HEADER_SIZE), _WORKER_FIRST_S)
        except TimeoutError:
            first = None
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if first is not None:
            await self._redirect(first, writer)
            return
        try:
            hello, answer = await accept_primary(reader, writer, self.set.token, _HANDSHAKE_S)
            primary = hello.get("primary")
            try:
                record = await self.set.coordinator.read()
            except CoordinatorUnavailable as exc:
                answer(False, f"the coordinator cannot be asked: {exc}")
                return
            if hello.get("set") != self.config.replica_set or record is None or record.primary != primary:
                answer(False, f"{primary} is not the primary of replica set {self.config.replica_set} by the record")
                log.warning("replica set: refused %s as primary (the record says %s)", primary, record)
                return
            answer(True)
        except LinkRefused as exc:
            # (workers that look for the new primary knock here too: only a primary's proof counts)
            log.debug("replica set: a connection that is not its primary's was closed: %s", exc)
            writer.close()
            return
        if self.link is not None:
            self.link.close()
        self.link, self.heard, self.lost_at = writer, time.monotonic(), None
        if primary != self.held_from:
            self.held = None  # a state of another primary is not this one's
        self.held_from = primary
        log.info("replica set: following primary %s (term %d)", primary, hello.get("term", 0))
        try:
            while True:
                kind, body = await read_frame(reader)
                if self.link is not writer:
                    return
                self.heard = time.monotonic()
                if kind == STAT:
                    number, manifest, arrays = decode_state(body)
                    self.held = (number, manifest, arrays)
                    write_frame(writer, ACK, encode_ack(number))
                elif kind == BEAT:
                    write_frame(writer, ACK, encode_ack(self.held[0] if self.held else 0))
                elif kind == BYE:
                    log.info("replica set: primary %s retired the set (its run is over): this backup stops", primary)
                    self.retired = True
                    return
        except (asyncio.IncompleteReadError, ConnectionError, LinkRefused, OSError) as exc:
            if self.link is writer:
                log.warning("replica set: the link to primary %s broke (%s)", primary, type(exc).__name__)
                self._lose()
        finally:
            writer.close()

    async def _redirect(self, first: bytes, writer: asyncio.StreamWriter) -> None:
        """A worker knocked (its first frame's header is ``first``): name the primary, close."""
        try:
            header = unpack_header(first)
        except ServerError:  # (not an aps frame at all)
            writer.close()
            return
        primary = self.held_from if self.link is not None else None
        if primary is None:
            with contextlib.suppress(CoordinatorUnavailable):
                record = await self.set.coordinator.read()
                primary = record.primary if record is not None and record.primary != self.set.me else None
        payload = encode_error(ErrorCode.NOT_PRIMARY, NotPrimary.SAYS + (primary or ""))
        writer.write(pack_header(Op.ERROR, 0, 0, header.request_id, 0, 0, len(payload)) + payload)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.drain(), _HANDSHAKE_S)
        writer.close()

    async def _take_over(self) -> str | None:
        """Become primary, if the record still lists this backup under its primary."""
        try:
            record = await self.set.coordinator.read()
            if record is None or record.primary != self.held_from or self.set.me not in record.backups:
                return None
            won = await self.set.coordinator.swap(record.term, Record(self.set.me, (), 0, record.detail))
        except CoordinatorUnavailable as exc:
            log.warning("replica set: cannot take over yet (%s)", exc)
            return None
        if won is None:
            return None
        self.set.record = won
        assert self.held is not None
        number, manifest, arrays = self.held
        lost = time.monotonic() - (self.lost_at or time.monotonic())
        log.warning(
            "replica set %s: took over from %s at term %d, %.2f s after losing it, with capture %d",
            self.config.replica_set,
            self.held_from,
            won.term,
            lost,
            number,
        )
        if manifest is None:
            return None  # (no model yet: nothing to resume)
        return await asyncio.to_thread(self._write, manifest, arrays)

    def _write(self, manifest: dict, arrays: dict[str, np.ndarray]) -> str:
        """The held state as a checkpoint (the same files --checkpoint-dir writes)."""
        directory = self.config.checkpoint_dir or tempfile.mkdtemp(prefix="aps-takeover-")
        os.makedirs(directory, exist_ok=True)
        manifest = {k: v for k, v in manifest.items() if k != "served_at"}  # (the coordinator fenced it)
        layout = _coerce_layout(manifest["layout"])
        flat = {name[len("state:") :]: a for name, a in arrays.items() if name.startswith("state:")}
        weights, state = checkpoint_arrays(layout, arrays["weights"], flat)
        name = checkpoint_name(next_sequence(directory), int(manifest["version"]))
        return str(write_checkpoint(directory, name, manifest, weights, state, key=self.key))
