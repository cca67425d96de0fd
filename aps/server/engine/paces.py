"""The workers' step rates, measured on the server's clock (PACE).

A worker of ``aps.torch.LocalSGD`` with dynamic local updates says, after each sync, how
many local steps it has taken in all; the server times those reports and keeps each rank's
rate, steps per second, and answers with every live worker's. The worker then sets its next
number of local steps in proportion to its rate against the fastest (Liu et al., 2024,
"dynamic local updates"), so that uneven workers sync at about the same wall-clock interval.

A rate is a running mean over report intervals, the newest weighing :attr:`Paces.NEWEST`:
a worker that slows down (a straggler that comes and goes) is seen within two or three
syncs. A count that goes down is another process under the rank: its rate starts again.
Rates are measurements, not run state: they are not in checkpoints, and a resumed or taken
over server measures them again. One record a rank (at most the run's MAX workers); only
the live ranks' rates are answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Paces"]


@dataclass(slots=True)
class _Pace:
    steps: int
    at: float
    rate: float | None = None


class Paces:
    """Each rank's step rate, from its reports of its step count (:meth:`report`)."""

    #: The weight of the newest interval in a rank's rate.
    NEWEST = 0.5

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._paces: dict[int, _Pace] = {}

    def report(self, rank: int, steps: int) -> None:
        """``rank`` has taken ``steps`` local steps in all, now."""
        now = self._now()
        pace = self._paces.get(rank)
        if pace is None or steps < pace.steps:  # (first report, or another process under the rank)
            self._paces[rank] = _Pace(steps, now)
            return
        if steps == pace.steps or now <= pace.at:
            return  # nothing to measure over
        rate = (steps - pace.steps) / (now - pace.at)
        pace.rate = rate if pace.rate is None else self.NEWEST * rate + (1.0 - self.NEWEST) * pace.rate
        pace.steps, pace.at = steps, now

    def rates(self, ranks: Iterable[int]) -> dict[int, float]:
        """The measured rate of each of ``ranks`` that has one (two reports or more)."""
        paces = self._paces
        return {rank: pace.rate for rank in ranks if (pace := paces.get(rank)) is not None and pace.rate is not None}
