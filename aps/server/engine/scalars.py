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

Checkpoints keep the curves (:meth:`Scalars.saved`, taken up by :meth:`Scalars.restore`):
a resumed server draws the run from its start. What a process reported of itself (CPU,
memory) and the batch digests are the processes' and start afresh.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ...wire.scalars import MAX_STEP, LogReport, check_scalar_name

__all__ = ["CURVE_POINTS", "MAX_NAMES", "Curve", "Drawn", "Scalars"]

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
#: Curves a checkpoint keeps at most (128 ranks of 32 names; the ranks beyond, in rank order,
#: are left out with a warning): the capture is on the loop and the index in the manifest.
SAVED_CURVES = 4096


class Curve:
    """One scalar of one rank: at most CURVE_POINTS (step, value) points over the run, and its newest.

    The points are in numpy arrays (grown as they fill, up to CURVE_POINTS), so that a
    checkpoint takes every curve of the run in a few copies (:meth:`Scalars.saved`)."""

    __slots__ = ("_steps", "_values", "count", "stride", "seen", "last_step", "last_value")

    def __init__(self, capacity: int = 16) -> None:
        self._steps = np.empty(capacity, np.int64)
        self._values = np.empty(capacity, np.float64)
        self.count = 0  # points kept
        self.stride = 1  # a point is kept every this many
        self.seen = 0
        self.last_step = 0
        self.last_value = math.nan

    @property
    def steps(self) -> np.ndarray:
        return self._steps[: self.count]

    @property
    def values(self) -> np.ndarray:
        return self._values[: self.count]

    def add(self, step: int, value: float) -> bool:
        """Record one value; True when the curve kept it as a point. The value it has at its
        newest step already is not counted again (a LOG sent again after a reconnect)."""
        if (
            self.seen
            and step == self.last_step
            and (value == self.last_value or (math.isnan(value) and math.isnan(self.last_value)))
        ):
            return False
        self.last_step, self.last_value = step, value
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return False
        n = self.count
        if n == len(self._steps):
            capacity = min(CURVE_POINTS, 2 * n)
            self._steps = np.concatenate((self._steps, np.empty(capacity - n, np.int64)))
            self._values = np.concatenate((self._values, np.empty(capacity - n, np.float64)))
        self._steps[n], self._values[n] = step, value
        n += 1
        if n >= CURVE_POINTS:  # every other point goes: the first stays, the spacing doubles
            kept = (n + 1) // 2
            self._steps[:kept] = self._steps[0:n:2].copy()
            self._values[:kept] = self._values[0:n:2].copy()
            n = kept
            self.stride *= 2
        self.count = n
        return True

    def points(self) -> list[list]:
        return [[s, v] for s, v in zip(self.steps.tolist(), self.values.tolist())]

    @classmethod
    def restored(cls, steps: np.ndarray, values: np.ndarray, stride: int, seen: int) -> Curve:
        """The curve :meth:`Scalars.saved` kept: its points, then its newest (step, value)."""
        count = len(steps) - 1
        curve = cls(min(CURVE_POINTS, max(16, 2 * count)))
        curve._steps[:count], curve._values[:count] = steps[:-1], values[:-1]
        curve.count = count
        curve.last_step, curve.last_value = int(steps[-1]), float(values[-1])
        curve.stride, curve.seen = stride, seen
        return curve


@dataclass(slots=True)
class _Rank:
    curves: dict[str, Curve] = field(default_factory=dict)
    process: dict | None = None
    cpu_percent: float | None = None  # over the last two reports of the same process
    reported: float | None = None  # time.monotonic() of the last report in this process
    batches: deque = field(default_factory=lambda: deque(maxlen=BATCHES_KEPT))
    batch_set: set = field(default_factory=set)


class Scalars:
    """The run's reported scalars; :meth:`record` takes a rank's checked LOG."""

    def __init__(self, now=time.monotonic) -> None:
        self._now = now
        self._ranks: dict[int, _Rank] = {}
        self._seq = 0
        self._changes = 0  # the curves changed this many times (a point kept, a restore, a rank forgotten)
        #: (seq, rank, name, step, value) of every point curves kept, newest last (the dashboards').
        self.recent: deque[tuple[int, int, str, int, float]] = deque(maxlen=RECENT_POINTS)
        self._shared: dict[tuple[int, int], int] = {}  # (rank, rank) -> batches seen by both
        self.warnings: deque[dict] = deque(maxlen=WARNINGS_KEPT)
        self._warned: set[tuple[int, int]] = set()
        self._saved_all_warned = False

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
            raise ValueError(
                f"a rank logs {MAX_NAMES} scalars at most; rank {rank} would log "
                f"{len(new_names) + (len(seat.curves) if seat else 0)}"
            )
        if seat is None:
            seat = self._ranks[rank] = _Rank()
        for step, name, value in report.points:
            curve = seat.curves.get(name)
            if curve is None:
                curve = seat.curves[name] = Curve()
            if curve.add(step, value):
                self._seq += 1
                self._changes += 1
                self.recent.append((self._seq, rank, name, step, value))
        now = self._now()
        if report.process is not None:
            before = seat.process
            if (
                before is not None
                and before["pid"] == report.process["pid"]
                and seat.reported is not None
                and now > seat.reported
            ):
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
                message = (
                    f"ranks {pair[0]} and {pair[1]} trained on the same batches ({count} of their last "
                    f"{BATCHES_KEPT}): each worker should read its own part of the data (a sampler: "
                    f'docs/guide/pytorch.md, "Data across workers")'
                )
                log.warning("%s", message)
                self.warnings.append({"t": time.time(), "ranks": list(pair), "message": message})

    def saved(self) -> tuple[list[list], np.ndarray, np.ndarray]:
        """What a checkpoint keeps: an index, ``[[rank, name, points, stride, seen], ...]``
        (JSON), and each curve's points then its newest point, in the index's order, as
        steps (int64) and values (float64)."""
        index: list[list] = []
        steps: list = []
        values: list = []
        for rank, seat in sorted(self._ranks.items()):
            if len(index) + len(seat.curves) > SAVED_CURVES:
                if not self._saved_all_warned:
                    self._saved_all_warned = True
                    log.warning(
                        "checkpoints keep the curves of the first %d logged scalars; those of rank %d "
                        "and after are left out",
                        SAVED_CURVES,
                        rank,
                    )
                break
            for name, curve in seat.curves.items():
                index.append([rank, name, curve.count, curve.stride, curve.seen])
                steps += (curve.steps, (curve.last_step,))
                values += (curve.values, (curve.last_value,))
        if not index:
            return index, np.empty(0, np.int64), np.empty(0, np.float64)
        return index, np.concatenate(steps, dtype=np.int64), np.concatenate(values, dtype=np.float64)

    def restore(self, index: object, steps: object, values: object) -> None:
        """Take up the curves of :meth:`saved` (a resumed run), replacing any. ValueError
        saying why, and nothing kept, when they do not hold together."""
        if not isinstance(index, list):
            raise ValueError("the index is not a list")
        if (
            not (isinstance(steps, np.ndarray) and isinstance(values, np.ndarray))
            or steps.ndim != 1
            or values.ndim != 1
            or steps.dtype != np.int64
            or values.dtype != np.float64
            or len(steps) != len(values)
        ):
            raise ValueError("the points are not two int64 and float64 vectors of one length")
        if len(steps) and not (0 <= steps.min() and steps.max() <= MAX_STEP):
            raise ValueError(f"a step is out of range 0..{MAX_STEP}")
        ranks: dict[int, _Rank] = {}
        at = 0
        for entry in index:
            if not (
                isinstance(entry, list)
                and len(entry) == 5
                and all(isinstance(n, int) and not isinstance(n, bool) for n in entry[:1] + entry[2:])
            ):
                raise ValueError(
                    f"an entry of the index is not [rank, name, points, stride, seen]: {reprlib.repr(entry)}"
                )
            rank, name, points, stride, seen = entry
            if not isinstance(name, str):
                raise ValueError(f"a curve's name is {type(name).__name__}, not a string")
            check_scalar_name(name)
            # (a curve that has seen SEEN values keeps every STRIDE-th, the first included)
            if not (
                0 <= rank < 2**31
                and 1 <= seen <= MAX_STEP + 1
                and 0 < points < CURVE_POINTS
                and stride & (stride - 1) == 0
                and 1 <= stride <= seen
                and points == -(-seen // stride)
            ):
                raise ValueError(f"rank {rank}'s curve {name!r} has points {points}, stride {stride}, seen {seen}")
            seat = ranks.setdefault(rank, _Rank())
            if name in seat.curves or len(seat.curves) >= MAX_NAMES:
                raise ValueError(f"rank {rank} has {name!r} twice, or more than {MAX_NAMES} names")
            end = at + points + 1
            if end > len(steps):
                raise ValueError(f"rank {rank}'s curve {name!r} runs past the points kept")
            seat.curves[name] = Curve.restored(steps[at:end], values[at:end], stride, seen)
            at = end
        if at != len(steps):
            raise ValueError(f"{len(steps) - at} points belong to no curve")
        self._ranks = ranks
        self._changes += 1
        self.recent.clear()

    def forget(self, rank: int) -> None:
        """Drop what ``rank`` reported (a run whose size shrank for good)."""
        if self._ranks.pop(rank, None) is not None:
            self._changes += 1

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

    @property
    def changes(self) -> int:
        """How many times the curves changed: a :meth:`drawn` copy with as many is current."""
        return self._changes

    def curves(self) -> dict[str, dict[str, list]]:
        """Every curve, ``{rank: {name: [[step, value], ...]}}`` (rank as a string: JSON's keys;
        values may be NaN or infinite: the JSON written of them has null)."""
        return {
            str(rank): {name: curve.points() for name, curve in seat.curves.items()}
            for rank, seat in sorted(self._ranks.items())
        }

    def drawn(self) -> Drawn:
        """Every curve as it is now, copied (a few copies: on the loop) to be written as JSON
        on another thread (:meth:`Drawn.json`; at the bound that takes a second)."""
        return Drawn(
            self._seq,
            self._changes,
            [
                (
                    str(rank),
                    [
                        (name, c.steps.copy(), c.values.copy(), bool(np.isfinite(c.values).all()))
                        for name, c in seat.curves.items()
                    ],
                )
                for rank, seat in sorted(self._ranks.items())
            ],
        )

    def newest(self) -> dict[int, dict]:
        """Per rank: each name's newest (step, value), its process and CPU use, and when it last reported."""
        now = self._now()
        return {
            rank: {
                "scalars": {name: {"step": c.last_step, "value": c.last_value} for name, c in seat.curves.items()},
                "process": seat.process,
                "cpu_percent": seat.cpu_percent,
                "reported_s_ago": None if seat.reported is None else now - seat.reported,
            }
            for rank, seat in sorted(self._ranks.items())
        }


@dataclass(frozen=True, slots=True)
class Drawn:
    """A copy of every curve (:meth:`Scalars.drawn`), its own: any thread may write it out."""

    seq: int  # the newest point's sequence number then: the points after it are not in it
    changes: int  # Scalars.changes then
    ranks: list[tuple[str, list[tuple[str, np.ndarray, np.ndarray, bool]]]]  # (name, steps, values, all finite)

    def json(self) -> str:
        """``{rank: {name: [[step, value], ...]}}`` as JSON text (:meth:`Scalars.curves`), with
        null for a value that is not finite (strict JSON: what browsers parse)."""
        return "{" + b", ".join(self.pieces()).decode() + "}"

    def pieces(self) -> list[bytes]:
        """The inside of :meth:`json`'s object, a rank a piece (``"rank": {...}``, UTF-8), to
        be joined with ``, `` (or sent one after the other with a ``, `` between).

        Written a curve at a time: the encoder holds the GIL for the whole of one call, and a
        thread writing a million points in one call would stop the loop as if it wrote them
        itself. No numpy call that lets go of the GIL runs here either (whether the values are
        finite was found on the loop): a thread that lets go of the GIL and takes it again every
        few hundred microseconds keeps a waiting thread out for as long as it runs (the waiter
        is never owed a forced switch), and the loop is that waiter."""
        ranks = []
        for rank, curves in self.ranks:
            seat = []
            for name, steps, values, finite in curves:
                kept = values.tolist()
                if not finite:
                    kept = [v if math.isfinite(v) else None for v in kept]
                points = json.dumps(list(map(list, zip(steps.tolist(), kept))), allow_nan=False)
                seat.append(f"{json.dumps(name)}: {points}")
            ranks.append(f"{json.dumps(rank)}: {{{', '.join(seat)}}}".encode())
        return ranks
