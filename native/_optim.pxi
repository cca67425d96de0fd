# Fused update kernels over flat float32 vectors.
#
# Every kernel is one pass that reads the old weights, the gradient and the
# optimizer state and writes the new weights, so the parameter table can write
# a new version out of place (into a free snapshot slot) at the cost of an
# in-place update. The loops run without the GIL: a large update may run on a
# helper thread while the server's event loop keeps reading sockets.
#
# Arithmetic follows torch.optim's single-tensor code path operation by
# operation, in float32, so a run here equals a torch.optim run on the same
# gradient sequence to float rounding (tests/unit/test_kernels_torch.py).

from libc.math cimport sqrt, pow, sqrtf
from libc.stdint cimport uint32_t

cdef extern from "_stream.h" nogil:
    void aps_sgd_stream(float* out, const float* w, const float* g, float a, float s, Py_ssize_t n)

# A float32 is NaN or infinite exactly when all bits of its exponent field
# are set.
cdef enum:
    _FINITE_BLOCK = 65536




cdef inline int _check_len(str what, Py_ssize_t got, Py_ssize_t want) except -1:
    if got != want:
        raise ValueError(f"{what} has {got} elements, expected {want}")
    return 0


cdef bint _all_finite(const float* x, Py_ssize_t n) noexcept nogil:
    cdef const uint32_t* bits = <const uint32_t*> x
    cdef Py_ssize_t start = 0, stop, i
    cdef uint32_t bad
    cdef uint32_t exponent = 0x7f800000u, exponent_one = 0x00800000u, sign = 0x80000000u
    # Adding 1 to the exponent field carries into the sign bit exactly when
    # the field is all ones (NaN or infinity). And/add/or only: the inner loop
    # vectorizes with baseline SSE2. Blocks let a bad gradient stop the scan.
    while start < n:
        stop = start + _FINITE_BLOCK
        if stop > n:
            stop = n
        bad = 0
        for i in range(start, stop):
            bad = bad | ((bits[i] & exponent) + exponent_one)
        if bad & sign:
            return False
        start = stop
    return True


def all_finite(const float[::1] x not None) -> bool:
    """True when no element of the float32 vector ``x`` is NaN or infinite."""
    cdef Py_ssize_t n = x.shape[0]
    cdef bint ok = True
    if n:
        with nogil:
            ok = _all_finite(&x[0], n)
    return ok


def accumulate(float[::1] acc not None, const float[::1] grad not None,
               float scale=1.0, bint first=False) -> None:
    """``acc = scale * grad`` when ``first``, else ``acc += scale * grad``."""
    cdef Py_ssize_t i, n = acc.shape[0]
    _check_len("grad", grad.shape[0], n)
    if n == 0:
        return
    cdef float* a = &acc[0]
    cdef const float* g = &grad[0]
    with nogil:
        if first:
            if scale == 1.0:
                for i in range(n):
                    a[i] = g[i]
            else:
                for i in range(n):
                    a[i] = g[i] * scale
        elif scale == 1.0:
            for i in range(n):
                a[i] = a[i] + g[i]
        else:
            for i in range(n):
                a[i] = a[i] + g[i] * scale


def sgd_step(float[::1] w_out not None, const float[::1] w_in not None,
             const float[::1] grad not None, float[::1] momentum_buffer,
             double lr, double momentum=0.0, double dampening=0.0,
             double weight_decay=0.0, bint nesterov=False, bint first=False,
             float scale=1.0) -> None:
    """One SGD step: ``w_out = w_in - lr * d`` as ``torch.optim.SGD`` computes ``d``.

    ``d`` starts as ``scale * grad`` plus ``weight_decay * w_in``; with
    momentum, the buffer becomes ``d`` on the ``first`` step and
    ``momentum * buf + (1 - dampening) * d`` after, and ``d`` becomes the
    buffer (or ``d + momentum * buf`` with Nesterov). ``w_out`` may be
    ``w_in`` (in place) or another vector of the same size (out of place).
    """
    cdef Py_ssize_t i, n = w_in.shape[0]
    _check_len("w_out", w_out.shape[0], n)
    _check_len("grad", grad.shape[0], n)
    if momentum != 0.0:
        if momentum_buffer is None:
            raise ValueError("momentum needs a momentum buffer")
        _check_len("momentum_buffer", momentum_buffer.shape[0], n)
    if n == 0:
        return
    cdef float* wo = &w_out[0]
    cdef const float* wi = &w_in[0]
    cdef const float* g = &grad[0]
    cdef float* buf = NULL
    if momentum != 0.0:
        buf = &momentum_buffer[0]
    cdef float neg_lr = <float> -lr
    cdef float wd = <float> weight_decay
    cdef float mu = <float> momentum
    cdef float keep = <float> (1.0 - dampening)
    cdef float d, b
    with nogil:
        if buf == NULL:
            if wd == 0.0:
                aps_sgd_stream(wo, wi, g, neg_lr, scale, n)
            else:
                for i in range(n):
                    d = g[i] * scale + wd * wi[i]
                    wo[i] = wi[i] + neg_lr * d
        elif first:
            for i in range(n):
                d = g[i] * scale
                if wd != 0.0:
                    d = d + wd * wi[i]
                buf[i] = d
                if nesterov:
                    d = d + mu * d
                wo[i] = wi[i] + neg_lr * d
        elif nesterov:
            for i in range(n):
                d = g[i] * scale
                if wd != 0.0:
                    d = d + wd * wi[i]
                b = buf[i] * mu + keep * d
                buf[i] = b
                wo[i] = wi[i] + neg_lr * (d + mu * b)
        else:
            for i in range(n):
                d = g[i] * scale
                if wd != 0.0:
                    d = d + wd * wi[i]
                b = buf[i] * mu + keep * d
                buf[i] = b
                wo[i] = wi[i] + neg_lr * b


def adam_step(float[::1] w_out not None, const float[::1] w_in not None,
              const float[::1] grad not None, float[::1] exp_avg not None,
              float[::1] exp_avg_sq not None, long step, double lr,
              double beta1=0.9, double beta2=0.999, double eps=1e-8,
              double weight_decay=0.0, bint decoupled=False,
              float scale=1.0) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step.

    ``step`` is the 1-based step count after this step, as ``torch.optim.Adam``
    counts it for bias correction. The moment vectors are updated in place;
    ``w_out`` may be ``w_in`` or another vector of the same size.
    """
    cdef Py_ssize_t i, n = w_in.shape[0]
    _check_len("w_out", w_out.shape[0], n)
    _check_len("grad", grad.shape[0], n)
    _check_len("exp_avg", exp_avg.shape[0], n)
    _check_len("exp_avg_sq", exp_avg_sq.shape[0], n)
    if step < 1:
        raise ValueError("step counts from 1")
    if n == 0:
        return
    cdef float* wo = &w_out[0]
    cdef const float* wi = &w_in[0]
    cdef const float* g = &grad[0]
    cdef float* m = &exp_avg[0]
    cdef float* v = &exp_avg_sq[0]
    # Scalars as torch computes them: in double on the host, then used as
    # float32 by the tensor ops.
    cdef double bias1 = 1.0 - pow(beta1, <double> step)
    cdef double bias2 = 1.0 - pow(beta2, <double> step)
    cdef float neg_step_size = <float> -(lr / bias1)
    cdef float bias2_sqrt = <float> sqrt(bias2)
    cdef float w1 = <float> (1.0 - beta1)
    cdef bint lerp_low = (1.0 - beta1) < 0.5
    cdef float w1c = <float> (1.0 - (1.0 - beta1))
    cdef float b2 = <float> beta2
    cdef float c2 = <float> (1.0 - beta2)
    cdef float epsf = <float> eps
    cdef float wd = <float> weight_decay
    cdef float shrink = <float> (1.0 - lr * weight_decay)
    cdef float gi, wv, mi, vi, denom
    with nogil:
        for i in range(n):
            gi = g[i] * scale
            wv = wi[i]
            if decoupled:
                if weight_decay != 0.0:
                    wv = wv * shrink
            elif weight_decay != 0.0:
                gi = gi + wd * wv
            # torch.lerp(m, g, w): m + w * (g - m) for |w| < 0.5, else
            # g - (g - m) * (1 - w).
            if lerp_low:
                mi = m[i] + w1 * (gi - m[i])
            else:
                mi = gi - (gi - m[i]) * w1c
            vi = v[i] * b2 + c2 * gi * gi
            m[i] = mi
            v[i] = vi
            denom = sqrtf(vi) / bias2_sqrt + epsf
            wo[i] = wv + neg_step_size * (mi / denom)
