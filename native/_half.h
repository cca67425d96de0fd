/* 16-bit gradients and weights on the wire: bfloat16 and IEEE half (fp16).
 *
 * A worker that compresses its pushes narrows its float32 gradient to 16
 * bits, rounding to nearest even; the server's update kernels take the 16-bit
 * words and widen them to float32 in the same call: block by block into a
 * small scratch that stays in the L1 cache, each block then updated by the
 * float32 kernel, so the gradient is read from memory once and the update
 * itself stays float32 (the same arithmetic as for a float32 gradient equal
 * to the widened one). Widening is exact (every bf16 and fp16 value is a
 * float32), and NaN and infinity stay NaN and infinity, so the kernels refuse
 * them as they refuse them in float32.
 *
 * fp16 conversions use the CPU's F16C instructions when it has them (chosen
 * at run time), else portable code that rounds the same way.
 */
#ifndef APS_HALF_H
#define APS_HALF_H

#include <string.h>

#include "_kernels.h"

/* Element types, as aps.protocol.DType numbers them. */
enum { APS_FLOAT32 = 1, APS_FLOAT16 = 3, APS_BFLOAT16 = 4, APS_INT8Q = 8, APS_INT4Q = 9 };

/* Block-quantized gradients (aps/wire/quantized.py): element e of the payload is
 * code[e] * scales[e / APS_QBLOCK], the codes signed bytes (APS_INT8Q) or signed nibbles, two
 * to a byte, the lower the even element (APS_INT4Q). A kernel's gradient argument of such a
 * type points at one of these: the payload's scales and codes, and the element its first
 * value is (a slice of a gradient starts further in). */
#define APS_QBLOCK 256
typedef struct {
    const float *scales;
    const uint8_t *codes;
    ptrdiff_t start;
} aps_quantized;

static inline void aps_dequantize(float *out, const aps_quantized *q, ptrdiff_t i, ptrdiff_t m, int dtype) {
    ptrdiff_t j, e = q->start + i;
    if (dtype == APS_INT8Q) {
        const int8_t *codes = (const int8_t *)q->codes;
        for (j = 0; j < m; j++, e++)
            out[j] = (float)codes[e] * q->scales[e / APS_QBLOCK];
        return;
    }
    for (j = 0; j < m; j++, e++) {
        unsigned byte = q->codes[e >> 1], nibble = (e & 1) ? byte >> 4 : byte & 15u;
        out[j] = (float)((int)(nibble ^ 8u) - 8) * q->scales[e / APS_QBLOCK];
    }
}

/* Elements widened at a time: 16 KiB of float32 scratch, on the stack. */
#define APS_WIDEN_BLOCK 4096

static inline float aps_bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t aps_float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float aps_bf16_to_float(uint16_t h) { return aps_bits_float((uint32_t)h << 16); }

/* Round to nearest even; NaN stays NaN (made quiet), the sign kept. */
static inline uint16_t aps_float_to_bf16(float f) {
    uint32_t u = aps_float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp16 -> float32: the exponent and mantissa moved into place, then scaled by
 * 2^(127-15) (exact, and right for subnormal halves too); infinity and NaN
 * (exponent all ones) get float32's all-ones exponent. */
static inline float aps_fp16_to_float_portable(uint16_t h) {
    uint32_t magnitude = h & 0x7fffu;
    float f = aps_bits_float(magnitude << 13) * 0x1p112f;
    uint32_t u = aps_float_bits(f);
    if (magnitude >= 0x7c00u)
        u |= 0x7f800000u;
    return aps_bits_float(u | ((uint32_t)(h & 0x8000u) << 16));
}

/* float32 -> fp16, rounding to nearest even: values from 65520 up overflow to
 * infinity; below fp16's smallest normal (2^-14) the float32 adder does the
 * rounding (adding 0.5 leaves the subnormal half's bits at the bottom). */
static inline uint16_t aps_float_to_fp16_portable(float f) {
    uint32_t u = aps_float_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u)
        return sign | 0x7e00u;
    if (u >= 0x477ff000u)
        return sign | 0x7c00u;
    if (u < 0x38800000u)
        return sign | (uint16_t)(aps_float_bits(aps_bits_float(u) + 0.5f) - 0x3f000000u);
    u += ((uint32_t)(15 - 127) << 23) + 0x0fffu + ((u >> 13) & 1u);
    return sign | (uint16_t)(u >> 13);
}

#if defined(APS_FMA_DISPATCH)
static __attribute__((target("avx,f16c"))) void aps_widen_fp16_f16c(float *out, const uint16_t *in, ptrdiff_t n) {
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    for (; i < n; i++)
        out[i] = aps_fp16_to_float_portable(in[i]);
}

static __attribute__((target("avx,f16c"))) void aps_narrow_fp16_f16c(uint16_t *out, const float *in, ptrdiff_t n) {
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        out[i] = aps_float_to_fp16_portable(in[i]);
}
#endif

/* 1: fp16 conversions use F16C (when the CPU has it); 0: the portable code
 * (tests compare the two). */
static int aps_f16c_allowed = 1;

static inline int aps_use_f16c(void) {
#if defined(APS_FMA_DISPATCH)
    static int has = -1; /* a benign race: every thread computes the same answer */
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    }
    return has && aps_f16c_allowed;
#else
    return 0;
#endif
}

/* out[i] = in[i] as float32 (dtype APS_BFLOAT16 or APS_FLOAT16). */
static inline void aps_widen(float *out, const uint16_t *in, ptrdiff_t n, int dtype) {
    ptrdiff_t i;
    if (dtype == APS_BFLOAT16) {
        APS_IVDEP
        for (i = 0; i < n; i++)
            out[i] = aps_bf16_to_float(in[i]);
        return;
    }
#if defined(APS_FMA_DISPATCH)
    if (aps_use_f16c()) {
        aps_widen_fp16_f16c(out, in, n);
        return;
    }
#endif
    for (i = 0; i < n; i++)
        out[i] = aps_fp16_to_float_portable(in[i]);
}

/* Elements i..i+m of a gradient that is not float32 (16-bit words, or a quantized payload's
 * descriptor), as float32 into out. */
static inline void aps_widen_at(float *out, const void *g, ptrdiff_t i, ptrdiff_t m, int dtype) {
    if (dtype == APS_INT8Q || dtype == APS_INT4Q)
        aps_dequantize(out, (const aps_quantized *)g, i, m, dtype);
    else
        aps_widen(out, (const uint16_t *)g + i, m, dtype);
}

/* out[i] = in[i] rounded to 16 bits; returns how many finite elements became
 * infinite (overflowed: fp16 tops out at 65504). */
static inline ptrdiff_t aps_narrow(uint16_t *out, const float *in, ptrdiff_t n, int dtype) {
    ptrdiff_t i, overflowed = 0;
    uint16_t exponent = dtype == APS_BFLOAT16 ? 0x7f80u : 0x7c00u;
    if (dtype == APS_BFLOAT16) {
        for (i = 0; i < n; i++)
            out[i] = aps_float_to_bf16(in[i]);
    }
#if defined(APS_FMA_DISPATCH)
    else if (aps_use_f16c()) {
        aps_narrow_fp16_f16c(out, in, n);
    }
#endif
    else {
        for (i = 0; i < n; i++)
            out[i] = aps_float_to_fp16_portable(in[i]);
    }
    for (i = 0; i < n; i++) {
        int inf = (out[i] & 0x7fffu) == exponent;
        overflowed += inf & !APS_BAD(in[i]);
    }
    return overflowed;
}

/* 1 when no 16-bit element is NaN or infinite (its exponent field all ones). */
static inline int aps_all_finite_16(const uint16_t *x, ptrdiff_t n, int dtype) {
    uint16_t exponent = dtype == APS_BFLOAT16 ? 0x7f80u : 0x7c00u, bad = 0;
    ptrdiff_t i;
    for (i = 0; i < n; i++)
        bad |= (uint16_t)((x[i] & exponent) == exponent);
    return !bad;
}

/* 1 when no element of a gradient that is not float32 is NaN or infinite once widened. */
static inline int aps_all_finite_any(const void *g, ptrdiff_t n, int dtype) {
    if (dtype != APS_INT8Q && dtype != APS_INT4Q)
        return aps_all_finite_16((const uint16_t *)g, n, dtype);
    float scratch[APS_WIDEN_BLOCK];
    ptrdiff_t i, j, m;
    for (i = 0; i < n; i += m) {
        int bad = 0;
        m = n - i < APS_WIDEN_BLOCK ? n - i : APS_WIDEN_BLOCK;
        aps_dequantize(scratch, (const aps_quantized *)g, i, m, dtype);
        for (j = 0; j < m; j++)
            bad |= APS_BAD(scratch[j]);
        if (bad)
            return 0;
    }
    return 1;
}

/* The update kernels of _kernels.h for a gradient of any element type: a
 * float32 gradient goes straight to the kernel, a 16-bit one block by block
 * through an L1-resident scratch. A refused block ends the call (the outputs
 * are scratch then anyway). */
#define APS_BLOCKS(CALL)                                                     \
    float scratch[APS_WIDEN_BLOCK] __attribute__((aligned(64)));             \
    ptrdiff_t i, m;                                                          \
    for (i = 0; i < n; i += m) {                                             \
        m = n - i < APS_WIDEN_BLOCK ? n - i : APS_WIDEN_BLOCK;               \
        aps_widen_at(scratch, g, i, m, dtype);                               \
        if (!(CALL))                                                         \
            return 0;                                                        \
    }                                                                        \
    return 1;

#define APS_AT(p) ((p) == NULL ? NULL : (p) + i)

/* Large updates are written around the cache. An update out of place writes
 * its results into buffers it does not read (a fresh snapshot slot, the
 * spare optimizer state): ordinary stores first read every line they write
 * (read-for-ownership), a third more memory traffic for SGD with momentum
 * and Adam, and the results are read next by a socket, another process or
 * the next update, not by this core. So from APS_STREAM_MIN elements on
 * (native/_kernels.h: below it, the arrays of an update stay in the caches
 * and ordinary stores are faster), a
 * kernel computes tiles of APS_STREAM_TILE elements into L1-resident scratch
 * (the same arithmetic, the same loop: bit for bit the direct call) and
 * copies each tile out with streaming stores, which skip that read. The
 * compiler does not emit streaming stores itself, and writing every kernel's
 * every variant with intrinsics would fork the arithmetic; a 512-byte tile
 * costs one pass over L1. Outputs that are their inputs (in place), or not
 * 16-byte aligned, are written directly. */
#define APS_STREAM_TILE 128

static inline int aps_streamable(const float *out, const float *in) {
#if defined(__SSE2__)
    return out == NULL || (out != in && ((uintptr_t)out & 15u) == 0);
#else
    (void)out, (void)in;
    return 0;
#endif
}

#if defined(APS_WIDE_DISPATCH)
/* The copy out, as wide as the kernels run (an out 32 or 64 bytes aligned, as the server's buffers are). */
static __attribute__((target("avx"))) void aps_stream_avx(float *out, const float *tile, ptrdiff_t m) {
    ptrdiff_t j = 0;
    for (; j + 8 <= m; j += 8)
        _mm256_stream_ps(out + j, _mm256_load_ps(tile + j));
    for (; j < m; j++)
        out[j] = tile[j];
}

static __attribute__((target("avx512f"))) void aps_stream_avx512(float *out, const float *tile, ptrdiff_t m) {
    ptrdiff_t j = 0;
    for (; j + 16 <= m; j += 16)
        _mm512_stream_ps(out + j, _mm512_load_ps(tile + j));
    for (; j < m; j++)
        out[j] = tile[j];
}
#endif

static inline void aps_stream(float *out, const float *tile, ptrdiff_t m) {
#if defined(APS_WIDE_DISPATCH)
    int isa = aps_kernel_isa();
    if (isa == APS_ISA_AVX512 && ((uintptr_t)out & 63u) == 0) {
        aps_stream_avx512(out, tile, m);
        return;
    }
    if (isa != APS_ISA_BASELINE && ((uintptr_t)out & 31u) == 0) {
        aps_stream_avx(out, tile, m);
        return;
    }
#endif
#if defined(__SSE2__)
    ptrdiff_t j = 0;
    for (; j + 4 <= m; j += 4)
        _mm_stream_ps(out + j, _mm_load_ps(tile + j));
    for (; j < m; j++)
        out[j] = tile[j];
#else
    memcpy(out, tile, (size_t)m * sizeof(float));
#endif
}

/* CALL runs on tile i..i+m with the gradient at gi (widened if 16-bit), its
 * outputs in t0, t1, t2; OUT copies them out. */
#define APS_TILES(CALL, OUT)                                                 \
    float tg[APS_STREAM_TILE] __attribute__((aligned(64)));                  \
    float t0[APS_STREAM_TILE] __attribute__((aligned(64)));                  \
    float t1[APS_STREAM_TILE] __attribute__((aligned(64)));                  \
    float t2[APS_STREAM_TILE] __attribute__((aligned(64)));                  \
    ptrdiff_t i, m;                                                          \
    int ok = 1;                                                              \
    (void)t1, (void)t2;                                                      \
    for (i = 0; i < n && ok; i += m) {                                       \
        const float *gi = tg;                                                \
        m = n - i < APS_STREAM_TILE ? n - i : APS_STREAM_TILE;               \
        if (dtype == APS_FLOAT32)                                            \
            gi = (const float *)g + i;                                       \
        else                                                                 \
            aps_widen_at(tg, g, i, m, dtype);                                \
        ok = (CALL);                                                         \
        if (ok) {                                                            \
            OUT;                                                             \
        }                                                                    \
    }                                                                        \
    _mm_sfence();                                                            \
    return ok;

static inline int aps_sgd_plain_any(float *out, const float *w, const void *g, int dtype, float a, float s,
                                    ptrdiff_t n) {
    /* (aps_sgd_plain streams by itself: one output, no state) */
    if (dtype == APS_FLOAT32)
        return aps_sgd_plain(out, w, (const float *)g, a, s, n);
    APS_BLOCKS(aps_sgd_plain(out + i, w + i, scratch, a, s, m))
}

static inline int aps_sgd_any(float *w_out, const float *w_in, const void *g, int dtype, float *buf_out,
                              const float *buf_in, ptrdiff_t n, float a, float s, float wd, float mu, float keep,
                              int nesterov, int first) {
#if defined(__SSE2__)
    if (n >= APS_STREAM_MIN && aps_streamable(w_out, w_in) && aps_streamable(buf_out, buf_in)) {
        APS_TILES(aps_sgd(t0, w_in + i, gi, buf_out == NULL ? NULL : t1, APS_AT(buf_in), m, a, s, wd, mu, keep,
                          nesterov, first),
                  aps_stream(w_out + i, t0, m);
                  if (buf_out != NULL) aps_stream(buf_out + i, t1, m))
    }
#endif
    if (dtype == APS_FLOAT32)
        return aps_sgd(w_out, w_in, (const float *)g, buf_out, buf_in, n, a, s, wd, mu, keep, nesterov, first);
    APS_BLOCKS(aps_sgd(w_out + i, w_in + i, scratch, APS_AT(buf_out), APS_AT(buf_in), m, a, s, wd, mu, keep,
                       nesterov, first))
}

static inline int aps_adam_any(float *w_out, const float *w_in, const void *g, int dtype, float *m_out,
                               const float *m_in, float *v_out, const float *v_in, ptrdiff_t n, float s,
                               float neg_step_size, float bias2_sqrt, float w1, int lerp_low, float w1c, float b2,
                               float c2, float eps, float wd, float shrink, int decoupled, int decay) {
#if defined(__SSE2__)
    if (n >= APS_STREAM_MIN && aps_streamable(w_out, w_in) && aps_streamable(m_out, m_in) &&
        aps_streamable(v_out, v_in)) {
        APS_TILES(aps_adam(t0, w_in + i, gi, t1, m_in + i, t2, v_in + i, m, s, neg_step_size, bias2_sqrt, w1,
                           lerp_low, w1c, b2, c2, eps, wd, shrink, decoupled, decay),
                  aps_stream(w_out + i, t0, m); aps_stream(m_out + i, t1, m); aps_stream(v_out + i, t2, m))
    }
#endif
    if (dtype == APS_FLOAT32)
        return aps_adam(w_out, w_in, (const float *)g, m_out, m_in, v_out, v_in, n, s, neg_step_size, bias2_sqrt,
                        w1, lerp_low, w1c, b2, c2, eps, wd, shrink, decoupled, decay);
    APS_BLOCKS(aps_adam(w_out + i, w_in + i, scratch, m_out + i, m_in + i, v_out + i, v_in + i, m, s,
                        neg_step_size, bias2_sqrt, w1, lerp_low, w1c, b2, c2, eps, wd, shrink, decoupled, decay))
}

static inline int aps_delayed_nesterov_any(float *w_out, const float *w_in, const void *g, int dtype, float *m_out,
                                           const float *m_in, float *delta_out, const float *delta_in, ptrdiff_t n,
                                           float a, float s, float beta, float k, float cb, float period,
                                           int milestone) {
    /* (m_out is NULL between milestones: the momentum is read, not written) */
#if defined(__SSE2__)
    if (n >= APS_STREAM_MIN && aps_streamable(w_out, w_in) && aps_streamable(m_out, m_in) &&
        aps_streamable(delta_out, delta_in)) {
        APS_TILES(aps_delayed_nesterov(t0, w_in + i, gi, m_out == NULL ? NULL : t1, m_in + i, t2, delta_in + i, m, a,
                                       s, beta, k, cb, period, milestone),
                  aps_stream(w_out + i, t0, m);
                  if (m_out != NULL) aps_stream(m_out + i, t1, m); aps_stream(delta_out + i, t2, m))
    }
#endif
    if (dtype == APS_FLOAT32)
        return aps_delayed_nesterov(w_out, w_in, (const float *)g, m_out, m_in, delta_out, delta_in, n, a, s, beta,
                                    k, cb, period, milestone);
    APS_BLOCKS(aps_delayed_nesterov(w_out + i, w_in + i, scratch, APS_AT(m_out), m_in + i, delta_out + i,
                                    delta_in + i, m, a, s, beta, k, cb, period, milestone))
}

static inline int aps_accumulate_any(float *out, const float *in, const void *g, int dtype, float s, int first,
                                     ptrdiff_t n) {
#if defined(__SSE2__)
    if (n >= APS_STREAM_MIN && aps_streamable(out, in)) {
        APS_TILES(aps_accumulate(t0, APS_AT(in), gi, s, first, m), aps_stream(out + i, t0, m))
    }
#endif
    if (dtype == APS_FLOAT32)
        return aps_accumulate(out, in, (const float *)g, s, first, n);
    APS_BLOCKS(aps_accumulate(out + i, APS_AT(in), scratch, s, first, m))
}

#undef APS_AT
#endif
