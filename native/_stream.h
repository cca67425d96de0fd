/* Streaming (non-temporal) stores for kernels that write a fresh snapshot slot.
 *
 * An out-of-place update writes a vector nobody will read soon from cache;
 * ordinary stores first read every destination line into the cache
 * (read-for-ownership), which costs a third more memory traffic. On x86 with
 * SSE2, _mm_stream_ps writes around the cache. Elsewhere this is a plain loop.
 * The arithmetic is the same expression in the same order either way.
 */
#ifndef APS_STREAM_H
#define APS_STREAM_H

#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* out[i] = w[i] + a * (g[i] * s) */
static inline void aps_sgd_stream(float *out, const float *w, const float *g,
                                  float a, float s, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(__SSE2__)
    if (out != w) {
        while (i < n && ((uintptr_t)(out + i) & 15u)) {
            out[i] = w[i] + a * (g[i] * s);
            i++;
        }
        const __m128 va = _mm_set1_ps(a), vs = _mm_set1_ps(s);
        for (; i + 4 <= n; i += 4) {
            __m128 d = _mm_mul_ps(_mm_loadu_ps(g + i), vs);
            _mm_stream_ps(out + i, _mm_add_ps(_mm_loadu_ps(w + i), _mm_mul_ps(va, d)));
        }
        _mm_sfence();
    }
#endif
    for (; i < n; i++)
        out[i] = w[i] + a * (g[i] * s);
}

#endif
