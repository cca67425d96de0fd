# Python entry points of the embedding-table kernels (native/_rows.h): the id hash, rows
# made from their id, the index from id to row, and the row-wise optimizers. The
# optimizers work on compact rows (the distinct rows of one request, gathered by the
# caller) in place, and return False when a gradient value or a new weight is not finite:
# the caller then throws the compact rows away, and nothing the server keeps changed.

from libc.stdint cimport int32_t, int64_t, uint64_t

import numpy as _np

cdef extern from "_rows.h" nogil:
    uint64_t aps_mix64(uint64_t x)
    void aps_rows_init(float* out, const int64_t* ids, Py_ssize_t n, Py_ssize_t dim, uint64_t seed, int kind,
                       double scale)
    Py_ssize_t aps_index_lookup(int64_t* buckets, uint64_t mask, const int64_t* ids, Py_ssize_t n, int64_t* rows,
                                int add, int64_t* size)
    void aps_index_place(int64_t* buckets, uint64_t mask, const int64_t* ids, const int64_t* rows, Py_ssize_t n)
    void aps_rows_gather(float* out, const float* slab, const int64_t* rows, Py_ssize_t n, Py_ssize_t dim)
    void aps_rows_scatter(float* slab, const float* inp, const int64_t* rows, Py_ssize_t n, Py_ssize_t dim)
    void aps_rows_coalesce(float* out, const int64_t* where, const float* g, Py_ssize_t n, Py_ssize_t dim)
    int aps_rows_sgd(float* w, const int64_t* where, const float* g, Py_ssize_t n, Py_ssize_t dim, float a)
    int aps_rows_adagrad(float* w, float* s, const float* g, Py_ssize_t rows, Py_ssize_t dim, float a, float eps,
                         int rowwise)
    int aps_rows_adam(float* w, float* m, float* v, const float* g, Py_ssize_t n, float c1, float c2, float eps,
                      float neg_step)

#: The most ids an index holds (its buckets, twice as many, still fit a Py_ssize_t).
cdef Py_ssize_t _MAX_INDEX = 1 << 60

#: Row initializers (rows_init's ``kind``).
INIT_ZEROS, INIT_NORMAL, INIT_UNIFORM = 0, 1, 2


def ids_range(const int64_t[::1] ids not None) -> tuple[int, int]:
    """``(lowest, highest)`` of a non-empty vector of ids, in one pass."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef int64_t low, high, x
    if n == 0:
        raise ValueError("no ids")
    low = high = ids[0]
    with nogil:
        for i in range(1, n):
            x = ids[i]
            if x < low:
                low = x
            if x > high:
                high = x
    return low, high


def mix64(const int64_t[::1] ids not None, uint64_t[::1] out not None) -> None:
    """``out[i]`` = SplitMix64's finalizer of ``ids[i]`` (as a 64-bit word): the id hash of
    the tables, whose low bits place an id in the index and high bits choose its shard."""
    cdef Py_ssize_t i, n = ids.shape[0]
    _check_len("out", out.shape[0], n)
    with nogil:
        for i in range(n):
            out[i] = aps_mix64(<uint64_t> ids[i])


def rows_init(float[:, ::1] out not None, const int64_t[::1] ids not None, uint64_t seed, int kind,
              double scale) -> None:
    """Each row of ``out`` made from its id in ``ids`` alone (see native/_rows.h): zeros
    (``kind`` INIT_ZEROS), normal with standard deviation ``scale`` (INIT_NORMAL), or
    uniform in (-scale, scale) (INIT_UNIFORM), the same for a table's ``seed`` wherever
    and whenever it is made."""
    cdef Py_ssize_t n = ids.shape[0]
    _check_len("out", out.shape[0], n)
    if kind not in (INIT_ZEROS, INIT_NORMAL, INIT_UNIFORM):
        raise ValueError(f"unknown row initializer {kind}")
    if n and out.shape[1]:
        with nogil:
            aps_rows_init(&out[0, 0], &ids[0], n, out.shape[1], seed, kind, scale)


def rows_gather(float[:, ::1] out not None, const float[:, ::1] slab not None,
                const int64_t[::1] rows not None) -> None:
    """``out[e] = slab[rows[e]]`` (a batch's rows, gathered with their cache misses
    overlapped)."""
    cdef Py_ssize_t n = rows.shape[0], dim = slab.shape[1]
    _check_len("out", out.shape[0], n)
    _check_len("out's row", out.shape[1], dim)
    _check_where(rows, slab.shape[0])
    if n and dim:
        with nogil:
            aps_rows_gather(&out[0, 0], &slab[0, 0], &rows[0], n, dim)


def rows_distinct(const int64_t[::1] rows not None, int64_t[::1] where not None, int32_t[::1] mark not None):
    """The distinct values of ``rows`` (rows of a slab) in the order first met, and
    ``where[e]``, entry e's place among them: one pass, no sort, no hash. ``mark`` is
    scratch, one int32 a row of the slab, all 0 (so that ``np.zeros`` maps its pages only
    where a row is marked), and left so."""
    cdef Py_ssize_t n = rows.shape[0], e, count = 0
    cdef int64_t r
    cdef int32_t m
    _check_len("where", where.shape[0], n)
    _check_where(rows, mark.shape[0])
    if n >= 2**31:
        raise ValueError(f"{n} entries: at most 2**31 - 1 a call")
    out = _np.empty(n, _np.int64)
    cdef int64_t[::1] distinct = out
    with nogil:
        for e in range(n):
            r = rows[e]
            m = mark[r]
            if m == 0:
                distinct[count] = r
                count += 1
                m = <int32_t> count
                mark[r] = m
            where[e] = m - 1
        for e in range(count):
            mark[distinct[e]] = 0
    return out[:count]


def rows_scatter(float[:, ::1] slab not None, const float[:, ::1] inp not None,
                 const int64_t[::1] rows not None) -> None:
    """``slab[rows[e]] = inp[e]`` (a push's updated rows written back; ``rows`` distinct)."""
    cdef Py_ssize_t n = rows.shape[0], dim = slab.shape[1]
    _check_len("inp", inp.shape[0], n)
    _check_len("inp's row", inp.shape[1], dim)
    _check_where(rows, slab.shape[0])
    if n and dim:
        with nogil:
            aps_rows_scatter(&slab[0, 0], &inp[0, 0], &rows[0], n, dim)


def rows_coalesce(float[:, ::1] out not None, const int64_t[::1] where not None,
                  const float[:, ::1] grad not None) -> None:
    """``out[where[e]] += grad[e]`` for each entry in order: duplicates summed (``out``
    zeroed by the caller, one row per distinct id)."""
    cdef Py_ssize_t n = where.shape[0], dim = out.shape[1]
    _check_len("grad", grad.shape[0], n)
    _check_rows(grad.shape[1], dim, where, out.shape[0])
    if n and dim:
        with nogil:
            aps_rows_coalesce(&out[0, 0], &where[0], &grad[0, 0], n, dim)


def rows_sgd(float[:, ::1] w not None, const int64_t[::1] where not None, const float[:, ::1] grad not None,
             double lr) -> bool:
    """SGD on compact rows, entry by entry in order: ``w[where[e]] -= lr * grad[e]``, as
    ``torch.optim.SGD`` applies an uncoalesced sparse gradient (a fused multiply-add where
    torch's axpy uses one). False when a gradient value or a new weight is not finite."""
    cdef Py_ssize_t n = where.shape[0], dim = w.shape[1]
    cdef int ok = 1
    _check_len("grad", grad.shape[0], n)
    _check_rows(grad.shape[1], dim, where, w.shape[0])
    if n and dim:
        with nogil:
            ok = aps_rows_sgd(&w[0, 0], &where[0], &grad[0, 0], n, dim, <float> -lr)
    return bool(ok)


def rows_adagrad(float[:, ::1] w not None, float[::1] state not None, const float[:, ::1] grad not None,
                 double lr, double eps=1e-10, bint rowwise=False) -> bool:
    """Adagrad on compact, coalesced rows (``grad[r]`` is row r's summed gradient), as
    ``torch.optim.Adagrad`` with a sparse gradient: ``state`` (one value per element, or
    per row with ``rowwise``) += g*g (row-wise: the row's mean of g*g); ``w -= lr * g /
    (sqrt(state) + eps)``. False when a gradient value, a new weight or a new state value
    is not finite."""
    cdef Py_ssize_t rows = w.shape[0], dim = w.shape[1]
    cdef int ok = 1
    _check_len("grad", grad.shape[0], rows)
    _check_len("grad's row", grad.shape[1], dim)
    _check_len("state", state.shape[0], rows if rowwise else rows * dim)
    if rows and dim:
        with nogil:
            ok = aps_rows_adagrad(&w[0, 0], &state[0], &grad[0, 0], rows, dim, <float> -lr, <float> eps, rowwise)
    return bool(ok)


def rows_adam(float[:, ::1] w not None, float[:, ::1] m not None, float[:, ::1] v not None,
              const float[:, ::1] grad not None, long step, double lr, double beta1=0.9, double beta2=0.999,
              double eps=1e-8) -> bool:
    """Lazy Adam on compact, coalesced rows, as ``torch.optim.SparseAdam``: the moments
    of the rows touched move, the bias correction counts ``step`` (the table's steps,
    from 1). False when a gradient value, a new weight or a new second moment is not finite."""
    cdef Py_ssize_t rows = w.shape[0], dim = w.shape[1]
    cdef int ok = 1
    _check_len("grad", grad.shape[0], rows)
    _check_len("grad's row", grad.shape[1], dim)
    for name, other in (("m", m), ("v", v)):
        _check_len(name, other.shape[0], rows)
        _check_len(f"{name}'s row", other.shape[1], dim)
    if step < 1:
        raise ValueError("step counts from 1")
    # torch computes the step size in double on the host, then as float32 in the tensor op
    cdef double step_size = lr * sqrt(1.0 - pow(beta2, <double> step)) / (1.0 - pow(beta1, <double> step))
    if rows and dim:
        with nogil:
            ok = aps_rows_adam(&w[0, 0], &m[0, 0], &v[0, 0], &grad[0, 0], rows * dim, <float> (1.0 - beta1),
                               <float> (1.0 - beta2), <float> eps, <float> -step_size)
    return bool(ok)


cdef int _check_rows(Py_ssize_t got_dim, Py_ssize_t dim, const int64_t[::1] where, Py_ssize_t rows) except -1:
    _check_len("grad's row", got_dim, dim)
    return _check_where(where, rows)


cdef int _check_where(const int64_t[::1] where, Py_ssize_t rows) except -1:
    cdef Py_ssize_t e
    for e in range(where.shape[0]):
        if where[e] < 0 or where[e] >= rows:
            raise ValueError(f"where[{e}] = {where[e]} is not one of the {rows} rows")
    return 0


cdef class RowIndex:
    """The index of one table: id -> row, rows numbered 0, 1, 2... in the order their ids
    were first seen. Open addressing with linear probing (native/_rows.h) over one numpy
    array of 16-byte buckets (key, row), at most half full: 32 bytes a row at most, no
    object per id, one cache line a probe, and a lookup of a batch is one pass in C without
    the GIL."""

    cdef object _buckets
    cdef int64_t[:, ::1] buckets
    cdef int64_t size

    def __cinit__(self, Py_ssize_t capacity=16):
        cdef Py_ssize_t buckets = 16
        if not 0 <= capacity <= _MAX_INDEX:
            raise ValueError(f"an index holds 0 to 2**60 ids, not {capacity}")
        while buckets < 2 * capacity:
            buckets *= 2
        self._allocate(buckets)
        self.size = 0

    cdef _allocate(self, Py_ssize_t buckets):
        self._buckets = _np.empty((buckets, 2), _np.int64)
        self._buckets[:, 0] = -1
        self.buckets = self._buckets

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """The bytes the index holds (its buckets)."""
        return self._buckets.nbytes

    def lookup(self, const int64_t[::1] ids not None, int64_t[::1] rows not None, bint add=True) -> int:
        """``rows[e]`` = the row of ``ids[e]``; an id not there yet gets the next row when
        ``add``, else -1. Returns how many ids were added (with ``add``), or how many
        entries are -1 (without). Refuses a negative id, changing nothing."""
        cdef Py_ssize_t e, n = ids.shape[0], missing = 0
        cdef int64_t before = self.size
        _check_len("rows", rows.shape[0], n)
        for e in range(n):
            if ids[e] < 0:
                raise ValueError(f"ids[{e}] = {ids[e]} is negative")
        if add and self.size + n > self.buckets.shape[0] // 2:
            if self.size + n > _MAX_INDEX:
                raise ValueError("an index holds at most 2**60 ids")
            self._grow(self.size + n)
        if n:
            with nogil:
                missing = aps_index_lookup(&self.buckets[0, 0], self.buckets.shape[0] - 1, &ids[0], n, &rows[0],
                                           add, &self.size)
        return self.size - before if add else missing

    def ids(self):
        """The ids held, in row order (``ids()[row]`` is the row's id)."""
        out = _np.empty(self.size, _np.int64)
        keys, values = self._buckets[:, 0], self._buckets[:, 1]
        held = keys >= 0
        out[values[held]] = keys[held]
        return out

    cdef _grow(self, Py_ssize_t needed):
        """More buckets (the load at most one half again), every id keeping its row."""
        cdef Py_ssize_t buckets = self.buckets.shape[0]
        while needed > buckets // 2:
            buckets *= 2
        held = self._buckets[:, 0] >= 0
        keys = _np.ascontiguousarray(self._buckets[held, 0])
        values = _np.ascontiguousarray(self._buckets[held, 1])
        self._allocate(buckets)
        cdef int64_t[::1] k = keys
        cdef int64_t[::1] v = values
        if k.shape[0]:
            with nogil:
                aps_index_place(&self.buckets[0, 0], self.buckets.shape[0] - 1, &k[0], &v[0], k.shape[0])
