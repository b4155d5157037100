/* The GEMM over block weights for batches bound by compute: with AVX-512 VNNI the weights' codes as bytes against
 * the activations' codes as bytes, elsewhere the fp32 GEMM over panels dequantized per thread. */
#include "internal.h"

#ifdef NT_VNNI512
/* ------------------------------------------- byte GEMM over block weights, AVX-512 VNNI */

/* Products of many rows bound by compute, with the block kernels' precision: the weights' exact integer codes meet
 * the activations' codes as bytes in vpdpbusd, 64 products a vector where an fp32 FMA does 16; each scale group's
 * int32 sums take one float multiply-add by the product of the two scales (and Q4's offset one more). The exact
 * route's codes (split_levels) are three planes of bytes a row: its first level's int16 codes as 256 hi + lo (lo
 * unsigned, hi signed) and its second level's int8 codes, so 4 codes of a row against 16 weight rows take three
 * multiply-adds (two levels of int16 codes in vpdpwssd, the weights widened to int16 pairs, took four; see
 * exact_tile); int8 activation codes (`--activations int8`) are one plane. The weights are laid out per thread, 32
 * rows at a time, into two panels of [K / 4][16 rows][4] bytes (a 32-bit lane holds 4 neighbouring codes of one
 * row, in their natural order), with their scales as [groups][16]: every row tile of x then runs over them. The
 * layout is a 16 x 16 transpose of 32-bit lanes of the codes as stored, Q4's nibbles then masked apart. */

#define IG_ROWS 6 /* int8 codes: activation rows of a tile, 12 int32 and 12 float accumulators, two weight vectors */
/* With it, projections keep no fp32 panels (quant_linear.py): it is faster than the fp32 GEMM over them for every
 * batch past the block kernels. With int16 codes in both levels, on panels widened to int16, it already cost less
 * than the products it saves from 12 rows (SmolLM2's 30 layers' projections, ms, block kernels / fp32 panels /
 * int16: 12 rows 18.4 / 15.8 / 13.2, 32 rows 43.9 / 37.9 / 25.1, 128 rows 168.5 / 142.9 / 83.4, 512 rows 819 / 555
 * / 337). The LM head has no panels: its blocks take it from 16 rows (ms: 16 rows 5.6 vs 8.1 for the fp32 GEMM over
 * dequantized rows, 64 rows 12.8 vs 20.2).
 * Byte activations alone (absmax / 127 per 32, vpdpbusd on the head's own int8 codes) ran Gemma 3's head at 64 rows
 * in 53 against 77 ms, but even with each row's 32 best logits recomputed exactly they moved teacher-forced top-5
 * log-probabilities by up to 0.07 (KL 5e-4): the error of the many near-best tokens shifts the normalizer. So the
 * head keeps the exact codes unless int8 activations are asked for (nt_block_gemm8, its outlier columns in fp32: the
 * head's logits 3 times closer, Gemma 3's mean error 0.049 -> 0.016, at 64 rows 62 against 83 ms). */

/* Batches under this many rows widen with the next panel's rows requested ahead: a panel's loads, 16 rows apart,
 * each wait on memory, as the hardware prefetchers do not follow them (Gemma 3's 262k-row head at 64 rows: 89 ->
 * 75 ms; its blocks' projections at 16 and 64 rows 4% and 2% faster; at 512 rows, where a panel's products take 8
 * times as long, no faster). */
#define IG_PREFETCH_ROWS 128

/* r[i] lane c -> r[c] lane i, for 16 vectors of 16 int32: pairs within 128-bit lanes, then 4 x 4 blocks of lanes. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i ab02 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
        const __m512i ab13 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
        const __m512i cd02 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
        const __m512i cd13 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
        t[j] = _mm512_shuffle_i32x4(ab02, cd02, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(ab13, cd13, 0x88);
        t[8 + j] = _mm512_shuffle_i32x4(ab02, cd02, 0xDD);
        t[12 + j] = _mm512_shuffle_i32x4(ab13, cd13, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Activation columns that byte codes would flatten: where one column of x runs far above the others (RMSNorm
 * weights and the gated MLP's products put a few such columns in every model), the absmax / 127 step of its group
 * leaves the other 31 values a few levels, or none. The OUTLIER_MAX columns whose largest magnitude over the rows
 * most exceeds OUTLIER_RATIO times the median column's are taken out of the codes and multiplied in fp32 instead,
 * by their weights dequantized as each panel is widened (the decomposition of LLM.int8()). Teacher-forced through
 * prefill against fp32, byte codes alone: SmolLM2 98.2%, KL 2.6e-3; Gemma 3 98.6%, 1.4e-3. With 8 outlier columns
 * 8.5e-4 / 4.3e-4; with 16 6.9e-4 / 3.3e-4 (99.2% / 99.5%); with 32 (ratio 2) 5.6e-4 / 2.8e-4. */
#define OUTLIER_MAX NT_OUTLIER_MAX
#define OUTLIER_RATIO 3.0f

/* The element of rank k (0-based, ascending) of v [n], which it reorders. */
static float select_rank(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot) i++;
            while (v[j] > pivot) j--;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j], v[j--] = t;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else break;
    }
    return v[k];
}

/* Given the largest magnitude of each of K columns (colmax; scratch: K floats), the outlier columns (see
 * OUTLIER_MAX), ascending, into cols; returns how many. The median column is the one of rank K / 2. */
static int64_t outlier_columns(const float *colmax, int64_t K, float *scratch, int32_t *cols) {
    memcpy(scratch, colmax, (size_t)K * sizeof(float));
    const float limit = OUTLIER_RATIO * select_rank(scratch, K, K / 2);
    int64_t n = 0; /* the largest columns above the limit, by size: insertion into cols */
    for (int64_t c = 0; c < K; c++) {
        if (!(colmax[c] > limit) || (n == OUTLIER_MAX && colmax[c] <= colmax[cols[n - 1]])) continue;
        int64_t at = n < OUTLIER_MAX ? n++ : n - 1;
        for (; at > 0 && colmax[cols[at - 1]] < colmax[c]; at--) cols[at] = cols[at - 1];
        cols[at] = (int32_t)c;
    }
    for (int64_t i = 1; i < n; i++) /* ascending */
        for (int64_t j = i; j > 0 && cols[j - 1] > cols[j]; j--) {
            const int32_t t = cols[j];
            cols[j] = cols[j - 1], cols[j - 1] = t;
        }
    return n;
}

/* The same products with the activations as int8 codes per 32 values (absmax / 127, as llama.cpp quantizes them):
 * vpdpbusd takes 64 byte products a vector where vpdpwssd takes 32 of int16, at the cost of the activations'
 * precision (see nt_block_gemm). A 32-bit lane of a panel holds 4 neighbouring codes of one weight row, in the
 * order stored: a Q4 block's 16 bytes, transposed 4 at a time, give codes 4j..4j + 3 from their low nibbles and
 * 4j + 16.. from their high ones, so both weights and activations stay in their natural order. vpdpbusd multiplies
 * unsigned by signed bytes: Q4's codes (0..15) are the unsigned side against signed activation codes; signed
 * weights (int8 codes) meet the activations' codes plus 128 (their sign bit flipped), the extra 128 times the
 * weights' sum taken out by starting each group's sums at -128 times it (`bias`, per panel). */
/* x [K] -> int8 codes per 32 values in natural order (plus 128 where `flip`), d = absmax / 127, s = d * sum; the
 * values of group b where bit i of skip[b] is set count as zeros (outlier columns; skip may be null). */
static void quantize_row8(const float *x, int64_t K, int8_t *q, float *d, float *s, int flip, const uint32_t *skip) {
    for (int64_t b = 0; b < K / QK; b++) {
        __m512i c0, c1;
        quantize_group(x + b * QK, skip ? skip[b] : 0, 127.0f, &c0, &c1, d + b, s + b);
        const __m128i sign = _mm_set1_epi8(flip ? (char)0x80 : 0);
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm_xor_si128(_mm512_cvtepi32_epi8(c0), sign));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(c1), sign));
    }
}

/* Weight rows n0..n0 + 31 (those from N on as zeros) of a block weight into p: 16 rows' bytes as stored transposed,
 * 4 to a 32-bit lane: int8 codes 4q..4q + 3 in lane q, a Q4 group's low nibbles 4j..4j + 3 and high ones 4j + 16..
 * in lane j, kept in natural order, with each scale group's bias (int8 codes). */
static void gemm_widen(int kind, const void *qs, const void *d, const void *m, int64_t n0, int64_t N,
                       int64_t K, const gemm_panels *p, int prefetch, const int32_t *outliers, int64_t nout) {
    const int64_t groups = K / QK, sg = kind == NT_Q8_HALVES ? 2 * groups : groups, per = kind == NT_Q8_HALVES ? 4 : 8;
    if (prefetch) { /* the next panel's rows into L2 */
        const int64_t row_bytes = IS_Q4(kind) ? K / 2 : K;
        const int64_t end = (n0 + 64 < N ? n0 + 64 : N) * row_bytes;
        for (int64_t b = (n0 + 32) * row_bytes; b < end; b += 64) _mm_prefetch((const char *)qs + b, _MM_HINT_T1);
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    for (int h = 0; h < 2; h++) {
        __m512i *vecs = (__m512i *)p->codes[h];
        if (!IS_Q4(kind)) { /* int8 codes, 64 per row at a time (or one last group of 32) */
            for (int64_t c = 0; c < K; c += 64) {
                const int full = K - c >= 64;
                __m512i r[16];
                for (int64_t i = 0; i < 16; i++) {
                    const int64_t n = n0 + 16 * h + i;
                    r[i] = n >= N ? _mm512_setzero_si512()
                                  : _mm512_maskz_loadu_epi8(full ? ~(__mmask64)0 : 0xFFFFFFFFull,
                                                            (const int8_t *)qs + n * K + c);
                }
                transpose16_epi32(r); /* r[q]: codes 4q..4q + 3 of each row */
                for (int q = 0; q < (full ? 16 : 8); q++) {
                    const int64_t v = c / 4 + q;
                    _mm512_storeu_si512(vecs + v, r[q]);
                    /* the sum of each lane's 4 codes: ones (unsigned) times the codes (signed) */
                    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, r[q]);
                    int32_t *bias = p->bias[h] + (v / per) * 16;
                    const __m512i prev = v % per ? _mm512_loadu_si512(bias) : _mm512_setzero_si512();
                    _mm512_storeu_si512(bias, _mm512_sub_epi32(prev, _mm512_slli_epi32(sum, 7)));
                }
            }
        } else {
            for (int64_t g0 = 0; g0 < groups; g0 += 4) { /* Q4: the nibbles of 4 groups a row at a time */
                const int64_t have = groups - g0 < 4 ? groups - g0 : 4;
                const __mmask64 mask = have == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * have)) - 1;
                __m512i r[16];
                for (int64_t i = 0; i < 16; i++) {
                    const int64_t n = n0 + 16 * h + i;
                    r[i] = n >= N ? _mm512_setzero_si512()
                                  : _mm512_maskz_loadu_epi8(mask, (const uint8_t *)qs + n * (K / 2) + g0 * 16);
                }
                transpose16_epi32(r); /* r[u]: bytes 4j..4j + 3 (j = u % 4) of group g0 + u / 4 of each row */
                for (int u = 0; u < 4 * have; u++) {
                    const __m512i lo = _mm512_and_si512(r[u], nibble); /* codes 4j..4j + 3 */
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(r[u], 4), nibble); /* 4j + 16.. */
                    __m512i *dst = vecs + (g0 + u / 4) * 8 + u % 4;
                    _mm512_storeu_si512(dst, lo);
                    _mm512_storeu_si512(dst + 4, hi);
                }
            }
        }
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = n0 + 16 * h + i;
            for (int64_t g = 0; g < sg; g++) {
                float scale = 0.0f;
                if (n < N)
                    scale = kind == NT_Q8_HALVES || kind == NT_Q4_F32 ? ((const float *)d)[n * sg + g]
                                                   : half_to_float(((const uint16_t *)d)[n * groups + g]);
                p->scale[h][g * 16 + i] = scale;
            }
            if (IS_Q4(kind))
                for (int64_t g = 0; g < groups; g++)
                    p->offset[h][g * 16 + i] = n >= N ? 0.0f
                                               : kind == NT_Q4_F32 ? ((const float *)m)[n * groups + g]
                                                           : half_to_float(((const uint16_t *)m)[n * groups + g]);
        }
        /* The outlier columns' weights of these 16 rows, from the codes and scales just laid out (bytes): the code
         * of column c sits in byte c % 4 of each row's 32-bit lane of one vector. */
        for (int64_t j = 0; j < nout; j++) {
            const int64_t c = outliers[j], g = c / QK, i = c % QK, shift = 8 * (c % 4);
            const __m512i lanes = _mm512_loadu_si512(IS_Q4(kind) ? vecs + g * 8 + (i % 16) / 4 + (i >= 16 ? 4 : 0)
                                                               : vecs + c / 4);
            const __m512i q = IS_Q4(kind) ? _mm512_and_si512(_mm512_srli_epi32(lanes, (unsigned)shift),
                                                           _mm512_set1_epi32(0xFF))
                                        : _mm512_srai_epi32(_mm512_slli_epi32(lanes, (unsigned)(24 - shift)), 24);
            const __m512 scale = _mm512_loadu_ps(p->scale[h] + (kind == NT_Q8_HALVES ? c / 16 : g) * 16);
            __m512 w = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q));
            if (IS_Q4(kind)) w = _mm512_add_ps(w, _mm512_loadu_ps(p->offset[h] + g * 16));
            _mm512_storeu_ps(p->outlier[h] + j * 16, w);
        }
    }
}

/* Group x [32] of split_levels' row of codes `row` as the exact route's planes of bytes, with its scale d and Q4 sum
 * s: a first level's int16 codes as lo (unsigned, 32 bytes at lo) and hi (signed, at hi), a second level's int8 codes
 * at lo alone. `flip` (0x80 bytes) makes the signed planes unsigned, for vpdpbusd against int8 weight codes. */
static inline void level_planes(const float *x, int64_t row, __m128i flip, uint8_t *lo, uint8_t *hi, float *d,
                                float *s) {
    __m512i c0, c1;
    quantize_group(x, 0, level_codes(row), &c0, &c1, d, s);
    const __m128i flip_lo = row & 1 ? flip : _mm_setzero_si128();
    _mm_storeu_si128((__m128i *)lo, _mm_xor_si128(_mm512_cvtepi32_epi8(c0), flip_lo));
    _mm_storeu_si128((__m128i *)(lo + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(c1), flip_lo));
    if (row & 1) return;
    _mm_storeu_si128((__m128i *)hi, _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srai_epi32(c0, 8)), flip));
    _mm_storeu_si128((__m128i *)(hi + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srai_epi32(c1, 8)), flip));
}

/* out rows r0..r0 + T - 1, columns n0..n0 + cols - 1 (cols <= 32) = those rows of x (int8 activation codes `codes`,
 * [M, K], with their scales xd and Q4 sums xs per group) by the panels: a step takes 4 bytes of each row's codes
 * against a 64-byte vector of each panel in vpdpbusd (Q4's codes the unsigned side; int8 codes against the
 * activations plus 128, from the bias), then the outlier columns' products in fp32. */
static inline __attribute__((always_inline)) void gemm_tile(int kind, const int T, const int8_t *codes,
                                                            const float *xd, const float *xs, int64_t r0, int64_t K,
                                                            const gemm_panels *p, float *out, int64_t ldo,
                                                            int64_t n0, int64_t cols, const float *xo,
                                                            int64_t nout) {
    const int64_t groups = K / QK, sg = kind == NT_Q8_HALVES ? 2 * groups : groups;
    const int64_t steps = (kind == NT_Q8_HALVES ? 16 : 32) / 4; /* per scale group */
    __m512 f[IG_ROWS][2];
    for (int t = 0; t < T; t++) f[t][0] = f[t][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < sg; s++) {
        const int64_t g = kind == NT_Q8_HALVES ? s / 2 : s; /* the activations' scale group */
        const panel_group pg = panel_group_at(kind, p, s);
        __m512i a[IG_ROWS][2];
        for (int t = 0; t < T; t++) a[t][0] = pg.bias[0], a[t][1] = pg.bias[1];
        const uint8_t *w0 = (const uint8_t *)p->codes[0] + s * steps * 64;
        const uint8_t *w1 = (const uint8_t *)p->codes[1] + s * steps * 64;
        const uint8_t *xr = (const uint8_t *)codes + r0 * K + s * steps * 4;
        /* Unrolled, the accumulators stay in their registers (otherwise copied each pass: 3-6% of a model's
         * projections at 64 and 512 rows). */
#pragma GCC unroll 16
        for (int64_t k = 0; k < steps; k++) {
            const __m512i v0 = _mm512_loadu_si512(w0 + k * 64), v1 = _mm512_loadu_si512(w1 + k * 64);
            for (int t = 0; t < T; t++) {
                int32_t four;
                memcpy(&four, xr + t * K + 4 * k, 4);
                const __m512i x4 = _mm512_set1_epi32(four);
                if (IS_Q4(kind)) {
                    a[t][0] = _mm512_dpbusd_epi32(a[t][0], v0, x4);
                    a[t][1] = _mm512_dpbusd_epi32(a[t][1], v1, x4);
                } else {
                    a[t][0] = _mm512_dpbusd_epi32(a[t][0], x4, v0);
                    a[t][1] = _mm512_dpbusd_epi32(a[t][1], x4, v1);
                }
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(xd[(r0 + t) * groups + g]);
            const __m512 sx = IS_Q4(kind) ? _mm512_set1_ps(xs[(r0 + t) * groups + g]) : _mm512_setzero_ps();
            for (int h = 0; h < 2; h++) f[t][h] = scale_group(f[t][h], a[t][h], pg.d[h], dx, IS_Q4(kind), pg.m[h], sx);
        }
    }
    tile_out(1, T, f, p, xo, nout, r0, out, ldo, n0, cols);
}

/* The exact route's tile: out rows a0..a0 + A - 1, activation rows whose levels are rows of codes 2a (first) and
 * 2a + 1 (second), columns n0..n0 + cols - 1 (cols <= 32), from planes [lo | hi][M rows of codes][K]: a first
 * level's lo and hi bytes, a second level's int8 codes in the lo plane (against int8 weights, hi and the int8 codes
 * plus 128, the bias taking 128 times the weights' sum out). A step takes 4 codes of each of a row's three planes
 * against a 64-byte vector of each panel in vpdpbusd: lo the unsigned side against either kind of weight code, Q4's
 * codes (0..15) the unsigned side against hi and the second level. The first level's sums are 256 hi + lo, its
 * int16 codes' sums; each level's then scaled as gemm_tile scales a row of codes and the two added (tile_out): the
 * operations of block_few and amx_rows, so the same bits. Per 4 codes of a row and 16 weight rows, three
 * multiply-adds where two levels of int16 codes took four. */
#define EXACT_ROWS 2 /* activation rows of a tile: 12 int32 accumulators (3 planes x 2 panels) and 8 float ones */
static inline __attribute__((always_inline)) void exact_tile(int kind, const int A, const uint8_t *planes,
                                                             const float *xd, const float *xs, int64_t a0, int64_t M,
                                                             int64_t K, const gemm_panels *p, float *out, int64_t ldo,
                                                             int64_t n0, int64_t cols) {
    const int64_t groups = K / QK, halves = kind == NT_Q8_HALVES, sg = halves ? 2 * groups : groups;
    const int64_t steps = (halves ? 16 : 32) / 4; /* per scale group */
    const uint8_t *hi = planes + M * K;
    __m512 f[2 * EXACT_ROWS][2];
    for (int t = 0; t < 2 * A; t++) f[t][0] = f[t][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < sg; s++) {
        const int64_t g = halves ? s / 2 : s;
        const panel_group pg = panel_group_at(kind, p, s);
        __m512i l[EXACT_ROWS][2], h[EXACT_ROWS][2], c[EXACT_ROWS][2]; /* lo, hi, second level; by panel */
        for (int i = 0; i < A; i++) {
            l[i][0] = l[i][1] = _mm512_setzero_si512();
            h[i][0] = c[i][0] = pg.bias[0], h[i][1] = c[i][1] = pg.bias[1];
        }
        const uint8_t *w0 = (const uint8_t *)p->codes[0] + s * steps * 64;
        const uint8_t *w1 = (const uint8_t *)p->codes[1] + s * steps * 64;
#pragma GCC unroll 8
        for (int64_t k = 0; k < steps; k++) {
            const __m512i v0 = _mm512_loadu_si512(w0 + k * 64), v1 = _mm512_loadu_si512(w1 + k * 64);
            for (int i = 0; i < A; i++) {
                const int64_t at = 2 * (a0 + i) * K + s * steps * 4 + 4 * k;
                int32_t lo4, hi4, c4;
                memcpy(&lo4, planes + at, 4);
                memcpy(&hi4, hi + at, 4);
                memcpy(&c4, planes + at + K, 4);
                const __m512i xl = _mm512_set1_epi32(lo4), xh = _mm512_set1_epi32(hi4), xc = _mm512_set1_epi32(c4);
                l[i][0] = _mm512_dpbusd_epi32(l[i][0], xl, v0);
                l[i][1] = _mm512_dpbusd_epi32(l[i][1], xl, v1);
                if (IS_Q4(kind)) {
                    h[i][0] = _mm512_dpbusd_epi32(h[i][0], v0, xh);
                    h[i][1] = _mm512_dpbusd_epi32(h[i][1], v1, xh);
                    c[i][0] = _mm512_dpbusd_epi32(c[i][0], v0, xc);
                    c[i][1] = _mm512_dpbusd_epi32(c[i][1], v1, xc);
                } else {
                    h[i][0] = _mm512_dpbusd_epi32(h[i][0], xh, v0);
                    h[i][1] = _mm512_dpbusd_epi32(h[i][1], xh, v1);
                    c[i][0] = _mm512_dpbusd_epi32(c[i][0], xc, v0);
                    c[i][1] = _mm512_dpbusd_epi32(c[i][1], xc, v1);
                }
            }
        }
        for (int i = 0; i < A; i++) {
            const int64_t r = 2 * (a0 + i);
            const __m512 dx = _mm512_set1_ps(xd[r * groups + g]), dx2 = _mm512_set1_ps(xd[(r + 1) * groups + g]);
            const __m512 sx = IS_Q4(kind) ? _mm512_set1_ps(xs[r * groups + g]) : _mm512_setzero_ps();
            const __m512 sx2 = IS_Q4(kind) ? _mm512_set1_ps(xs[(r + 1) * groups + g]) : _mm512_setzero_ps();
            for (int e = 0; e < 2; e++) { /* panel e: 256 hi + lo, then the second level */
                const __m512i first = _mm512_add_epi32(l[i][e], _mm512_slli_epi32(h[i][e], 8));
                f[2 * i][e] = scale_group(f[2 * i][e], first, pg.d[e], dx, IS_Q4(kind), pg.m[e], sx);
                f[2 * i + 1][e] = scale_group(f[2 * i + 1][e], c[i][e], pg.d[e], dx2, IS_Q4(kind), pg.m[e], sx2);
            }
        }
    }
    tile_out(0, 2 * A, f, p, NULL, 0, 2 * a0, out, ldo, n0, cols);
}

/* Rows of codes [0, M) (bytes: int8 codes [M][K]; else the exact route's planes, M even) by the panels. */
static inline __attribute__((always_inline)) void gemm_rows(int kind, int bytes, const void *codes, const float *xd,
                                                            const float *xs, int64_t M, int64_t K,
                                                            const gemm_panels *p, float *out, int64_t ldo,
                                                            int64_t n0, int64_t cols, const float *xo,
                                                            int64_t nout) {
    if (!bytes) {
        int64_t a0 = 0;
        for (; a0 + EXACT_ROWS <= M / 2; a0 += EXACT_ROWS)
            exact_tile(kind, EXACT_ROWS, codes, xd, xs, a0, M, K, p, out, ldo, n0, cols);
        if (a0 < M / 2) exact_tile(kind, 1, codes, xd, xs, a0, M, K, p, out, ldo, n0, cols); /* EXACT_ROWS 2 */
        return;
    }
    int64_t r0 = 0;
    for (; r0 + IG_ROWS <= M; r0 += IG_ROWS)
        gemm_tile(kind, IG_ROWS, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout);
    switch (M - r0) {
    case 1: gemm_tile(kind, 1, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 2: gemm_tile(kind, 2, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 3: gemm_tile(kind, 3, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 4: gemm_tile(kind, 4, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 5: gemm_tile(kind, 5, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    default: break;
    }
}

/* block_gemm_codes (below) over M rows of x as they are (the exact route: M rows of codes, both levels of M / 2 rows
 * of out). */
static int block_gemm_rows(int kind, int bytes, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                           const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads,
                           const int32_t *fixed, int64_t fixed_n) {
    const int64_t groups = K / QK, sg = kind == NT_Q8_HALVES ? 2 * groups : groups;
    int32_t outliers[OUTLIER_MAX];
    int64_t nout = 0;
    const int chosen = bytes && fixed_n < 0; /* the outlier columns chosen over these rows, else fixed ones */
    const int64_t team = threads > 1 && M > 1 ? threads : 1;
#ifdef NT_AMX
    const int amx = amx_on(); /* the products on AMX tiles (amx.c): byte panels, the codes as planes of bytes */
#else
    const int amx = 0;
#endif
    const int64_t code_bytes = M * K * (bytes ? 1 : 2); /* the exact route: two planes */
    void *rows = malloc((size_t)(code_bytes + (2 * M * groups + M * OUTLIER_MAX) * (int64_t)sizeof(float) +
                                 groups * (int64_t)sizeof(uint32_t) +
                                 (bytes ? (team + 2) * K * (int64_t)sizeof(float) : 0)) + 64);
    if (!rows) return -1;
    float *xd = (float *)rows, *xs = xd + M * groups, *xo = xs + M * groups; /* xo [M][nout]: outlier values */
    uint32_t *skip = (uint32_t *)(xo + M * OUTLIER_MAX); /* per group, the outlier columns' bits */
    float *colmax = (float *)(skip + groups); /* bytes: [team + 2][K], each thread's maxima, then all's */
    void *codes = bytes ? (void *)(colmax + (team + 2) * K) : (void *)colmax;
    uint8_t *planes = (uint8_t *)codes; /* the exact route: [lo | hi][M][K] */
    memset(skip, 0, (size_t)groups * sizeof(uint32_t));
    if (bytes && !chosen) {
        nout = fixed_n;
        for (int64_t j = 0; j < nout; j++) {
            outliers[j] = fixed[j];
            skip[fixed[j] / QK] |= 1u << (fixed[j] % QK);
        }
    }
    /* Off AMX, int8 weights meet the signed planes plus 128 (the panels' bias takes it out again) */
    const __m128i flip = _mm_set1_epi8(!amx && !IS_Q4(kind) ? (char)0x80 : 0);
#pragma omp parallel num_threads(threads) if (team > 1)
    {
        if (chosen) { /* the columns' largest magnitudes, each thread over the rows it then quantizes (static) */
            float *mine = colmax + (int64_t)omp_get_thread_num() * K;
            memset(mine, 0, (size_t)K * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                for (int64_t c = 0; c < K; c += 16)
                    _mm512_storeu_ps(mine + c, _mm512_max_ps(_mm512_loadu_ps(mine + c),
                                                             _mm512_abs_ps(_mm512_loadu_ps(x + r * ldx + c))));
#pragma omp single
            {
                float *all = colmax + team * K;
                memcpy(all, colmax, (size_t)K * sizeof(float));
                for (int t = 1; t < omp_get_num_threads(); t++)
                    for (int64_t c = 0; c < K; c += 16)
                        _mm512_storeu_ps(all + c, _mm512_max_ps(_mm512_loadu_ps(all + c),
                                                                _mm512_loadu_ps(colmax + t * K + c)));
                nout = outlier_columns(all, K, all + K, outliers);
                for (int64_t j = 0; j < nout; j++) skip[outliers[j] / QK] |= 1u << (outliers[j] % QK);
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            if (bytes) {
                quantize_row8(x + r * ldx, K, (int8_t *)codes + r * K, xd + r * groups, xs + r * groups,
                              !IS_Q4(kind) && !amx, nout ? skip : NULL);
                for (int64_t j = 0; j < nout; j++) xo[r * nout + j] = x[r * ldx + outliers[j]];
                continue;
            }
            for (int64_t b = 0; b < groups; b++)
                level_planes(x + r * ldx + b * QK, r, flip, planes + r * K + b * QK, planes + (M + r) * K + b * QK,
                             xd + r * groups + b, xs + r * groups + b);
        }
    }
    const int64_t pairs_of_panels = (N + 31) / 32;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && pairs_of_panels > 1)
    {
        gemm_panels p;
        void *block = malloc((size_t)(2 * 16 * K + (3 * 2 * sg + 2 * OUTLIER_MAX) * 16 * 4) + 64);
        if (!block) failed = 1;
        else {
            p.codes[0] = block, p.codes[1] = (uint8_t *)block + 16 * K;
            p.scale[0] = (float *)((uint8_t *)p.codes[1] + 16 * K), p.scale[1] = p.scale[0] + sg * 16;
            p.offset[0] = p.scale[1] + sg * 16, p.offset[1] = p.offset[0] + sg * 16;
            p.bias[0] = (int32_t *)(p.offset[1] + sg * 16), p.bias[1] = p.bias[0] + sg * 16;
            p.outlier[0] = (float *)(p.bias[1] + sg * 16), p.outlier[1] = p.outlier[0] + OUTLIER_MAX * 16;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < pairs_of_panels; c++) {
            if (!block) continue;
            const int64_t n0 = c * 32, cols = N - n0 < 32 ? N - n0 : 32;
            gemm_widen(kind, qs, d, m, n0, N, K, &p, M < IG_PREFETCH_ROWS, outliers, nout);
#ifdef NT_AMX
            if (amx) {
                amx_rows(kind, bytes, planes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);
                continue;
            }
#endif
#define NT_GEMM_ROWS(B)                                                                                              \
    if (kind == NT_Q4) gemm_rows(NT_Q4, B, planes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);                   \
    else if (kind == NT_Q4_F32) gemm_rows(NT_Q4_F32, B, planes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);      \
    else if (kind == NT_Q8) gemm_rows(NT_Q8, B, planes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);              \
    else gemm_rows(NT_Q8_HALVES, B, planes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);
            if (bytes) { NT_GEMM_ROWS(1) } else { NT_GEMM_ROWS(0) }
#undef NT_GEMM_ROWS
        }
        free(block);
    }
    free(rows);
    return failed ? -1 : 0;
}

/* ------------------------------------------- few rows: the GEMM's bits from the weights as stored */

/* Between one row and the GEMM sit small decode batches and a sequence's verified proposals. There the GEMM is bound
 * by widening the weights into panels (16 rows 1 to 2 KB apart per load), and the one-row kernels, running row by
 * row, by their instructions per row. Here the weights are read as stored, 16 rows at a time: each 64 bytes of the
 * 16 rows, transposed 4 bytes to a 32-bit lane (as gemm_widen does, but in registers, once for all the rows of
 * codes), give vectors of 4 neighbouring codes of 16 rows, and every row of activation codes meets them in vpdpbusd
 * with its 4 matching codes broadcast. The exact route's first level of codes (int16, split_levels) is 256 hi + lo
 * (lo unsigned, hi signed), two planes of bytes: Q4's codes (0..15) are signed bytes against lo and unsigned ones
 * against hi; int8 weight codes meet lo, and hi + 128 (unsigned) with 128 times their sum taken out again. Its
 * second level (int8 codes) and int8 activation codes (`bytes`, with their outlier columns fixed) are one plane:
 * Q4's codes unsigned against them, int8 weight codes against them plus 128, as gemm_tile takes them. Either way
 * each scale group's int32 sum is exactly the GEMM's, and from there the float work is gemm_tile's, operation for
 * operation (per scale group one multiply-add by the product of the scales, Q4's offset one more, then the outlier
 * columns in order), so every output has the GEMM's bits whatever the rows beside it, and a row's numbers do not
 * change with its batch or with the route its batch size takes. */
#define FEW_PASS 4 /* activation rows per pass over 16 weight rows (up to 8 rows of codes: accumulators in registers) */
#define ROWS8_MAX 16 /* activation rows up to which nt_block_gemm8 takes it */

/* Values [0, per_row) of 16 rows' scales from row n0 (rows from N on as zeros), fp16 or (f32) fp32, as dst[v * 16 + i]
 * = row n0 + i's value v: the layout of gemm_panels' scales, by 16 x 16 transposes. */
static void scales16(const void *src, int f32, int64_t per_row, int64_t n0, int64_t N, float *dst) {
    for (int64_t v0 = 0; v0 < per_row; v0 += 16) {
        const int64_t cnt = per_row - v0 < 16 ? per_row - v0 : 16;
        const __mmask16 mask = (__mmask16)((1u << cnt) - 1);
        __m512i r[16];
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = n0 + i;
            if (n >= N) r[i] = _mm512_setzero_si512();
            else if (f32) r[i] = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, (const float *)src + n * per_row + v0));
            else r[i] = _mm512_castps_si512(_mm512_cvtph_ps(
                     _mm256_maskz_loadu_epi16(mask, (const uint16_t *)src + n * per_row + v0)));
        }
        transpose16_epi32(r);
        for (int64_t j = 0; j < cnt; j++) _mm512_storeu_si512(dst + (v0 + j) * 16, r[j]);
    }
}

/* The outlier columns' weights of rows n0..n0 + 15 as gemm_widen forms them, [outlier][16 rows] into wout: the bytes
 * holding their codes read row by row (rows from N on repeat row N - 1) at positions worked out once, then per
 * outlier one vector of 16 codes times the scales (and plus Q4's offsets) laid out by scales16. */
static void outlier_weights16(int kind, const void *qs, int64_t K, int64_t N, int64_t n0, const int32_t *outliers,
                              int64_t nout, const float *scale, const float *offset, float *wout) {
    const int64_t row_bytes = IS_Q4(kind) ? K / 2 : K, halves = kind == NT_Q8_HALVES;
    uint8_t bytes[OUTLIER_MAX][16];
    int32_t pos[OUTLIER_MAX];
    for (int64_t j = 0; j < nout; j++)
        pos[j] = IS_Q4(kind) ? (outliers[j] / QK) * 16 + (outliers[j] % QK) % 16 : outliers[j];
    for (int64_t r = 0; r < 16; r++) {
        const uint8_t *row = (const uint8_t *)qs + (n0 + r < N ? n0 + r : N - 1) * row_bytes;
        for (int64_t j = 0; j < nout; j++) bytes[j][r] = row[pos[j]];
    }
    for (int64_t j = 0; j < nout; j++) {
        const int64_t c = outliers[j], g = c / QK, i = c % QK;
        const __m128i b = _mm_loadu_si128((const __m128i *)bytes[j]);
        const __m512i q = IS_Q4(kind) ? _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(b), i < 16 ? 0 : 4),
                                                         _mm512_set1_epi32(0x0F))
                                      : _mm512_cvtepi8_epi32(b);
        __m512 w = _mm512_mul_ps(_mm512_loadu_ps(scale + (halves ? c / 16 : g) * 16), _mm512_cvtepi32_ps(q));
        if (IS_Q4(kind)) w = _mm512_add_ps(w, _mm512_loadu_ps(offset + g * 16));
        _mm512_storeu_ps(wout + j * 16, w);
    }
}

/* One scale group's sums of 16 weight rows against T rows of codes, for `nv` vectors of weights w (4 codes of each
 * row, 16 rows): vector i against the 4 codes at byte 4 i of each row of codes (x: the group's codes, 64 bytes a row
 * of codes: a first level's lo plane then its hi plane, or int8 codes: a second level's, or `bytes`), into f as
 * gemm_tile does (wsum: 128 times the int8 weight codes' sums). Two rows of codes at a time, each plane's sum in two
 * chains (even and odd vectors): up to eight independent chains of multiply-adds (one chain per plane left the
 * kernel waiting on their latency: 35-40 G products/s on a Zen 5 core in cache, then 50-60), every code one
 * displacement from x. */
static inline __attribute__((always_inline)) void few_group(const int kind, const int bytes, const int T,
                                                            const __m512i *w, const int nv, const uint8_t *x,
                                                            __m512i wsum, __m512 dw, __m512 mw, const float *xd,
                                                            const float *xs, int64_t g, int64_t groups, __m512 *f) {
#pragma GCC unroll 8
    for (int t = 0; t < T; t += 2) {
        __m512i a[2][2][2]; /* [row of codes][plane: lo or int8 codes, hi][chain] */
        for (int j = 0; j < 2; j++)
            for (int p = 0; p < 2; p++) a[j][p][0] = a[j][p][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int i = 0; i < nv; i++)
#pragma GCC unroll 2
            for (int j = 0; j < 2; j++) {
                if (t + j >= T) continue;
                int32_t l4, h4;
                memcpy(&l4, x + (t + j) * 64 + 4 * i, 4);
                memcpy(&h4, x + (t + j) * 64 + 32 + 4 * i, 4);
                __m512i *lo = &a[j][0][i & 1], *hi = &a[j][1][i & 1];
                if ((bytes || j) && IS_Q4(kind)) *lo = _mm512_dpbusd_epi32(*lo, w[i], _mm512_set1_epi32(l4));
                else *lo = _mm512_dpbusd_epi32(*lo, _mm512_set1_epi32(l4), w[i]);
                if (!bytes && !j)
                    *hi = IS_Q4(kind) ? _mm512_dpbusd_epi32(*hi, w[i], _mm512_set1_epi32(h4))
                                      : _mm512_dpbusd_epi32(*hi, _mm512_set1_epi32(h4), w[i]);
            }
#pragma GCC unroll 2
        for (int j = 0; j < 2; j++) {
            if (t + j >= T) continue;
            __m512i sum = _mm512_add_epi32(a[j][0][0], a[j][0][1]);
            if (bytes || j) {
                if (!IS_Q4(kind)) sum = _mm512_sub_epi32(sum, wsum); /* (c + 128) . w - 128 sum(w) */
            } else {
                __m512i hi = _mm512_add_epi32(a[j][1][0], a[j][1][1]);
                if (!IS_Q4(kind)) hi = _mm512_sub_epi32(hi, wsum); /* (hi + 128) . w - 128 sum(w) */
                sum = _mm512_add_epi32(sum, _mm512_slli_epi32(hi, 8));
            }
            const int64_t r = t + j;
            f[r] = scale_group(f[r], sum, dw, _mm512_set1_ps(xd[r * groups + g]), IS_Q4(kind), mw,
                               IS_Q4(kind) ? _mm512_set1_ps(xs[r * groups + g]) : _mm512_setzero_ps());
        }
    }
}

/* out rows [0, M) (M <= FEW_PASS), columns n0..n0 + 15 (those from N on not written), against M activation rows'
 * codes in planes ([groups][`rows` rows of codes][64 bytes]; int16: rows 2r and 2r + 1 the levels of row r), their
 * scales xd and Q4 sums xs [rows of codes][groups], and (bytes) outlier values xo [M][nout] with their weights wout. */
static inline __attribute__((always_inline)) void few_block(const int kind, const int bytes, const int M,
                                                            const uint8_t *planes, int64_t rows, const float *xd,
                                                            const float *xs, const float *xo, int64_t nout,
                                                            const float *wout, int64_t K, int64_t N, const void *qs,
                                                            int64_t n0, const float *scale, const float *offset,
                                                            float *out, int64_t ldo) {
    const int T = bytes ? M : 2 * M;
    const int64_t groups = K / QK, halves = kind == NT_Q8_HALVES, row_bytes = IS_Q4(kind) ? K / 2 : K;
    const __m512i nibble = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    __m512 f[2 * FEW_PASS];
    for (int t = 0; t < T; t++) f[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < row_bytes; c += 64) {
        const int64_t left = row_bytes - c;
        const __mmask64 mask = left >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << left) - 1;
        if (n0 + 32 < N) { /* rows n0 + 32..n0 + 47 (contiguous) in order, a 16th of them per 64 bytes here */
            const int64_t end = (n0 + 48 < N ? n0 + 48 : N) * row_bytes, last = c + 64 >= row_bytes;
            const int64_t from = (n0 + 32) * row_bytes + c * 16, to = last ? end : from + 1024;
            for (int64_t b = from; b < to && b < end; b += 64) _mm_prefetch((const char *)qs + b, _MM_HINT_T0);
        }
        __m512i r[16];
        for (int64_t i = 0; i < 16; i++)
            r[i] = n0 + i < N ? _mm512_maskz_loadu_epi8(mask, (const uint8_t *)qs + (n0 + i) * row_bytes + c)
                              : _mm512_setzero_si512();
        transpose16_epi32(r); /* r[u] lane i: bytes c + 4u..c + 4u + 3 of row n0 + i */
        const int64_t have = left >= 64 ? 16 : left / 4; /* vectors holding bytes of the rows */
        if (IS_Q4(kind)) { /* a group is 16 bytes: 4 vectors, low nibbles codes 4j.., high ones 4j + 16.. */
            for (int64_t u0 = 0; u0 < have; u0 += 4) {
                const int64_t g = (c + 4 * u0) / 16;
                __m512i w[8];
                for (int j = 0; j < 4; j++) {
                    w[j] = _mm512_and_si512(r[u0 + j], nibble);
                    w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(r[u0 + j], 4), nibble);
                }
                few_group(kind, bytes, T, w, 8, planes + g * rows * 64, _mm512_setzero_si512(),
                          _mm512_loadu_ps(scale + g * 16), _mm512_loadu_ps(offset + g * 16), xd, xs, g, groups, f);
            }
            continue;
        }
        const int per = halves ? 4 : 8; /* vectors of a scale group: 16 or 32 codes */
        for (int64_t u0 = 0; u0 < have; u0 += per) {
            const int64_t s = (c + 4 * u0) / (halves ? 16 : QK), g = halves ? s / 2 : s;
            __m512i wsum = _mm512_setzero_si512();
            for (int j = 0; j < per; j++) wsum = _mm512_dpbusd_epi32(wsum, ones, r[u0 + j]);
            few_group(kind, bytes, T, r + u0, per, planes + g * rows * 64 + (halves ? 16 * (s & 1) : 0),
                      _mm512_slli_epi32(wsum, 7), _mm512_loadu_ps(scale + s * 16), _mm512_setzero_ps(), xd, xs, g,
                      groups, f);
        }
    }
    const __mmask16 keep = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    if (!bytes) {
        for (int i = 0; i < M; i++)
            _mm512_mask_storeu_ps(out + i * ldo + n0, keep, _mm512_add_ps(f[2 * i], f[2 * i + 1]));
        return;
    }
    for (int t = 0; t < M; t++) {
        for (int64_t j = 0; j < nout; j++)
            f[t] = _mm512_fmadd_ps(_mm512_set1_ps(xo[t * nout + j]), _mm512_loadu_ps(wout + j * 16), f[t]);
        _mm512_mask_storeu_ps(out + t * ldo + n0, keep, f[t]);
    }
}

/* M rows of x (row stride ldx) against a block weight with the GEMM's bits (few_block): two levels of codes, or
 * (`bytes`) int8 codes without the outlier columns outliers [nout] (fixed), whose products are added in fp32.
 * Returns 0, or -1 for no memory. */
static int block_few(int kind, int bytes, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                     const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads,
                     const int32_t *outliers, int64_t nout) {
    const int64_t groups = K / QK, sg = kind == NT_Q8_HALVES ? 2 * groups : groups, T = bytes ? M : 2 * M;
    const size_t floats = (size_t)((bytes ? 0 : T * K) + 2 * T * groups + M * nout);
    const size_t codes = (size_t)(bytes ? M * K : 0);
    void *block = malloc(floats * sizeof(float) + codes + (size_t)(groups * 4 + groups * T * 64) + 64);
    if (!block) return -1;
    float *levels = (float *)block, *xd = levels + (bytes ? 0 : T * K), *xs = xd + T * groups, *xo = xs + T * groups;
    int8_t *natural = (int8_t *)(xo + M * nout);
    uint32_t *skip = (uint32_t *)(natural + codes);
    uint8_t *planes = (uint8_t *)(skip + groups);
    if (bytes) {
        memset(skip, 0, (size_t)groups * sizeof(uint32_t));
        for (int64_t j = 0; j < nout; j++) skip[outliers[j] / QK] |= 1u << (outliers[j] % QK);
        for (int64_t r = 0; r < M; r++) {
            quantize_row8(x + r * ldx, K, natural + r * K, xd + r * groups, xs + r * groups, !IS_Q4(kind),
                          nout ? skip : NULL);
            for (int64_t b = 0; b < groups; b++) memcpy(planes + (b * T + r) * 64, natural + r * K + b * QK, QK);
            for (int64_t j = 0; j < nout; j++) xo[r * nout + j] = x[r * ldx + outliers[j]];
        }
    } else {
        split_levels(x, M, K, ldx, levels);
        const __m128i flip = _mm_set1_epi8(IS_Q4(kind) ? 0 : (char)0x80);
        for (int64_t t = 0; t < T; t++)
            for (int64_t b = 0; b < groups; b++) {
                uint8_t *dst = planes + (b * T + t) * 64;
                level_planes(levels + t * K + b * QK, t, flip, dst, dst + 32, xd + t * groups + b,
                             xs + t * groups + b);
            }
    }
    const int64_t blocks = (N + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *scratch = malloc((size_t)((sg + groups + OUTLIER_MAX) * 16) * sizeof(float) + 64);
        if (!scratch) failed = 1;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!scratch) continue;
            const int64_t n0 = 16 * b;
            float *scale = scratch, *offset = scale + sg * 16, *wout = offset + groups * 16;
            if (n0 + 16 < N) { /* the next 16 rows' scales and offsets */
                const int64_t end = n0 + 32 < N ? n0 + 32 : N;
                const int64_t scale_bytes = kind == NT_Q8_HALVES || kind == NT_Q4_F32 ? 4 * sg : 2 * sg;
                for (int64_t at = (n0 + 16) * scale_bytes; at < end * scale_bytes; at += 64) {
                    _mm_prefetch((const char *)d + at, _MM_HINT_T0);
                    if (IS_Q4(kind)) _mm_prefetch((const char *)m + at, _MM_HINT_T0);
                }
            }
            scales16(d, kind == NT_Q8_HALVES || kind == NT_Q4_F32, sg, n0, N, scale);
            if (IS_Q4(kind)) scales16(m, kind == NT_Q4_F32, groups, n0, N, offset);
            if (nout) outlier_weights16(kind, qs, K, N, n0, outliers, nout, scale, offset, wout);
            for (int64_t r0 = 0; r0 < M; r0 += FEW_PASS) {
                const int64_t R = M - r0 < FEW_PASS ? M - r0 : FEW_PASS, first = bytes ? r0 : 2 * r0;
                const uint8_t *p = planes + first * 64;
                const float *pd = xd + first * groups, *ps = xs + first * groups, *po = xo + r0 * nout;
                float *o = out + r0 * ldo;
#define NT_FEW(B, R)                                                                                                 \
    if (kind == NT_Q4) few_block(NT_Q4, B, R, p, T, pd, ps, po, nout, wout, K, N, qs, n0, scale, offset, o, ldo);    \
    else if (kind == NT_Q4_F32)                                                                                      \
        few_block(NT_Q4_F32, B, R, p, T, pd, ps, po, nout, wout, K, N, qs, n0, scale, offset, o, ldo);              \
    else if (kind == NT_Q8)                                                                                          \
        few_block(NT_Q8, B, R, p, T, pd, ps, po, nout, wout, K, N, qs, n0, scale, offset, o, ldo);                  \
    else few_block(NT_Q8_HALVES, B, R, p, T, pd, ps, po, nout, wout, K, N, qs, n0, scale, offset, o, ldo);
#define NT_FEW_ROWS(B)                                                                                               \
    switch (R) {                                                                                                     \
    case 1: NT_FEW(B, 1) break;                                                                                      \
    case 2: NT_FEW(B, 2) break;                                                                                      \
    case 3: NT_FEW(B, 3) break;                                                                                      \
    default: NT_FEW(B, 4) break;                                                                                     \
    }
                if (bytes) { NT_FEW_ROWS(1) } else { NT_FEW_ROWS(0) }
#undef NT_FEW_ROWS
#undef NT_FEW
            }
        }
        free(scratch);
    }
    free(block);
    return failed ? -1 : 0;
}

static int block_gemm_codes(int kind, int bytes, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                            const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads,
                            const int32_t *outliers, int64_t num_outliers);

/* Activation rows from which a product of a few rows (nt_block_matmul's, nt_block_gemm8's with fixed outlier
 * columns) takes the GEMM instead of block_few: the same bits either way. On a CPU with AMX (Sapphire Rapids: two
 * ports for 512-bit vpdpbusd) the VNNI GEMM is the faster from 8 rows of exact codes and from 12 of int8 ones: one
 * decoder block's products of SmolLM2 and of Gemma 3 on 2 cores, block_few's time over the GEMM's (medians of 7
 * alternating rounds, two runs), exact codes 8 rows 1.04x and 1.13x, 12 rows 1.16-1.17x, 16 rows 1.25-1.37x; int8
 * codes 8 rows 0.96-0.97x, 12 rows 1.22x, 16 rows 1.34-1.37x. On Zen 4 and Zen 5 block_few stays the faster up to
 * 16 rows (quant_linear.VNNI_MAX_ROWS). Where the AMX route is switched on, from 8 rows (a tile takes 16 rows of a
 * plane). */
#define GEMM_FEW_ROWS 8
#define GEMM_FEW_ROWS8 12

static int few_on_gemm(int bytes, int64_t M) {
#ifdef NT_AMX
    return (amx_on() && M >= GEMM_FEW_ROWS) || (amx_cpu() && M >= (bytes ? GEMM_FEW_ROWS8 : GEMM_FEW_ROWS));
#else
    (void)bytes, (void)M;
    return 0;
#endif
}

/* nt_block_matmul's products of two rows and more with AVX-512 VNNI (two levels of codes): block_few, or the
 * GEMM (few_on_gemm). */
NT_INTERNAL int block_rows16(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                             const void *d, const void *m, float *out, int64_t ldo, int threads) {
    if (few_on_gemm(0, M)) return block_gemm_codes(kind, 0, x, M, K, ldx, N, qs, d, m, out, ldo, threads, NULL, 0);
    return block_few(kind, 0, x, M, K, ldx, N, qs, d, m, out, ldo, threads, NULL, 0);
}

/* The GEMM over block weights, with activation codes in two levels (split_levels) or (`bytes`) int8 ones,
 * these without the outlier columns (outlier_columns), whose products are added in fp32. */
static int block_gemm_codes(int kind, int bytes, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                            const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads,
                            const int32_t *outliers, int64_t num_outliers) {
    if (!bytes) { /* the levels as rows of their own, each pair summed into one output row by exact_tile */
        float *levels = malloc((size_t)(2 * M * K) * sizeof(float) + 64);
        if (!levels) return -1;
        split_levels(x, M, K, ldx, levels);
        x = levels, M *= 2, ldx = K;
    }
    const int status = block_gemm_rows(kind, bytes, x, M, K, ldx, N, qs, d, m, out, ldo, threads, outliers,
                                       num_outliers);
    if (!bytes) free((void *)x);
    return status;
}
#endif

/* nt_block_matmul's product through a GEMM, for batches bound by compute: with AVX-512 VNNI the byte one
 * (block_gemm_codes), else the fp32 one: each thread dequantizes 16 weight rows at a time into a panel of its own (a
 * few percent of the multiply-adds at 64 rows) and runs every row tile of x over it. Either way no fp32 copy of the
 * weight is kept. Returns 0, or -1 as nt_block_matmul. */
int nt_block_gemm(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                  const void *d, const void *m, float *out, int64_t ldo, int threads) {
    if (!KNOWN_KIND(kind) || K % QK) return -1;
#ifdef NT_VNNI512
    return block_gemm_codes(kind, 0, x, M, K, ldx, N, qs, d, m, out, ldo, threads, NULL, 0);
#endif
    const int64_t panels = (N + SG_COLS - 1) / SG_COLS;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        float *rows = malloc((size_t)(2 * SG_COLS * K) * sizeof(float)), *panel = rows + SG_COLS * K;
        if (!rows) failed = 1;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!rows) continue;
            const int64_t n0 = p * SG_COLS, cols = N - n0 < SG_COLS ? N - n0 : SG_COLS;
            for (int64_t j = 0; j < SG_COLS; j++) {
                if (j < cols) dequantize_row(kind, qs, d, m, n0 + j, K, rows + j * K);
                else memset(rows + j * K, 0, (size_t)K * sizeof(float));
            }
            to_panel(rows, K, panel);
            panel_product(x, M, K, ldx, panel, out + n0, ldo, cols);
        }
        free(rows);
    }
    return failed ? -1 : 0;
}

/* nt_block_gemm with the activations as int8 codes per 32 values (block_gemm_codes with bytes), where the CPU has
 * AVX-512 VNNI, their outlier columns (outlier_columns) multiplied in fp32: a layer's projections at 512 rows, over
 * their real prefill activations, 1.47-1.53x the rate of the exact route when its second level was int16 codes too
 * (SmolLM2, Gemma 3; codes alone 1.56-1.66x), at 64 rows 1.33x. The activations' step is absmax / 127 per 32 values
 * where int16 codes keep it 258 times finer: teacher-forced top-1 agreement with the reference 99.2% for SmolLM2 and
 * 98.9% for Gemma 3, KL 6.8e-4 / 3.6e-4, where int16 gives 100% (transformers in bf16: 98.4% / 97.8%, KL 1.4e-3 /
 * 5.6e-4). Elsewhere the same as nt_block_gemm. outliers [num_outliers] (ascending, each below K, at most
 * NT_OUTLIER_MAX): the outlier columns, fixed, so that each row's result depends on that row alone (gemm_tile's
 * arithmetic per row does not depend on the rows beside it); num_outliers -1: chosen over the M rows. */
int nt_block_gemm8(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                   const void *d, const void *m, float *out, int64_t ldo, int threads, const int32_t *outliers,
                   int64_t num_outliers) {
    if (M < 0 || num_outliers > NT_OUTLIER_MAX || (num_outliers > 0 && !outliers)) return -1;
    for (int64_t j = 0; j < num_outliers; j++)
        if (outliers[j] < 0 || outliers[j] >= K || (j && outliers[j] <= outliers[j - 1])) return -1;
#ifdef NT_VNNI512
    if (!KNOWN_KIND(kind) || K % QK) return -1;
    if (M == 0) return 0;
    if (num_outliers >= 0 && M <= ROWS8_MAX && !few_on_gemm(1, M))
        return block_few(kind, 1, x, M, K, ldx, N, qs, d, m, out, ldo, threads, outliers, num_outliers);
    return block_gemm_codes(kind, 1, x, M, K, ldx, N, qs, d, m, out, ldo, threads, outliers, num_outliers);
#else
    return nt_block_gemm(kind, x, M, K, ldx, N, qs, d, m, out, ldo, threads);
#endif
}
