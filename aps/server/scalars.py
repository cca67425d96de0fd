"""What the workers' training loops report (:meth:`aps.Worker.log`), kept per rank with a bound.

A worker sends the scalars it logs (its loss, accuracy, learning rate: whatever its loop
logs) in LOG requests, at most about one a second, with its process's CPU time and
resident memory and, from the trainer integrations, a digest of each batch. The server
keeps, per rank and name, a curve of at most :data:`CURVE_POINTS` points over the whole
run: when one is full every other point goes and the curve takes every other point from
then on, so that it keeps the run's shape in a bounded size (its newest value is kept
apart, always exact). The dashboard draws the curves, ``/metrics`` exports the newest
values. Two ranks reporting the same batches at the same steps (:data:`SAME_BATCHES` of
them) read the same data: the server warns once for the pair (each rank is meant to read its own part:
a sampler). What is kept is bounded: :data:`MAX_NAMES` names a rank, ranks as the
server has, :data:`RECENT_POINTS` points waiting for the dashboards.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from ..wire.scalars import LogReport

__all__ = ["CURVE_POINTS", "MAX_NAMES", "Curve", "Scalars"]

log = logging.getLogger("aps.server")

#: A curve keeps at most this many points (then every other one; see the module).
CURVE_POINTS = 512
#: A rank logs at most this many names (a LOG with more is refused whole).
MAX_NAMES = 32
#: The points recorded last, kept for the dashboards' frames (each takes those it has not had).
RECENT_POINTS = 8192
#: (step, batch digest) pairs kept per rank to compare with the others'.
BATCHES_KEPT = 256
#: Batches two ranks must share before the server warns that they read the same data.
SAME_BATCHES = 8
#: Warnings kept (the newest; one per pair of ranks).
WARNINGS_KEPT = 32


class Curve:
    """One scalar of one rank: at most CURVE_POINTS (step, value) points over the run, and its newest."""

    __slots__ = ("steps", "values", "stride", "seen", "last_step", "last_value")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[float] = []
        self.stride = 1  # a point is kept every this many
        self.seen = 0
        self.last_step = 0
        self.last_value = math.nan

    def add(self, step: int, value: float) -> bool:
        """Record one value; True when the curve kept it as a point. The value it has at its
        newest step already is not counted again (a LOG sent again after a reconnect)."""
        if self.seen and step == self.last_step and (value == self.last_value or math.isnan(value) and math.isnan(self.last_value)):
            return False
        self.last_step, self.last_value = step, value
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return False
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) >= CURVE_POINTS:
            del self.steps[1::2], self.values[1::2]
            self.stride *= 2
        return True

    def points(self) -> list[list]:
        return [[s, v] for s, v in zip(self.steps, self.values)]


@dataclass(slots=True)
class _Rank:
    curves: dict[str, Curve] = field(default_factory=dict)
    process: dict | None = None
    cpu_percent: float | None = None  # over the last two reports of the same process
    reported: float = 0.0  # time.monotonic() of the last report
    batches: deque = field(default_factory=lambda: deque(maxlen=BATCHES_KEPT))
    batch_set: set = field(default_factory=set)


class Scalars:
    """The run's reported scalars; :meth:`record` takes a rank's checked LOG."""

    def __init__(self, now=time.monotonic) -> None:
        self._now = now
        self._ranks: dict[int, _Rank] = {}
        self._seq = 0
        #: (seq, rank, name, step, value) of every point curves kept, newest last (the dashboards').
        self.recent: deque[tuple[int, int, str, int, float]] = deque(maxlen=RECENT_POINTS)
        self._shared: dict[tuple[int, int], int] = {}  # (rank, rank) -> batches seen by both
        self.warnings: deque[dict] = deque(maxlen=WARNINGS_KEPT)
        self._warned: set[tuple[int, int]] = set()

    @property
    def seq(self) -> int:
        """The newest point's sequence number (0: none yet)."""
        return self._seq

    def record(self, rank: int, report: LogReport) -> None:
        """Keep ``rank``'s report. ValueError (nothing kept) when it would log more than
        MAX_NAMES names."""
        seat = self._ranks.get(rank)
        new_names = {name for _, name, _ in report.points if seat is None or name not in seat.curves}
        if len(new_names) + (len(seat.curves) if seat is not None else 0) > MAX_NAMES:
            raise ValueError(f"a rank logs {MAX_NAMES} scalars at most; rank {rank} would log "
                             f"{len(new_names) + (len(seat.curves) if seat else 0)}")
        if seat is None:
            seat = self._ranks[rank] = _Rank()
        for step, name, value in report.points:
            curve = seat.curves.get(name)
            if curve is None:
                curve = seat.curves[name] = Curve()
            if curve.add(step, value):
                self._seq += 1
                self.recent.append((self._seq, rank, name, step, value))
        now = self._now()
        if report.process is not None:
            before = seat.process
            if before is not None and before["pid"] == report.process["pid"] and now > seat.reported:
                seat.cpu_percent = 100.0 * max(0.0, report.process["cpu_s"] - before["cpu_s"]) / (now - seat.reported)
            elif before is not None:
                seat.cpu_percent = None  # (another process took the rank)
            seat.process = report.process
        seat.reported = now
        for step, digest in report.batches:
            self._batch(rank, seat, step, digest)

    def _batch(self, rank: int, seat: _Rank, step: int, digest: str) -> None:
        """Two ranks that read the same data read the same batch at the same step (their own
        count): that is what counts, not a batch seen at another step (an epoch's batches come
        round again; a shared queue may hand one rank's chunk of one epoch to another in the next)."""
        key = (step, digest)
        if key in seat.batch_set:
            return  # (sent again after a reconnect)
        if len(seat.batches) == seat.batches.maxlen:
            seat.batch_set.discard(seat.batches[0])
        seat.batches.append(key)
        seat.batch_set.add(key)
        for other, theirs in self._ranks.items():
            if other == rank or key not in theirs.batch_set:
                continue
            pair = (min(rank, other), max(rank, other))
            if pair in self._warned:
                continue
            count = self._shared[pair] = self._shared.get(pair, 0) + 1
            if count >= SAME_BATCHES:
                self._warned.add(pair)
                del self._shared[pair]
                message = (f"ranks {pair[0]} and {pair[1]} trained on the same batches ({count} of their last "
                           f"{BATCHES_KEPT}): each worker should read its own part of the data (a sampler: "
                           f"docs/guide/pytorch.md, \"Data across workers\")")
                log.warning("%s", message)
                self.warnings.append({"t": time.time(), "ranks": list(pair), "message": message})

    def forget(self, rank: int) -> None:
        """Drop what ``rank`` reported (a run whose size shrank for good)."""
        self._ranks.pop(rank, None)

    def points_after(self, seq: int) -> list[list]:
        """[seq, rank, name, step, value] of the points recorded after ``seq``, oldest first."""
        recent = self.recent
        if not recent or recent[-1][0] <= seq:
            return []
        out = []
        for point in reversed(recent):
            if point[0] <= seq:
                break
            out.append(list(point))
        out.reverse()
        return out

    def curves(self) -> dict[str, dict[str, list]]:
        """Every curve, ``{rank: {name: [[step, value], ...]}}`` (rank as a string: JSON's keys;
        values may be NaN or infinite: the JSON written of them has null)."""
        return {str(rank): {name: curve.points() for name, curve in seat.curves.items()}
                for rank, seat in sorted(self._ranks.items())}

    def newest(self) -> dict[int, dict]:
        """Per rank: each name's newest (step, value), its process and CPU use, and when it last reported."""
        now = self._now()
        return {
            rank: {
                "scalars": {name: {"step": c.last_step, "value": c.last_value}
                            for name, c in seat.curves.items()},
                "process": seat.process,
                "cpu_percent": seat.cpu_percent,
                "reported_s_ago": now - seat.reported,
            }
            for rank, seat in sorted(self._ranks.items())
        }

