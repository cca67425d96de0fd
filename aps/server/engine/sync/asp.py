"""ASP, asynchronous parallel: every gradient is applied on arrival; nobody waits."""

from __future__ import annotations

from .base import ApplyOnArrival

__all__ = ["ASP"]


class ASP(ApplyOnArrival):
    """Every gradient is applied on arrival, alone; a pull is answered at once
    with the newest version (docs/algorithms.md, ASP)."""

    name = "asp"
