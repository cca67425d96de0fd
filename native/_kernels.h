/* Fused, transactional update kernels over flat float32 vectors.
 *
 * Every kernel is one pass. It reads each gradient element exactly once, and
 * tests the value it read (not a second load of it) for NaN and infinity, so
 * a gradient in memory another process may still be writing (shared memory)
 * cannot slip a bad value past the test. It writes the new weights and the
 * new optimizer state out of place: nothing the server keeps is modified, and
 * a refused gradient leaves only scratch to throw away. Each returns 1 when
 * every gradient element and every new weight is finite, else 0.
 *
 * Arithmetic follows torch.optim's single-tensor code path operation by
 * operation, in float32 (see aps/_reference.py for the same in numpy).
 */
#ifndef APS_KERNELS_H
#define APS_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* x - x is 0 exactly when x is finite (NaN and infinity give NaN). */
#define APS_BAD(x) (!((x) - (x) == 0.0f))

/* Outputs may be their inputs (same index read, then written) but never
 * overlap them otherwise, so no iteration depends on another: say so, or the
 * compiler gives up vectorizing loops over many pointers. */
#if defined(__clang__)
#define APS_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define APS_IVDEP _Pragma("GCC ivdep")
#else
#define APS_IVDEP
#endif

/* From this many elements (2 MiB of float32) on, an update out of place writes its outputs
 * around the cache (native/_half.h, "Large updates"); below it the arrays of one update (five
 * to seven of them) stay in the last-level cache, and streaming them out to memory costs more
 * than the read-for-ownership it saves: measured on a 32 MiB L3, SGD with momentum and Adam
 * on 1 MiB went from 0.66-1.06 to 1.23-1.30 times torch's fused step; from 4 MiB on, streaming
 * is as fast or faster (docs/science/performance.md). */
#define APS_STREAM_MIN (1 << 19)

/* The SGD kernels (native/_sgd.inc, and the embedding tables' in native/_rows.inc) come in two flavours that differ in one
 * thing: how x*y + z is rounded where torch.optim computes it with
 * ``add(..., alpha=)`` (weight decay, momentum, Nesterov, the weight update).
 * torch's vectorized CPU kernels use a fused multiply-add there (one
 * rounding) when the CPU has one, and a multiply then an add (two roundings)
 * when it has not (torch's AVX2 level needs AVX2 and FMA). aps does the same, choosing at run time, so that an aps
 * run equals a torch.optim run bit for bit on the same machine.
 * Everything else is compiled with -ffp-contract=off: no other expression is
 * fused behind our back. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define APS_FMA_DISPATCH 1
#include <immintrin.h>
#endif

#define APS_SUFFIX(name) name##_unfused
#define APS_TARGET
#if !defined(APS_FMA_DISPATCH) && defined(__FP_FAST_FMAF)
#define APS_MADD(x, y, z) __builtin_fmaf((x), (y), (z))
#else
#define APS_MADD(x, y, z) ((x) * (y) + (z))
#endif
#if defined(__SSE2__)
#define APS_MADD4(x, y, z) _mm_add_ps(_mm_mul_ps((x), (y)), (z))
#endif
#include "_sgd.inc"
#include "_rows.inc"
#undef APS_SUFFIX
#undef APS_TARGET
#undef APS_MADD
#undef APS_MADD4

#if defined(APS_FMA_DISPATCH)
#define APS_SUFFIX(name) name##_fused
#define APS_TARGET __attribute__((target("avx,fma")))
#define APS_MADD(x, y, z) __builtin_fmaf((x), (y), (z))
#define APS_MADD4(x, y, z) _mm_fmadd_ps((x), (y), (z))
#include "_sgd.inc"
#include "_rows.inc"
#undef APS_SUFFIX
#undef APS_TARGET
#undef APS_MADD
#undef APS_MADD4
#endif

/* 1 when the SGD kernels round x*y + z once (a fused multiply-add), else 0. */
static inline int aps_fused_multiply_add(void) {
#if defined(APS_FMA_DISPATCH)
    static int fused = -1; /* a benign race: every thread computes the same answer */
    if (fused < 0) {
        __builtin_cpu_init();
        fused = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return fused;
#elif defined(__FP_FAST_FMAF)
    return 1;
#else
    return 0;
#endif
}

static inline int aps_sgd_plain(float *out, const float *w, const float *g, float a, float s, ptrdiff_t n) {
#if defined(APS_FMA_DISPATCH)
    if (aps_fused_multiply_add())
        return aps_sgd_plain_fused(out, w, g, a, s, n);
#endif
    return aps_sgd_plain_unfused(out, w, g, a, s, n);
}

static inline int aps_sgd(float *w_out, const float *w_in, const float *g, float *buf_out, const float *buf_in,
                          ptrdiff_t n, float a, float s, float wd, float mu, float keep, int nesterov, int first) {
#if defined(APS_FMA_DISPATCH)
    if (aps_fused_multiply_add())
        return aps_sgd_fused(w_out, w_in, g, buf_out, buf_in, n, a, s, wd, mu, keep, nesterov, first);
#endif
    return aps_sgd_unfused(w_out, w_in, g, buf_out, buf_in, n, a, s, wd, mu, keep, nesterov, first);
}

static inline int aps_delayed_nesterov(float *w_out, const float *w_in, const float *g, float *m_out,
                                       const float *m_in, float *delta_out, const float *delta_in, ptrdiff_t n,
                                       float a, float s, float beta, float k, float cb, float period, int milestone) {
#if defined(APS_FMA_DISPATCH)
    if (aps_fused_multiply_add())
        return aps_delayed_nesterov_fused(w_out, w_in, g, m_out, m_in, delta_out, delta_in, n, a, s, beta, k, cb,
                                          period, milestone);
#endif
    return aps_delayed_nesterov_unfused(w_out, w_in, g, m_out, m_in, delta_out, delta_in, n, a, s, beta, k, cb,
                                        period, milestone);
}

/* Instruction sets the kernels of _wide.inc are compiled for, widest last. */
enum { APS_ISA_BASELINE = 0, APS_ISA_AVX2 = 1, APS_ISA_AVX512 = 2 };

#define APS_SUFFIX(name) name##_baseline
#define APS_TARGET
#include "_wide.inc"
#undef APS_SUFFIX
#undef APS_TARGET

#if defined(APS_FMA_DISPATCH)
#define APS_WIDE_DISPATCH 1
#define APS_SUFFIX(name) name##_avx2
#define APS_TARGET __attribute__((target("avx2")))
#include "_wide.inc"
#undef APS_SUFFIX
#undef APS_TARGET
#define APS_SUFFIX(name) name##_avx512
#define APS_TARGET __attribute__((target("avx512f,avx512vl,prefer-vector-width=512")))
#include "_wide.inc"
#undef APS_SUFFIX
#undef APS_TARGET
#endif

/* 1 when this processor runs the instruction set ``isa``. */
static inline int aps_isa_supported(int isa) {
    if (isa == APS_ISA_BASELINE)
        return 1;
#if defined(APS_WIDE_DISPATCH)
    __builtin_cpu_init();
    if (isa == APS_ISA_AVX2)
        return __builtin_cpu_supports("avx2");
    if (isa == APS_ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

/* The instruction set the kernels of _wide.inc run: the widest this processor
 * has, unless aps_set_kernel_isa chose one (APS_KERNEL_ISA). */
static int aps_isa_chosen = -1;

static inline int aps_kernel_isa(void) {
    int isa = aps_isa_chosen;
    if (isa < 0) { /* a benign race: every thread computes the same answer */
        isa = aps_isa_supported(APS_ISA_AVX512) ? APS_ISA_AVX512
              : aps_isa_supported(APS_ISA_AVX2) ? APS_ISA_AVX2
                                                 : APS_ISA_BASELINE;
        aps_isa_chosen = isa;
    }
    return isa;
}

/* Run the kernels of _wide.inc on ``isa`` from now on; 0 when this processor cannot (nothing changes). */
static inline int aps_set_kernel_isa(int isa) {
    if (isa < APS_ISA_BASELINE || isa > APS_ISA_AVX512 || !aps_isa_supported(isa))
        return 0;
    aps_isa_chosen = isa;
    return 1;
}

/* ``return kernel(args)`` in the variant of the instruction set chosen. */
#if defined(APS_WIDE_DISPATCH)
#define APS_ON_ISA(kernel, args) \
    switch (aps_kernel_isa()) { \
    case APS_ISA_AVX512: return kernel##_avx512 args; \
    case APS_ISA_AVX2: return kernel##_avx2 args; \
    default: return kernel##_baseline args; \
    }
#else
#define APS_ON_ISA(kernel, args) return kernel##_baseline args;
#endif

static inline int aps_adam(float *w_out, const float *w_in, const float *g, float *m_out, const float *m_in,
                           float *v_out, const float *v_in, ptrdiff_t n, float s, float neg_step_size,
                           float bias2_sqrt, float w1, int lerp_low, float w1c, float b2, float c2, float eps,
                           float wd, float shrink, int decoupled, int decay) {
    APS_ON_ISA(aps_adam, (w_out, w_in, g, m_out, m_in, v_out, v_in, n, s, neg_step_size, bias2_sqrt, w1, lerp_low,
                          w1c, b2, c2, eps, wd, shrink, decoupled, decay))
}

static inline int aps_accumulate(float *out, const float *in, const float *g, float s, int first, ptrdiff_t n) {
    APS_ON_ISA(aps_accumulate, (out, in, g, s, first, n))
}

static inline int aps_compensate(float *out, const float *g, const float *w, const float *w_then, float *s_out,
                                 const float *s_in, ptrdiff_t n, int kind, float lam, float decay, float keep,
                                 float eps, float corr) {
    APS_ON_ISA(aps_compensate, (out, g, w, w_then, s_out, s_in, n, kind, lam, decay, keep, eps, corr))
}

static inline void aps_step_scale(float *c_out, const float *c_in, const float *w_out, const float *w_in,
                                  ptrdiff_t n, float decay, float keep) {
#if defined(APS_WIDE_DISPATCH)
    int isa = aps_kernel_isa();
    if (isa == APS_ISA_AVX512)
        aps_step_scale_avx512(c_out, c_in, w_out, w_in, n, decay, keep);
    else if (isa == APS_ISA_AVX2)
        aps_step_scale_avx2(c_out, c_in, w_out, w_in, n, decay, keep);
    else
#endif
        aps_step_scale_baseline(c_out, c_in, w_out, w_in, n, decay, keep);
}

#endif
