"""What a worker is, read from its channels (one per server, in shard order): its rank and
count, the servers' address, options and versions, its clock, the model's layout and the
views of its weights and gradients. A base of :class:`aps.client.verbs._Workers`, so of
:class:`aps.Worker` and :class:`aps.AsyncWorker` alike; for a model over K > 1 servers the
views are the worker's own (the whole model), for one server its channel's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..layout import Layout

__all__ = ["WorkerFacts"]


class WorkerFacts:
    """The read-only face of a worker (and its three timeouts, which it sets on every shard)."""

    _channels: list
    _one: bool
    _clock_offsets: list[int]
    _layout: Layout | None
    _weights: Mapping[str, np.ndarray]
    _grads: Mapping[str, np.ndarray]
    _flat_weights: np.ndarray | None
    _flat_grad: np.ndarray | None
    _bounds: tuple[int, ...]

    @property
    def compression_residual(self) -> np.ndarray | None:
        """The error feedback of ``compression="int8"`` or ``"int4"``: what quantizing the pushes
        so far left out, added to the next push (flat float32, the model's order; a copy). None
        before the first quantized push. Save it with a checkpoint and give it back with
        :meth:`load_compression_residual` (:class:`aps.torch.LocalSGD`'s ``state_dict`` does)."""
        parts = [channel._core.residual for channel in self._channels]
        if all(part is None for part in parts):
            return None
        sizes = [stop - start for start, stop in zip(self._bounds, self._bounds[1:])] if len(parts) > 1 else None
        return np.concatenate(
            [
                part.copy() if part is not None else np.zeros(sizes[index] if sizes else 0, np.float32)
                for index, part in enumerate(parts)
            ]
        )

    def load_compression_residual(self, residual: np.ndarray | None) -> None:
        """Take back a :attr:`compression_residual` (None: start from none). Raises ValueError for
        an array of another size than the model's, or one that is not finite."""
        if residual is None:
            for channel in self._channels:
                channel._core.residual = None
            return
        layout = self._layout if len(self._channels) > 1 else self._channels[0]._core.layout
        values = np.asarray(residual, np.float32).ravel()
        if layout is None or len(values) != layout.numel:
            raise ValueError(f"a residual of {len(values)} values; the model has {layout.numel if layout else '?'}")
        if not np.isfinite(values).all():
            raise ValueError("a residual that is not finite")
        bounds = self._bounds if len(self._channels) > 1 else (0, len(values))
        for channel, start, stop in zip(self._channels, bounds, bounds[1:]):
            channel._core.residual = values[start:stop].copy()

    @property
    def shards(self) -> Sequence:
        """The channel of each server, in shard order (one for an unsharded model): its
        ``address``, ``version``, ``clock``, ``server_info`` and its own calls."""
        return tuple(self._channels)

    @property
    def rank(self) -> int | None:
        """This worker's rank, ``0 <= rank < MAX``: the one it was given, or the one the server
        assigned it at :meth:`init` (None before, when it asked for any: ``rank=None`` without ``$RANK``)."""
        return self._channels[0].rank

    @property
    def num_workers(self) -> int | None:
        """The server's fixed ``--workers P``, or for an elastic server (``MIN:MAX``) the workers
        live at its last answer. Before :meth:`init`, the count given (None: none)."""
        return self._channels[0].num_workers

    @property
    def elastic(self) -> bool:
        """The server runs ``--workers MIN:MAX`` (known after :meth:`init`)."""
        return (span := self.workers_range) is not None and span[0] < span[1]

    @property
    def workers_range(self) -> tuple[int, int] | None:
        """The server's ``(MIN, MAX)`` workers (equal for a fixed size); None before :meth:`init`."""
        core = self._channels[0]._core
        return None if core.max_workers is None else (core.min_workers, core.max_workers)

    @property
    def address(self) -> str:
        """The server's address (a sharded model's: every shard's, comma-separated, in shard order)."""
        return ",".join(channel.address for channel in self._channels)

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"tcp"``: what the worker uses (``transport="auto"`` decides at connection);
        for shards on both, ``"shm+tcp"``."""
        if self._one:
            return self._channels[0].transport
        return "+".join(sorted({channel.transport for channel in self._channels}))

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for each reply (see :class:`aps.Worker`); setting it sets every shard's."""
        return self._channels[0].timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        for channel in self._channels:
            channel.timeout = value

    @property
    def server_timeout(self) -> float | None:
        """See :class:`aps.Worker`; setting it sets every shard's."""
        return self._channels[0].server_timeout

    @server_timeout.setter
    def server_timeout(self, value: float | None) -> None:
        for channel in self._channels:
            channel.server_timeout = value

    @property
    def reconnect_timeout(self) -> float | None:
        """See :class:`aps.Worker` (0: the worker does not reconnect by itself); setting it sets every shard's."""
        return self._channels[0].reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, value: float | None) -> None:
        for channel in self._channels:
            channel.reconnect_timeout = value

    @property
    def server_info(self):
        """What the (first) server said of itself in the handshake (:class:`aps.wire.protocol.ServerInfo`)."""
        return self._channels[0].server_info

    @property
    def server_options(self) -> dict[str, Any] | None:
        """The options that define the server's run, as it said in the handshake:
        ``optimizer``, ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``betas``,
        ``eps``, ``sync``, ``workers`` ... (None before connecting, or from an older server;
        every shard runs with the same: checked at connection)."""
        return self._channels[0].server_options

    @property
    def version(self) -> int:
        """Version of the weights last received (the version a push says its gradient used);
        sharded: the smallest of the shards' (each shard counts its own updates)."""
        if self._one:
            return self._channels[0].version
        return min(channel.version for channel in self._channels)

    @property
    def clock(self) -> int:
        """This worker's clock at the server: how many gradients it has pushed.

        Sharded, the iterations it has pushed that some shard still holds (docs/algorithms.md,
        "Sharded resume"): each shard counts its own, and a shard resumed from an older
        checkpoint forgets some, so this is the largest shard count, each shard's counted
        from where this worker found it (a shard that lost iterations does not make the
        worker take them again: the other shards have them)."""
        if self._one:
            return self._channels[0].clock
        return max(channel.clock + offset for channel, offset in zip(self._channels, self._clock_offsets))

    @property
    def layout(self) -> Layout | None:
        """The model's names, shapes and offsets in the flat vector (None before :meth:`init`)."""
        return self._channels[0].layout if self._one else self._layout

    @property
    def weights(self) -> Mapping[str, np.ndarray]:
        """The last weights received, as views into :attr:`flat_weights` (updated in place by
        every pull; with ``zero_copy``, read-only views replaced by every pull)."""
        return self._channels[0].weights if self._one else self._weights

    @property
    def grads(self) -> Mapping[str, np.ndarray]:
        """Gradient buffers, as views into :attr:`flat_grad`: write gradients here and ``push(worker.grads)``."""
        return self._channels[0].grads if self._one else self._grads

    @property
    def zero_copy(self) -> bool:
        """The weights are read-only views, replaced by every pull (see :class:`Worker`)."""
        return self._channels[0]._core.zero_copy

    @property
    def flat_weights(self) -> np.ndarray | None:
        """The weights as one flat float32 array in the layout's order (None before :meth:`init`)."""
        return self._channels[0].flat_weights if self._one else self._flat_weights

    @property
    def flat_grad(self) -> np.ndarray | None:
        """The gradient buffer as one flat float32 array; :attr:`grads` are views into it."""
        return self._channels[0].flat_grad if self._one else self._flat_grad

    @property
    def compression(self) -> str | None:
        """``"bf16"``/``"fp16"`` when pushes go compressed (over TCP), else None; with shards
        on both transports, the TCP shards'."""
        return next((channel.compression for channel in self._channels if channel.compression), None)

    @property
    def last_push_dropped(self) -> bool:
        """True when the server dropped the last gradient, not applied: it arrived for a closed
        BSP round, it was older than the staleness bound or cut-off allows, or it was in flight
        when a reconnect gave this worker another rank (not sent again: it may not count)."""
        return any(channel.last_push_dropped for channel in self._channels)
