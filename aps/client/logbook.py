"""What a worker's training loop reports (:meth:`aps.Worker.log`), gathered for the next LOG.

Logging costs the loop no round trip: the scalars are kept here and sent in one LOG
request about once a second (:data:`LOG_EVERY_S`), or sooner when a LOG's worth has
gathered, and on ``close()``. Each LOG carries the process's CPU time and resident memory
too (psutil). Names and values are checked when logged, so that a bad one raises in the
caller's own line instead of being refused later, with what else was waiting.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import psutil

from ..wire.scalars import MAX_LOG_POINTS, MAX_STEP, check_scalar_name, encode_log

__all__ = ["LOG_EVERY_S", "Logbook", "batch_digest"]

#: A worker sends what it logged about this often (seconds).
LOG_EVERY_S = 1.0
#: A rank logs at most this many names (the server keeps as many).
MAX_NAMES = 32
#: Bytes a LOG's payload is let grow to before it is sent (its limit is 64 KiB).
_SEND_AT_BYTES = 48 << 10
#: Bytes of a batch hashed for its digest (its first ones: enough to tell batches apart).
_DIGEST_BYTES = 1 << 16


def batch_digest(batch: Any) -> str:
    """A 16-hex-digit digest of ``batch`` (bytes, an array or anything numpy reads as one,
    or a torch tensor on any device): its shape, element type and first 64 KiB (of a tensor,
    its first 16,384 elements, the only ones brought to the host), enough to tell two
    batches apart."""
    if isinstance(batch, (bytes, bytearray, memoryview)):
        data, head = bytes(memoryview(batch)[:_DIGEST_BYTES]), b"bytes"
    elif hasattr(batch, "detach") and hasattr(batch, "cpu"):  # a torch tensor (without importing torch)
        first = batch.detach().reshape(-1)[: _DIGEST_BYTES // 4].cpu()
        data = np.asarray(first.float() if first.is_floating_point() else first.long()).tobytes()
        head = f"{batch.dtype}{tuple(batch.shape)}".encode()
    else:
        array = np.ascontiguousarray(np.asarray(batch))
        data = array.reshape(-1).view(np.uint8)[:_DIGEST_BYTES].tobytes()
        head = f"{array.dtype.str}{array.shape}".encode()
    return hashlib.blake2b(head + b"\0" + data, digest_size=8).hexdigest()


class Logbook:
    """The scalars, batch digests and process figures waiting for the next LOG."""

    def __init__(self, now=time.monotonic) -> None:
        self._now = now
        self._points: list[tuple[int, dict[str, float]]] = []
        self._batches: list[tuple[int, str]] = []
        self._values = 0
        self._bytes = 0
        self._names: set[str] = set()
        self._sent = now()
        self._process: psutil.Process | None = None

    @property
    def pending(self) -> bool:
        return bool(self._points or self._batches)

    def add(self, scalars: Mapping[str, Any], step: int, batch: Any = None) -> bool:
        """Keep one step's scalars (and its batch's digest); True when a LOG is due."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"a step is an integer from 0 to 2**53, not {step!r}")
        values: dict[str, float] = {}
        for name, value in scalars.items():
            check_scalar_name(name)
            try:
                values[name] = float(value)  # (numpy scalars, one-element tensors)
            except (TypeError, ValueError):
                raise ValueError(f"scalar {name}: a number, not {type(value).__name__}") from None
        new = {name for name in values if name not in self._names}
        if len(self._names) + len(new) > MAX_NAMES:
            raise ValueError(f"a worker logs {MAX_NAMES} names at most (it has {sorted(self._names)})")
        if len(values) > MAX_LOG_POINTS:
            raise ValueError(f"one step logs {MAX_LOG_POINTS} values at most")
        self._names |= new
        if values:
            self._points.append((int(step), values))
            self._values += len(values)
            self._bytes += 24 + sum(len(name) + 26 for name in values)
        if batch is not None:
            self._batches.append((int(step), batch_digest(batch)))
            self._bytes += 40
        return (
            self._now() - self._sent >= LOG_EVERY_S
            or self._bytes >= _SEND_AT_BYTES
            or self._values + MAX_LOG_POINTS // 4 > MAX_LOG_POINTS
            or len(self._batches) >= MAX_LOG_POINTS
        )

    def take(self) -> bytes:
        """The payload of a LOG of everything waiting (emptied)."""
        points, batches = self._points, self._batches
        self._points, self._batches, self._values, self._bytes = [], [], 0, 0
        self._sent = self._now()
        return encode_log(points, self._process_figures(), batches)

    def _process_figures(self) -> dict | None:
        try:
            if self._process is None or self._process.pid != os.getpid():
                self._process = psutil.Process()
            with self._process.oneshot():
                cpu = self._process.cpu_times()
                return {
                    "pid": self._process.pid,
                    "cpu_s": cpu.user + cpu.system,
                    "rss_bytes": self._process.memory_info().rss,
                }
        except psutil.Error:
            return None
