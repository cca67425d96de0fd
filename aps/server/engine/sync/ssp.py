"""SSP, stale synchronous parallel with threshold ``s``."""

from __future__ import annotations

from .base import ApplyOnArrival

__all__ = ["SSP"]


class SSP(ApplyOnArrival):
    """Gradients are applied on arrival; a worker is released only while it is
    at most ``s`` iterations ahead of the slowest live worker
    (docs/algorithms.md, SSP). ``s = 0`` gives lockstep iterations."""

    name = "ssp"
