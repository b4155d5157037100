/* Attention over the paged KV cache: one new token per sequence (decode), a sequence's new queries over its whole
 * context (prefill, AVX-512), chunks of both in one batch, and the cache's stores. */
#include "internal.h"

/* ------------------------------------------------------- decode attention */

#define ATT_GROUP 32 /* positions attend8 takes at a time: their rows as pointers (or converted), scores per head */

/* Key/value rows of a paged cache [num_blocks, block_size, kv_heads, head_dim] in any nt_kv_kind. */
typedef struct {
    const void *data;
    const uint16_t *scales;
    int kind;
} kv_store;

/* n values of a narrow cache from element `at` on, as fp32 (int8: n and at multiples of 32). */
static inline void load_row(const kv_store *s, int64_t at, int64_t n, float *dst) {
    if (s->kind == NT_KV_BF16) {
        const uint16_t *src = (const uint16_t *)s->data + at;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)src[i] << 16;
            float f;
            memcpy(&f, &bits, 4);
            dst[i] = f;
        }
    } else {
        const int8_t *src = (const int8_t *)s->data + at;
        const uint16_t *sc = s->scales + at / QK;
        for (int64_t g = 0; g < n / QK; g++) {
            const float d = half_to_float(sc[g]);
#pragma omp simd
            for (int64_t i = 0; i < QK; i++) dst[g * QK + i] = d * (float)src[g * QK + i];
        }
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
#ifdef NT_AVX2
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        return hsum_ps(_mm256_add_ps(s0, s1));
    }
#endif
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Cache row of each position in [first, len) of a sequence whose blocks are `table` (in units of one kv head's
 * values: position p's kv heads start at at[p - first] * D). */
static void cache_rows(const int64_t *table, int64_t bs, int64_t kv_heads, int64_t first, int64_t len, int64_t *at) {
    for (int64_t b = first / bs, p = first; p < len; b++) /* a block at a time: no division per position */
        for (const int64_t end = (b + 1) * bs < len ? (b + 1) * bs : len; p < end; p++)
            at[p - first] = (table[b] * bs + p - b * bs) * kv_heads;
}

/* A token's kv heads (kv_heads * D values from element `at`) as fp32: in place for an fp32 cache, else into row. */
static inline const float *token_kv(const kv_store *s, int64_t at, int64_t width, float *row) {
    if (s->kind == NT_KV_F32) return (const float *)s->data + at;
    load_row(s, at, width, row);
    return row;
}

/* Per head h (scores [heads, count]): max[h] = the largest score, scores -> exp(score - max[h]) in place, sum[h] =
 * their total: the unnormalized softmax that parts of one context can be merged from. */
static void softmax_parts(float *scores, int64_t heads, int64_t count, float *max, float *sum) {
    for (int64_t h = 0; h < heads; h++) {
        float *sr = scores + h * count;
        float m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < count; j++) m = sr[j] > m ? sr[j] : m;
        int64_t j = 0;
#ifdef NT_AVX2
        const __m256 mv = _mm256_set1_ps(m);
        __m256 tv = _mm256_setzero_ps();
        for (; j + 8 <= count; j += 8) {
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
            _mm256_storeu_ps(sr + j, e);
            tv = _mm256_add_ps(tv, e);
        }
        total = hsum_ps(tv);
#endif
        for (; j < count; j++) {
            sr[j] = expf(sr[j] - m);
            total += sr[j];
        }
        max[h] = m;
        sum[h] = total;
    }
}

#ifdef NT_AVX2
/* The 8 dot products q . k[i][0:D] (D a multiple of 8) as one vector: 8 accumulators, reduced together. */
static inline __m256 dots8(const float *q, const float *const *k, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + d), a7);
    }
    /* pairwise sums: u0 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], u1 the same for a4..a7 */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Requests into the L2 cache the stored rows (width values each) of the tokens at[from..to) (clipped to count): the
 * cache's blocks are scattered, and a cold context was read at a third of the memory's bandwidth without this.
 * Requested into L1 instead, a group's rows held the core's miss buffers and the pass took 20-30% longer (64
 * contexts of 192 tokens, 30 layers of SmolLM2's heads on 2 Zen 4 cores: 47-50 against 36-39 ms). */
static inline __attribute__((always_inline)) void prefetch_tokens(const kv_store *s, const int64_t *at, int64_t from,
                                                                  int64_t to, int64_t count, int64_t D,
                                                                  int64_t width) {
    const int64_t size = s->kind == NT_KV_F32 ? 4 : s->kind == NT_KV_BF16 ? 2 : 1;
    for (int64_t j = from; j < to && j < count; j++) {
        const char *p = (const char *)s->data + at[j] * D * size;
        for (int64_t b = 0; b < width * size; b += 64) _mm_prefetch(p + b, _MM_HINT_T2);
    }
}

/* prefetch_tokens for head h of `heads`: its share of the `group` tokens from `next` on. Each head of a group's pass
 * requests a share of the next group's rows instead of one loop requesting them all at its start: such a burst
 * filled the core's miss buffers, and the prefetch instructions waited for memory with the arithmetic behind them
 * (30 layers of SmolLM2's heads on 2 Zen 5 cores, fp32 cache, the same bits: one context 4,096 deep 8.3 -> 6.9 ms,
 * 64 contexts of 192 tokens 23.7 -> 19.5 ms, 8 of 1,024 16.3 -> 13.4 ms; the AVX2 route there 1.15-1.18x). Both
 * inlined always: gcc 12 drops a call that does nothing but prefetch as dead code once it is not inlined early. */
static inline __attribute__((always_inline)) void prefetch_share(const kv_store *s, const int64_t *at, int64_t next,
                                                                 int64_t group, int64_t h, int64_t heads,
                                                                 int64_t count, int64_t D, int64_t width) {
    prefetch_tokens(s, at, next + h * group / heads, next + (h + 1) * group / heads, count, D, width);
}

/* o[0:64] += sum_i w[i] * rows[i][0:64] over n rows, the 64 outputs in 8 named registers (an array spills). */
static inline void weighted_sum64(float *o, const float *const *rows, int64_t off, const float *w, int64_t n) {
    __m256 a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8), a2 = _mm256_loadu_ps(o + 16),
           a3 = _mm256_loadu_ps(o + 24), a4 = _mm256_loadu_ps(o + 32), a5 = _mm256_loadu_ps(o + 40),
           a6 = _mm256_loadu_ps(o + 48), a7 = _mm256_loadu_ps(o + 56);
    for (int64_t i = 0; i < n; i++) {
        const __m256 wi = _mm256_broadcast_ss(w + i);
        const float *value = rows[i] + off;
        a0 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value), a0);
        a1 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 8), a1);
        a2 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 16), a2);
        a3 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 24), a3);
        a4 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 32), a4);
        a5 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 40), a5);
        a6 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 48), a6);
        a7 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 56), a7);
    }
    _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2);
    _mm256_storeu_ps(o + 24, a3), _mm256_storeu_ps(o + 32, a4), _mm256_storeu_ps(o + 40, a5);
    _mm256_storeu_ps(o + 48, a6), _mm256_storeu_ps(o + 56, a7);
}

/* attend() for head sizes that are a multiple of 8, ATT_GROUP positions at a time: their keys (or values) as fp32
 * pointers (converted into `row`, ATT_GROUP x width floats, for narrow caches); scores of a head eight positions at
 * once; each head's output accumulated in registers over the whole group. The next group's rows are requested
 * while one is computed, a share with each head (prefetch_share). */
static void attend8(const float *q, float *out, float *max, float *sum, int64_t heads, int64_t h0,
                    const kv_store *ks, const kv_store *vs, int64_t rep, int64_t D, int64_t width, int64_t count,
                    float scale, float *scores, float *row, const int64_t *at) {
    const float *rows[ATT_GROUP], *heads_at[8];
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < count; j0 += ATT_GROUP) {
        const int64_t ng = count - j0 < ATT_GROUP ? count - j0 : ATT_GROUP;
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(ks, at[j0 + i] * D, width, row + i * width);
        for (int64_t i = ng; i < (ng + 7) / 8 * 8; i++) rows[i] = rows[0]; /* a last partial eight: scores unused */
        for (int64_t h = 0; h < heads; h++) {
            prefetch_share(ks, at, j0 + ATT_GROUP, ATT_GROUP, h, heads, count, D, width);
            const int64_t off = ((h0 + h) / rep) * D;
            float *sh = scores + h * count + j0;
            for (int64_t i0 = 0; i0 < ng; i0 += 8) {
                for (int i = 0; i < 8; i++) heads_at[i] = rows[i0 + i] + off;
                const __m256 s8 = _mm256_mul_ps(sv, dots8(q + h * D, heads_at, D));
                if (i0 + 8 <= ng) {
                    _mm256_storeu_ps(sh + i0, s8);
                } else {
                    float s[8];
                    _mm256_storeu_ps(s, s8);
                    for (int64_t i = i0; i < ng; i++) sh[i] = s[i - i0];
                }
            }
        }
    }
    softmax_parts(scores, heads, count, max, sum);
    memset(out, 0, (size_t)(heads * D) * sizeof(float));
    for (int64_t j0 = 0; j0 < count; j0 += ATT_GROUP) {
        const int64_t ng = count - j0 < ATT_GROUP ? count - j0 : ATT_GROUP;
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(vs, at[j0 + i] * D, width, row + i * width);
        for (int64_t h = 0; h < heads; h++) {
            prefetch_share(vs, at, j0 + ATT_GROUP, ATT_GROUP, h, heads, count, D, width);
            const float *w = scores + h * count + j0;
            const int64_t off = ((h0 + h) / rep) * D;
            float *o = out + h * D;
            int64_t d = 0;
            for (; d + 64 <= D; d += 64) weighted_sum64(o + d, rows, off + d, w, ng);
            for (; d < D; d += 8) { /* the rest, 8 at a time */
                __m256 acc = _mm256_loadu_ps(o + d);
                for (int64_t i = 0; i < ng; i++)
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i), _mm256_loadu_ps(rows[i] + off + d), acc);
                _mm256_storeu_ps(o + d, acc);
            }
        }
    }
}
#endif

#ifdef NT_VNNI512
/* Lane i of the result = the sum of a[i]'s 16 lanes: pairs within 128-bit lanes, then across them (45 operations
 * for 16 sums, where one horizontal sum each would take 16 x 8). */
static inline __m512 sum16_ps(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [a2k, a2k+1, a2k, a2k+1], partial */
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: [a4k, a4k+1, a4k+2, a4k+3], that lane's share */
        const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
        c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; k++) /* 128-bit lanes: c[2k]'s halves, then c[2k + 1]'s */
        d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

/* o[0:D] = alpha o + sum over i in [from, to) of w[i] rows[i][off:off + D] (D a multiple of 16): up to four
 * vectors of outputs at a time, two positions at a time into two sets of accumulators (the FMAs' latency). */
static inline void weighted_rows512(float *o, const float *const *rows, int64_t off, const float *w, int64_t from,
                                    int64_t to, int64_t D, float alpha) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < D; d += 64) {
        const int nv = D - d >= 64 ? 4 : (int)((D - d) / 16);
        __m512 a[4], b[4];
        for (int c = 0; c < nv; c++) a[c] = _mm512_mul_ps(av, _mm512_loadu_ps(o + d + 16 * c)), b[c] = _mm512_setzero_ps();
        int64_t i = from;
        for (; i + 2 <= to; i += 2) {
            const __m512 w0 = _mm512_set1_ps(w[i]), w1 = _mm512_set1_ps(w[i + 1]);
            const float *v0 = rows[i] + off + d, *v1 = rows[i + 1] + off + d;
            for (int c = 0; c < nv; c++) {
                a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), a[c]);
                b[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * c), b[c]);
            }
        }
        if (i < to) {
            const __m512 w0 = _mm512_set1_ps(w[i]);
            for (int c = 0; c < nv; c++) a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(rows[i] + off + d + 16 * c), a[c]);
        }
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + d + 16 * c, _mm512_add_ps(a[c], b[c]));
    }
}

/* attend() with AVX-512 for head sizes that are a multiple of 16, 16 positions at a time: each head's 16 scores
 * from 16 accumulators over the head size, summed together (sum16_ps); the values weighted into a head's outputs
 * two positions at a time (two sets of accumulators: FMA latency). The next group's rows are requested while one
 * is computed, a share with each head (prefetch_share). */
#define ATT16 16
static void attend16(const float *q, float *out, float *max, float *sum, int64_t heads, int64_t h0,
                     const kv_store *ks, const kv_store *vs, int64_t rep, int64_t D, int64_t width, int64_t count,
                     float scale, float *scores, float *row, const int64_t *at) {
    const float *rows[ATT16];
    const __m512 sv = _mm512_set1_ps(scale);
    /* A short context's values are requested during the keys' pass, so that they are on their way when it ends
     * (64 contexts of 192 tokens: 6% faster); a long one's would leave L2 before their pass. */
    const int early_values = count * width * (ks->kind == NT_KV_F32 ? 4 : ks->kind == NT_KV_BF16 ? 2 : 1) <= (256 << 10);
    for (int64_t j0 = 0; j0 < count; j0 += ATT16) {
        const int64_t ng = count - j0 < ATT16 ? count - j0 : ATT16;
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(ks, at[j0 + i] * D, width, row + i * width);
        for (int64_t i = ng; i < ATT16; i++) rows[i] = rows[0]; /* a last partial group: scores unused */
        for (int64_t h = 0; h < heads; h++) {
            prefetch_share(ks, at, j0 + ATT16, ATT16, h, heads, count, D, width);
            if (early_values) prefetch_share(vs, at, j0, ATT16, h, heads, count, D, width);
            const int64_t off = ((h0 + h) / rep) * D;
            const float *qh = q + h * D;
            __m512 acc[ATT16];
            for (int i = 0; i < ATT16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                const __m512 qv = _mm512_loadu_ps(qh + d);
                for (int i = 0; i < ATT16; i++) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[i] + off + d), acc[i]);
            }
            const __m512 s16 = _mm512_mul_ps(sv, sum16_ps(acc));
            _mm512_mask_storeu_ps(scores + h * count + j0, (__mmask16)((1u << ng) - 1u), s16);
        }
    }
    softmax_parts(scores, heads, count, max, sum);
    memset(out, 0, (size_t)(heads * D) * sizeof(float));
    for (int64_t j0 = 0; j0 < count; j0 += ATT16) {
        const int64_t ng = count - j0 < ATT16 ? count - j0 : ATT16;
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(vs, at[j0 + i] * D, width, row + i * width);
        for (int64_t h = 0; h < heads; h++) {
            prefetch_share(vs, at, j0 + ATT16, ATT16, h, heads, count, D, width);
            const float *w = scores + h * count + j0;
            const int64_t off = ((h0 + h) / rep) * D;
            weighted_rows512(out + h * D, rows, off, w, 0, ng, D, 1.0f);
        }
    }
}
#endif

/* Attention of `heads` query heads [heads, D] of one token, from head h0 of the model's on, over positions
 * [first, len) of a sequence whose blocks are `table`: query head h0 + h reads kv head (h0 + h) / rep. Positions
 * are visited once, all kv heads of a token together (they are neighbours in the cache). Leaves out[h] =
 * sum_p exp(s_p - max[h]) v_p unnormalized, with max[h] and sum[h] = sum_p exp(s_p - max[h]), so that parts of one
 * sequence's positions can be merged. `scores` has room for heads * (len - first) floats, `row` for
 * ATT_GROUP * kv_heads * D, `at` for len - first indices. */
static void attend(const float *q, float *out, float *max, float *sum, int64_t heads, int64_t h0, int64_t rep,
                   const nt_cache *c, int64_t kv_heads, int64_t D, const int64_t *table, int64_t first, int64_t len,
                   float scale, float *scores, float *row, int64_t *at) {
    const int64_t count = len - first, width = kv_heads * D;
    const kv_store ks = {c->k, c->k_scales, (int)c->kind}, vs = {c->v, c->v_scales, (int)c->kind};
    cache_rows(table, c->block_size, kv_heads, first, len, at);
#ifdef NT_VNNI512
    if (D % 16 == 0) {
        attend16(q, out, max, sum, heads, h0, &ks, &vs, rep, D, width, count, scale, scores, row, at);
        return;
    }
#endif
#ifdef NT_AVX2
    if (D % 8 == 0) {
        attend8(q, out, max, sum, heads, h0, &ks, &vs, rep, D, width, count, scale, scores, row, at);
        return;
    }
#endif
    for (int64_t j = 0; j < count; j++) {
        const float *keys = token_kv(&ks, at[j] * D, width, row);
        for (int64_t h = 0; h < heads; h++)
            scores[h * count + j] = scale * dot_f32(q + h * D, keys + ((h0 + h) / rep) * D, D);
    }
    softmax_parts(scores, heads, count, max, sum);
    memset(out, 0, (size_t)(heads * D) * sizeof(float));
    for (int64_t j = 0; j < count; j++) {
        const float *values = token_kv(&vs, at[j] * D, width, row);
        for (int64_t h = 0; h < heads; h++) {
            float *o = out + h * D;
            const float *value = values + ((h0 + h) / rep) * D, w = scores[h * count + j];
#pragma omp simd
            for (int64_t i = 0; i < D; i++) o[i] += w * value[i];
        }
    }
}

/* A context is attended in parts of about SPLIT_LEN positions (at most MAX_SPLIT parts), merged by their softmax
 * maxima and sums (as flash-decoding does), so that one long sequence keeps every thread busy. */
#define SPLIT_LEN 256
#define MAX_SPLIT 16
/* Positions from which a context of one part is shared between threads by its query heads instead. */
#define HEAD_SPLIT_MIN 16

/* How many parts a context of `span` positions is attended in: a function of the span alone, never of the thread
 * count or of the other sequences in the batch, so that a sequence's output is the same bits however many threads
 * run and whatever else is batched with it. */
static inline int64_t context_parts(int64_t span) {
    const int64_t parts = (span + SPLIT_LEN - 1) / SPLIT_LEN;
    return parts < 1 ? 1 : parts > MAX_SPLIT ? MAX_SPLIT : parts;
}

/* One new query token per listed sequence, attending over that sequence's cached tokens (its own K/V included):
 * out[rows[i], h] = softmax(scale * q[rows[i], h] . K^T) V over positions [max(0, len - window), len) of sequence i,
 * whose blocks are tables[table_rows[i] * table_stride + ...] (rows, table_rows: NULL for 0, 1, 2, ...). Query
 * heads map to kv heads in groups (GQA). q and out are [tokens, heads, head_dim] fp32. head_dim must be a multiple
 * of 32 for int8 caches. A context longer than SPLIT_LEN is split into parts (context_parts) attended on their own
 * and merged; where every context is one part and there are fewer sequences than threads, a context is shared out
 * by its query heads instead (each head is computed whole either way). */
int decode_attention(const float *q, float *out, int64_t n, const int64_t *rows, const int64_t *seq_lens,
                            const int64_t *tables, const int64_t *table_rows, int64_t table_stride,
                            const nt_cache *c, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                            int64_t window, int threads) {
    if (c->kind == NT_KV_INT8 && D % QK) return -1;
    int64_t parts = 1, groups = 1, longest = 0; /* parts: the most of any sequence; groups: of query heads */
    for (int64_t i = 0; i < n; i++) {
        const int64_t span = window > 0 && seq_lens[i] > window ? window : seq_lens[i];
        const int64_t own = context_parts(span);
        parts = own > parts ? own : parts, longest = span > longest ? span : longest;
    }
    if (parts == 1 && n < threads && longest >= HEAD_SPLIT_MIN) groups = threads / n < heads ? threads / n : heads;
    const int64_t rep = heads / kv_heads;
    /* per (sequence, part): heads * D outputs, heads maxima and sums */
    float *partial = parts > 1 ? malloc((size_t)(n * parts * heads * (D + 2)) * sizeof(float)) : NULL;
    if (parts > 1 && !partial) return -1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && n * parts * groups > 1)
    for (int64_t task = 0; task < n * parts * groups; task++) {
        const int64_t i = task / (parts * groups), part = task / groups % parts, group = task % groups;
        const int64_t h0 = group * heads / groups, nh = (group + 1) * heads / groups - h0; /* all when groups = 1 */
        const int64_t len = seq_lens[i];
        const int64_t start = window > 0 && len > window ? len - window : 0;
        int64_t first = start, last = len;
        if (parts > 1) { /* this sequence's own parts (context_parts); the grid's others are empty */
            const int64_t own = context_parts(len - start), share = (len - start + own - 1) / own;
            first = part < own && start + part * share < len ? start + part * share : len;
            last = first + share < len ? first + share : len;
        }
        const int64_t at = (rows ? rows[i] : i) * heads * D, count = last - first;
        float *o = parts > 1 ? partial + (i * parts + part) * heads * (D + 2) : out + at; /* then maxima, sums */
        if (count == 0) { /* an empty part (parts > 1): contributes nothing */
            for (int64_t h = 0; h < heads; h++) o[heads * D + h] = -INFINITY, o[heads * D + heads + h] = 0.0f;
            continue;
        }
        /* cache rows of the positions, then scores, a converted row, and (one part) the maxima and sums */
        int64_t *rows_at = malloc((size_t)count * sizeof(int64_t) +
                                  (size_t)(count * nh + ATT_GROUP * kv_heads * D + 2 * nh) * sizeof(float));
        if (!rows_at) {
            failed = 1;
            continue;
        }
        float *scores = (float *)(rows_at + count), *row = scores + count * nh;
        /* parts > 1 (then all heads): after the part's outputs; else this task's heads' own, in scratch */
        float *max = parts > 1 ? o + heads * D : row + ATT_GROUP * kv_heads * D, *sum = max + (parts > 1 ? heads : nh);
        attend(q + at + h0 * D, o + h0 * D, max, sum, nh, h0, rep, c, kv_heads, D,
               tables + (table_rows ? table_rows[i] : i) * table_stride, first, last, scale, scores, row, rows_at);
        if (parts == 1) {
            for (int64_t h = 0; h < nh; h++) {
                const float inv = 1.0f / sum[h];
                for (int64_t j = 0; j < D; j++) o[(h0 + h) * D + j] *= inv;
            }
        }
        free(rows_at);
    }
    if (parts > 1 && !failed) {
        for (int64_t i = 0; i < n; i++) {
            float *o = out + (rows ? rows[i] : i) * heads * D;
            for (int64_t h = 0; h < heads; h++) {
                float m = -INFINITY, total = 0.0f;
                for (int64_t part = 0; part < parts; part++)
                    m = fmaxf(m, partial[(i * parts + part) * heads * (D + 2) + heads * D + h]);
                memset(o + h * D, 0, (size_t)D * sizeof(float));
                for (int64_t part = 0; part < parts; part++) {
                    const float *p = partial + (i * parts + part) * heads * (D + 2);
                    if (p[heads * D + heads + h] == 0.0f) continue; /* empty part */
                    const float w = expf(p[heads * D + h] - m);
                    total += w * p[heads * D + heads + h];
                    for (int64_t j = 0; j < D; j++) o[h * D + j] += w * p[h * D + j];
                }
                const float inv = 1.0f / total;
                for (int64_t j = 0; j < D; j++) o[h * D + j] *= inv;
            }
        }
    }
    free(partial);
    return failed ? -1 : 0;
}

int nt_decode_attention(const float *q, float *out, int64_t n, const int64_t *rows, const int64_t *seq_lens,
                        const int64_t *tables, const int64_t *table_rows, int64_t table_stride, void *k, void *v,
                        uint16_t *k_scales, uint16_t *v_scales, int kind, int64_t block_size, int64_t heads,
                        int64_t kv_heads, int64_t D, float scale, int64_t window, int threads) {
    const nt_cache c = {k, v, k_scales, v_scales, kind, block_size};
    return decode_attention(q, out, n, rows, seq_lens, tables, table_rows, table_stride, &c, heads, kv_heads, D,
                            scale, window, threads);
}

/* Store one token's K or V row (kv_heads * D values) at cache row `at` (= slot * kv_heads). */
void store_row(void *data, uint16_t *scales, int64_t kind, int64_t at, const float *src, int64_t n) {
    if (kind == NT_KV_F32) {
        memcpy((float *)data + at, src, (size_t)n * sizeof(float));
    } else if (kind == NT_KV_BF16) {
        uint16_t *dst = (uint16_t *)data + at;
        for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
    } else { /* as kv_pool.quantize_int8: fp16 scale absmax / 127, codes round(x / scale) */
        int8_t *dst = (int8_t *)data + at;
        for (int64_t g = 0; g < n / QK; g++) {
            float max = 0.0f;
#pragma omp simd reduction(max : max)
            for (int i = 0; i < QK; i++) max = fabsf(src[g * QK + i]) > max ? fabsf(src[g * QK + i]) : max;
            const uint16_t h = float_to_half(max / 127.0f);
            const float d = half_to_float(h), inv = d > 0 ? 1.0f / d : 0.0f;
            scales[at / QK + g] = h;
            for (int i = 0; i < QK; i++) {
                const float c = nearbyintf(src[g * QK + i] * inv);
                dst[g * QK + i] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
            }
        }
    }
}

/* Rows of src (n of width floats, ld apart) into a cache's slots (kind as nt_cache; width = kv heads x head size),
 * the rows split across threads. */
void nt_store_rows(void *data, uint16_t *scales, int64_t kind, const int64_t *slots, const float *src, int64_t n,
                   int64_t width, int64_t ld, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 1)
    for (int64_t t = 0; t < n; t++) store_row(data, scales, kind, slots[t] * width, src + t * ld, width);
}

/* Attention of a batch whose sequence s owns tokens [query_start[s], query_start[s + 1]), the last of its seq_lens[s]
 * positions (already in the cache): q, out [tokens, H, D]. Sequences of one new token through decode_attention
 * together; longer chunks through the prefill kernel over their whole context, gathered from the cache as fp32 (as
 * the module path gathers it). */
int chunk_attention(const float *q, float *out, const int64_t *query_start, int64_t num_seqs,
                           const int64_t *seq_lens, const int64_t *tables, int64_t table_stride, const nt_cache *c,
                           int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, int threads) {
    int64_t singles = 0;
    for (int64_t s = 0; s < num_seqs; s++) singles += query_start[s + 1] - query_start[s] == 1;
    int status = 0;
    if (singles) {
        int64_t *rows = malloc((size_t)(3 * singles) * sizeof(int64_t)), *lens = rows + singles;
        int64_t *table_rows = lens + singles;
        if (!rows) return -1;
        for (int64_t s = 0, i = 0; s < num_seqs; s++)
            if (query_start[s + 1] - query_start[s] == 1) rows[i] = query_start[s], lens[i] = seq_lens[s], table_rows[i++] = s;
        status |= decode_attention(q, out, singles, rows, lens, tables, table_rows, table_stride, c, H, KVH, D, scale,
                                   window, threads);
        free(rows);
    }
    const int64_t width = KVH * D;
    const kv_store ks = {c->k, c->k_scales, (int)c->kind}, vs = {c->v, c->v_scales, (int)c->kind};
    for (int64_t s = 0; s < num_seqs && !status; s++) {
        const int64_t q0 = query_start[s], nq = query_start[s + 1] - q0, len = seq_lens[s];
        if (nq < 2) continue;
        float *kv = malloc((size_t)(2 * len * width) * sizeof(float)); /* K [len, width], then V */
        int64_t *at = malloc((size_t)len * sizeof(int64_t));
        if (!kv || !at) {
            free(kv), free(at);
            return -1;
        }
        cache_rows(tables + s * table_stride, c->block_size, KVH, 0, len, at);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && len * width > 65536)
        for (int64_t p = 0; p < len; p++) {
            if (c->kind == NT_KV_F32) {
                memcpy(kv + p * width, (const float *)c->k + at[p] * D, (size_t)width * sizeof(float));
                memcpy(kv + (len + p) * width, (const float *)c->v + at[p] * D, (size_t)width * sizeof(float));
            } else {
                load_row(&ks, at[p] * D, width, kv + p * width);
                load_row(&vs, at[p] * D, width, kv + (len + p) * width);
            }
        }
        status |= nt_prefill_attention(q + q0 * H * D, kv, kv + len * width, out + q0 * H * D, nq, len, H, KVH, D,
                                       scale, window, threads);
        free(kv), free(at);
    }
    return status ? -1 : 0;
}

/* ------------------------------------------------------ prefill attention */

#ifdef NT_VNNI512
#define PF_ROWS 64 /* query positions of one task (one query head) */
#define PF_KEYS 64 /* keys of a step: four vectors of scores per query (SmolLM2: 9% faster than 32) */
#define PF_TILE 4  /* queries whose scores are accumulated together */

/* o rows 0..PF_TILE - 1 (D floats apart; those from nr on are neither read nor written) = alpha[r] * o[r] plus the
 * value rows from..to - 1 weighted by p[r], for NVC vectors of 16 from column d: each value vector is loaded once
 * for the tile's queries (a query at a time loaded it once per query, a load per multiply-add). */
static inline __attribute__((always_inline)) void weighted_tile_cols(const int NVC, float *o, const float *const *rows,
                                                                     const float p[][PF_KEYS], const float *alpha,
                                                                     int64_t from, int64_t to, int64_t D, int64_t d,
                                                                     int64_t nr) {
    __m512 a[PF_TILE][4];
    for (int r = 0; r < PF_TILE; r++)
        for (int c = 0; c < NVC; c++)
            a[r][c] = r < nr ? _mm512_mul_ps(_mm512_set1_ps(alpha[r]), _mm512_loadu_ps(o + r * D + d + 16 * c))
                             : _mm512_setzero_ps();
    for (int64_t i = from; i < to; i++) {
        __m512 v[4];
        for (int c = 0; c < NVC; c++) v[c] = _mm512_loadu_ps(rows[i] + d + 16 * c);
        for (int r = 0; r < PF_TILE; r++) {
            const __m512 w = _mm512_set1_ps(p[r][i]);
            for (int c = 0; c < NVC; c++) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
        }
    }
    for (int r = 0; r < PF_TILE && r < nr; r++)
        for (int c = 0; c < NVC; c++) _mm512_storeu_ps(o + r * D + d + 16 * c, a[r][c]);
}

static void weighted_tile(float *o, const float *const *rows, const float p[][PF_KEYS], const float *alpha,
                          int64_t from, int64_t to, int64_t D, int64_t nr) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) weighted_tile_cols(4, o, rows, p, alpha, from, to, D, d, nr);
    if (D - d >= 32) weighted_tile_cols(2, o, rows, p, alpha, from, to, D, d, nr), d += 32;
    if (D - d >= 16) weighted_tile_cols(1, o, rows, p, alpha, from, to, D, d, nr);
}

/* One task of nt_prefill_attention: query head h, queries [t0, t1), as flash attention does it: keys PF_KEYS at
 * a time, each query's running maximum m, sum l and unnormalized output o (scratch) rescaled as the maximum
 * grows. Scores of PF_TILE queries against PF_KEYS keys come from K transposed (kt [D][S] of this kv head): a key
 * vector against each query's value broadcast, D multiply-adds per 16 scores. */
static void prefill_task(const float *q, const float *kt, const float *v, float *out, int64_t t0, int64_t t1,
                         int64_t T, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t h, float scale,
                         int64_t window, float *o, float *m, float *l) {
    enum { NV = PF_KEYS / 16 }; /* score vectors per query */
    const int64_t g = h / (H / KVH), n = t1 - t0, shift = S - T; /* query t sits at position shift + t */
    const int64_t last = shift + t1 - 1, first = window > 0 && shift + t0 - window + 1 > 0 ? shift + t0 - window + 1 : 0;
    for (int64_t r = 0; r < n; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(o, 0, (size_t)(n * D) * sizeof(float));
    const float *vrows[PF_KEYS];
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sv = _mm512_set1_ps(scale);
    for (int64_t j0 = first / 16 * 16; j0 <= last; j0 += PF_KEYS) {
        for (int64_t j = 0; j < PF_KEYS && j0 + j < S; j++) vrows[j] = v + ((j0 + j) * KVH + g) * D;
        __mmask16 in[NV]; /* keys past S read as zeros */
        for (int c = 0; c < NV; c++) {
            const int64_t left = S - j0 - 16 * c;
            in[c] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
        }
        for (int64_t r0 = 0; r0 < n; r0 += PF_TILE) {
            const int64_t nr = n - r0 < PF_TILE ? n - r0 : PF_TILE;
            if (shift + t0 + r0 + nr - 1 < j0) continue; /* these queries precede every key here */
            __m512 acc[PF_TILE][NV];
            for (int r = 0; r < PF_TILE; r++)
                for (int c = 0; c < NV; c++) acc[r][c] = _mm512_setzero_ps();
            const float *qrow[PF_TILE]; /* past the last query: its row again (scores unused) */
            for (int r = 0; r < PF_TILE; r++) qrow[r] = q + ((t0 + r0 + (r < nr ? r : nr - 1)) * H + h) * D;
            for (int64_t d = 0; d < D; d++) {
                __m512 k[NV];
                for (int c = 0; c < NV; c++) k[c] = _mm512_maskz_loadu_ps(in[c], kt + d * S + j0 + 16 * c);
                for (int r = 0; r < PF_TILE; r++) {
                    const __m512 qv = _mm512_set1_ps(qrow[r][d]);
                    for (int c = 0; c < NV; c++) acc[r][c] = _mm512_fmadd_ps(qv, k[c], acc[r][c]);
                }
            }
            float sc[PF_TILE][PF_KEYS]; /* out of the registers (indexing acc by a variable row would spill it) */
            for (int r = 0; r < PF_TILE; r++)
                for (int c = 0; c < NV; c++) _mm512_storeu_ps(sc[r] + 16 * c, acc[r][c]);
            float pr[PF_TILE][PF_KEYS], alphas[PF_TILE]; /* each query's weights (zero off its keys), rescale */
            int64_t ka = PF_KEYS, kb = 0;                 /* the keys of any of them */
            for (int64_t r = 0; r < PF_TILE; r++) {
                alphas[r] = 1.0f;
                for (int c = 0; c < NV; c++) _mm512_storeu_ps(pr[r] + 16 * c, _mm512_setzero_ps());
                if (r >= nr) continue;
                const int64_t row = r0 + r, pos = shift + t0 + row;
                const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                /* keys lo..pos of this query among j0..j0 + PF_KEYS - 1 */
                const int64_t a = lo > j0 ? lo - j0 : 0, b = pos - j0 + 1 < PF_KEYS ? pos - j0 + 1 : PF_KEYS;
                if (b <= a) continue;
                __m512 sr[NV], top = ninf;
                __mmask16 mk[NV];
                for (int c = 0; c < NV; c++) {
                    const int64_t from = a - 16 * c, to = b - 16 * c; /* this vector's lanes [from, to) */
                    const uint32_t below = to >= 16 ? 0xFFFFu : to <= 0 ? 0u : (1u << to) - 1u;
                    const uint32_t above = from <= 0 ? 0xFFFFu : from >= 16 ? 0u : ~((1u << from) - 1u) & 0xFFFFu;
                    mk[c] = (__mmask16)(below & above);
                    sr[c] = _mm512_mul_ps(_mm512_loadu_ps(sc[r] + 16 * c), sv);
                    top = _mm512_max_ps(top, _mm512_mask_blend_ps(mk[c], ninf, sr[c]));
                }
                const float best = _mm512_reduce_max_ps(top);
                const float mnew = best > m[row] ? best : m[row];
                const float alpha = expf(m[row] - mnew); /* 0 on the first keys (m = -inf) */
                const __m512 mv = _mm512_set1_ps(mnew);
                __m512 total = _mm512_setzero_ps();
                for (int c = 0; c < NV; c++) {
                    if (!mk[c]) continue;
                    const __m512 e = _mm512_maskz_mov_ps(mk[c], exp512_ps(_mm512_sub_ps(sr[c], mv)));
                    total = _mm512_add_ps(total, e);
                    _mm512_storeu_ps(pr[r] + 16 * c, e);
                }
                l[row] = l[row] * alpha + _mm512_reduce_add_ps(total);
                m[row] = mnew;
                alphas[r] = alpha;
                ka = a < ka ? a : ka, kb = b > kb ? b : kb;
            }
            if (kb > ka) weighted_tile(o + r0 * D, vrows, (const float(*)[PF_KEYS])pr, alphas, ka, kb, D, nr);
        }
    }
    for (int64_t r = 0; r < n; r++) {
        const float inv = 1.0f / l[r];
        float *dst = out + ((t0 + r) * H + h) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
}
#endif

/* Attention of T new queries over S >= T keys of one sequence, the queries the last T positions: out[t, h] =
 * softmax_j(scale * q[t, h] . k[j, g]) v[j, g] over keys j in [max(0, p - window + 1), p], p = S - T + t, g = h /
 * (H / KVH) (window 0: none). q, out [T, H, D], k, v [S, KVH, D], fp32, contiguous. Needs AVX-512 and D a
 * multiple of 16; returns -1 otherwise or without memory (the caller's SDPA then runs). Tasks (a query head and
 * up to PF_ROWS queries) go to the threads longest first. */
int nt_prefill_attention(const float *q, const float *k, const float *v, float *out, int64_t T, int64_t S, int64_t H,
                         int64_t KVH, int64_t D, float scale, int64_t window, int threads) {
#ifdef NT_VNNI512
    if (D % 16 || T > S || H % KVH) return -1;
    float *kt = malloc((size_t)(KVH * D * S) * sizeof(float)); /* K transposed per kv head: [KVH][D][S] */
    if (!kt) return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1 && S * KVH * D > 65536)
    for (int64_t gd = 0; gd < KVH * D; gd++) {
        const int64_t g = gd / D, d = gd % D;
        for (int64_t j = 0; j < S; j++) kt[gd * S + j] = k[(j * KVH + g) * D + d];
    }
    const int64_t blocks = (T + PF_ROWS - 1) / PF_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks * H > 1)
    {
        float *scratch = malloc((size_t)(PF_ROWS * D + 2 * PF_ROWS) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < blocks * H; task++) {
            if (!scratch) continue;
            const int64_t b = blocks - 1 - task / H, h = task % H; /* the last queries see the most keys */
            const int64_t t0 = b * PF_ROWS, t1 = t0 + PF_ROWS < T ? t0 + PF_ROWS : T;
            prefill_task(q, kt + (h / (H / KVH)) * D * S, v, out, t0, t1, T, S, H, KVH, D, h, scale, window,
                         scratch, scratch + PF_ROWS * D, scratch + PF_ROWS * D + PF_ROWS);
        }
        free(scratch);
    }
    free(kt);
    return failed ? -1 : 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)S, (void)H, (void)KVH, (void)D, (void)scale, (void)window,
        (void)threads;
    return -1;
#endif
}
