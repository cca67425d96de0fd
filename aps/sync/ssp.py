"""SSP, stale synchronous parallel with threshold ``s``."""

from __future__ import annotations

from .base import ApplyOnArrival

__all__ = ["SSP"]


class SSP(ApplyOnArrival):
    """Gradients are applied on arrival; a worker is released only while it is
    at most ``s`` iterations ahead of the slowest live worker
    (docs/algorithms.md, SSP). ``s = 0`` gives lockstep iterations."""

    name = "ssp"

    def _make_window(self, window_type: type):
        return window_type(self.num_workers, self.config.staleness, self.config.staleness)

    def describe(self) -> str:
        return f"ssp s={self.config.staleness}"
