"""The verbs every worker shares: :class:`_Workers`, each request of a worker (one server, or
a model sharded across K, each request sliced over the shards' ranges) written once as a
generator of steps (each server's part in :mod:`aps.client.steps`), which
:class:`aps.Worker` (:mod:`aps.client.worker`) runs in the calling thread and
:class:`aps.AsyncWorker` (:mod:`aps.client.aio`) on the asyncio loop.
"""

from __future__ import annotations

import logging
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
from .facts import WorkerFacts
from .logbook import Logbook
from .payloads import server_hyperparameters
from .rowsets import rows_call, split
from .shards import (
    _renumber,
    check_fp16_range,
    check_runs,
    check_values,
    common_cut,
    hyper_payloads,
    joined_state,
    send_order,
    state_payloads,
    weights_payloads,
)
from .steps import EACH, Steps

log = logging.getLogger("aps.worker")


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
