# Python entry points of the fused update kernels (native/_kernels.h).
#
# Each kernel is one pass that reads the current weights, the gradient and the
# optimizer state and writes the next weights and the next state out of place
# (a free snapshot slot, a spare state buffer), reading every gradient element
# once and refusing the update (returning False) when a gradient element or a
# new weight is not finite. So an update is a transaction: the caller adopts
# the outputs, or throws them away and nothing changed. The loops run without
# the GIL: a large update may run on a helper thread while the server's event
# loop keeps reading sockets.
#
# Arithmetic follows torch.optim's single-tensor code path operation by
# operation, in float32, so a run here equals a torch.optim run on the same
# gradient sequence: SGD bit for bit (fused multiply-adds where torch uses
# them, chosen at run time), Adam to float rounding
# (tests/unit/test_kernels_torch.py).

from libc.math cimport sqrt, pow
from libc.stdint cimport uint8_t, uint16_t, uint32_t

cdef extern from "_kernels.h" nogil:
    int aps_sgd_plain(float* out, const float* w, const float* g, float a, float s, Py_ssize_t n)
    int aps_sgd(float* w_out, const float* w_in, const float* g, float* buf_out, const float* buf_in,
                Py_ssize_t n, float a, float s, float wd, float mu, float keep, int nesterov, int first)
    int aps_adam(float* w_out, const float* w_in, const float* g, float* m_out, const float* m_in,
                 float* v_out, const float* v_in, Py_ssize_t n, float s, float neg_step_size,
                 float bias2_sqrt, float w1, int lerp_low, float w1c, float b2, float c2, float eps,
                 float wd, float shrink, int decoupled, int decay)
    int aps_accumulate(float* out, const float* inp, const float* g, float s, int first, Py_ssize_t n)
    int aps_delayed_nesterov(float* w_out, const float* w_in, const float* g, float* m_out, const float* m_in,
                             float* delta_out, const float* delta_in, Py_ssize_t n, float a, float s, float beta,
                             float k, float cb, float period, int milestone)
    int aps_fused_multiply_add()
    int aps_kernel_isa()
    int aps_set_kernel_isa(int isa)
    int aps_isa_supported(int isa)
    int aps_compensate(float* out, const float* g, const float* w, const float* w_then, float* s_out,
                       const float* s_in, Py_ssize_t n, int kind, float lam, float decay, float keep, float eps,
                       float corr)
    void aps_step_scale(float* c_out, const float* c_in, const float* w_out, const float* w_in, Py_ssize_t n,
                        float decay, float keep)

cdef extern from "_half.h" nogil:
    enum:
        APS_FLOAT32
        APS_FLOAT16
        APS_BFLOAT16
        APS_INT8Q
        APS_INT4Q
        APS_QBLOCK
        APS_STREAM_MIN
    ctypedef struct aps_quantized:
        const float* scales
        const uint8_t* codes
        Py_ssize_t start
    int aps_all_finite_any(const void* g, Py_ssize_t n, int dtype)
    void aps_widen_at(float* out, const void* g, Py_ssize_t i, Py_ssize_t m, int dtype)
    int aps_f16c_allowed
    int aps_use_f16c()
    void aps_widen(float* out, const uint16_t* inp, Py_ssize_t n, int dtype)
    Py_ssize_t aps_narrow(uint16_t* out, const float* inp, Py_ssize_t n, int dtype)
    int aps_all_finite_16(const uint16_t* x, Py_ssize_t n, int dtype)
    int aps_sgd_plain_any(float* out, const float* w, const void* g, int dtype, float a, float s, Py_ssize_t n)
    int aps_sgd_any(float* w_out, const float* w_in, const void* g, int dtype, float* buf_out, const float* buf_in,
                    Py_ssize_t n, float a, float s, float wd, float mu, float keep, int nesterov, int first)
    int aps_adam_any(float* w_out, const float* w_in, const void* g, int dtype, float* m_out, const float* m_in,
                     float* v_out, const float* v_in, Py_ssize_t n, float s, float neg_step_size,
                     float bias2_sqrt, float w1, int lerp_low, float w1c, float b2, float c2, float eps,
                     float wd, float shrink, int decoupled, int decay)
    int aps_accumulate_any(float* out, const float* inp, const void* g, int dtype, float s, int first, Py_ssize_t n)
    int aps_delayed_nesterov_any(float* w_out, const float* w_in, const void* g, int dtype, float* m_out,
                                 const float* m_in, float* delta_out, const float* delta_in, Py_ssize_t n, float a,
                                 float s, float beta, float k, float cb, float period, int milestone)

#: Element types of a gradient, as aps.protocol.DType numbers them: float32, or
#: 16-bit words holding IEEE half (fp16) or bfloat16 values (compressed pushes).
FLOAT32 = APS_FLOAT32
FLOAT16 = APS_FLOAT16
BFLOAT16 = APS_BFLOAT16
#: Block-quantized gradients (aps.wire.quantized.Quantized): int8 and 4-bit codes, a float32
#: scale per QBLOCK elements, decoded as the kernels read them.
INT8Q = APS_INT8Q
INT4Q = APS_INT4Q
QBLOCK = APS_QBLOCK
#: From this many elements on, an update out of place writes its results with
#: streaming stores, around the cache (native/_half.h).
STREAM_MIN = APS_STREAM_MIN


#: The instruction sets the kernels whose results do not depend on the vector
#: width (Adam, AdamW, a round's sum, delay compensation) are compiled for,
#: narrowest first: each gives the same results bit for bit (native/_wide.inc).
KERNEL_ISAS = ("baseline", "avx2", "avx512")


def kernel_isa():
    """The instruction set those kernels run on: the widest this processor has, or
    the one :func:`set_kernel_isa` chose."""
    return KERNEL_ISAS[aps_kernel_isa()]


def kernel_isas():
    """The instruction sets of :data:`KERNEL_ISAS` this processor runs."""
    return tuple(name for index, name in enumerate(KERNEL_ISAS) if aps_isa_supported(index))


def set_kernel_isa(name):
    """Run those kernels on ``name`` (one of :data:`KERNEL_ISAS`) from now on, in
    this process. Raises ValueError for a name this processor cannot run."""
    if name not in KERNEL_ISAS:
        raise ValueError(f"unknown instruction set {name!r}: one of {', '.join(KERNEL_ISAS)}")
    if not aps_set_kernel_isa(KERNEL_ISAS.index(name)):
        raise ValueError(f"this processor cannot run {name}: it runs {', '.join(kernel_isas())}")


def fused_multiply_add():
    """True when the SGD kernels round ``x*y + z`` once, as torch's vectorized
    CPU kernels do on this machine (a CPU with FMA), False when they round it
    twice (as torch does without FMA)."""
    return bool(aps_fused_multiply_add())


cdef enum:
    _FINITE_BLOCK = 65536


cdef class _Gradient:
    """A kernel's gradient argument: float32 values, 16-bit words of ``dtype``, or elements
    ``[start, stop)`` of a quantized payload (an ``aps.wire.quantized.Quantized``)."""
    cdef const float[::1] f32
    cdef const uint16_t[::1] u16
    cdef const float[::1] qscales
    cdef const uint8_t[::1] qcodes
    cdef aps_quantized q
    cdef const void* data
    cdef Py_ssize_t n
    cdef int dtype

    def __cinit__(self, grad, int dtype):
        if grad is None:
            raise TypeError("the gradient must not be None")
        self.dtype = dtype
        if dtype == APS_FLOAT32:
            self.f32 = grad
            self.n = self.f32.shape[0]
            self.data = &self.f32[0] if self.n else NULL
        elif dtype == APS_BFLOAT16 or dtype == APS_FLOAT16:
            self.u16 = grad
            self.n = self.u16.shape[0]
            self.data = &self.u16[0] if self.n else NULL
        elif dtype == APS_INT8Q or dtype == APS_INT4Q:
            if getattr(grad, "dtype", None) != dtype:
                raise TypeError(f"a gradient of dtype {dtype} is a Quantized of that dtype")
            self.qscales, self.qcodes = grad.scales, grad.codes
            start, stop = grad.start, grad.stop
            codes_needed = stop if dtype == APS_INT8Q else (stop + 1) // 2
            if not (0 <= start <= stop and self.qcodes.shape[0] >= codes_needed
                    and self.qscales.shape[0] * APS_QBLOCK >= stop):
                raise ValueError("the quantized gradient's range is outside its payload")
            self.n = stop - start
            self.q.scales = &self.qscales[0] if self.qscales.shape[0] else NULL
            self.q.codes = &self.qcodes[0] if self.qcodes.shape[0] else NULL
            self.q.start = start
            self.data = &self.q
        else:
            raise ValueError(f"unknown gradient dtype {dtype}: FLOAT32, FLOAT16, BFLOAT16, INT8Q or INT4Q")


def use_f16c(bint allowed=True) -> bool:
    """Let fp16 conversions use the CPU's F16C instructions (the default), or make them
    use the portable code (for tests); returns whether F16C is now in use."""
    global aps_f16c_allowed
    aps_f16c_allowed = allowed
    return bool(aps_use_f16c())


def narrow(uint16_t[::1] out not None, const float[::1] x not None, int dtype) -> int:
    """``out = x`` rounded to 16 bits (``dtype`` FLOAT16 or BFLOAT16), to nearest even.

    Returns how many finite elements overflowed to infinity (fp16's largest
    value is 65504). NaN stays NaN.
    """
    cdef Py_ssize_t n = x.shape[0], overflowed = 0
    _check_len("out", out.shape[0], n)
    if dtype != APS_FLOAT16 and dtype != APS_BFLOAT16:
        raise ValueError(f"narrow to FLOAT16 or BFLOAT16, not dtype {dtype}")
    if n:
        with nogil:
            overflowed = aps_narrow(&out[0], &x[0], n, dtype)
    return overflowed


def widen(float[::1] out not None, x not None, int dtype) -> None:
    """``out = x`` as float32, ``x`` holding FLOAT16 or BFLOAT16 values (exact), or a quantized
    gradient of INT8Q or INT4Q (``code * scale``)."""
    if dtype == APS_FLOAT32:
        raise ValueError("widen from FLOAT16, BFLOAT16, INT8Q or INT4Q, not FLOAT32")
    cdef _Gradient g = _Gradient(x, dtype)
    _check_len("out", out.shape[0], g.n)
    if g.n:
        with nogil:
            aps_widen_at(&out[0], g.data, 0, g.n, g.dtype)


cdef inline int _check_len(str what, Py_ssize_t got, Py_ssize_t want) except -1:
    if got != want:
        raise ValueError(f"{what} has {got} elements, expected {want}")
    return 0


cdef bint _all_finite(const float* x, Py_ssize_t n) noexcept nogil:
    cdef const uint32_t* bits = <const uint32_t*> x
    cdef Py_ssize_t start = 0, stop, i
    cdef uint32_t bad
    cdef uint32_t exponent = 0x7f800000u, exponent_one = 0x00800000u, sign = 0x80000000u
    # A float32 is NaN or infinite exactly when its exponent field is all
    # ones. Adding 1 to the exponent field carries into the sign bit exactly when
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


def all_finite(x not None, int dtype=APS_FLOAT32) -> bool:
    """True when no element of the vector ``x`` (float32, 16-bit words or a quantized
    gradient of ``dtype``) is NaN or infinite."""
    cdef _Gradient g = _Gradient(x, dtype)
    cdef bint ok = True
    if g.n:
        with nogil:
            if g.dtype == APS_FLOAT32:
                ok = _all_finite(<const float*> g.data, g.n)
            else:
                ok = aps_all_finite_any(g.data, g.n, g.dtype)
    return ok


def accumulate(float[::1] out not None, const float[::1] inp, grad not None,
               float scale=1.0, bint first=False, int grad_dtype=APS_FLOAT32) -> bool:
    """``out = scale * grad`` when ``first``, else ``out = inp + scale * grad``.

    Returns False (``out`` is then scratch) when ``grad`` or the sum is not finite.
    ``out`` may be ``inp``. ``grad`` is float32, or 16-bit words of ``grad_dtype``.
    """
    cdef Py_ssize_t n = out.shape[0]
    cdef _Gradient g = _Gradient(grad, grad_dtype)
    _check_len("grad", g.n, n)
    if not first:
        if inp is None:
            raise ValueError("accumulate needs the running sum unless first")
        _check_len("inp", inp.shape[0], n)
    if n == 0:
        return True
    cdef const float* src = NULL if first else &inp[0]
    cdef int ok
    with nogil:
        ok = aps_accumulate_any(&out[0], src, g.data, g.dtype, scale, first, n)
    return bool(ok)


def sgd_step(float[::1] w_out not None, const float[::1] w_in not None,
             grad not None, float[::1] buf_out, const float[::1] buf_in,
             double lr, double momentum=0.0, double dampening=0.0,
             double weight_decay=0.0, bint nesterov=False, bint first=False,
             float scale=1.0, int grad_dtype=APS_FLOAT32) -> bool:
    """One SGD step, as ``torch.optim.SGD`` computes it, out of place.

    ``d`` is ``scale * grad`` plus ``weight_decay * w_in``; with momentum, the
    next buffer ``buf_out`` is ``d`` on the ``first`` step and
    ``momentum * buf_in + (1 - dampening) * d`` after, and ``d`` becomes the
    buffer (or ``d + momentum * buf`` with Nesterov); ``w_out = w_in - lr * d``.
    Returns False (the outputs are then scratch) when ``grad`` or a new weight
    is not finite. Outputs may alias their inputs. ``grad`` is float32, or 16-bit
    words of ``grad_dtype`` (widened to float32 as the kernel reads them).
    """
    cdef Py_ssize_t n = w_in.shape[0]
    cdef _Gradient g = _Gradient(grad, grad_dtype)
    _check_len("w_out", w_out.shape[0], n)
    _check_len("grad", g.n, n)
    if momentum != 0.0:
        if buf_out is None or (buf_in is None and not first):
            raise ValueError("momentum needs momentum buffers")
        _check_len("buf_out", buf_out.shape[0], n)
        if not first:
            _check_len("buf_in", buf_in.shape[0], n)
    if n == 0:
        return True
    cdef float* bo = NULL
    cdef const float* bi = NULL
    if momentum != 0.0:
        bo = &buf_out[0]
        if not first:
            bi = &buf_in[0]
    cdef float a = <float> -lr
    cdef float wd = <float> weight_decay
    cdef float mu = <float> momentum
    cdef float keep = <float> (1.0 - dampening)
    cdef int ok
    with nogil:
        if bo == NULL and wd == 0.0:
            ok = aps_sgd_plain_any(&w_out[0], &w_in[0], g.data, g.dtype, a, scale, n)
        else:
            ok = aps_sgd_any(&w_out[0], &w_in[0], g.data, g.dtype, bo, bi, n, a, scale, wd, mu, keep, nesterov,
                             first)
    return bool(ok)


def adam_step(float[::1] w_out not None, const float[::1] w_in not None,
              grad not None, float[::1] m_out not None, const float[::1] m_in not None,
              float[::1] v_out not None, const float[::1] v_in not None, long step, double lr,
              double beta1=0.9, double beta2=0.999, double eps=1e-8,
              double weight_decay=0.0, bint decoupled=False,
              float scale=1.0, int grad_dtype=APS_FLOAT32) -> bool:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step, out of place.

    ``step`` is the 1-based step count after this step, as ``torch.optim.Adam``
    counts it for bias correction. Reads the moments ``m_in``/``v_in`` and writes
    the next ones to ``m_out``/``v_out``. Returns False (the outputs are then
    scratch) when ``grad`` or a new weight is not finite. Outputs may alias
    their inputs. ``grad`` is float32, or 16-bit words of ``grad_dtype``.
    """
    cdef Py_ssize_t n = w_in.shape[0]
    cdef _Gradient g = _Gradient(grad, grad_dtype)
    _check_len("w_out", w_out.shape[0], n)
    _check_len("grad", g.n, n)
    _check_len("m_out", m_out.shape[0], n)
    _check_len("m_in", m_in.shape[0], n)
    _check_len("v_out", v_out.shape[0], n)
    _check_len("v_in", v_in.shape[0], n)
    if step < 1:
        raise ValueError("step counts from 1")
    if n == 0:
        return True
    # Scalars as torch computes them: in double on the host, then used as
    # float32 by the tensor ops.
    cdef double bias1 = 1.0 - pow(beta1, <double> step)
    cdef double bias2 = 1.0 - pow(beta2, <double> step)
    cdef float neg_step_size = <float> -(lr / bias1)
    cdef float bias2_sqrt = <float> sqrt(bias2)
    cdef float w1 = <float> (1.0 - beta1)
    cdef int lerp_low = (1.0 - beta1) < 0.5
    cdef float w1c = <float> (1.0 - (1.0 - beta1))
    cdef int ok
    with nogil:
        ok = aps_adam_any(&w_out[0], &w_in[0], g.data, g.dtype, &m_out[0], &m_in[0], &v_out[0], &v_in[0], n, scale,
                      neg_step_size, bias2_sqrt, w1, lerp_low, w1c, <float> beta2, <float> (1.0 - beta2),
                      <float> eps, <float> weight_decay, <float> (1.0 - lr * weight_decay), decoupled,
                      weight_decay != 0.0)
    return bool(ok)


def delayed_nesterov_step(float[::1] w_out not None, const float[::1] w_in not None, grad not None,
                          float[::1] m_out, const float[::1] m_in not None, float[::1] delta_out not None,
                          const float[::1] delta_in not None, long step, double lr, double momentum,
                          long period, double c=0.0, float scale=1.0, int grad_dtype=APS_FLOAT32) -> bool:
    """One push of delayed Nesterov (Liu et al., 2024, Algorithm 3), out of place.

    ``step`` is the 1-based count of pushes after this one, ``period`` is N, ``c``
    the share of the momentum applied between milestones. With ``d = scale * grad``:
    when ``step`` is a multiple of ``period`` (a milestone), ``m_out = momentum * m_in
    + (delta_in + d) / period``, ``delta_out = 0`` and ``w_out = w_in - lr * ((1 -
    c*period + c) * momentum * m_out + d / period)``; otherwise ``delta_out =
    delta_in + d`` and ``w_out = w_in - lr * (c * momentum * m_in + d / period)``, and
    ``m_out`` (which may be None) is not written. Returns False (the outputs are then
    scratch) when ``grad``, a new state value or a new weight is not finite. Outputs
    may alias their inputs. ``grad`` is float32, or 16-bit words of ``grad_dtype``.
    """
    cdef Py_ssize_t n = w_in.shape[0]
    cdef _Gradient g = _Gradient(grad, grad_dtype)
    if step < 1:
        raise ValueError("step counts from 1")
    if period < 1 or period > (1 << 24):
        raise ValueError(f"period must be in 1..{1 << 24}, got {period}")
    cdef int milestone = step % period == 0
    _check_len("w_out", w_out.shape[0], n)
    _check_len("grad", g.n, n)
    _check_len("m_in", m_in.shape[0], n)
    _check_len("delta_out", delta_out.shape[0], n)
    _check_len("delta_in", delta_in.shape[0], n)
    if milestone:
        if m_out is None:
            raise ValueError("a milestone writes the momentum: m_out is needed")
        _check_len("m_out", m_out.shape[0], n)
    if n == 0:
        return True
    cdef float* mo = &m_out[0] if milestone else NULL
    # Scalars in double on the host, then float32, as torch.optim computes its
    # own; (1 + c*(1 - N)) is 1 exactly for N = 1 (torch's Nesterov step).
    cdef float k = <float> ((1.0 + c * (1.0 - <double> period)) * momentum)
    cdef float cb = <float> (c * momentum)
    cdef int ok
    with nogil:
        ok = aps_delayed_nesterov_any(&w_out[0], &w_in[0], g.data, g.dtype, mo, &m_in[0], &delta_out[0],
                                      &delta_in[0], n, <float> -lr, scale, <float> momentum, k, cb,
                                      <float> period, milestone)
    return bool(ok)


#: Kinds of delay compensation (aps_compensate): DC-ASGD, its adaptive variant, gap-aware.
COMPENSATE_DC = 1
COMPENSATE_DC_ADAPTIVE = 2
COMPENSATE_GAP = 3


def compensate(float[::1] out not None, const float[::1] grad not None, const float[::1] w not None,
               const float[::1] w_then not None, float[::1] state_out, const float[::1] state_in, int kind,
               double lam=0.0, double decay=0.0, double eps=0.0, double corr=1.0) -> bool:
    """``out`` = the float32 gradient ``grad``, computed on the weights ``w_then``, compensated
    for being applied to ``w`` (docs/algorithms.md, "Delay compensation"), in one pass.

    ``kind`` COMPENSATE_DC: ``grad + lam * grad * grad * (w - w_then)``. COMPENSATE_DC_ADAPTIVE:
    the mean square ``state_out = decay * state_in + (1 - decay) * grad * grad`` is written, and
    ``lam`` is divided by ``sqrt(state_out + eps)``. COMPENSATE_GAP: ``grad / max(1, gap)``, the
    gap ``|w - w_then| / (corr * state_in + eps)`` (``state_in``: the running step scale, see
    :func:`step_scale`; ``corr`` its bias correction). Returns False (``out`` is then scratch)
    when ``grad`` or ``out`` is not finite. ``out`` may be ``grad``.
    """
    cdef Py_ssize_t n = grad.shape[0]
    _check_len("out", out.shape[0], n)
    _check_len("w", w.shape[0], n)
    _check_len("w_then", w_then.shape[0], n)
    if kind != COMPENSATE_DC and kind != COMPENSATE_DC_ADAPTIVE and kind != COMPENSATE_GAP:
        raise ValueError(f"unknown compensation kind {kind}")
    if kind != COMPENSATE_DC:
        if state_in is None:
            raise ValueError("this compensation needs its state")
        _check_len("state_in", state_in.shape[0], n)
    if kind == COMPENSATE_DC_ADAPTIVE:
        if state_out is None:
            raise ValueError("the adaptive compensation writes its state")
        _check_len("state_out", state_out.shape[0], n)
    if n == 0:
        return True
    cdef float* so = &state_out[0] if kind == COMPENSATE_DC_ADAPTIVE else NULL
    cdef const float* si = &state_in[0] if kind != COMPENSATE_DC else NULL
    cdef int ok
    with nogil:
        ok = aps_compensate(&out[0], &grad[0], &w[0], &w_then[0], so, si, n, kind, <float> lam, <float> decay,
                            <float> (1.0 - decay), <float> eps, <float> corr)
    return bool(ok)


def step_scale(float[::1] c_out not None, const float[::1] c_in not None, const float[::1] w_out not None,
               const float[::1] w_in not None, double decay) -> None:
    """Gap-aware's running step scale after an update from ``w_in`` to ``w_out``:
    ``c_out = decay * c_in + (1 - decay) * |w_out - w_in|``. ``c_out`` may be ``c_in``."""
    cdef Py_ssize_t n = c_in.shape[0]
    _check_len("c_out", c_out.shape[0], n)
    _check_len("w_out", w_out.shape[0], n)
    _check_len("w_in", w_in.shape[0], n)
    if n:
        with nogil:
            aps_step_scale(&c_out[0], &c_in[0], &w_out[0], &w_in[0], n, <float> decay, <float> (1.0 - decay))
