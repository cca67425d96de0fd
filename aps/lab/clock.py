"""A cluster on a virtual clock: P simulated workers driving the real engine.

The engine (the same sync policies, staleness window, update lane and
kernels as a server) runs with a virtual clock, in one process, without
sockets. Each worker loops: it is released with the weights of some version
(its pull's snapshot), computes for one iteration time, and pushes its
gradient, which the engine plans, applies (or accumulates, or drops) and
answers; the worker then pulls and waits at the gate like a real one.
Events are processed in virtual-time order (ties by the order they were
scheduled), so a run depends only on its inputs and its seed, not on the
machine or its load.

A worker's gradient is computed (by ``compute``) when it is released, on
exactly the weights its pull returned, and applied when its push arrives in
virtual time: staleness as a server makes it. Under local SGD (``local``) a
worker takes several iterations between syncs and pushes its pseudo-gradient. Without ``compute`` the
gradients are zeros: the run measures synchronization only (``aps
simulate``); with it, training (``aps simulate --train``).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..server.engine import Engine
from ..server.engine.paces import Paces
from ..config import ServerConfig
from ..errors import APSError
from ..layout import Layout

__all__ = ["IterationTimes", "LocalSteps", "SimulationError", "Stragglers", "VirtualCluster"]


class SimulationError(APSError):
    """The simulated cluster stopped making progress (a deadlock), or the engine refused a push."""


@dataclass(frozen=True)
class Stragglers:
    """Markov on/off stragglers: each worker, independently, turns slow at ``rate`` times
    per virtual second (exponential waits), stays slow for an exponential time of mean
    ``duration`` virtual seconds, and while slow takes ``slowdown`` times as long per
    iteration; then it recovers."""

    rate: float
    duration: float
    slowdown: float

    def __post_init__(self) -> None:
        for name in ("rate", "duration", "slowdown"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"straggler {name} must be a positive number, got {value}")


class IterationTimes:
    """How long each worker's iterations take: its mean (``speeds``), times a lognormal
    factor of spread ``jitter`` (mean 1), times ``stragglers.slowdown`` while it
    straggles. Deterministic for a ``seed``."""

    _BLOCK = 4096

    def __init__(
        self, speeds: list[float], jitter: float = 0.0, stragglers: Stragglers | None = None, seed: int = 0
    ) -> None:
        self.base = np.asarray(speeds, dtype=np.float64)
        self.jitter = float(jitter)
        self.stragglers = stragglers
        self._rng = np.random.default_rng(seed)
        self._noise = np.empty(0)
        self._at = 0
        # Straggler state per worker: slow or not, and when it changes next.
        count = len(speeds)
        self._slow = [False] * count
        self._switch = [math.inf] * count
        self._state_rng = np.random.default_rng([seed, 104729])
        if stragglers is not None:
            self._switch = [float(self._state_rng.exponential(1.0 / stragglers.rate)) for _ in range(count)]
        #: Virtual seconds of the slow spells each worker began (each counted whole when it begins).
        self.slow_time = [0.0] * count

    def _factor(self) -> float:
        if self.jitter <= 0:
            return 1.0
        if self._at >= len(self._noise):
            sigma = self.jitter
            self._noise = np.exp(self._rng.normal(-0.5 * sigma * sigma, sigma, self._BLOCK))
            self._at = 0
        value = self._noise[self._at]
        self._at += 1
        return float(value)

    def slow(self, rank: int, now: float) -> bool:
        """Whether ``rank`` straggles at virtual time ``now`` (advancing its on/off chain)."""
        model = self.stragglers
        if model is None:
            return False
        while self._switch[rank] <= now:
            start = self._switch[rank]
            self._slow[rank] = not self._slow[rank]
            mean = model.duration if self._slow[rank] else 1.0 / model.rate
            length = float(self._state_rng.exponential(mean))
            if self._slow[rank]:
                self.slow_time[rank] += length
            self._switch[rank] = start + length
        return self._slow[rank]

    def draw(self, rank: int, now: float) -> float:
        """The duration of ``rank``'s iteration starting at ``now``."""
        value = float(self.base[rank]) * self._factor()
        model = self.stragglers
        if model is not None and self.slow(rank, now):  # (none straggles without a model)
            value *= model.slowdown
        return value


#: ``compute(rank, weights, grad_out, steps)``: what worker ``rank`` pushes after ``steps``
#: iterations from ``weights`` (the flat snapshot its pull returned, read-only), into
#: ``grad_out`` (flat float32): a gradient (one step), or local SGD's pseudo-gradient.
Compute = Callable[[int, np.ndarray, np.ndarray, int], None]


class LocalSteps:
    """How many iterations each worker of a local SGD run takes between syncs: ``every``, or
    with ``dynamic`` (dynamic local updates) ``ceil(every * own rate / fastest rate)``, the rates
    kept as a server keeps them (:class:`aps.server.engine.paces.Paces`) from each sync's step
    count and the virtual seconds the steps took."""

    def __init__(self, every: int, count: int, dynamic: bool) -> None:
        self.every, self.dynamic = every, dynamic
        self.steps = [0] * count  # each worker's iterations so far
        self.seconds = [0.0] * count  # and the virtual time they took (not its waits)
        self.current = [every] * count  # and how many it takes before its next sync
        self._paces = Paces()

    def synced(self, rank: int, steps: int, seconds: float) -> None:
        """``rank`` synced after ``steps`` iterations that took ``seconds``: its next number."""
        self.steps[rank] += steps
        self.seconds[rank] += seconds
        if not self.dynamic:
            return
        self._paces.report(rank, self.steps[rank], self.seconds[rank])
        own, fastest = self._paces.answer(rank, range(len(self.steps)))
        if own is not None and fastest is not None:
            self.current[rank] = max(1, min(self.every, math.ceil(self.every * min(1.0, own / fastest))))


class VirtualCluster:
    """The engine of ``config`` and ``len(speeds)`` virtual workers of the model ``layout``
    (initial flat weights ``values``); see the module docstring.

    Attributes:
        engine: the engine (its ``weights``, ``version``, ``stats``).
        now: the virtual time of the event being processed (or last processed).
        pushes: gradients pushed so far, all workers together.
        waits: each release's wait at the gate (virtual seconds), in order.
        staleness: each applied gradient's staleness, in order of commit.
        max_gap: the largest ``t_i - min_j t_j`` at any release.
        per_worker: pushes per worker.
    """

    def __init__(
        self,
        config: ServerConfig,
        times: IterationTimes,
        layout: Layout,
        values: np.ndarray,
        compute: Compute | None = None,
        local: tuple[int, bool] | None = None,
    ) -> None:
        self.config = config
        self.times = times
        self.compute = compute
        self.now = 0.0
        self.engine = Engine(config, now=lambda: self.now)
        count = len(times.base)
        #: Local SGD (``local``: inner steps between syncs, dynamic or not): each push is a sync.
        self.local = None if local is None else LocalSteps(local[0], count, local[1])
        self._steps = [1] * count  # the iterations of each worker's push in flight
        self._took = [0.0] * count  # and the virtual seconds they took
        if count != config.workers:
            raise ValueError(f"{count} iteration speeds for {config.workers} workers")
        self._window = self.engine.policy.window
        self._events: list[tuple[float, int, int]] = []
        self._sequence = 0
        self._pushed_at = [0.0] * count
        self._version = [0] * count
        self._errors: list[BaseException] = []
        self.pushes = 0
        self.per_worker = [0] * count
        self.waits: list[float] = []
        self.staleness: list[int] = []
        self.max_gap = 0
        self._ready = [self._released(rank) for rank in range(count)]
        self._done = [self._committed(rank) for rank in range(count)]
        self.members = [
            self.engine.membership.join(rank, count, layout, values, self._joined(rank), self._errors.append)
            for rank in range(count)
        ]
        if self._errors:
            raise SimulationError(str(self._errors[0]))

    # Engine callbacks ------------------------------------------------------
    def _joined(self, rank: int):
        def ready(snapshot, clock) -> None:
            self._start(rank, snapshot)

        return ready

    def _released(self, rank: int):
        def ready(snapshot, clock) -> None:
            gap = self._window.gap(rank)
            if gap > self.max_gap:
                self.max_gap = gap
            self.waits.append(self.now - self._pushed_at[rank])
            self._start(rank, snapshot)

        return ready

    def _committed(self, rank: int):
        def done(result) -> None:
            self.per_worker[rank] += 1
            if self.local is not None:
                self.local.synced(rank, self._steps[rank], self._took[rank])
            if not result.dropped:
                self.staleness.append(result.staleness)
            self.engine.training.pull(self.members[rank], self._ready[rank])

        return done

    def _start(self, rank: int, snapshot) -> None:
        """``rank`` holds the weights of ``snapshot``: compute on them, push when its iteration ends."""
        self._version[rank] = snapshot.version
        steps = self._steps[rank] = 1 if self.local is None else self.local.current[rank]
        if self.compute is not None:  # (its member by rank: the last join releases everyone before it returns)
            grad = self.engine.roster.members[rank].grad
            assert grad is not None  # its join made its gradient buffer
            self.compute(rank, snapshot.array, grad, steps)
        snapshot.release()
        end = self.now
        for _ in range(steps):  # (each iteration its own time: a straggling spell may begin midway)
            end += self.times.draw(rank, end)
        self._took[rank] = end - self.now
        self._sequence += 1
        heapq.heappush(self._events, (end, self._sequence, rank))

    # Running ---------------------------------------------------------------
    @property
    def next_time(self) -> float:
        """When the next push arrives (inf: none is due)."""
        return self._events[0][0] if self._events else math.inf

    def step(self) -> None:
        """Process the next push (advancing the virtual clock to it)."""
        if not self._events:
            raise SimulationError(f"every worker waits and none can push (after {self.pushes} pushes)")
        now, _, rank = heapq.heappop(self._events)
        self.now = now
        self._pushed_at[rank] = now
        try:
            self.engine.training.push(self.members[rank], self._version[rank], self._done[rank], self._errors.append)
        except APSError as exc:
            self._errors.append(exc)
        self.pushes += 1
        if self._errors:
            raise SimulationError(str(self._errors[0]))

    @property
    def batches(self) -> int:
        """The iterations the workers took, all together: one a push, or under local SGD its inner steps."""
        return self.pushes if self.local is None else sum(self.local.steps)

    @property
    def error(self) -> BaseException | None:
        """What stopped the run, if the engine refused a push (e.g. ``NonFiniteGradient``)."""
        return self._errors[0] if self._errors else None

    def sync_figures(self) -> dict:
        """What the run's synchronization looked like: gate waits, staleness, the largest gap."""
        waits, staleness = sorted(self.waits), sorted(self.staleness)
        hist: dict[str, int] = {}
        for value in staleness:
            hist[str(value)] = hist.get(str(value), 0) + 1
        return {
            "mean_wait": statistics.fmean(waits) if waits else 0.0,
            "p50_wait": _percentile(waits, 50),
            "p99_wait": _percentile(waits, 99),
            "max_wait": waits[-1] if waits else 0.0,
            "mean_staleness": statistics.fmean(staleness) if staleness else 0.0,
            "p50_staleness": _percentile(staleness, 50),
            "p99_staleness": _percentile(staleness, 99),
            "max_staleness": staleness[-1] if staleness else 0,
            "staleness_hist": hist,
            "max_gap": self.max_gap,
        }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[index]
