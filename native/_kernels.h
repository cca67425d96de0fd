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

/* out[i] = w[i] + a * (g[i] * s): plain SGD, the hot path of asynchronous
 * training. With SSE2 and a separate output, streaming stores write the fresh
 * snapshot slot around the cache (it is read next by a socket or another
 * process, not by this core), saving the read-for-ownership traffic. */
static inline int aps_sgd_plain(float *out, const float *w, const float *g, float a, float s, ptrdiff_t n) {
    ptrdiff_t i = 0;
    int bad = 0;
#if defined(__SSE2__)
    if (out != w) {
        while (i < n && ((uintptr_t)(out + i) & 15u)) {
            float gi = g[i], wo = w[i] + a * (gi * s);
            bad |= APS_BAD(gi) | APS_BAD(wo);
            out[i] = wo;
            i++;
        }
        const __m128 va = _mm_set1_ps(a), vs = _mm_set1_ps(s), zero = _mm_setzero_ps();
        __m128 mask = _mm_setzero_ps();
        for (; i + 4 <= n; i += 4) {
            __m128 gi = _mm_loadu_ps(g + i);
            __m128 wo = _mm_add_ps(_mm_loadu_ps(w + i), _mm_mul_ps(va, _mm_mul_ps(gi, vs)));
            mask = _mm_or_ps(mask, _mm_cmpneq_ps(_mm_sub_ps(gi, gi), zero));
            mask = _mm_or_ps(mask, _mm_cmpneq_ps(_mm_sub_ps(wo, wo), zero));
            _mm_stream_ps(out + i, wo);
        }
        _mm_sfence();
        bad |= _mm_movemask_ps(mask) != 0;
    }
#endif
    APS_IVDEP
    for (; i < n; i++) {
        float gi = g[i], wo = w[i] + a * (gi * s);
        bad |= APS_BAD(gi) | APS_BAD(wo);
        out[i] = wo;
    }
    return !bad;
}

/* SGD with weight decay and/or momentum, as torch.optim.SGD: d = s*g + wd*w;
 * buf' = d on the first step, else mu*buf + keep*d; w' = w + a*(nesterov ?
 * d + mu*buf' : buf'). buf_in may be NULL (no momentum). */
static inline int aps_sgd(float *w_out, const float *w_in, const float *g, float *buf_out, const float *buf_in,
                          ptrdiff_t n, float a, float s, float wd, float mu, float keep, int nesterov, int first) {
    int bad = 0;
    ptrdiff_t i;
    if (buf_out == NULL) {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], d = gi * s + wd * w_in[i], wo = w_in[i] + a * d;
            bad |= APS_BAD(gi) | APS_BAD(wo);
            w_out[i] = wo;
        }
    } else if (first) {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], d = gi * s;
            if (wd != 0.0f)
                d = d + wd * w_in[i];
            float wo = w_in[i] + a * (nesterov ? d + mu * d : d);
            bad |= APS_BAD(gi) | APS_BAD(wo);
            buf_out[i] = d;
            w_out[i] = wo;
        }
    } else {
        APS_IVDEP
        for (i = 0; i < n; i++) {
            float gi = g[i], d = gi * s;
            if (wd != 0.0f)
                d = d + wd * w_in[i];
            float b = buf_in[i] * mu + keep * d;
            float wo = w_in[i] + a * (nesterov ? d + mu * b : b);
            bad |= APS_BAD(gi) | APS_BAD(wo);
            buf_out[i] = b;
            w_out[i] = wo;
        }
    }
    return !bad;
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

#endif
