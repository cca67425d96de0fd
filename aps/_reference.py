"""Plain-Python twin of the native module ``aps._core``: the test oracle.

Every class and function here has the same name, signature and behaviour as
its native counterpart in ``native/_core.pyx``; the tests run the same
scenarios on both and compare them step by step. It favours being obviously
right over being fast.
"""

from __future__ import annotations

import math

import numpy as np

from .wire.quantized import BLOCK, Quantized, dequantize

__all__ = [
    "BFLOAT16",
    "COMPENSATE_DC",
    "COMPENSATE_DC_ADAPTIVE",
    "COMPENSATE_GAP",
    "FLOAT16",
    "FLOAT32",
    "INIT_NORMAL",
    "INIT_UNIFORM",
    "INIT_ZEROS",
    "INT4Q",
    "INT8Q",
    "QBLOCK",
    "RowIndex",
    "StalenessWindow",
    "accumulate",
    "adam_step",
    "all_finite",
    "compensate",
    "delayed_nesterov_step",
    "dssp_controller",
    "fused_multiply_add",
    "mix64",
    "narrow",
    "rows_adagrad",
    "rows_adam",
    "rows_coalesce",
    "rows_gather",
    "rows_init",
    "rows_scatter",
    "rows_sgd",
    "sgd_step",
    "step_scale",
    "use_f16c",
    "widen",
]

_F32 = np.float32
#: Element types of a gradient (aps.wire.protocol.DType's numbers).
FLOAT32, FLOAT16, BFLOAT16, INT8Q, INT4Q = 1, 3, 4, 8, 9
#: Elements per scale of a quantized gradient.
QBLOCK = BLOCK


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


def widened(x: np.ndarray | Quantized, dtype: int) -> np.ndarray:
    """A float32 copy of ``x``: float32 already, 16-bit words of ``dtype``, or a quantized
    gradient (INT8Q, INT4Q: ``code * scale``)."""
    if dtype == FLOAT32:
        return np.array(x, dtype=_F32)
    if dtype in (INT8Q, INT4Q):
        if not isinstance(x, Quantized) or x.dtype != dtype:
            raise TypeError(f"a gradient of dtype {dtype} is a Quantized of that dtype")
        return dequantize(x)
    _check_16(dtype)
    words = np.asarray(x, dtype=np.uint16)
    if dtype == FLOAT16:
        return words.view(np.float16).astype(_F32)
    return (words.astype(np.uint32) << 16).view(_F32)


def widen(out: np.ndarray, x: np.ndarray | Quantized, dtype: int) -> None:
    """``out`` = ``x`` (16-bit words, or a quantized gradient, of ``dtype``) as float32."""
    if dtype == FLOAT32:
        raise ValueError("widen from FLOAT16, BFLOAT16, INT8Q or INT4Q, not FLOAT32")
    _check_len("out", len(out), len(x))
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
def accumulate(
    out: np.ndarray,
    inp: np.ndarray | None,
    grad: np.ndarray,
    scale: float = 1.0,
    first: bool = False,
    grad_dtype: int = FLOAT32,
) -> bool:
    """``out = scale * grad`` when ``first``, else ``out = inp + scale * grad``; False if not finite."""
    _check_len("grad", len(grad), len(out))
    g = widened(grad, grad_dtype)
    if first:
        result = g * _F32(scale)
    else:
        if inp is None:
            raise ValueError("accumulate needs the running sum unless first")
        _check_len("inp", len(inp), len(out))
        result = inp + g * _F32(scale)
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
        if first or buf_in is None:  # buf_in may be None on the first step only (checked above)
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
    for what, arr in (
        ("w_out", w_out),
        ("grad", grad),
        ("m_out", m_out),
        ("m_in", m_in),
        ("v_out", v_out),
        ("v_in", v_in),
    ):
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


@np.errstate(all="ignore")
def delayed_nesterov_step(
    w_out: np.ndarray,
    w_in: np.ndarray,
    grad: np.ndarray,
    m_out: np.ndarray | None,
    m_in: np.ndarray,
    delta_out: np.ndarray,
    delta_in: np.ndarray,
    step: int,
    lr: float,
    momentum: float,
    period: int,
    c: float = 0.0,
    scale: float = 1.0,
    grad_dtype: int = FLOAT32,
) -> bool:
    """One push of delayed Nesterov, out of place (see the native twin for the formula)."""
    n = len(w_in)
    if step < 1:
        raise ValueError("step counts from 1")
    if not 1 <= period <= 1 << 24:
        raise ValueError(f"period must be in 1..{1 << 24}, got {period}")
    milestone = step % period == 0
    arrays = (("w_out", w_out), ("grad", grad), ("m_in", m_in), ("delta_out", delta_out), ("delta_in", delta_in))
    for what, arr in arrays:
        _check_len(what, len(arr), n)
    if milestone:
        if m_out is None:
            raise ValueError("a milestone writes the momentum: m_out is needed")
        _check_len("m_out", len(m_out), n)
    raw = widened(grad, grad_dtype)
    fused = fused_multiply_add()
    d = raw * _F32(scale)
    w, m_prev, sum_prev, big_n = np.array(w_in, _F32), np.array(m_in, _F32), np.array(delta_in, _F32), _F32(period)
    if milestone:
        m = m_prev * _F32(momentum) + (sum_prev + d) / big_n
        k = _F32((1.0 + c * (1.0 - period)) * momentum)
        result = _madd(_madd(m, k, d / big_n, fused), _F32(-lr), w, fused)
        assert m_out is not None
        m_out[:] = m
        delta_out[:] = 0.0
        w_out[:] = result
        return _finite(raw, m, result)
    total = sum_prev + d
    result = _madd(_madd(m_prev, _F32(c * momentum), d / big_n, fused), _F32(-lr), w, fused)
    delta_out[:] = total
    w_out[:] = result
    return _finite(raw, total, result)


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

    def restore(self, min_clock: int, last_r_star: int = -1, controller_calls: int = 0, released_max: int = -1) -> None:
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


# Embedding tables (native/_rows.h) ----------------------------------------

#: Row initializers (rows_init's ``kind``).
INIT_ZEROS, INIT_NORMAL, INIT_UNIFORM = 0, 1, 2
_U64 = np.uint64


@np.errstate(over="ignore")
def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64 words (numpy's uint64 arithmetic wraps as C's)."""
    x = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def ids_range(ids: np.ndarray) -> tuple[int, int]:
    """``(lowest, highest)`` of a non-empty vector of ids."""
    if not len(ids):
        raise ValueError("no ids")
    return int(ids.min()), int(ids.max())


def mix64(ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i]`` = SplitMix64's finalizer of ``ids[i]`` as a 64-bit word."""
    _check_len("out", len(out), len(ids))
    out[:] = _mix64(np.asarray(ids, dtype=np.int64).view(_U64))


@np.errstate(over="ignore")
def rows_init(out: np.ndarray, ids: np.ndarray, seed: int, kind: int, scale: float) -> None:
    """Each row of ``out`` made from its id alone: zeros, normal(0, scale) or uniform(-scale, scale)."""
    _check_len("out", len(out), len(ids))
    if kind not in (INIT_ZEROS, INIT_NORMAL, INIT_UNIFORM):
        raise ValueError(f"unknown row initializer {kind}")
    dim = out.shape[1]
    base = _mix64(np.asarray(ids, dtype=np.int64).view(_U64) ^ _U64(seed))[:, None]
    j = np.arange(dim, dtype=_U64)[None, :]
    if kind == INIT_NORMAL:
        u1 = ((_mix64(base + _U64(2) * j) >> _U64(11)).astype(np.float64) + 0.5) / 2.0**53
        u2 = (_mix64(base + _U64(2) * j + _U64(1)) >> _U64(11)).astype(np.float64) / 2.0**53
        out[:] = (scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(6.283185307179586 * u2)).astype(_F32)
    elif kind == INIT_UNIFORM:
        u = ((_mix64(base + j) >> _U64(40)).astype(np.float64) + 0.5) / 2.0**24
        out[:] = (scale * (2.0 * u - 1.0)).astype(_F32)
    else:
        out[:] = 0.0


def _check_rows(grad: np.ndarray, dim: int, where: np.ndarray, rows: int) -> None:
    _check_len("grad's row", grad.shape[1], dim)
    _check_where(where, rows)


def _check_where(where: np.ndarray, rows: int) -> None:
    bad = np.nonzero((where < 0) | (where >= rows))[0]
    if len(bad):
        raise ValueError(f"where[{bad[0]}] = {where[bad[0]]} is not one of the {rows} rows")


def rows_gather(out: np.ndarray, slab: np.ndarray, rows: np.ndarray) -> None:
    """``out[e] = slab[rows[e]]``."""
    _check_len("out", len(out), len(rows))
    _check_len("out's row", out.shape[1], slab.shape[1])
    _check_where(rows, len(slab))
    out[:] = slab[rows]


def rows_distinct(rows: np.ndarray, where: np.ndarray, mark: np.ndarray) -> np.ndarray:
    """The distinct values of ``rows`` in the order first met, and ``where[e]``, entry e's
    place among them (``mark``: scratch of the native kernel, all 0, left so)."""
    _check_len("where", len(where), len(rows))
    _check_where(rows, len(mark))
    places: dict[int, int] = {}
    for e, row in enumerate(rows.tolist()):
        where[e] = places.setdefault(row, len(places))
    return np.array(list(places), np.int64)


def rows_scatter(slab: np.ndarray, inp: np.ndarray, rows: np.ndarray) -> None:
    """``slab[rows[e]] = inp[e]``."""
    _check_len("inp", len(inp), len(rows))
    _check_len("inp's row", inp.shape[1], slab.shape[1])
    _check_where(rows, len(slab))
    slab[rows] = inp


def rows_coalesce(out: np.ndarray, where: np.ndarray, grad: np.ndarray) -> None:
    """``out[where[e]] += grad[e]`` for each entry in order."""
    _check_len("grad", len(grad), len(where))
    _check_rows(grad, out.shape[1], where, len(out))
    for e, row in enumerate(where):
        out[row] += grad[e]


@np.errstate(all="ignore")
def rows_sgd(w: np.ndarray, where: np.ndarray, grad: np.ndarray, lr: float) -> bool:
    """SGD on compact rows, entry by entry in order, as torch.optim.SGD applies a sparse gradient."""
    _check_len("grad", len(grad), len(where))
    _check_rows(grad, w.shape[1], where, len(w))
    fused = fused_multiply_add()
    ok = _finite(grad)
    for e, row in enumerate(where):
        w[row] = _madd(grad[e], _F32(-lr), w[row], fused)
    return ok and _finite(w[np.unique(where)]) if len(where) else True


@np.errstate(all="ignore")
def rows_adagrad(
    w: np.ndarray, state: np.ndarray, grad: np.ndarray, lr: float, eps: float = 1e-10, rowwise: bool = False
) -> bool:
    """Adagrad on compact, coalesced rows, as torch.optim.Adagrad with a sparse gradient
    (``rowwise``: one state value per row, the mean of g*g)."""
    rows, dim = w.shape
    _check_len("grad", len(grad), rows)
    _check_len("grad's row", grad.shape[1], dim)
    _check_len("state", len(state), rows if rowwise else rows * dim)
    if not rows or not dim:
        return True
    fused = fused_multiply_add()
    if rowwise:
        sums = np.array([np.float32(sum(_F32(x) * _F32(x) for x in row) if dim else 0.0) for row in grad], _F32)
        s = state + sums / _F32(dim)
        std = (np.sqrt(s) + _F32(eps))[:, None]
    else:
        s = state.reshape(rows, dim) + grad * grad
        std = np.sqrt(s) + _F32(eps)
    state[:] = s.reshape(-1)
    w[:] = _madd(grad / std, _F32(-lr), w, fused)
    return _finite(grad, s, w)


@np.errstate(all="ignore")
def rows_adam(
    w: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    grad: np.ndarray,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
) -> bool:
    """Lazy Adam on compact, coalesced rows, as torch.optim.SparseAdam."""
    rows, dim = w.shape
    _check_len("grad", len(grad), rows)
    for name, other in (("grad", grad), ("m", m), ("v", v)):
        _check_len(f"{name}'s row", other.shape[1] if other.ndim == 2 else -1, dim)
        _check_len(name, len(other), rows)
    if step < 1:
        raise ValueError("step counts from 1")
    step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    dm = (grad - m) * _F32(1.0 - beta1)
    dv = (grad * grad - v) * _F32(1.0 - beta2)
    result = w + _F32(-step_size) * ((dm + m) / (np.sqrt(dv + v) + _F32(eps)))
    m += dm
    v += dv
    w[:] = result
    return _finite(grad, v, result)


class RowIndex:
    """id -> row, rows numbered in the order their ids were first seen (a dict here)."""

    def __init__(self, capacity: int = 16) -> None:
        self._rows: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        return 0  # (the twin's dict is not what the native index costs)

    def lookup(self, ids: np.ndarray, rows: np.ndarray, add: bool = True) -> int:
        _check_len("rows", len(rows), len(ids))
        negative = np.nonzero(np.asarray(ids) < 0)[0]
        if len(negative):
            raise ValueError(f"ids[{negative[0]}] = {ids[negative[0]]} is negative")
        before = len(self._rows)
        for e, i in enumerate(np.asarray(ids).tolist()):
            row = self._rows.get(i)
            if row is None and add:
                row = self._rows[i] = len(self._rows)
            rows[e] = -1 if row is None else row
        return len(self._rows) - before if add else int(np.count_nonzero(rows < 0))

    def ids(self) -> np.ndarray:
        return np.array(list(self._rows), dtype=np.int64)


#: Kinds of delay compensation (see :func:`compensate`).
COMPENSATE_DC, COMPENSATE_DC_ADAPTIVE, COMPENSATE_GAP = 1, 2, 3


@np.errstate(all="ignore")
def compensate(
    out: np.ndarray,
    grad: np.ndarray,
    w: np.ndarray,
    w_then: np.ndarray,
    state_out: np.ndarray | None,
    state_in: np.ndarray | None,
    kind: int,
    lam: float = 0.0,
    decay: float = 0.0,
    eps: float = 0.0,
    corr: float = 1.0,
) -> bool:
    """``out`` = ``grad`` (computed on ``w_then``) compensated for being applied to ``w``
    (see the native twin; docs/algorithms.md, "Delay compensation")."""
    n = len(grad)
    for name, array in (("out", out), ("w", w), ("w_then", w_then)):
        _check_len(name, len(array), n)
    if kind not in (COMPENSATE_DC, COMPENSATE_DC_ADAPTIVE, COMPENSATE_GAP):
        raise ValueError(f"unknown compensation kind {kind}")
    if kind != COMPENSATE_DC:
        if state_in is None:
            raise ValueError("this compensation needs its state")
        _check_len("state_in", len(state_in), n)
    if kind == COMPENSATE_DC_ADAPTIVE:
        if state_out is None:
            raise ValueError("the adaptive compensation writes its state")
        _check_len("state_out", len(state_out), n)
    g = np.array(grad, dtype=_F32)
    d = np.asarray(w, _F32) - np.asarray(w_then, _F32)
    if kind == COMPENSATE_GAP:
        gap = np.abs(d) / (np.asarray(state_in, _F32) * _F32(corr) + _F32(eps))
        result = g / np.maximum(gap, _F32(1.0))
    else:
        lam32: np.floating | np.ndarray = _F32(lam)
        if kind == COMPENSATE_DC_ADAPTIVE:
            assert state_out is not None  # checked above, before any work
            ms = np.asarray(state_in, _F32) * _F32(decay) + _F32(1.0 - decay) * (g * g)
            state_out[:] = ms
            lam32 = lam32 / np.sqrt(ms + _F32(eps))
        result = g + lam32 * ((g * g) * d)
    out[:] = result
    return _finite(g, result)


@np.errstate(all="ignore")
def step_scale(c_out: np.ndarray, c_in: np.ndarray, w_out: np.ndarray, w_in: np.ndarray, decay: float) -> None:
    """Gap-aware's running step scale after an update (see the native twin)."""
    n = len(c_in)
    for name, array in (("c_out", c_out), ("w_out", w_out), ("w_in", w_in)):
        _check_len(name, len(array), n)
    c_out[:] = np.asarray(c_in, _F32) * _F32(decay) + _F32(1.0 - decay) * np.abs(
        np.asarray(w_out, _F32) - np.asarray(w_in, _F32)
    )
