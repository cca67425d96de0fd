"""The worker: :class:`Worker`, the client for training scripts, over one channel per server.

One server is the case K = 1; a model sharded across K servers (a comma-separated
address, or a list) is the same worker over K channels, each request sliced over
the shards' ranges (:mod:`aps.client.shards`), as ps-lite's ``KVWorker`` slices
every request over its servers' key ranges. Each verb is written once, as a
generator of steps (:class:`_Workers` here, each server's part in
:mod:`aps.client.steps`); :class:`Worker` runs them in the calling thread,
:class:`aps.AsyncWorker` on the asyncio loop (:mod:`aps.client.aio`).
"""

from __future__ import annotations

import atexit
import logging
import os
import ssl
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import (
    APSConnectionError,
    APSError,
    ConfigurationError,
    InvalidHyperparameters,
    LayoutMismatch,
    NotInitialized,
    ServerError,
)
from ..layout import Layout, check_floating, shard_bounds
from ..tables import Table, check_tables
from ..wire.protocol import weights_digest
from .channel import Channel, run
from .facts import WorkerFacts
from .fanout import ThreadedFanOut
from .logbook import Logbook
from .payloads import server_hyperparameters
from .rowsets import rows_call, split
from .shards import (
    _ShardThreads,
    _renumber,
    check_fp16_range,
    check_runs,
    check_values,
    common_cut,
    hyper_payloads,
    in_shard_order,
    joined_state,
    send_order,
    server_addresses,
    state_payloads,
    weights_payloads,
)
from .steps import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_SERVER_TIMEOUT, EACH, Steps

__all__ = ["Worker"]

log = logging.getLogger("aps.worker")

#: The blocking workers that have logged something (held weakly): what they have not sent yet
#: goes out at interpreter exit, before their channels leave (_log_rest_at_exit).
_LOGGING: weakref.WeakSet = weakref.WeakSet()


def _log_rest_at_exit() -> None:
    """At interpreter exit, before the channels' own hook (registered first: atexit runs the
    last one first) makes them leave: each worker's last logged points go out, as close()
    sends them. A script rarely calls close(): its last second of curves would be lost."""
    for worker in list(_LOGGING):
        try:
            worker._send_log_rest()
        except Exception as exc:  # the exit goes on whatever one worker does
            log.debug("rank %s: sending what was logged at exit failed: %s", worker.rank, exc)


atexit.register(_log_rest_at_exit)


class _Workers(WorkerFacts):
    """What the blocking and the asyncio worker share: the channels (one per server, in
    shard order), the views, and every verb as a generator of steps. A driver's subclass
    adds how the channels are made and closed, and how one request goes to every shard
    at once (``_fan_out``, the ``EACH`` step)."""

    _channels: list
    _closing: bool

    def _setup(self, channels: list) -> None:
        self._channels = channels
        self._one = len(channels) == 1
        self._closing = False
        self._logbook = Logbook()  # (what log() keeps for the next LOG)
        self._layout: Layout | None = None  # (K > 1: the whole model's; K = 1: the channel's)
        self._bounds: tuple[int, ...] = ()
        # Per shard: this worker's clock minus the shard's count (see clock).
        self._clock_offsets = [0] * len(channels)
        self._flat_weights: np.ndarray | None = None
        self._flat_grad: np.ndarray | None = None
        self._weights: Mapping[str, np.ndarray] = MappingProxyType({})
        self._grads: Mapping[str, np.ndarray] = MappingProxyType({})
        self._half: tuple[np.ndarray, np.ndarray] | None = None

    # What the worker is: aps.client.facts; its 16-bit buffers here ------------
    def half_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """For a model trained in the compression's 16-bit type over TCP with compressed
        pulls: this worker's 16-bit weight and gradient buffers (``uint16`` words, one per
        element in the layout's order), to be the model's storage. From then on every
        weights reply lands in the weight buffer (the server's float32 weights rounded to
        nearest even; a float32 reply, as at a rejoin, is rounded here the same way), and
        ``push(grad)`` of the returned gradient buffer sends it as it is. :attr:`flat_weights`
        is no longer kept current (it would cost a widening pass per pull). Sharded, each
        shard's channel receives into and sends from its slice of them.

        Raises:
            ConfigurationError: not initialized, not over TCP, or without ``compression``
                and ``compress_pulls``.
        """
        if self._one:
            return self._channels[0].half_buffers()
        if self._half is None:
            if self._layout is None or not all(
                channel.compression and channel._core.compress_pulls for channel in self._channels
            ):
                raise ConfigurationError(
                    "half_buffers needs an initialized worker over TCP with compression and compress_pulls"
                )
            weights = np.zeros(self._layout.numel, np.uint16)
            grad = np.zeros(self._layout.numel, np.uint16)
            for index, channel in enumerate(self._channels):
                channel.half_buffers(self._slice(weights, index), self._slice(grad, index))
            self._half = (weights, grad)
        return self._half

    # Verbs: each once, as steps ----------------------------------------------
    def _init(self, params: Mapping[str, Any], timeout: float | None, tables: Mapping[str, Table] | None) -> Steps:
        pieces = [params] if self._one else self._adopt_layout(params, tables)
        first, seated = self._channels[0], False
        if not self._one and first.rank is None:
            # Asked for any rank: the first shard picks one, and the others seat this worker under it.
            yield from first._init(pieces[0], timeout, tables)
            for channel in self._channels[1:]:
                channel._core.rank = first.rank
            seated = True

        def init(index: int, channel, turn) -> Steps:
            if index == 0 and seated:
                return first._core.weights
            return (yield from channel._init(pieces[index], timeout, tables))

        yield from self._each(init)
        yield from self._one_round()
        if not self._one:
            # A shard may have come back meanwhile (init reconnects): check again; then the run
            # id of every shard, for every shard to keep (its checkpoints keep them), so that
            # shards resumed later from the checkpoints of different runs are told apart.
            check_runs(self._channels)
            runs = [channel.server_info.run_id for channel in self._channels]
            if all(runs):
                yield from self._each(lambda index, channel, turn: channel._record_shard_runs(runs))
        return self.weights

    def _pull(self, rows: Mapping[str, Any] | None = None, out: Mapping[str, np.ndarray] | None = None) -> Steps:
        self._require_layout()
        if rows is not None:
            call = yield from self._rows(None, "pull", None, rows, out, dense=True)
            return self.weights, dict(zip(call.names, call.outs))
        before = self._versions()
        yield from self._each(lambda index, channel, turn: channel._pull())
        yield from self._one_cut(before)
        return self.weights

    def _push(
        self,
        grads: Mapping[str, np.ndarray] | np.ndarray,
        then_pull: bool,
        rows: Mapping[str, Any] | None = None,
        pull_rows: Mapping[str, Any] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> Steps:
        if rows is not None or pull_rows is not None:
            if pull_rows is not None and not then_pull:
                raise ConfigurationError("push() pulls no rows: use push_pull(grads, rows=..., pull_rows=...)")
            call = yield from self._rows(grads, "push_pull" if then_pull else "push", rows, pull_rows, out, dense=True)
            return self.weights if pull_rows is None else (self.weights, dict(zip(call.names, call.outs)))
        pieces = [grads] if self._one else self._gradient_pieces(grads)
        if not self._one:
            check_fp16_range(pieces, self._channels)
        before = self._versions()
        yield from self._each(lambda index, channel, turn: channel._push(pieces[index], then_pull, turn), in_turn=True)
        yield from self._one_cut(before)
        return self.weights

    def _pull_rows(self, table: str | Mapping[str, Any], ids: Any, out: Any, versioned: bool = True) -> Steps:
        """(``versioned`` False: the reply's version is not taken as the worker's: see
        ``pull_rows(keep_version=True)``.)"""
        if isinstance(table, Mapping):
            if ids is not None:
                raise ConfigurationError("pull_rows({table: ids, ...}) takes no ids of its own")
            call = yield from self._rows(None, "pull", None, table, out, dense=False, versioned=versioned)
            return dict(zip(call.names, call.outs))
        call = yield from self._rows(
            None, "pull", None, {table: ids}, None if out is None else {table: out}, dense=False, versioned=versioned
        )
        return call.outs[0]

    def _push_rows(self, table: str | Mapping[str, Any], ids: Any, grads: Any) -> Steps:
        if isinstance(table, Mapping):
            if ids is not None or grads is not None:
                raise ConfigurationError("push_rows({table: (ids, grads), ...}) takes no ids or grads of its own")
            rows = table
        else:
            rows = {table: (ids, grads)}
        yield from self._rows(None, "push", rows, None, None, dense=False)

    def _rows(
        self,
        grads: Any,
        kind: str,
        push: Mapping[str, Any] | None,
        pull: Mapping[str, Any] | None,
        out: Mapping[str, np.ndarray] | None,
        dense: bool,
        versioned: bool = True,
    ) -> Steps:
        """A request with rows (``kind``: pull, push or push_pull; ``dense``: with the dense
        gradient or weights), each shard its ids (:func:`aps.tables.shard_of`); a push goes to
        every shard (each counts the iteration), a pull of rows alone to those holding some.
        Returns the call, its pulled rows in its out arrays."""
        self._require_layout()
        layout = self.layout
        if layout is None:
            raise NotInitialized("call init(params) before pulling or pushing rows")
        call = rows_call(layout, push, pull, out, dense)._replace(versioned=versioned)
        pushing, then_pull = kind != "pull", kind != "push"
        if self._one:
            channel = self._channels[0]
            if pushing:
                yield from channel._push(grads, then_pull, None, call)
            else:
                yield from channel._pull(call)
            return call
        pieces = [None] * len(self._channels)
        if pushing and dense:
            pieces = self._gradient_pieces(grads)
            check_fp16_range(pieces, self._channels)
        parts = split(call, len(self._channels), every=pushing)
        before = self._versions()

        def one(index: int, channel, turn) -> Steps:
            part = parts.calls[index]
            if part is None:
                return None
            if pushing:
                return (yield from channel._push(pieces[index], then_pull, turn, part))
            return (yield from channel._pull(part))

        yield from self._each(one, in_turn=pushing)
        parts.gather(call)
        yield from self._one_cut(before)
        return call

    def _ping(self) -> Steps:
        return min((yield from self._each(lambda index, channel, turn: channel._ping())))

    def _claim(self, name: str, count: int) -> Steps:
        self._require_layout("claim")
        return (yield from self._channels[0]._claim(name, count))  # (a sharded run's counters: shard 0's)

    def _pace(self, steps: int, seconds: float) -> Steps:  # (a sharded run's paces: shard 0's)
        return (yield from self._channels[0]._pace(steps, seconds))

    def _log(self, scalars: Mapping[str, Any], step: int | None, batch: Any) -> Steps:
        self._require_layout("log")
        if self._logbook.add(scalars, self.clock if step is None else step, batch):
            yield from self._channels[0]._log(self._logbook.take())  # (a sharded run's: shard 0's)

    def _log_rest(self) -> Steps:
        """Send what is left to log before leaving (a server gone by then is no error)."""
        if self._logbook.pending and self.layout is not None:
            try:
                yield from self._channels[0]._log(self._logbook.take())
            except APSError:
                pass

    def _set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> Steps:
        payloads: list[tuple[bytes, list[int] | None]]
        if self._one:
            payloads = [(self._channels[0]._hyper_payload(groups), None)]
        else:  # each shard the groups that meet its range, cut to it; every shard checks first
            layout, _, _ = self._whole("set_hyperparameters")
            payloads = list(
                hyper_payloads(groups, layout.numel, server_hyperparameters(self.server_info), self._bounds)
            )

        def call(check: bool):
            def one(index: int, channel, turn) -> Steps:
                payload, numbers = payloads[index]
                try:
                    yield from channel._hyper(payload, check)
                except InvalidHyperparameters as exc:  # named as the caller numbered the groups
                    raise (exc if numbers is None else _renumber(exc, numbers)) from None

            return one

        if not self._one:
            yield from self._each(call(True))
        yield from self._each(call(False))

    def _optimizer_state(self) -> Steps:
        self._require_layout("optimizer_state")
        states = yield from self._each(lambda index, channel, turn: channel._optimizer_state())
        return states[0] if self._one else joined_state(states)

    def _load_optimizer_state(self, state: Mapping[str, Any]) -> Steps:
        if self._one:
            payloads = [self._channels[0]._state_payload(state)]
        else:  # each shard its range of every array; every shard checks its part first
            layout, _, _ = self._whole("load_optimizer_state")
            payloads = state_payloads(state, layout.numel, self._bounds)
            yield from self._each(lambda index, channel, turn: channel._load_state(payloads[index][0], [], True))
            check_values(payloads)
        return any((yield from self._each(lambda index, channel, turn: channel._load_state(*payloads[index]))))

    def _load_weights(self, params: Mapping[str, Any] | np.ndarray) -> Steps:
        if self._one:
            values = self._channels[0]._weights_payload(params)
            payloads = [(weights_digest((values,)), values)]
        else:  # each shard its range; every shard checks its digest first
            payloads = weights_payloads(params, self._layout, self._bounds)
            yield from self._each(lambda index, channel, turn: channel._load_weights(payloads[index][0], None))
        return any((yield from self._each(lambda index, channel, turn: channel._load_weights(*payloads[index]))))

    def _reconnect(self, timeout: float | None) -> Steps:
        before = self._versions()
        yield from self._each(lambda index, channel, turn: channel._reconnect(timeout))
        yield from self._one_cut(before)  # a BSP shard that came back older
        return self.weights

    # Every shard at once ---------------------------------------------------
    def _each(self, call: Callable[[int, Any, Any], Steps], *, in_turn: bool = False) -> Steps:
        """``call(index, channel, turn)``'s steps for every channel, their results in shard
        order: one channel's in line, several at once (the driver's ``_fan_out``), pushes
        (``in_turn``) leaving one shard after the other (see :meth:`_turns`)."""
        if self._one:
            return [(yield from call(0, self._channels[0], None))]
        return (yield EACH, self, call, in_turn)

    def _turns(self, in_turn: bool, make: Callable[[int], Any]) -> list:
        """Each shard's place in a push's sending order, or None: the shards' requests leave
        this worker one after the other, starting with shard ``rank % K`` (so workers start
        on different shards), each as soon as the one before it is sent, while the replies
        of the shards served first come in. Sent all at once, the pieces would share the
        worker's link and arrive together, then their replies would come back together:
        every link busy one way at a time. ``make(position)`` makes one place."""
        turns: list = [None] * len(self._channels)
        if in_turn:
            rank = self.rank
            if rank is None:  # (a push comes after init, which seats this worker)
                raise NotInitialized("call init(params) before push")
            for position, index in enumerate(send_order(rank, len(self._channels))):
                turns[index] = make(position)
        return turns

    def _failed(self, errors: list[BaseException]) -> None:
        """Several shards' requests ended: raise the first failure, after saying the others."""
        if errors:
            for extra in errors[1:]:
                log.warning("rank %s: another shard failed too: %s: %s", self.rank, type(extra).__name__, extra)
            raise errors[0]

    def _check_open(self) -> None:
        if self._closing:
            raise APSConnectionError(f"the worker of {self.address} is closed")

    def _settle_clock(self) -> None:
        """After a request: each shard's count from now on goes on from :attr:`clock`."""
        clock = self.clock
        self._clock_offsets = [clock - channel.clock for channel in self._channels]

    # A BSP shard that came back older ----------------------------------------
    def _versions(self) -> list[int] | None:
        return None if self._one else self._shard_versions()

    def _shard_versions(self) -> list[int]:
        return [channel.version for channel in self._channels]

    def _one_cut(self, before: list[int] | None) -> Steps:
        """After a request in which a BSP shard came back older (its version went back): bring
        every shard back to one round, the newest every shard has a checkpoint of
        (docs/algorithms.md, "Sharded resume"). Other policies' shards keep what they hold."""
        if before is None or not any(c.version < v for c, v in zip(self._channels, before)):
            return
        if (self.server_options or {}).get("sync") != "bsp" or len(set(self._shard_versions())) == 1:
            return
        target = min(self._shard_versions())
        try:
            versions = yield from self._each(lambda index, channel, turn: channel._checkpoint_versions())
        except ServerError as exc:  # no --checkpoint-dir, an older server: each goes on from where it is
            log.error(
                "rank %s: a shard resumed older, and the shards cannot be brought back to one round: %s", self.rank, exc
            )
            return
        cut = common_cut(self.rank, self._shard_versions(), list(versions), target)
        if cut is None:
            return
        try:
            yield from self._each(lambda index, channel, turn: channel._rewind(cut, self.reconnect_timeout))
        except ServerError as exc:
            log.error("rank %s: a shard refused to go back to round %d: %s", self.rank, cut, exc)
            return
        self._clock_offsets = [0] * len(self._channels)  # one round again: they count alike

    def _one_round(self) -> Steps:
        """After a new worker's INIT under sharded BSP: a shard that seated it in the round
        before the one the others did (its INIT reached that shard before the round closed
        there, and the others after) has it skip that round, so that its gradients fall into
        the same rounds on every shard (docs/algorithms.md, "Sharded BSP: a worker that
        joins"). Clocks more than one apart are shards that count rounds apart (a shard
        resumed older without a common checkpoint): each goes on from where it is."""
        if self._one or (self.server_options or {}).get("sync") != "bsp":
            return
        clocks = [channel.clock for channel in self._channels]
        if max(clocks) - min(clocks) != 1:
            return
        behind = {index for index, clock in enumerate(clocks) if clock < max(clocks)}
        log.info(
            "rank %s: seated at clock %d on shard(s) %s and %d on the others: it takes no part in round %d there",
            self.rank,
            min(clocks),
            ", ".join(map(str, sorted(behind))),
            max(clocks),
            min(clocks),
        )

        def skip(index: int, channel: Any, turn: Any) -> Steps:
            if index in behind:
                yield from channel._skip_round()

        self._clock_offsets = [0] * len(self._channels)  # (one round again: they count alike)
        yield from self._each(skip)

    # The whole model and its slices (K > 1) ----------------------------------
    def _slice(self, flat: np.ndarray, index: int) -> np.ndarray:
        return flat[self._bounds[index] : self._bounds[index + 1]]

    def _require_layout(self, what: str = "pull or push") -> None:
        if not self._one and self._layout is None:
            raise NotInitialized(f"call init(params) before {what}")

    def _whole(self, what: str = "pull or push") -> tuple[Layout, np.ndarray, np.ndarray]:
        """(K > 1) The whole model: its layout, flat weights and flat gradient.

        Raises:
            NotInitialized: before init.
        """
        layout, weights, grad = self._layout, self._flat_weights, self._flat_grad
        if layout is None or weights is None or grad is None:
            raise NotInitialized(f"call init(params) before {what}")
        return layout, weights, grad

    def _adopt_layout(
        self, params: Mapping[str, Any], tables: Mapping[str, Table] | None
    ) -> list[Mapping[str, np.ndarray]]:
        """The model ``params`` describes, in the flat buffers (made, and their slices given
        to the shards' channels, at the first init); each shard's range of it, as the
        tensors (and pieces) of its layout."""
        if not isinstance(params, Mapping) or not params:
            raise ConfigurationError("init takes a non-empty mapping of name to float32 array")
        layout = Layout.from_arrays(params, check_tables(tables))
        if self._layout is not None:
            self._layout.require_same(
                layout, "init with a different model than before", "init with other tables than before"
            )
        count = len(self._channels)
        if self._layout is None:
            self._bounds = shard_bounds(layout.numel, count)
            weights = self._flat_weights = np.zeros(layout.numel, np.float32)
            grad = self._flat_grad = np.zeros(layout.numel, np.float32)
            for index, channel in enumerate(self._channels):
                channel._core.adopt(self._slice(weights, index), self._slice(grad, index))
            self._layout = layout
            self._weights = MappingProxyType(layout.views(weights))
            self._grads = MappingProxyType(layout.views(grad))
        _, weights, _ = self._whole("init")
        layout.flatten_into(params, weights)
        return [layout.shard(index, count).views(self._slice(weights, index)) for index in range(count)]

    def _gradient_pieces(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> list:
        """Each shard's piece of ``grads``, put in the flat gradient buffer first (nothing
        to do when they are in it; the 16-bit buffer of :meth:`half_buffers` goes as it is)."""
        layout, _, flat = self._whole()
        if self._half is not None and grads is self._half[1]:
            return [channel._core._half_grad for channel in self._channels]
        if grads is not flat and grads is not self._grads:
            if isinstance(grads, np.ndarray):
                if grads.shape != (layout.numel,):
                    raise LayoutMismatch(f"a flat gradient must have shape ({layout.numel},), got {grads.shape}")
                check_floating(grads.dtype, "the flat gradient")
                np.copyto(flat, grads, casting="same_kind")  # float64/float16 converted here, as one server's
            elif not isinstance(grads, Mapping):
                raise ConfigurationError("push takes a mapping of name to array, or a flat float32 array")
            else:
                layout.check(grads)
                for name, view in self._grads.items():
                    view[...] = grads[name]
        return [self._slice(flat, index) for index in range(len(self._channels))]


class Worker(ThreadedFanOut, _Workers):
    """A blocking client for one training process.

    Args:
        address: the server, ``tcp://HOST:PORT`` (default: ``$APS_ADDRESS``);
            several servers (comma-separated, or a list) for a model sharded
            across them (``aps serve --shard I --shards K``, see
            :mod:`aps.client.shards`): the same worker, over one channel per
            server (:attr:`shards`).
        rank: this worker's rank, ``0 <= rank < num_workers`` (default: ``$RANK``;
            without it, the server assigns a free rank at :meth:`init`).
        num_workers: the number of workers P, which must equal the server's
            ``--workers`` (an elastic server's ``MIN:MAX`` takes any count up to MAX;
            default: ``$WORLD_SIZE``; without it, the server's count).
        transport: ``"auto"`` (shared memory when co-located, when available;
            TCP otherwise) or ``"tcp"``.
        connect_timeout: seconds to wait for the server at the first
            connection (None: no limit). A server that does not listen yet
            (refused, unreachable: it is still starting) is tried again
            with a short backoff until then, said once in the log; each
            shard's server of a sharded worker gets its own.
        timeout: seconds to wait for each reply after ``init`` (None: as long as
            the server is alive; a sync policy may hold a pull for as long as
            slower workers need).
        heartbeat: seconds between pings while idle, so the server keeps this
            worker's seat (None: no pings).
        token: the server's shared secret, when it has one (``--token``); the
            worker proves it knows it and checks that the server does too
            (default: ``$APS_TOKEN``, else the token file of a server this user
            started on loopback without a token, read at every connection).
        tls: TCP over TLS: True (the system's CAs, or ``$APS_TLS_CA``; a client
            certificate from ``$APS_TLS_CERT``/``$APS_TLS_KEY`` when set), or an
            ``ssl.SSLContext``. A ``tls://`` address implies True.
        server_timeout: seconds without a byte from the server while a reply is
            due, after which it is taken to have hung or gone: the request
            raises :class:`aps.ServerSilent` (a ``TimeoutError`` and a
            ``ConnectionError``) instead of blocking forever. The server says
            it is alive every few seconds while it holds a request (None: wait
            forever).
        reconnect: when the server is lost (it crashed, restarted, dropped
            this worker, or the network failed), keep trying to get back for
            ``reconnect_timeout`` seconds (None: forever) with capped
            exponential backoff, rejoin under the same rank and finish the
            call in progress: a push whose reply never came is sent again and
            the server applies it only once. A server that resumed from an
            older checkpoint is taken as it is: its weights and this worker's
            clock there; a gradient computed on weights it no longer has is
            dropped (:attr:`last_push_dropped`). Raises
            :class:`aps.RunChanged` if the server came back with another run,
            and :class:`aps.APSConnectionError` when time is up. False: every
            lost connection raises at once (call :meth:`reconnect` yourself).
        reconnect_timeout: see ``reconnect``.
        compression: ``"bf16"``/``"fp16"``: over TCP, send gradients as 16-bit values (rounded
            to nearest even; widened to float32 in the server's update kernel), half the bytes;
            ``"int8"``/``"int4"``: block-quantized, with error feedback (:attr:`compression_residual`),
            a quarter and an eighth (default: ``$APS_COMPRESSION``, else None: float32). fp16
            overflows beyond 65504 (such a push raises :class:`aps.NonFiniteGradient`, nothing
            sent); bf16 has float32's range. Over shared memory gradients stay float32.
        compress_pulls: with ``compression``, the weights come back as 16-bit
            values too (the server keeps float32 master weights; the worker
            computes on weights rounded to 16 bits: see docs/design/wire.md, "Wire
            compression", for the cost).
        zero_copy: over shared memory, a pull moves no weight bytes: :attr:`weights`
            and :attr:`flat_weights` are read-only views into the server's snapshot
            slot the reply named, which stays unchanged until the next weights
            reply replaces them (read them again after each call: a view kept
            past the next reply may show another version, so ``.copy()`` what
            you keep; a write raises ``ValueError``). On ``close()`` the worker
            keeps a copy of its last weights. Over TCP they are read-only views
            of the worker's own buffer. One server only (a sharded worker copies).
        spin: over shared memory, seconds to poll for each reply before sleeping
            in the kernel (at most 0.01; 0, the default: sleep at once). A reply
            due within that time then costs no wake-up of this process: a 4 KiB
            push_pull in about two thirds of the time, for a core kept busy
            while waiting. For hosts with a core to spare per worker.

    Raises:
        ConfigurationError: bad address, rank or transport; servers that are not
            the shards of one model.
        APSConnectionError: the server cannot be reached.

    Example::

        with aps.Worker("tcp://127.0.0.1:7450", rank=0, num_workers=2) as worker:
            weights = worker.init({"w": np.zeros(10, np.float32)})
            for step in range(100):
                grads = {"w": compute_gradient(weights)}
                weights = worker.push_pull(grads)
    """

    def __init__(
        self,
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
        zero_copy: bool = False,
        spin: float = 0.0,
    ) -> None:
        self._pool: _ShardThreads | None = None
        if compression is None:
            compression = os.environ.get("APS_COMPRESSION") or None
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
        if zero_copy and len(addresses) > 1:
            raise ConfigurationError("zero_copy needs one server: a sharded worker joins its shards' weights")
        channels: list[Channel] = []
        try:
            for one in addresses:
                channels.append(
                    Channel(
                        one,
                        rank,
                        num_workers,
                        transport,
                        as_shard=len(addresses) > 1,
                        zero_copy=zero_copy,
                        spin=spin,
                        **options,
                    )
                )
            if len(channels) > 1:
                channels = in_shard_order(channels)
        except BaseException:
            for channel in channels:
                channel.close()
            raise
        self._setup(channels)
        if len(channels) > 1:
            self._pool = _ShardThreads(len(channels) - 1)
            weakref.finalize(self, self._pool.shutdown)  # a worker dropped without close() lets them go
        self._lock = threading.RLock()  # one sharded request at a time

    @classmethod
    def from_env(cls, **options: Any) -> Worker:
        """A worker for ``APS_ADDRESS``, ``RANK`` and ``WORLD_SIZE`` (set by ``torchrun`` or ``aps launch``)."""
        return cls(None, None, None, **options)

    # Requests -------------------------------------------------------------
    def init(
        self, params: Mapping[str, Any], *, tables: Mapping[str, Table] | None = None, timeout: float | None = 300.0
    ) -> Mapping[str, np.ndarray]:
        """Join the training and return the server's initial weights.

        The first worker to join provides the initial weights; later workers
        must send the same names, shapes and order. Blocks until all
        ``num_workers`` workers have joined (at once when training is already
        running: a rejoin). Sharded, every shard gets its range of ``params``.

        Args:
            params: mapping of tensor name to float array, in a fixed order (float64
                and float16 values make the float32 model).
            tables: the model's embedding tables, a mapping of name to
                :class:`aps.tables.Table`, the same from every worker (the first
                worker's declaration is the run's; every shard holds rows of every table).
            timeout: seconds to wait for every worker to join.

        Returns:
            The weights, as views into :attr:`flat_weights`.

        Raises:
            InitTimeout: not every worker joined in time (the connection is closed).
            LayoutMismatch, TableMismatch, RankTaken, RankOutOfRange, WorkerCountMismatch:
                the server refused the join (a table mismatch names the table and field).
        """
        return run(self._init(params, timeout, tables))

    def pull(self, *, rows: Mapping[str, Any] | None = None, out: Mapping[str, np.ndarray] | None = None):
        """Wait until the sync policy releases this worker; return the newest weights (views).

        With ``rows`` (``{table: ids}``), the rows of those ids too, read at the same moment
        as the weights: returns ``(weights, {table: rows})`` (see :meth:`pull_rows`).
        """
        return run(self._pull(rows, out))

    def pull_rows(
        self, table: str | Mapping[str, Any], ids: Any = None, *, out: Any = None, keep_version: bool = False
    ) -> Any:
        """The rows of ``ids`` of embedding table ``table``: a float32 array of shape
        ``(len(ids), dim)`` (duplicates allowed, order kept), into ``out`` when given (a
        C-contiguous float32 array of that shape: no other copy is made). Several tables in one
        request: ``pull_rows({table: ids, ...}, out={table: array, ...})`` returns ``{table: rows}``.

        Rows follow the sync policy as the weights do: the call waits until the policy releases
        this worker (docs/algorithms.md, "Rows"). Rows never pushed read as their initial
        values (the server keeps nothing for them: a row is made by its first push). With
        ``--shards K``, each shard is asked for the ids it holds, at once.

        Args:
            table: the table's name, or ``{table: ids}`` for several tables in one request.
            ids: the ids (integers in ``[0, rows)``; duplicates allowed).
            out: where the rows go (``{table: array}`` for several tables).
            keep_version: leave :attr:`version` as it is: the version of the dense weights
                this worker holds, which its next push says its gradient was computed on (a
                forward that reads rows between two steps, as :class:`aps.torch.Embedding`
                does). By default :attr:`version` becomes the version the rows were read at,
                as a :meth:`pull` sets it (under the asynchronous policies, pull the dense
                weights too).

        Returns:
            The rows (``out`` itself when given), or ``{table: rows}`` for several tables.

        Raises:
            InvalidIds: an unknown table, ids that are not integers or not in ``[0, rows)``, a
                bad ``out`` (nothing is sent, nothing changes).

        Example::

            rows = worker.pull_rows("items", ids, keep_version=True)  # the next push says the weights held
        """
        return run(self._pull_rows(table, ids, out, versioned=not keep_version))

    def push_rows(self, table: str | Mapping[str, Any], ids: Any = None, grads: Any = None) -> None:
        """Push gradient rows ``grads`` (shape ``(len(ids), dim)``) for ``ids`` of table ``table``
        (a duplicate id's rows are summed, as PyTorch's sparse gradients coalesce), or for
        several tables at once: ``push_rows({table: (ids, grads), ...})``.

        It is one iteration, as :meth:`push` is (the clock advances; the dense weights stay as
        they are). To push rows with the dense gradient, use ``push(grads, rows=...)`` or
        ``push_pull(grads, rows=..., pull_rows=...)``.

        Raises:
            InvalidIds: an unknown table, bad ids, rows of the wrong shape (nothing is sent).
            NonFiniteGradient: a row holds NaN or infinity (nothing changes on the server).
        """
        run(self._push_rows(table, ids, grads))

    def push(self, grads: Mapping[str, np.ndarray] | np.ndarray, *, rows: Mapping[str, Any] | None = None) -> None:
        """Send one gradient (ends this worker's iteration), and with ``rows``
        (``{table: (ids, grads)}``) gradient rows of the model's tables in the same request.

        Args:
            grads: mapping of name to float32 array matching the model, a flat
                float32 array of the model's size, or :attr:`grads` itself.
                float64 and float16 arrays are converted to float32 (into
                :attr:`grads`, which they overwrite); other dtypes raise
                DTypeMismatch.
        """
        run(self._push(grads, False, rows))

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray] | np.ndarray,
        *,
        rows: Mapping[str, Any] | None = None,
        pull_rows: Mapping[str, Any] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ):
        """:meth:`push` then :meth:`pull` in one round trip.

        With ``rows`` (``{table: (ids, grads)}``: the last batch's gradient rows) and
        ``pull_rows`` (``{table: ids}``: the next batch's), the training loop's whole step in
        one round trip: returns ``(weights, {table: rows})`` when ``pull_rows`` is given
        (into ``out``'s arrays, where given).
        """
        return run(self._push(grads, True, rows, pull_rows, out))

    def ping(self) -> int:
        """One empty round trip; returns the server's version (sharded: the smallest)."""
        return run(self._ping())

    def log(self, scalars: Mapping[str, Any], step: int | None = None, *, batch: Any = None) -> None:
        """Report the training loop's scalars (``{"loss": 0.41, "lr": 0.1}``: numbers, numpy scalars,
        one-element tensors) at ``step`` (default: this worker's :attr:`clock`).

        The server keeps them per rank as curves over the run, drawn on its dashboard beside this
        process's CPU and memory, and exports the newest in ``/metrics``. No round trip: they are
        sent about once a second, and on :meth:`close` (or at exit). ``batch`` (the step's input: an
        array, or bytes) sends a digest of it, by which the server warns when two ranks train on the
        same data. At most 32 names a worker, each 1 to 64 characters of ``A-Z a-z 0-9 _ . : / -``;
        a bad one raises ``ValueError`` and nothing is kept."""
        run(self._log(scalars, step, batch))
        _LOGGING.add(self)  # (its last points go out at exit, if it is never closed)

    def pace(self, steps: int, seconds: float) -> tuple[float | None, float | None]:
        """Say this worker took ``steps`` local steps in all in ``seconds``: its step rate and the
        fastest live worker's, as the server keeps them (docs/protocol.md, "Step rates")."""
        return run(self._pace(steps, seconds))

    def claim(self, name: str, count: int = 1) -> int:
        """Add ``count`` to the run's counter ``name`` (0 at first; adding 0 reads it) and return
        its value before: an atomic fetch-and-add on the server (shard 0), kept in checkpoints,
        so each value goes to one worker (:class:`aps.torch.ElasticSampler` claims chunks so).
        A name is 1 to 256 UTF-8 bytes; a run keeps 4,096 counters of at most 2**53."""
        return run(self._claim(name, count))

    def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """Set the optimizer values the server applies this worker's following pushes with,
        per group of parameters (torch's param groups), until they are set again.

        The groups cut the flat parameter vector (the layout's order) into
        consecutive ranges: the first starts at 0, each ends at its ``stop``
        (exclusive) where the next begins, and the last ends at the model's
        size. All are sent in one request; the server checks every value and
        refuses the whole request if one is wrong (nothing changes). The
        staleness-aware scale still multiplies the gradient. In BSP rounds
        and softsync groups, the one update is applied with the values of the
        push that closed it. The values belong to this connection: the worker
        sends them again when it reconnects, and a new worker process starts
        with the server's own. Sharded, ``stop`` counts in the whole model and
        each shard gets the groups that meet its range, cut to it; every shard
        checks its part first (Flag.CHECK), and only if all take them are they
        set on every shard: a refused request changes no shard.

        Args:
            groups: one dict per group, in order: ``stop`` (int; may be left out
                for the last group), ``lr``, ``weight_decay``, ``momentum``,
                ``dampening`` (for Adam and AdamW, ``momentum`` and
                ``dampening`` are beta1 and beta2). A value left out is the
                server's (``--lr``, ``--weight-decay``, ``--momentum`` or
                ``--betas``; SGD's dampening is 0).

        Raises:
            NotInitialized: before :meth:`init`.
            ConfigurationError: a group is not a dict, has unknown keys, or lacks a ``stop``.
            InvalidHyperparameters: the server refused a value or a stop (the
                message names the group); momentum with a server started
                without ``--momentum`` is refused too (it keeps no momentum state).

        Example::

            worker.set_hyperparameters([
                {"stop": 1000, "lr": 0.1, "weight_decay": 5e-4},  # elements 0..999
                {"lr": 0.1, "weight_decay": 0.0},                  # the rest (biases)
            ])
        """
        run(self._set_hyperparameters(groups))

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of the server's optimizer state, taken between two updates.

        Returns:
            ``{"optimizer": name, "steps": int, "version": int, "arrays": {name: array}}``:
            the optimizer's name (``sgd``, ``adam``, ``adamw``), its step count (the
            updates it has applied), the weights version the state belongs to, and its
            arrays, each flat float32 of the model's size in the layout's order: SGD's
            ``momentum_buffer`` (none without momentum), Adam's and AdamW's ``exp_avg``
            and ``exp_avg_sq``. The arrays are this caller's own. Sharded: every shard's
            state, read at once, each array the shards' pieces end to end; ``version``
            is the smallest of the shards'.

        Raises:
            NotInitialized: before :meth:`init`.
            InvalidState: (sharded) the shards' step counts differ (the state was read
                while updates were being applied).

        Example::

            state = worker.optimizer_state()
            np.savez("opt.npz", **state["arrays"])
        """
        return run(self._optimizer_state())

    def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """Load an optimizer state (as :meth:`optimizer_state` returns it) into the server,
        so that training goes on as if it had never stopped.

        It is taken only by a run that has not applied an update yet (version 0),
        or as a no-op when the very same state was loaded into this run already
        (every rank of a job may load the same checkpoint, in any order, and a
        retried load changes nothing). The server checks everything first and
        changes nothing when it refuses. The ``version`` of ``state`` is ignored.
        Sharded, each shard gets its range of every array; every shard checks its
        part first, and only if all would take it is it loaded on every shard.

        Args:
            state: ``optimizer`` (the server's optimizer's name), ``steps`` (an
                integer from 0 to 2**53), and ``arrays``: every array of the
                server's optimizer, each flat (or any shape) float32 with the
                model's number of elements.

        Returns:
            True when the state was loaded (by some shard); False when this state
            was loaded already (nothing changed).

        Raises:
            NotInitialized: before :meth:`init`.
            InvalidState: another optimizer, other arrays, an array of another size,
                a value that is not finite, a negative exp_avg_sq, a bad step count
                (sgd: a step count of 0 with a momentum buffer that is not zero), or
                another state when the server has applied updates already.
            DTypeMismatch: an array is not float32.
        """
        return run(self._load_optimizer_state(state))

    def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """Make ``params`` the server's weights: the run starts from them, as if they had
        been the first worker's initial weights.

        For weights loaded after the workers joined (a checkpoint loaded into the model
        once the optimizer exists, as training scripts resume). They are taken only before
        the server has applied an update or taken a gradient, and only once per run: every
        rank may load the same weights (a no-op after the first, which returns False),
        while other weights than those loaded already are refused. The server checks
        everything first and changes nothing when it refuses. This worker then holds them.
        Sharded, each shard gets its range, after every shard checked its digest.

        Args:
            params: a mapping of name to float32 array in the model's layout, or one flat
                float32 array of the model's size.

        Returns:
            True when they were loaded; False when these very weights were loaded already.

        Raises:
            NotInitialized: before :meth:`init`.
            LayoutMismatch, DTypeMismatch: not the model's names, shapes or float32.
            WeightsRefused: the server has applied updates or taken gradients already,
                other weights were loaded into this run, or a value is not finite.

        Example::

            worker.init(initial)  # every rank joins
            worker.load_weights(checkpoint_weights)  # every rank, before its first push
        """
        return run(self._load_weights(params))

    def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """Open a new connection and rejoin under the same rank; returns the newest weights.

        Retries for a few seconds while the server still holds the rank (it has
        not yet noticed the old connection go). Workers made with
        ``reconnect=True`` (the default) do this by themselves.
        """
        return run(self._reconnect(timeout))

    def close(self) -> None:
        """Leave the training (the server stops counting this worker) and disconnect.

        A worker still open when its process exits leaves by itself (an ``atexit`` hook
        does what this does, within a few seconds in all), so that a script that ends
        without calling it is counted as having left, not as a crash."""
        self.leave()

    def _send_log_rest(self) -> None:
        """What is left to log, sent now unless the worker is closing, or another thread holds
        its channel in a call (nothing waits at exit)."""
        channel = self._channels[0]
        if self._closing or channel._closing or not channel._lock.acquire(blocking=False):
            return
        try:
            run(self._log_rest())
        finally:
            channel._lock.release()

    def leave(self, *, finished: bool = False) -> None:
        """Leave the run for good (the server stops counting this worker at once) and
        disconnect: :meth:`close` by its elastic name. ``finished``: this worker's
        training is done and the run is ending: an elastic server then holds the
        workers still training below MIN no more (they finish their part), where a
        plain leave (a worker scaled away) holds them until MIN are back."""
        if not self._closing:
            run(self._log_rest())
        self._closing = True
        for channel in self._channels:
            channel.close(finished=finished)
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
