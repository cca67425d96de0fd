/* Embedding tables: the id hash, rows made from their id, the index from id to row, and
 * the row-wise optimizers (aps/server/rows.py uses them; aps/_reference.py is their twin).
 *
 * The id hash is SplitMix64's finalizer (Steele, Lea and Flood, "Fast splittable
 * pseudorandom number generators", 2014): a bijection of 64-bit words that mixes every
 * input bit into every output bit, so ids that differ in one bit, or that arrive as a
 * run (1, 2, 3, ...) or a power-law stream, spread evenly. The index takes the low bits
 * of mix64(id), the shards the high ones (aps/tables.py), so the ids one shard holds
 * still spread over its whole index. */
#ifndef APS_ROWS_H
#define APS_ROWS_H

#include <string.h>

#include "_kernels.h"

static inline uint64_t aps_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* A row made from its id alone, the same on every shard and after every resume: element j
 * of id i in a table of seed S takes base = mix64(i XOR S). kind 0: zeros. kind 1, normal
 * with standard deviation `scale`: u1 = (mix64(base + 2j) >> 11 + 0.5) / 2^53, u2 =
 * (mix64(base + 2j + 1) >> 11) / 2^53, value = scale * sqrt(-2 ln u1) cos(2 pi u2) (one
 * Box-Muller draw, in double). kind 2, uniform in (-scale, scale): u = (mix64(base + j) >>
 * 40 + 0.5) / 2^24, value = scale * (2u - 1). */
static void aps_rows_init(float *out, const int64_t *ids, ptrdiff_t n, ptrdiff_t dim, uint64_t seed, int kind,
                          double scale) {
    const double two53 = 9007199254740992.0, two24 = 16777216.0, two_pi = 6.283185307179586;
    for (ptrdiff_t r = 0; r < n; r++) {
        uint64_t base = aps_mix64((uint64_t) ids[r] ^ seed);
        float *row = out + r * dim;
        for (ptrdiff_t j = 0; j < dim; j++) {
            if (kind == 1) {
                double u1 = ((double) (aps_mix64(base + 2 * (uint64_t) j) >> 11) + 0.5) / two53;
                double u2 = (double) (aps_mix64(base + 2 * (uint64_t) j + 1) >> 11) / two53;
                row[j] = (float) (scale * sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
            } else if (kind == 2) {
                double u = ((double) (aps_mix64(base + (uint64_t) j) >> 40) + 0.5) / two24;
                row[j] = (float) (scale * (2.0 * u - 1.0));
            } else {
                row[j] = 0.0f;
            }
        }
    }
}

/* The index: open addressing with linear probing over `mask + 1` (a power of two) buckets
 * of 16 bytes, the key (-1: empty; ids are never negative) then its value (the id's row),
 * so that a probe reads one cache line. Looks each id up and, with `add`, gives an id it
 * lacks the next row (*size, then incremented); without, -1. Returns how many entries did
 * not find their id. The caller keeps the load at most one half, so a probe is short and
 * always ends. */
static ptrdiff_t aps_index_lookup(int64_t *buckets, uint64_t mask, const int64_t *ids, ptrdiff_t n, int64_t *rows,
                                  int add, int64_t *size) {
    ptrdiff_t missing = 0;
    /* A large index is out of the cache and its buckets are random: ask for the bucket of
     * the id APS_AHEAD places on while this one is probed, so the misses overlap. */
    enum { APS_AHEAD = 16 };
    for (ptrdiff_t e = 0; e < n; e++) {
        if (e + APS_AHEAD < n)
            __builtin_prefetch(buckets + 2 * (aps_mix64((uint64_t) ids[e + APS_AHEAD]) & mask));
        int64_t id = ids[e];
        uint64_t b = aps_mix64((uint64_t) id) & mask;
        for (;;) {
            int64_t k = buckets[2 * b];
            if (k == id) {
                rows[e] = buckets[2 * b + 1];
                break;
            }
            if (k == -1) {
                missing++;
                if (add) {
                    buckets[2 * b] = id;
                    buckets[2 * b + 1] = *size;
                    rows[e] = (*size)++;
                } else {
                    rows[e] = -1;
                }
                break;
            }
            b = (b + 1) & mask;
        }
    }
    return missing;
}

/* out[e] = slab[rows[e]]: a batch's rows for a reply. The rows are random lines of a
 * large slab: each is asked for APS_AHEAD rows ahead, so their cache misses overlap. */
static void aps_rows_gather(float *out, const float *slab, const int64_t *rows, ptrdiff_t n, ptrdiff_t dim) {
    enum { APS_AHEAD = 8 };
    const ptrdiff_t bytes = dim * (ptrdiff_t) sizeof(float);
    for (ptrdiff_t e = 0; e < n; e++) {
        if (e + APS_AHEAD < n) {
            const char *next = (const char *) (slab + rows[e + APS_AHEAD] * dim);
            for (ptrdiff_t line = 0; line < bytes; line += 64)
                __builtin_prefetch(next + line);
        }
        memcpy(out + e * dim, slab + rows[e] * dim, (size_t) bytes);
    }
}

/* slab[rows[e]] = inp[e]: a push's updated rows written back (rows distinct). */
static void aps_rows_scatter(float *slab, const float *inp, const int64_t *rows, ptrdiff_t n, ptrdiff_t dim) {
    enum { APS_AHEAD = 8 };
    const ptrdiff_t bytes = dim * (ptrdiff_t) sizeof(float);
    for (ptrdiff_t e = 0; e < n; e++) {
        if (e + APS_AHEAD < n) {
            char *next = (char *) (slab + rows[e + APS_AHEAD] * dim);
            for (ptrdiff_t line = 0; line < bytes; line += 64)
                __builtin_prefetch(next + line, 1);
        }
        memcpy(slab + rows[e] * dim, inp + e * dim, (size_t) bytes);
    }
}

/* Put ids that are not in the index there with the given rows (growing the index). */
static void aps_index_place(int64_t *buckets, uint64_t mask, const int64_t *ids, const int64_t *rows, ptrdiff_t n) {
    for (ptrdiff_t e = 0; e < n; e++) {
        uint64_t b = aps_mix64((uint64_t) ids[e]) & mask;
        while (buckets[2 * b] != -1)
            b = (b + 1) & mask;
        buckets[2 * b] = ids[e];
        buckets[2 * b + 1] = rows[e];
    }
}

/* out[where[e]] += g[e] in entry order (out zeroed by the caller): a sparse gradient
 * coalesced, duplicates summed, as torch's coalesce() does before a non-linear update. */
static void aps_rows_coalesce(float *out, const int64_t *where, const float *g, ptrdiff_t n, ptrdiff_t dim) {
    for (ptrdiff_t e = 0; e < n; e++) {
        float *row = out + where[e] * dim;
        const float *ge = g + e * dim;
        APS_IVDEP
        for (ptrdiff_t j = 0; j < dim; j++)
            row[j] += ge[j];
    }
}

/* Lazy Adam on coalesced rows, as torch.optim.SparseAdam: only the rows a gradient
 * touches move, their moments too; the bias correction counts the table's steps. In
 * torch's float32 order: dm = (g - m) * (1 - b1); dv = (g*g - v) * (1 - b2); m += dm;
 * v += dv; w += neg_step * ((dm + m_old) / (sqrt(dv + v_old) + eps)). */
static int aps_rows_adam(float *w, float *m, float *v, const float *g, ptrdiff_t n, float c1, float c2, float eps,
                         float neg_step) {
    int bad = 0;
    APS_IVDEP
    for (ptrdiff_t i = 0; i < n; i++) {
        float gi = g[i], mo = m[i], vo = v[i];
        float dm = (gi - mo) * c1, dv = (gi * gi - vo) * c2;
        float mi = mo + dm, vi = vo + dv;
        float wo = w[i] + neg_step * ((dm + mo) / (sqrtf(dv + vo) + eps));
        bad |= APS_BAD(gi) | APS_BAD(vi) | APS_BAD(wo);
        m[i] = mi;
        v[i] = vi;
        w[i] = wo;
    }
    return !bad;
}

/* The kernels with an x*y + z (native/_rows.inc) are compiled in both flavours by
 * _kernels.h, beside the SGD kernels; these choose one at run time as those do. */
static inline int aps_rows_sgd(float *w, const int64_t *where, const float *g, ptrdiff_t n, ptrdiff_t dim, float a) {
#if defined(APS_FMA_DISPATCH)
    if (aps_fused_multiply_add())
        return aps_rows_sgd_fused(w, where, g, n, dim, a);
#endif
    return aps_rows_sgd_unfused(w, where, g, n, dim, a);
}

static inline int aps_rows_adagrad(float *w, float *s, const float *g, ptrdiff_t rows, ptrdiff_t dim, float a,
                                   float eps, int rowwise) {
#if defined(APS_FMA_DISPATCH)
    if (aps_fused_multiply_add())
        return aps_rows_adagrad_fused(w, s, g, rows, dim, a, eps, rowwise);
#endif
    return aps_rows_adagrad_unfused(w, s, g, rows, dim, a, eps, rowwise);
}

#endif
