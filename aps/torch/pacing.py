"""Iteration pacing: emulated devices of different speeds (``aps launch --step-time``)."""

from __future__ import annotations

import math
import os
import time

import numpy as np

from ..errors import ConfigurationError

__all__ = ["Pacer"]


class Pacer:
    """Pads iterations to emulate a slower device (``aps launch --step-time``).

    Each iteration (from the end of one ``step()`` to the start of the next
    push) is stretched by sleeping to ``step_time * slowdown``, times a
    lognormal factor of spread ``jitter`` and mean 1. Work that already takes
    longer is not shortened.
    """

    def __init__(self, step_time: float, slowdown: float = 1.0, jitter: float = 0.0, seed: int = 0) -> None:
        if step_time < 0 or slowdown <= 0 or jitter < 0:
            raise ConfigurationError("step time and jitter must be >= 0 and the slowdown > 0")
        self.target = step_time * slowdown
        self.jitter = jitter
        self._rng = np.random.default_rng(seed)
        self._since = time.monotonic()

    @classmethod
    def from_env(cls, rank: int | None) -> Pacer | None:
        """The pacing ``aps launch`` asked for (``APS_STEP_TIME``, ``APS_SLOWDOWN``, ``APS_JITTER``), if any;
        ``rank`` (this worker's; None: 0) seeds its jitter."""
        step_time = float(os.environ.get("APS_STEP_TIME", "0") or 0)
        if step_time <= 0:
            return None
        slowdown = float(os.environ.get("APS_SLOWDOWN", "1") or 1)
        jitter = float(os.environ.get("APS_JITTER", "0") or 0)
        return cls(step_time, slowdown, jitter, seed=0 if rank is None else rank)

    def wait(self) -> None:
        """Sleep out the rest of this iteration's emulated time."""
        target = self.target
        if self.jitter:
            target *= math.exp(self._rng.normal(-0.5 * self.jitter**2, self.jitter))
        remaining = target - (time.monotonic() - self._since)
        if remaining > 0:
            time.sleep(remaining)

    def restart(self) -> None:
        """The next iteration starts now."""
        self._since = time.monotonic()
