# StalenessWindow: per-worker clocks, the live set and the gate decisions of
# the staleness-bounded policies (SSP, DSSP, and ASP as the unbounded case).
# The plain-Python twin in aps/_reference.py is the specification; tests run
# both on the same operations and compare their state after every step.

from libc.math cimport NAN, isnan, fabs, floor, INFINITY
from libc.stdlib cimport calloc, free
from libc.stdint cimport int64_t


cdef long _controller(double fast_newest, double fast_previous,
                      double slow_newest, double slow_previous,
                      long r_max) noexcept nogil:
    # r* = argmin_r min_k |Sim_s[k] - Sim_p[r]| (docs/algorithms.md). Sim_s is
    # an arithmetic sequence, so the nearest k to each Sim_p[r] is within one
    # of its rounded position: O(r_max) instead of the O(r_max^2) double loop
    # of the reference, with the same arithmetic for every distance compared.
    cdef long r, k, j, k0, best_r = 0
    cdef double interval_p, interval_s, sim_p, nearest, dist, best = INFINITY
    if r_max <= 0 or isnan(fast_previous) or isnan(slow_previous):
        return 0
    interval_p = fast_newest - fast_previous
    interval_s = slow_newest - slow_previous
    for r in range(r_max + 1):
        sim_p = fast_newest + r * interval_p
        if interval_s > 0.0:
            k0 = <long> floor((sim_p - slow_newest) / interval_s + 0.5) - 1
        else:
            k0 = 0
        nearest = INFINITY
        for j in range(k0 - 1, k0 + 2):
            k = j
            if k < 0:
                k = 0
            elif k > r_max:
                k = r_max
            dist = fabs(slow_newest + (k + 1) * interval_s - sim_p)
            if dist < nearest:
                nearest = dist
        if nearest < best:
            best = nearest
            best_r = r
    return best_r


def dssp_controller(double fast_newest, double fast_previous,
                    double slow_newest, double slow_previous,
                    long r_max) -> int:
    """DSSP's synchronization controller ``r*`` (see ``aps._reference``)."""
    return _controller(fast_newest, fast_previous, slow_newest, slow_previous, r_max)


cdef class StalenessWindow:
    """Clocks, live set and gate decisions for the staleness-bounded policies.

    ``lower < 0``: unbounded (ASP). ``lower == upper``: SSP with threshold
    ``lower``. ``upper > lower``: DSSP. The plain-Python twin
    ``aps._reference.StalenessWindow`` documents every rule.
    """

    cdef int _n
    cdef long _lower, _upper
    cdef int64_t* _clock
    cdef char* _live
    cdef char* _held
    cdef int64_t* _credit
    cdef double* _newest
    cdef double* _previous
    cdef int64_t _min
    cdef int64_t _released_max
    cdef int _num_live
    cdef long _last_r_star
    cdef long _controller_calls

    def __cinit__(self, int num_workers, long lower=-1, upper=None):
        cdef int i
        if num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        cdef long up = lower if upper is None else upper
        if lower >= 0 and up < lower:
            raise ValueError("upper must be at least lower")
        self._n = num_workers
        self._lower = lower
        self._upper = up if lower >= 0 else -1
        self._clock = <int64_t*> calloc(num_workers, sizeof(int64_t))
        self._credit = <int64_t*> calloc(num_workers, sizeof(int64_t))
        self._live = <char*> calloc(num_workers, sizeof(char))
        self._held = <char*> calloc(num_workers, sizeof(char))
        self._newest = <double*> calloc(num_workers, sizeof(double))
        self._previous = <double*> calloc(num_workers, sizeof(double))
        if (self._clock == NULL or self._credit == NULL or self._live == NULL
                or self._held == NULL or self._newest == NULL or self._previous == NULL):
            raise MemoryError()
        for i in range(num_workers):
            self._newest[i] = NAN
            self._previous[i] = NAN
        self._min = 0
        self._released_max = 0
        self._num_live = 0
        self._last_r_star = -1
        self._controller_calls = 0

    def __dealloc__(self):
        free(self._clock)
        free(self._credit)
        free(self._live)
        free(self._held)
        free(self._newest)
        free(self._previous)

    # Read-only views -----------------------------------------------------
    @property
    def num_workers(self):
        return self._n

    @property
    def lower(self):
        return self._lower

    @property
    def upper(self):
        return self._upper

    @property
    def bounded(self):
        return self._lower >= 0

    @property
    def num_live(self):
        return self._num_live

    @property
    def min_clock(self):
        return self._min

    @property
    def max_clock(self):
        return self._max_clock()

    @property
    def released_max(self):
        """The highest clock at which any worker has been released (never decreases)."""
        return self._released_max

    @property
    def last_r_star(self):
        """The controller's ``r*`` at its most recent call (-1 before any)."""
        return self._last_r_star

    @property
    def controller_calls(self):
        """How many times the controller has been consulted."""
        return self._controller_calls

    def clock(self, int rank):
        return self._clock[self._rank(rank)]

    def gap(self, int rank):
        return self._clock[self._rank(rank)] - self._min

    def is_live(self, int rank):
        return bool(self._live[self._rank(rank)])

    def is_held(self, int rank):
        return bool(self._held[self._rank(rank)])

    def credit(self, int rank):
        return self._credit[self._rank(rank)]

    def arrivals(self, int rank):
        rank = self._rank(rank)
        return self._newest[rank], self._previous[rank]

    def state(self):
        """Everything the window knows, for step-by-step comparison with its twin."""
        cdef int i
        return (
            tuple([self._clock[i] for i in range(self._n)]),
            tuple([bool(self._live[i]) for i in range(self._n)]),
            tuple([bool(self._held[i]) for i in range(self._n)]),
            tuple([self._credit[i] for i in range(self._n)]),
            self._min,
            self._last_r_star,
            self._controller_calls,
            self._released_max,
        )

    def admits(self, int rank, long clock=-1):
        """Whether a gradient ``rank`` computed in iteration ``clock`` may still be
        applied: ``c + upper >= released_max``, ``c`` the claim taken at most at the
        rank's own clock (see the twin in ``aps._reference``)."""
        rank = self._rank(rank)
        if self._lower < 0:
            return True
        cdef int64_t c = self._clock[rank]
        if 0 <= clock < c:
            c = clock
        return c + self._upper >= self._released_max

    # Transitions ----------------------------------------------------------
    def join(self, int rank, long clock=-1, bint held=False, long credit=0):
        """Make ``rank`` live; returns its clock. See the twin in ``aps._reference``."""
        rank = self._rank(rank)
        if self._live[rank]:
            raise ValueError(f"rank {rank} is already live")
        if clock >= 0 and held and self._lower < 0:
            raise ValueError("an unbounded window holds nobody")
        if credit < 0:
            raise ValueError("credit must be >= 0")
        self._clock[rank] = self._min if clock < 0 else clock
        self._live[rank] = 1
        self._num_live += 1
        self._held[rank] = held if clock >= 0 else 0
        self._credit[rank] = credit if clock >= 0 else 0
        self._newest[rank] = NAN
        self._previous[rank] = NAN
        self._recompute_min()
        if not self._held[rank]:  # it starts the iteration of its clock
            self._note_release(rank)
        return self._clock[rank]

    def restore(self, long min_clock, long last_r_star=-1, long controller_calls=0, long released_max=-1):
        """With nobody live, set the slowest clock, the highest clock released and the
        controller's counters (resuming from a checkpoint); see the twin in ``aps._reference``."""
        if self._num_live:
            raise ValueError("restore needs an empty live set")
        if min_clock < 0:
            raise ValueError("min_clock must be >= 0")
        if released_max < 0:
            released_max = min_clock + (self._upper if self._upper > 0 else 0)
        elif released_max < min_clock:
            raise ValueError(f"released_max ({released_max}) must be >= min_clock ({min_clock})")
        self._min = min_clock
        self._released_max = released_max
        self._last_r_star = last_r_star
        self._controller_calls = controller_calls

    def leave(self, int rank):
        """Remove ``rank`` from the live set; returns the workers this releases."""
        rank = self._rank(rank)
        if not self._live[rank]:
            raise ValueError(f"rank {rank} is not live")
        self._live[rank] = 0
        self._num_live -= 1
        self._held[rank] = 0
        self._credit[rank] = 0
        cdef int64_t old_min = self._min
        self._recompute_min()
        if self._min != old_min:
            return self._release_caught_up()
        return []

    def push(self, int rank, double now):
        """Count one push from ``rank`` at time ``now``; returns the released workers.

        ``rank`` itself comes first in the list when it is released at once.
        """
        rank = self._rank(rank)
        if not self._live[rank]:
            raise ValueError(f"rank {rank} is not live")
        if self._held[rank]:
            raise ValueError(f"rank {rank} is held at the gate and cannot push")
        cdef bint was_min = self._clock[rank] == self._min
        cdef int64_t old_min = self._min
        self._clock[rank] += 1
        self._previous[rank] = self._newest[rank]
        self._newest[rank] = now
        if was_min:
            self._recompute_min()
        released = []
        if self._decide(rank):
            self._note_release(rank)
            released.append(rank)
        if self._min != old_min:
            released.extend(self._release_caught_up())
        return released

    # Internals ------------------------------------------------------------
    cdef int _rank(self, int rank) except -1:
        if rank < 0 or rank >= self._n:
            raise IndexError(f"rank {rank} out of range 0..{self._n - 1}")
        return rank

    cdef int64_t _max_clock(self) noexcept:
        cdef int i
        cdef bint found = False
        cdef int64_t best = self._min
        for i in range(self._n):
            if self._live[i] and (not found or self._clock[i] > best):
                best = self._clock[i]
                found = True
        return best

    cdef inline void _note_release(self, int rank) noexcept:
        if self._clock[rank] > self._released_max:
            self._released_max = self._clock[rank]

    cdef void _recompute_min(self) noexcept:
        cdef int i
        cdef bint found = False
        cdef int64_t best = 0
        for i in range(self._n):
            if self._live[i] and (not found or self._clock[i] < best):
                best = self._clock[i]
                found = True
        if found:
            self._min = best

    cdef bint _decide(self, int rank) noexcept:
        cdef int64_t gap
        cdef long r_star, grant
        cdef int slow
        if self._lower < 0:
            return True
        gap = self._clock[rank] - self._min
        if self._credit[rank] > 0:
            self._credit[rank] -= 1
            return True
        if gap <= self._lower:
            return True
        if gap <= self._upper and self._clock[rank] == self._max_clock():
            slow = self._slowest()
            r_star = _controller(self._newest[rank], self._previous[rank],
                                 self._newest[slow], self._previous[slow],
                                 self._upper - self._lower)
            self._last_r_star = r_star
            self._controller_calls += 1
            # The release now spends one unit of r*; the grant is cut to the
            # room left below the upper bound so the gap never exceeds it.
            grant = r_star
            if grant > self._upper - gap + 1:
                grant = self._upper - gap + 1
            if grant > 0:
                self._credit[rank] = grant - 1
                return True
        self._held[rank] = 1
        return False

    cdef int _slowest(self) noexcept:
        cdef int i
        for i in range(self._n):
            if self._live[i] and self._clock[i] == self._min:
                return i
        return 0

    cdef list _release_caught_up(self):
        cdef int i
        cdef list released = []
        for i in range(self._n):
            if self._held[i] and self._clock[i] - self._min <= self._lower:
                self._held[i] = 0
                self._note_release(i)
                released.append(i)
        return released
