"""The workers' step rates (PACE), for dynamic local updates.

A worker of ``aps.torch.LocalSGD`` with dynamic local updates says, after each sync, how many
local steps it has taken in all and how many seconds it spent on them (its own time between
syncs: not the syncs themselves, nor a wait at a BSP barrier, which would make every worker
look as fast as the slowest). The server keeps each rank's rate, steps per second, and answers
with the worker's own and the fastest live worker's; the worker then sets its next number of
local steps in proportion to the two (Liu et al., 2024, "dynamic local updates"), so that
uneven workers sync at about the same wall-clock interval.

A rate is a running mean over report intervals, the newest weighing :attr:`Paces.NEWEST`:
a worker that slows down (a straggler that comes and goes) is seen within two or three
syncs. A count that goes down is another process under the rank: its rate starts again. The
fastest is taken among the plausible rates only: a rate more than :attr:`Paces.PLAUSIBLE`
times the upper median is left out, so that of three workers or more, one that reports
nonsense (a bug, a step count of another unit) cannot make every other sync after every step;
an honest straggler, however slow, is never the reason a rate is left out (workers hold the
run's token: a majority of them lying is not what this guards against). Intervals shorter
than :attr:`Paces.SHORTEST` seconds are not measured over, so every rate is finite. Rates are
measurements, not run state: they are not in checkpoints, and a resumed or taken over server
measures them again. One record a rank (at most the run's MAX workers).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Paces"]


@dataclass(slots=True)
class _Pace:
    steps: int
    seconds: float
    rate: float | None = None


class Paces:
    """Each rank's step rate, from its reports of its steps and the seconds they took (:meth:`report`)."""

    #: The weight of the newest interval in a rank's rate.
    NEWEST = 0.5
    #: A rate above this many times the upper median of the live ranks' is not believed.
    PLAUSIBLE = 100.0
    #: The shortest interval, in seconds, a rate is measured over (shorter: wait for more).
    SHORTEST = 1e-6

    def __init__(self) -> None:
        self._paces: dict[int, _Pace] = {}

    def report(self, rank: int, steps: int, seconds: float) -> None:
        """``rank`` has taken ``steps`` local steps in all, in ``seconds`` of its own time."""
        pace = self._paces.get(rank)
        if pace is None or steps < pace.steps or seconds < pace.seconds:  # (first, or another process)
            self._paces[rank] = _Pace(steps, seconds)
            return
        if steps == pace.steps or seconds - pace.seconds < self.SHORTEST:
            return  # nothing to measure over yet
        rate = (steps - pace.steps) / (seconds - pace.seconds)
        pace.rate = rate if pace.rate is None else self.NEWEST * rate + (1.0 - self.NEWEST) * pace.rate
        pace.steps, pace.seconds = steps, seconds

    def rates(self, ranks: Iterable[int]) -> dict[int, float]:
        """The measured rate of each of ``ranks`` that has one (two reports or more)."""
        paces = self._paces
        return {rank: pace.rate for rank in ranks if (pace := paces.get(rank)) is not None and pace.rate is not None}

    def answer(self, rank: int, ranks: Iterable[int]) -> tuple[float | None, float | None]:
        """``(rank's rate, the fastest plausible rate)`` among ``ranks`` (the live ones); None
        for what is not measured yet."""
        rates = self.rates(ranks)
        if not rates:
            return None, None
        ceiling = self.PLAUSIBLE * statistics.median_high(rates.values())
        return rates.get(rank), max(rate for rate in rates.values() if rate <= ceiling)
