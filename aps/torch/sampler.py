"""An epoch's samples shared out among the workers live at each moment: :class:`ElasticSampler`.

Workers of an elastic run (``aps serve --workers MIN:MAX``) come and go within an epoch, so
no fixed ``rank::world_size`` slice can cover it: the slices would skip the samples of a
worker that left and repeat those a newcomer takes over. Here the epoch's order (one
permutation of the dataset per epoch, the same on every worker) is cut into chunks, and
each worker claims the next chunk from a counter the server keeps for the epoch
(:meth:`aps.Worker.claim`, an atomic fetch-and-add): every chunk goes to exactly one
worker, whoever is live when it is handed out, so within an epoch no sample is skipped or
seen twice however the run is resized. The counters are kept in checkpoints, so a resumed
run goes on from the checkpoint's place in the epoch (repeating what its lost updates saw).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..client.worker import Worker

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Sample indices of one epoch of ``size`` samples, claimed chunk by chunk from the server.

    Use it as a ``torch.utils.data.DataLoader``'s ``sampler`` (with ``num_workers=0``, or
    knowing that indices the loader fetched ahead belong to this worker), calling
    :meth:`set_epoch` before each epoch as with ``DistributedSampler``::

        sampler = aps.torch.ElasticSampler(len(dataset), optimizer.worker, chunk=256, seed=1)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader: ...

    Args:
        size: the dataset's length.
        worker: this process's :class:`aps.Worker` (after ``init``; an ``aps.torch.Optimizer``'s
            ``.worker``).
        chunk: samples per claim: one round trip to the server every ``chunk`` samples; a
            multiple of the batch size keeps batches within one chunk.
        shuffle: a new order every epoch (the same on every worker: ``seed + epoch``).
        seed: the order's seed; every worker of the run must use the same.
        name: the counters' name, to keep several datasets apart (``{name}/{epoch}``).

    Leaving gracefully at a chunk's end (:attr:`chunk_done` is True) loses nothing; a worker
    that dies mid-chunk takes the rest of that chunk with it (at most ``chunk`` samples of
    the epoch are not seen), and one that leaves with chunks fetched ahead by a loader loses
    those too.
    """

    def __init__(
        self, size: int, worker: Worker, *, chunk: int = 256, shuffle: bool = True, seed: int = 0, name: str = "data"
    ) -> None:
        if not isinstance(size, (int, np.integer)) or size < 0:
            raise ConfigurationError(f"size must be a whole number >= 0, got {size!r}")
        if not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ConfigurationError(f"chunk must be at least 1, got {chunk!r}")
        if not name or "/" in name:
            raise ConfigurationError(f"name must be non-empty, without '/', got {name!r}")
        self.size, self.chunk, self.shuffle, self.seed, self.name = int(size), int(chunk), shuffle, int(seed), name
        self.worker = worker
        self.epoch = 0
        #: The chunks of the current epoch this worker claimed, in order (their indices).
        self.claimed: list[int] = []
        #: True when the last chunk claimed has been handed out whole (a graceful place to leave).
        self.chunk_done = True

    @property
    def chunks(self) -> int:
        """Chunks in an epoch."""
        return -(-self.size // self.chunk)

    def set_epoch(self, epoch: int) -> None:
        """The epoch to sample from next (every worker: the same order for the same epoch)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigurationError(f"epoch must be a whole number >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The sample indices of ``epoch`` (default: the current one) in the order chunks cut them."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng((self.seed, epoch)).permutation(self.size)

    def progress(self) -> int:
        """Chunks of the current epoch handed out so far, to every worker (a claim of none)."""
        return min(self.worker.claim(self._counter, 0), self.chunks)

    @property
    def _counter(self) -> str:
        return f"{self.name}/{self.epoch}"

    def __iter__(self) -> Iterator[int]:
        order, chunks = self.order(), self.chunks
        self.claimed = []
        while True:
            index = self.worker.claim(self._counter, 1)
            if index >= chunks:
                return
            self.claimed.append(index)
            self.chunk_done = False
            part = order[index * self.chunk : (index + 1) * self.chunk].tolist()
            for position, sample in enumerate(part, 1):
                self.chunk_done = position == len(part)
                yield sample
