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

/* Adam / AdamW (decoupled weight decay), as torch.optim.Adam[W]. The scalars
 * are computed by the caller in double, as torch computes them on the host.
 * The loop body is specialized on its three switches (always inlined with
 * constant arguments below) so that each variant vectorizes. */
static inline __attribute__((always_inline)) int aps_adam_loop(
        float *w_out, const float *w_in, const float *g, float *m_out, const float *m_in, float *v_out,
        const float *v_in, ptrdiff_t n, float s, float neg_step_size, float bias2_sqrt, float w1, float w1c,
        float b2, float c2, float eps, float wd, float shrink, const int decoupled, const int decay,
        const int lerp_low) {
    int bad = 0;
    ptrdiff_t i;
    APS_IVDEP
    for (i = 0; i < n; i++) {
        float gi = g[i], gs = gi * s, wv = w_in[i], mi, vi;
        if (decoupled && decay)
            wv = wv * shrink;
        if (!decoupled && decay)
            gs = gs + wd * wv;
        /* torch.lerp(m, g, w): m + w * (g - m) for |w| < 0.5, else g - (g - m) * (1 - w) */
        if (lerp_low)
            mi = m_in[i] + w1 * (gs - m_in[i]);
        else
            mi = gs - (gs - m_in[i]) * w1c;
        vi = v_in[i] * b2 + c2 * gs * gs;
        float denom = sqrtf(vi) / bias2_sqrt + eps;
        float wo = wv + neg_step_size * (mi / denom);
        bad |= APS_BAD(gi) | APS_BAD(wo);
        m_out[i] = mi;
        v_out[i] = vi;
        w_out[i] = wo;
    }
    return !bad;
}

static inline int aps_adam(float *w_out, const float *w_in, const float *g, float *m_out, const float *m_in,
                           float *v_out, const float *v_in, ptrdiff_t n, float s, float neg_step_size,
                           float bias2_sqrt, float w1, int lerp_low, float w1c, float b2, float c2, float eps,
                           float wd, float shrink, int decoupled, int decay) {
#define APS_ADAM(D, W, L) \
    aps_adam_loop(w_out, w_in, g, m_out, m_in, v_out, v_in, n, s, neg_step_size, bias2_sqrt, w1, w1c, b2, c2, \
                  eps, wd, shrink, D, W, L)
    switch ((decoupled ? 4 : 0) | (decay ? 2 : 0) | (lerp_low ? 1 : 0)) {
    case 0: return APS_ADAM(0, 0, 0);
    case 1: return APS_ADAM(0, 0, 1);
    case 2: return APS_ADAM(0, 1, 0);
    case 3: return APS_ADAM(0, 1, 1);
    case 4: return APS_ADAM(1, 0, 0);
    case 5: return APS_ADAM(1, 0, 1);
    case 6: return APS_ADAM(1, 1, 0);
    default: return APS_ADAM(1, 1, 1);
    }
#undef APS_ADAM
}

/* out = s*g (first) or in + s*g: summing a round's gradients, out of place. */
static inline int aps_accumulate(float *out, const float *in, const float *g, float s, int first, ptrdiff_t n) {
    int bad = 0;
    ptrdiff_t i;
    if (first) {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], o = gi * s;
            bad |= APS_BAD(gi) | APS_BAD(o);
            out[i] = o;
        }
    } else {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], o = in[i] + gi * s;
            bad |= APS_BAD(gi) | APS_BAD(o);
            out[i] = o;
        }
    }
    return !bad;
}

/* Delay compensation of a stale gradient (docs/algorithms.md, "Delay
 * compensation"), out of place, one pass: g was computed on the weights
 * w_then and is applied to w. kind 1 (DC-ASGD): out = g + lam*((g*g)*(w -
 * w_then)). kind 2 (DC-ASGD's adaptive variant): the mean square
 * ms' = ms*decay + keep*(g*g) is written to s_out, and lam becomes
 * lam / sqrt(ms' + eps). kind 3 (gap-aware): the gap |w - w_then| over the
 * typical step c = s_in*corr (bias-corrected, see aps_step_scale) plus eps,
 * and out = g / max(1, gap). Returns 1 when every gradient element and every
 * output is finite. out may be g. */
static inline int aps_compensate(float *out, const float *g, const float *w, const float *w_then, float *s_out,
                                 const float *s_in, ptrdiff_t n, int kind, float lam, float decay, float keep,
                                 float eps, float corr) {
    int bad = 0;
    ptrdiff_t i;
    if (kind == 1) {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], d = w[i] - w_then[i], o = gi + lam * ((gi * gi) * d);
            bad |= APS_BAD(gi) | APS_BAD(o);
            out[i] = o;
        }
    } else if (kind == 2) {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], d = w[i] - w_then[i], ms = s_in[i] * decay + keep * (gi * gi);
            float o = gi + (lam / sqrtf(ms + eps)) * ((gi * gi) * d);
            bad |= APS_BAD(gi) | APS_BAD(o);
            s_out[i] = ms;
            out[i] = o;
        }
    } else {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], gap = fabsf(w[i] - w_then[i]) / (s_in[i] * corr + eps);
            float o = gi / (gap > 1.0f ? gap : 1.0f);
            bad |= APS_BAD(gi) | APS_BAD(o);
            out[i] = o;
        }
    }
    return !bad;
}

/* Gap-aware's running step scale, after an update from w_in to w_out:
 * c_out = c_in*decay + keep*|w_out - w_in| (an exponential mean of each
 * parameter's step; its bias is corrected where it is read). */
static inline void aps_step_scale(float *c_out, const float *c_in, const float *w_out, const float *w_in,
                                  ptrdiff_t n, float decay, float keep) {
    ptrdiff_t i;
    APS_IVDEP
    for (i = 0; i < n; i++)
        c_out[i] = c_in[i] * decay + keep * fabsf(w_out[i] - w_in[i]);
}

#endif
