"""Plain-Python twin of the native module ``aps._core``: the test oracle.

Every class and function here has the same name, signature and behaviour as
its native counterpart in ``native/_core.pyx``; the tests run the same
scenarios on both and compare them step by step. It favours being obviously
right over being fast.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "StalenessWindow",
    "accumulate",
    "adam_step",
    "all_finite",
    "dssp_controller",
    "fused_multiply_add",
    "narrow",
    "sgd_step",
    "use_f16c",
    "widen",
]

_F32 = np.float32
#: Element types of a gradient (aps.wire.protocol.DType's numbers).
FLOAT32, FLOAT16, BFLOAT16 = 1, 3, 4


def use_f16c(allowed: bool = True) -> bool:
    """The twin has one way to convert fp16 (numpy's): nothing to choose."""
    return False


def _check_16(dtype: int) -> None:
    if dtype not in (FLOAT16, BFLOAT16):
        raise ValueError(f"FLOAT16 or BFLOAT16, not dtype {dtype}")


@np.errstate(all="ignore")
def narrow(out: np.ndarray, x: np.ndarray, dtype: int) -> int:
    """``out`` (uint16) = ``x`` rounded to 16 bits, to nearest even; returns how many
    finite elements overflowed to infinity."""
    _check_len("out", len(out), len(x))
    _check_16(dtype)
    x = np.asarray(x, dtype=_F32)
    if dtype == FLOAT16:
        out[:] = x.astype(np.float16).view(np.uint16)
    else:
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        out[:] = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
    return int((~np.isfinite(widened(out, dtype)) & np.isfinite(x)).sum())


def widened(x: np.ndarray, dtype: int) -> np.ndarray:
    """A float32 copy of ``x``: float32 already, or 16-bit words of ``dtype``."""
    if dtype == FLOAT32:
        return np.array(x, dtype=_F32)
    _check_16(dtype)
    words = np.asarray(x, dtype=np.uint16)
    if dtype == FLOAT16:
        return words.view(np.float16).astype(_F32)
    return (words.astype(np.uint32) << 16).view(_F32)


def widen(out: np.ndarray, x: np.ndarray, dtype: int) -> None:
    """``out`` = ``x`` (16-bit words of ``dtype``) as float32."""
    _check_len("out", len(out), len(x))
    _check_16(dtype)
    out[:] = widened(x, dtype)


def _check_len(what: str, got: int, want: int) -> None:
    if got != want:
        raise ValueError(f"{what} has {got} elements, expected {want}")


def all_finite(x: np.ndarray, dtype: int = FLOAT32) -> bool:
    """True when no element of ``x`` (float32, or 16-bit words of ``dtype``) is NaN or infinite."""
    return bool(np.isfinite(widened(x, dtype)).all())


def _finite(*arrays: np.ndarray) -> bool:
    return all(bool(np.isfinite(a).all()) for a in arrays)


def fused_multiply_add() -> bool:
    """Whether ``x*y + z`` in the SGD kernels is rounded once or twice.

    A property of the CPU, not of the code under test: torch's vectorized CPU
    kernels fuse it when the CPU has FMA, and the native kernels choose the
    same at run time; the twin follows the native module's choice.
    """
    try:
        from aps import _core
    except ImportError:
        return False
    return _core.fused_multiply_add()


@np.errstate(all="ignore")
def _madd(x: np.ndarray, y: np.float32, z: np.ndarray, fused: bool) -> np.ndarray:
    """``x*y + z`` in float32, rounded twice, or once as a fused multiply-add.

    The fused form is exact: the product of two float32 is exact in float64,
    TwoSum gives the double sum and its exact error, and rounding that sum to
    odd before rounding to float32 makes the double rounding correct.
    """
    if not fused:
        return x * y + z
    p = np.asarray(x, dtype=np.float64) * np.float64(y)
    z64 = np.asarray(z, dtype=np.float64)
    s = np.atleast_1d(p + z64)
    bb = s - p
    err = (p - (s - bb)) + (z64 - bb)
    even = (s.view(np.uint64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(_F32)


@np.errstate(all="ignore")  # non-finite values are reported, not warned about
def accumulate(out: np.ndarray, inp: np.ndarray | None, grad: np.ndarray, scale: float = 1.0, first: bool = False,
               grad_dtype: int = FLOAT32) -> bool:
    """``out = scale * grad`` when ``first``, else ``out = inp + scale * grad``; False if not finite."""
    _check_len("grad", len(grad), len(out))
    g = widened(grad, grad_dtype)
    if not first:
        if inp is None:
            raise ValueError("accumulate needs the running sum unless first")
        _check_len("inp", len(inp), len(out))
    result = g * _F32(scale) if first else inp + g * _F32(scale)
    out[:] = result
    return _finite(g, result)


@np.errstate(all="ignore")
def sgd_step(
    w_out: np.ndarray,
    w_in: np.ndarray,
    grad: np.ndarray,
    buf_out: np.ndarray | None,
    buf_in: np.ndarray | None,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first: bool = False,
    scale: float = 1.0,
    grad_dtype: int = FLOAT32,
) -> bool:
    """One SGD step, out of place, exactly as ``torch.optim.SGD`` computes it (see the native twin)."""
    n = len(w_in)
    _check_len("w_out", len(w_out), n)
    _check_len("grad", len(grad), n)
    w = np.array(w_in, dtype=_F32)
    g = widened(grad, grad_dtype)
    fused = fused_multiply_add()
    d = g * _F32(scale)
    if weight_decay != 0.0:
        d = _madd(w, _F32(weight_decay), d, fused)
    if momentum != 0.0:
        if buf_out is None or (buf_in is None and not first):
            raise ValueError("momentum needs momentum buffers")
        _check_len("buf_out", len(buf_out), n)
        if first:
            buf = d.copy()
        else:
            _check_len("buf_in", len(buf_in), n)
            buf = _madd(d, _F32(1.0 - dampening), buf_in * _F32(momentum), fused)
        buf_out[:] = buf
        d = _madd(buf, _F32(momentum), d, fused) if nesterov else buf
    result = _madd(d, _F32(-lr), w, fused)
    w_out[:] = result
    return _finite(g, result)


@np.errstate(all="ignore")
def adam_step(
    w_out: np.ndarray,
    w_in: np.ndarray,
    grad: np.ndarray,
    m_out: np.ndarray,
    m_in: np.ndarray,
    v_out: np.ndarray,
    v_in: np.ndarray,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    scale: float = 1.0,
    grad_dtype: int = FLOAT32,
) -> bool:
    """One Adam or AdamW step, out of place, exactly as ``torch.optim.Adam[W]`` computes it."""
    n = len(w_in)
    for what, arr in (("w_out", w_out), ("grad", grad), ("m_out", m_out), ("m_in", m_in), ("v_out", v_out),
                      ("v_in", v_in)):
        _check_len(what, len(arr), n)
    if step < 1:
        raise ValueError("step counts from 1")
    raw = widened(grad, grad_dtype)
    g = raw * _F32(scale)
    w = np.array(w_in, dtype=_F32)
    m_prev, v_prev = np.array(m_in, dtype=_F32), np.array(v_in, dtype=_F32)
    if decoupled:
        if weight_decay != 0.0:
            w = w * _F32(1.0 - lr * weight_decay)
    elif weight_decay != 0.0:
        g = g + _F32(weight_decay) * w
    weight = 1.0 - beta1
    if weight < 0.5:
        m = m_prev + _F32(weight) * (g - m_prev)
    else:
        m = g - (g - m_prev) * _F32(1.0 - weight)
    v = v_prev * _F32(beta2) + _F32(1.0 - beta2) * g * g
    m_out[:] = m
    v_out[:] = v
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = np.sqrt(v) / _F32(math.sqrt(bias2)) + _F32(eps)
    result = w + _F32(-(lr / bias1)) * (m / denom)
    w_out[:] = result
    return _finite(raw, result)


def dssp_controller(
    fast_newest: float,
    fast_previous: float,
    slow_newest: float,
    slow_previous: float,
    r_max: int,
) -> int:
    """DSSP's synchronization controller: the extra iterations ``r*`` to grant.

    With the fast worker's last interval ``I_p`` and the slowest worker's
    ``I_s``, the predicted push times are ``Sim_p[r] = A_p[0] + r * I_p`` for
    ``r = 0..r_max`` and ``Sim_s[k] = A_s[0] + (k + 1) * I_s`` for
    ``k = 0..r_max``; ``r*`` minimizes ``min_k |Sim_s[k] - Sim_p[r]|``, ties
    going to the smaller ``r``. A NaN arrival time means "fewer than two
    pushes": then ``r* = 0``.
    """
    if r_max <= 0:
        return 0
    if math.isnan(fast_previous) or math.isnan(slow_previous):
        return 0
    interval_p = fast_newest - fast_previous
    interval_s = slow_newest - slow_previous
    best_r, best = 0, math.inf
    for r in range(r_max + 1):
        sim_p = fast_newest + r * interval_p
        nearest = min(abs(slow_newest + (k + 1) * interval_s - sim_p) for k in range(r_max + 1))
        if nearest < best:
            best_r, best = r, nearest
    return best_r


class StalenessWindow:
    """Clocks, live set and gate decisions for the staleness-bounded policies.

    ``lower < 0`` leaves the window unbounded (ASP: every push releases its
    worker). Otherwise a worker is released after a push while its gap
    ``t_i - min_j t_j`` (over live workers) is at most ``lower``; with
    ``upper > lower`` (DSSP) the fastest worker may be granted up to
    ``upper - lower`` extra iterations by the controller, never beyond a gap of
    ``upper``. ``lower == upper`` is SSP. See docs/algorithms.md.
    """

    def __init__(self, num_workers: int, lower: int = -1, upper: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        if upper is None:
            upper = lower
        if lower >= 0 and upper < lower:
            raise ValueError("upper must be at least lower")
        self._n = num_workers
        self._lower = lower
        self._upper = upper if lower >= 0 else -1
        self._clock = [0] * num_workers
        self._live = [False] * num_workers
        self._held = [False] * num_workers
        self._credit = [0] * num_workers
        self._newest = [math.nan] * num_workers
        self._previous = [math.nan] * num_workers
        self._min = 0
        self._released_max = 0
        self._last_r_star = -1
        self._controller_calls = 0

    # Read-only views -----------------------------------------------------
    @property
    def num_workers(self) -> int:
        return self._n

    @property
    def lower(self) -> int:
        return self._lower

    @property
    def upper(self) -> int:
        return self._upper

    @property
    def bounded(self) -> bool:
        return self._lower >= 0

    @property
    def num_live(self) -> int:
        return sum(self._live)

    @property
    def min_clock(self) -> int:
        return self._min

    @property
    def max_clock(self) -> int:
        clocks = [c for c, live in zip(self._clock, self._live) if live]
        return max(clocks) if clocks else self._min

    @property
    def released_max(self) -> int:
        """The highest clock at which any worker has been released (let start that
        iteration), live or not since: never decreases. ``min_clock <= released_max
        <= min_clock + upper`` in a bounded window."""
        return self._released_max

    @property
    def last_r_star(self) -> int:
        """The controller's ``r*`` at its most recent call (-1 before any)."""
        return self._last_r_star

    @property
    def controller_calls(self) -> int:
        """How many times the controller has been consulted."""
        return self._controller_calls

    def clock(self, rank: int) -> int:
        return self._clock[self._rank(rank)]

    def gap(self, rank: int) -> int:
        return self._clock[self._rank(rank)] - self._min

    def is_live(self, rank: int) -> bool:
        return self._live[self._rank(rank)]

    def is_held(self, rank: int) -> bool:
        return self._held[self._rank(rank)]

    def credit(self, rank: int) -> int:
        return self._credit[self._rank(rank)]

    def arrivals(self, rank: int) -> tuple[float, float]:
        rank = self._rank(rank)
        return self._newest[rank], self._previous[rank]

    def state(self) -> tuple:
        """Everything the window knows, for step-by-step comparison with its twin."""
        return (
            tuple(self._clock),
            tuple(self._live),
            tuple(self._held),
            tuple(self._credit),
            self._min,
            self._last_r_star,
            self._controller_calls,
            self._released_max,
        )

    def admits(self, rank: int, clock: int = -1) -> bool:
        """Whether a gradient ``rank`` computed in iteration ``clock`` may still be applied.

        The bound's promise (docs/algorithms.md, "The bound across a reconnect"):
        a worker starting iteration ``t`` has seen every gradient of iterations
        ``< t - upper``. So a gradient of iteration ``c`` is admitted only while no
        worker has been released into an iteration beyond ``c + upper``:
        ``c + upper >= released_max``. ``clock`` is the iteration the push says it
        was computed in, taken at most at the rank's own clock (a claim can make
        the rule stricter, never looser); ``clock < 0``: the rank's clock. A
        worker that kept its connection always computes at its own clock, and
        ``released_max <= min_clock + upper`` with ``min_clock`` at most its
        clock, so only a gradient from before a reconnect can be refused. An
        unbounded window admits everything.
        """
        rank = self._rank(rank)
        if self._lower < 0:
            return True
        own = self._clock[rank]
        c = own if clock < 0 or clock > own else clock
        return c + self._upper >= self._released_max

    # Transitions ----------------------------------------------------------
    def join(self, rank: int, clock: int = -1, held: bool = False, credit: int = 0) -> int:
        """Make ``rank`` live; returns its clock.

        By default (``clock < 0``) a (re)joining worker starts at the slowest
        live clock, so it can never hold the others back retroactively; with
        nobody live, it starts where the slowest worker was when the last one
        left. With ``clock >= 0`` it is placed exactly there, held at the gate
        or not, with ``credit`` extra iterations (restoring a checkpoint, or a
        worker that reconnects at the clock it had); the slowest clock is then
        recomputed over the live workers.
        """
        rank = self._rank(rank)
        if self._live[rank]:
            raise ValueError(f"rank {rank} is already live")
        if clock >= 0 and held and self._lower < 0:
            raise ValueError("an unbounded window holds nobody")
        if credit < 0:
            raise ValueError("credit must be >= 0")
        placed = clock >= 0
        self._clock[rank] = clock if placed else self._min
        self._live[rank] = True
        self._held[rank] = bool(held) if placed else False
        self._credit[rank] = credit if placed else 0
        self._newest[rank] = math.nan
        self._previous[rank] = math.nan
        self._recompute_min()
        if not self._held[rank]:  # it starts the iteration of its clock
            self._released_max = max(self._released_max, self._clock[rank])
        return self._clock[rank]

    def restore(self, min_clock: int, last_r_star: int = -1, controller_calls: int = 0,
                released_max: int = -1) -> None:
        """With nobody live, set the slowest clock (where workers joining at the
        default clock start), the highest clock released and the controller's
        counters: resuming from a checkpoint. ``released_max < 0`` (a checkpoint
        that does not say) takes the highest the bound allows, ``min_clock +
        upper``: the strictest choice, which still admits every gradient computed
        at a clock of at least ``min_clock``. The arrival times are not restored:
        they were measured on another process's clock."""
        if any(self._live):
            raise ValueError("restore needs an empty live set")
        if min_clock < 0:
            raise ValueError("min_clock must be >= 0")
        if released_max < 0:
            released_max = min_clock + max(self._upper, 0)
        elif released_max < min_clock:
            raise ValueError(f"released_max ({released_max}) must be >= min_clock ({min_clock})")
        self._min = min_clock
        self._released_max = released_max
        self._last_r_star = last_r_star
        self._controller_calls = controller_calls

    def leave(self, rank: int) -> list[int]:
        """Remove ``rank`` from the live set; returns the workers this releases."""
        rank = self._rank(rank)
        if not self._live[rank]:
            raise ValueError(f"rank {rank} is not live")
        self._live[rank] = False
        self._held[rank] = False
        self._credit[rank] = 0
        old_min = self._min
        self._recompute_min()
        return self._release_caught_up() if self._min != old_min else []

    def push(self, rank: int, now: float) -> list[int]:
        """Count one push from ``rank`` at time ``now``; returns the released workers.

        ``rank`` itself comes first in the list when it is released at once.
        """
        rank = self._rank(rank)
        if not self._live[rank]:
            raise ValueError(f"rank {rank} is not live")
        if self._held[rank]:
            raise ValueError(f"rank {rank} is held at the gate and cannot push")
        was_min = self._clock[rank] == self._min
        self._clock[rank] += 1
        self._previous[rank] = self._newest[rank]
        self._newest[rank] = now
        old_min = self._min
        if was_min:
            self._recompute_min()
        released = [rank] if self._decide(rank) else []
        if released:
            self._released_max = max(self._released_max, self._clock[rank])
        if self._min != old_min:
            released.extend(self._release_caught_up())
        return released

    # Internals ------------------------------------------------------------
    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self._n:
            raise IndexError(f"rank {rank} out of range 0..{self._n - 1}")
        return rank

    def _recompute_min(self) -> None:
        clocks = [c for c, live in zip(self._clock, self._live) if live]
        if clocks:
            self._min = min(clocks)

    def _decide(self, rank: int) -> bool:
        """The gate after a push by ``rank`` (docs/algorithms.md, DSSP steps 2-5)."""
        if self._lower < 0:
            return True
        gap = self._clock[rank] - self._min
        if self._credit[rank] > 0:
            self._credit[rank] -= 1
            return True
        if gap <= self._lower:
            return True
        if gap <= self._upper and self._clock[rank] == self.max_clock:
            r_star = self._controller(rank)
            self._last_r_star = r_star
            self._controller_calls += 1
            # The release now spends one unit of r*; the grant is cut to the
            # room left below the upper bound so the gap never exceeds it.
            grant = min(r_star, self._upper - gap + 1)
            if grant > 0:
                self._credit[rank] = grant - 1
                return True
        self._held[rank] = True
        return False

    def _slowest(self) -> int:
        for rank in range(self._n):
            if self._live[rank] and self._clock[rank] == self._min:
                return rank
        raise AssertionError("no live worker")

    def _controller(self, rank: int) -> int:
        slow = self._slowest()
        return dssp_controller(
            self._newest[rank],
            self._previous[rank],
            self._newest[slow],
            self._previous[slow],
            self._upper - self._lower,
        )

    def _release_caught_up(self) -> list[int]:
        released = []
        for rank in range(self._n):
            if self._held[rank] and self._clock[rank] - self._min <= self._lower:
                self._held[rank] = False
                self._released_max = max(self._released_max, self._clock[rank])
                released.append(rank)
        return released
