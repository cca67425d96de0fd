"""Streaming local SGD: the model's fragments synced in turn, one per shard server
(:class:`aps.torch.LocalSGD` with ``streaming=True``; Douillard et al., "Streaming DiLoCo", 2025).

A sharded model lives on K servers (``aps serve --shard I --shards K``), each holding one
contiguous range of the flat vector (:func:`aps.layout.shard_bounds`). Streaming gives each
shard its own :class:`aps.Worker` of this rank, so that each range is a *fragment* with its
own sync: fragment ``i`` syncs every ``every`` inner steps like the whole model would, but
at step ``(i + 1) * every // K`` of each period, so the K syncs of a period are spread
evenly over it and each moves 1/K of the bytes. Each shard runs its sync policy on its own
(its rounds, clocks and staleness in units of that fragment's syncs), exactly as a plain
server does for a whole model: the shards' servers need nothing of their own for it.

Where a period stands is the run's, not the worker's: a worker that joins a run under way
(a restarted process, an elastic joiner) takes it from the shards' clocks (how many
syncs each fragment has had), so that it pushes the fragment the others push next;
counting from its own zero it could wait on one shard's round while the others wait on
another's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..client.shards import in_shard_order
from ..client.worker import Worker
from ..errors import ConfigurationError
from ..layout import Layout, shard_bounds

__all__ = ["Fragments"]


class Fragments:
    """The K fragments of ``params`` (name -> float32 parameter) and a worker for each of the
    servers at ``addresses`` (in any order: each says which shard it is), joined with the
    model's weights, each fragment's global weights then loaded into the model.

    Attributes:
        workers: one :class:`aps.Worker` per shard, in shard order.
        bounds: where each fragment begins and ends in the flat vector (K + 1 offsets).
        offsets: the step of each period (``position % every``) at which each fragment syncs.
        position: the run's inner steps so far, as the schedule counts them (see the module
            docstring).
        anchor: the flat global weights each fragment's inner steps started from.
    """

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        addresses: Sequence[str],
        every: int,
        make_worker: Callable[[str, tuple[int | None, int]], Worker],
        init_timeout: float | None,
    ) -> None:
        self.params = params
        self.every = every
        self.layout = Layout(tuple(params), tuple(tuple(p.shape) for p in params.values()))
        count = len(addresses)
        workers: list[Worker] = []
        try:
            for address in addresses:
                workers.append(make_worker(address, (None, count)))  # (each checks it is one of K shards)
            self.workers = in_shard_order(workers)
        except BaseException:
            for worker in workers:
                worker.close()
            raise
        self.bounds = shard_bounds(self.layout.numel, count)
        self.pieces = [self.layout.shard(index, count) for index in range(count)]
        self.offsets = [(index + 1) * every // count % every for index in range(count)]
        self.anchor = np.empty(self.layout.numel, np.float32)
        try:
            local = self.range(0, self.layout.numel)
            for index, worker in enumerate(self.workers):  # (every rank joins shard 0 first, then 1, ...)
                lo, hi = self.bounds[index : index + 2]
                weights = worker.init(self.pieces[index].views(local[lo:hi].copy()), timeout=init_timeout)
                self.anchor[lo:hi] = self._joined(index, weights)
            self.load(0, self.layout.numel, self.anchor)
        except BaseException:
            self.close()
            raise
        self.position = max(self._last_sync(index, worker.clock) for index, worker in enumerate(self.workers))

    def _last_sync(self, index: int, syncs: int) -> int:
        """The inner step of fragment ``index``'s ``syncs``-th sync (0: none yet)."""
        if syncs <= 0:
            return 0
        offset = self.offsets[index]
        return offset + (syncs - 1) * self.every if offset else syncs * self.every

    def step(self) -> list[int]:
        """One more inner step: the fragments whose sync falls at it."""
        self.position += 1
        return [index for index, offset in enumerate(self.offsets) if self.position % self.every == offset]

    def sync(self, index: int) -> None:
        """Push fragment ``index``'s pseudo-gradient (its anchor minus its weights now) to its
        shard and take that shard's new global weights into the model (its part alone)."""
        lo, hi = self.bounds[index : index + 2]
        pseudo = self.anchor[lo:hi] - self.range(lo, hi)
        weights = self.workers[index].push_pull(self.pieces[index].views(pseudo))
        self.anchor[lo:hi] = self._joined(index, weights)
        self.load(lo, hi, self.anchor[lo:hi])

    def _joined(self, index: int, weights) -> np.ndarray:
        return np.concatenate([np.asarray(weights[name], np.float32).ravel() for name in self.pieces[index].names])

    def _covering(self, lo: int, hi: int):
        """(parameter, the range's start and end within it, where that falls in ``[lo, hi)``)
        for each parameter the flat range ``[lo, hi)`` covers."""
        for p, offset, size in zip(self.params.values(), self.layout.offsets, self.layout.sizes):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                yield p, a - offset, b - offset, a - lo

    def range(self, lo: int, hi: int) -> np.ndarray:
        """The model's weights now in the flat range ``[lo, hi)`` (float32; only the parameters
        it covers are read)."""
        out = np.empty(hi - lo, np.float32)
        for p, a, b, at in self._covering(lo, hi):
            out[at : at + b - a] = p.detach().reshape(-1)[a:b].cpu().numpy()
        return out

    def load(self, lo: int, hi: int, values: np.ndarray) -> None:
        """Write ``values`` (the flat range ``[lo, hi)``) into the parameters it covers."""
        with torch.no_grad():
            for p, a, b, at in self._covering(lo, hi):
                piece = torch.from_numpy(values[at : at + b - a])
                if p.is_contiguous():
                    p.view(-1)[a:b].copy_(piece)
                else:  # (channels_last and the like: the flat order is the logical one)
                    whole = p.detach().reshape(-1).clone()
                    whole[a:b] = piece.to(whole.device)
                    p.copy_(whole.view(p.shape))

    # Error feedback (int8/int4), flat across the fragments ----------------------------
    def residual(self) -> np.ndarray | None:
        """Each fragment's error feedback in flat order (zeros where one has none yet)."""
        parts = [worker.compression_residual for worker in self.workers]
        if all(part is None for part in parts):
            return None
        flat = np.zeros(self.layout.numel, np.float32)
        for index, part in enumerate(parts):
            if part is not None:
                flat[self.bounds[index] : self.bounds[index + 1]] = part
        return flat

    def load_residual(self, flat: np.ndarray | None) -> None:
        if flat is not None and flat.shape != (self.layout.numel,):
            raise ConfigurationError(f"a residual of {flat.shape} for a model of {self.layout.numel} elements")
        for index, worker in enumerate(self.workers):
            lo, hi = self.bounds[index : index + 2]
            worker.load_compression_residual(None if flat is None else flat[lo:hi].copy())

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
