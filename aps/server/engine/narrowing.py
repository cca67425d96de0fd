"""The weights rounded to 16 bits, for compressed pulls (``Worker(compress=...)`` over TCP).

Each version is narrowed once per element type (bfloat16, fp16), into a buffer
of its own: a reply being sent keeps its buffer alive, and a newer version
gets a new one. Narrowing 64 MiB of weights takes 10 to 15 ms, too long for
the event loop, which would stop reading every other worker's socket
meanwhile: from :data:`INLINE_MAX` elements on it runs on the server's
background thread, holding its own lease on the weights' slot, and the pulls
that asked for that version wait for it (each is answered when it is ready;
a connection lost meanwhile is simply not answered).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import numpy as np

from .lane import Offload
from .table import Snapshot

__all__ = ["INLINE_MAX", "NarrowedWeights"]

log = logging.getLogger(__name__)

#: Narrowed on the loop below this many elements (1 MiB of float32: about 0.2 ms).
INLINE_MAX = 1 << 18


class NarrowedWeights:
    """The newest weights narrowed, per element type, and the narrowings under way."""

    def __init__(self, kernels: ModuleType, background: Offload | None) -> None:
        self._kernels = kernels
        self._background = background
        self._newest: dict[int, tuple[int, np.ndarray]] = {}  # dtype: (version, words)
        # (dtype, version, generation): the replies waiting for a narrowing under way
        self._waiting: dict[tuple[int, int, int], list[Callable[[np.ndarray], None]]] = {}
        self._generation = 0  # (weights replaced at the same version: LOAD_WEIGHTS)

    @property
    def under_way(self) -> int:
        """Narrowings running off the loop."""
        return len(self._waiting)

    def get(self, snap: Snapshot, dtype: int, done: Callable[[np.ndarray], None]) -> None:
        """Call ``done`` with the weights of ``snap`` rounded to ``dtype`` (BFLOAT16 or FLOAT16):
        now when they are ready or small, else on the loop once the background thread made
        them. ``snap`` must stay leased until ``done`` is called."""
        newest = self._newest.get(dtype)
        if newest is not None and newest[0] == snap.version:
            done(newest[1])
            return
        key = (dtype, snap.version, self._generation)
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.append(done)
            return
        words = np.empty(len(snap.array), np.uint16)
        if self._background is None or len(words) < INLINE_MAX:
            self._kernels.narrow(words, snap.array, dtype)
            self._keep(key, words)
            done(words)
            return
        self._waiting[key] = [done]
        lease = snap.again()  # (the asking reply may be dropped before the narrowing ends)
        kernels = self._kernels

        def work() -> np.ndarray:
            kernels.narrow(words, lease.array, dtype)
            return words

        def finished(result: object) -> None:
            if not isinstance(result, np.ndarray):  # (it cannot fail but for memory: do it here, then)
                kernels.narrow(words, lease.array, dtype)
            lease.release()
            self._keep(key, words)
            for each in self._waiting.pop(key):
                try:
                    each(words)
                except Exception:  # (one reply's failure is not the others')
                    log.exception("answering a compressed pull failed")

        self._background(work, finished)

    def forget(self) -> None:
        """The weights were replaced without a new version (loaded): what was narrowed, or is
        being narrowed, is not of them (the replies already waiting get what they asked for)."""
        self._newest.clear()
        self._generation += 1

    def _keep(self, key: tuple[int, int, int], words: np.ndarray) -> None:
        dtype, version, generation = key
        if generation != self._generation:
            return
        newest = self._newest.get(dtype)
        if newest is None or newest[0] <= version:
            self._newest[dtype] = (version, words)
