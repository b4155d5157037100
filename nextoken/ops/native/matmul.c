/* Block products of a few activation rows: weights in the formats of nt_format against activations in two levels of
 * codes per 32 values (split_levels), bound by the bytes of the weight (decode). */
#include "internal.h"

/* ------------------------------------------------------------ block scales */

#define TILE 4          /* activation rows of one tile */

#ifdef NT_AVX2
/* 8 block scales from h at g: fp16, or fp32 where `f32`. */
static inline __m256 scales_at(const void *h, int f32, int64_t g) {
    return f32 ? _mm256_loadu_ps((const float *)h + g)
               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)h + g)));
}
#endif

/* Weight row n's block scales against both levels of one activation row (code rows r and r + 1, split_levels):
 * s0[g] = d_w[g] * d_x[r][g] and s1[g] = d_w[g] * d_x[r + 1][g] (NT_Q8_HALVES: per half block, [2g] and [2g + 1]),
 * each weight scale read and converted once for both. Returns the row's Q4 offset term for the activation row,
 * sum_g m[g] * (s_x[r][g] + s_x[r + 1][g]) (0 for the int8 kinds): with AVX2 as a vector of partial sums, which the
 * kernels add to their products' before the one horizontal sum of the output. Against a pass per level and
 * an offset per level (two horizontal sums), SmolLM2's projections at one row took 0.9x the time. */
#ifdef NT_AVX2
typedef __m256 offset_sum;
#else
typedef float offset_sum;
#endif

static inline offset_sum level_scales(int kind, const quantized_rows *x, int64_t r, int64_t groups, const void *wd,
                                      const void *wm, int64_t n, float *s0, float *s1) {
    const float *d0 = x->d + r * groups, *d1 = d0 + groups;
    if (kind == NT_Q8_HALVES) {
        const float *d = (const float *)wd + n * 2 * groups;
        for (int64_t g = 0; g < groups; g++) {
            s0[2 * g] = d[2 * g] * d0[g], s0[2 * g + 1] = d[2 * g + 1] * d0[g];
            s1[2 * g] = d[2 * g] * d1[g], s1[2 * g + 1] = d[2 * g + 1] * d1[g];
        }
        return (offset_sum){0};
    }
    const int f32 = kind == NT_Q4_F32;
    const int64_t bytes = f32 ? 4 : 2;
    const void *h = (const uint8_t *)wd + n * groups * bytes;
    const void *mh = IS_Q4(kind) ? (const uint8_t *)wm + n * groups * bytes : NULL;
    const float *x0 = x->s + r * groups, *x1 = x0 + groups;
#ifdef NT_AVX2
    if (groups >= 8) { /* whole vectors: a last partial one is the row's last 8 groups, its repeated lanes masked
                        * out of the sum, so nothing is read past the row and no scalar tail runs */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0;; g += 8) {
            const int64_t at = g + 8 <= groups ? g : groups - 8;
            const __m256 hv = scales_at(h, f32, at);
            _mm256_storeu_ps(s0 + at, _mm256_mul_ps(hv, _mm256_loadu_ps(d0 + at)));
            _mm256_storeu_ps(s1 + at, _mm256_mul_ps(hv, _mm256_loadu_ps(d1 + at)));
            if (mh) {
                const __m256 fresh = _mm256_castsi256_ps(_mm256_cmpgt_epi32( /* lanes at + lane >= g */
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)(g - at) - 1)));
                acc = _mm256_fmadd_ps(_mm256_and_ps(scales_at(mh, f32, at), fresh),
                                      _mm256_add_ps(_mm256_loadu_ps(x0 + at), _mm256_loadu_ps(x1 + at)), acc);
            }
            if (g + 8 >= groups) break;
        }
        return acc;
    }
#endif
    float dot = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const float hv = f32 ? ((const float *)h)[g] : half_to_float(((const uint16_t *)h)[g]);
        s0[g] = hv * d0[g], s1[g] = hv * d1[g];
        if (mh) dot += (f32 ? ((const float *)mh)[g] : half_to_float(((const uint16_t *)mh)[g])) * (x0[g] + x1[g]);
    }
#ifdef NT_AVX2
    return _mm256_setr_ps(dot, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
#else
    return dot;
#endif
}

/* ------------------------------------------------------ block products */

/* Weights in the formats of nt_block_matmul (kind) against activations in two levels of codes per 32 values, held as
 * int16 (split_levels): weights are widened to int16, so each block is two 16-bit multiply-add instructions per row
 * of codes, and the result is within the codes' own error (split_levels) and fp32 rounding of an fp32 matmul over
 * the dequantized weight. Per weight row, the products of weight and activation block scales are formed first
 * (vectorized), so the inner loop is integer products and one multiply-add per block. Inlined for each constant
 * number of activation rows T, so that the accumulators stay in registers. */
#ifdef NT_AVX2
/* Block g of Q4 weight row n, a last block without a pair (see pair_into for the others), as two int16 vectors in
 * the activations' order (code_at): A holds the even elements of each half, B the odd ones; lane 0 is the first
 * half, lane 1 the second. Both lanes hold the 16 bytes, shifted per lane by 0 / 4 (A) and 8 / 12 (B) bits and
 * masked to one nibble per 16-bit word. */
static inline __attribute__((always_inline)) void unpack_q4(const void *qs, int64_t n, int64_t K, int64_t g,
                                                            __m256i *a, __m256i *b) {
    const __m256i bytes = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + n * (K / 2) + g * 16)));
    const __m256i nibble = _mm256_set1_epi32(0x000F000F);
    *a = _mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), nibble);
    *b = _mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12)), nibble);
}
#endif

#ifdef NT_AVX2
/* Block g of weight row n against activation rows r0..r0+T-1, into accumulator `which` of each output. */
static inline __attribute__((always_inline)) void block_into(int kind, int halves, const quantized_rows *x,
                                                             int64_t r0, const int T, int64_t K, const void *qs,
                                                             int64_t n, int64_t g, float scale[][2 * MAX_GROUPS],
                                                             __m256 acc[][2], const int which) {
    __m256i xa[TILE], xb[TILE];
    for (int i = 0; i < T; i++) {
        const int16_t *a = x->q + (r0 + i) * K + g * QK;
        xa[i] = _mm256_loadu_si256((const __m256i *)a);
        xb[i] = _mm256_loadu_si256((const __m256i *)(a + 16));
    }
    if (IS_Q4(kind)) {
        __m256i wa, wb;
        unpack_q4(qs, n, K, g, &wa, &wb);
        for (int i = 0; i < T; i++) {
            const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(wa, xa[i]),
                                                                 _mm256_madd_epi16(wb, xb[i])));
            acc[i][which] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&scale[i][g]), acc[i][which]);
        }
    } else { /* int8 codes, widened in their natural order: elements 0-15, then 16-31 */
        const int8_t *c = (const int8_t *)qs + n * K + g * QK;
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
        for (int i = 0; i < T; i++) {
            const __m256i p0 = _mm256_madd_epi16(w0, xa[i]), p1 = _mm256_madd_epi16(w1, xb[i]);
            if (halves == 2) {
                acc[i][which] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(&scale[i][2 * g]),
                                                acc[i][which]);
                acc[i][which] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(&scale[i][2 * g + 1]),
                                                acc[i][which]);
            } else {
                acc[i][which] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                                _mm256_broadcast_ss(&scale[i][g]), acc[i][which]);
            }
        }
    }
}

/* Blocks g and g + 1 of Q4 weight row n against activation rows r0..r0+T-1 (codes in q4_position order),
 * into accumulator `which`: the pair's 32 bytes of nibbles are four int16 vectors by three shifts and three masks
 * (per 16-bit word: elements 2w, 2w + 16, 2w + 1, 2w + 17, the first block in words 0..7, the second in 8..15). The
 * four products are summed as integers; lanes 0..3 then belong to block g and 4..7 to g + 1, so one multiply-add
 * by [scale g x 4 | scale g + 1 x 4] finishes the pair. */
static inline __attribute__((always_inline)) void pair_into(const quantized_rows *x, int64_t r0, const int T,
                                                            int64_t K, const void *qs, int64_t n, int64_t g,
                                                            float scale[][2 * MAX_GROUPS], __m256 acc[][2],
                                                            const int which) {
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint8_t *)qs + n * (K / 2) + g * 16));
    const __m256i w0 = _mm256_and_si256(v, nibble), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                  w2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), nibble), w3 = _mm256_srli_epi16(v, 12);
    for (int i = 0; i < T; i++) {
        const __m256i *a = (const __m256i *)(x->q + (r0 + i) * K + g * QK);
        const __m256i sum = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(a)),
                             _mm256_madd_epi16(w1, _mm256_loadu_si256(a + 1))),
            _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_loadu_si256(a + 2)),
                             _mm256_madd_epi16(w3, _mm256_loadu_si256(a + 3))));
        const __m256 sc = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)&scale[i][g]))), spread);
        acc[i][which] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc, acc[i][which]);
    }
}
#endif

/* out[(r0 + i) / 2, n] for the rows of codes i < T (T even: both levels of T / 2 activation rows, see split_levels)
 * and every weight row n in [n0, n1), one weight row at a time, in the order the rows lie in memory; the rows of
 * codes share each unpacked weight block, with two chains per row (even and
 * odd blocks) where there are few. Four weight rows at a time for one activation row (its codes loaded once per
 * block for the four's chains) was as fast in cache, but with the weights streaming a whole SmolLM2 decode step (all
 * Q4_1) took 1.23x as long, on this route (built without AVX-512) and on the VNNI one alike (alternating in one
 * process, medians of 10 rounds): reading four rows side by side defeats the hardware's stream prefetch. */
static inline __attribute__((always_inline)) void tile(int kind, const quantized_rows *x, int64_t r0, const int T,
                                                       int64_t K, const void *qs, const void *wd, const void *wm,
                                                       int64_t n0, int64_t n1, float *out, int64_t ldo) {
    const int64_t groups = K / QK, halves = kind == NT_Q8_HALVES ? 2 : 1;
    float scale[TILE][2 * MAX_GROUPS];
    offset_sum offset[TILE / 2];
    for (int64_t n = n0; n < n1; n++) {
        for (int i = 0; i < T; i += 2)
            offset[i / 2] = level_scales(kind, x, r0 + i, groups, wd, wm, n, scale[i], scale[i + 1]);
#ifdef NT_AVX2
        /* The weight row after the next, into cache while this one is computed: the hardware prefetcher alone left
         * a 262k-row head (Gemma 3's, 168 MB) at 8.3 ms a pass, 7.3 ms with this. A prefetch never faults, so rows
         * past the end need no check. */
        const int64_t row_bytes = IS_Q4(kind) ? K / 2 : K;
        for (int64_t b = 0; b < row_bytes; b += 64)
            _mm_prefetch((const char *)qs + (n + 2) * row_bytes + b, _MM_HINT_T0);
        __m256 acc[TILE][2];
        for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        int64_t g = 0;
        if (IS_Q4(kind)) { /* blocks in pairs; two chains per output where there are few outputs */
            if (T < 4)
                for (; g + 4 <= groups; g += 4) {
                    pair_into(x, r0, T, K, qs, n, g, scale, acc, 0);
                    pair_into(x, r0, T, K, qs, n, g + 2, scale, acc, 1);
                }
            for (; g + 2 <= groups; g += 2) pair_into(x, r0, T, K, qs, n, g, scale, acc, 0);
        } else if (T < 4) { /* two chains per output, even and odd blocks: enough multiply-adds in flight */
            for (; g + 2 <= groups; g += 2) {
                block_into(kind, halves, x, r0, T, K, qs, n, g, scale, acc, 0);
                block_into(kind, halves, x, r0, T, K, qs, n, g + 1, scale, acc, 1);
            }
        }
        for (; g < groups; g++) block_into(kind, halves, x, r0, T, K, qs, n, g, scale, acc, 0);
        for (int i = 0; i < T; i += 2) { /* the two levels of one activation row */
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                             _mm256_add_ps(acc[i + 1][0], acc[i + 1][1]));
            out[((r0 + i) >> 1) * ldo + n] = hsum_ps(_mm256_add_ps(sum, offset[i / 2]));
        }
#else
        for (int i = 0; i < T; i++) {
            const int16_t *a = x->q + (r0 + i) * K;
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t sum[2] = {0, 0}; /* elements 0..15, 16..31 */
                for (int e = 0; e < QK; e++) {
                    int w;
                    if (IS_Q4(kind)) {
                        const uint8_t byte = ((const uint8_t *)qs)[n * (K / 2) + g * 16 + e % 16];
                        w = e < 16 ? byte & 0x0F : byte >> 4;
                    } else {
                        w = ((const int8_t *)qs)[n * K + g * QK + e];
                    }
                    sum[e / 16] += w * a[IS_Q4(kind) ? q4_position(g, e, groups) : g * QK + e];
                }
                if (halves == 2) acc += (float)sum[0] * scale[i][2 * g] + (float)sum[1] * scale[i][2 * g + 1];
                else acc += (float)(sum[0] + sum[1]) * scale[i][g];
            }
            if (i & 1) out[((r0 + i) >> 1) * ldo + n] += acc; /* the second level */
            else out[((r0 + i) >> 1) * ldo + n] = acc + offset[i / 2];
        }
#endif
    }
}


#ifdef NT_VNNI512
/* ------------------------------------------ one-row Q4 products, AVX-512 VNNI */

/* With AVX-512 VNNI, one activation row meets Q4 weights through vpdpbusd, which multiplies unsigned bytes by signed
 * bytes and adds each four products into a 32-bit lane. The first level's int16 codes (the same codes as
 * quantize_row16, so the sums are the same integers) are split into bytes: c = 256 hi + lo, lo 0..255 unsigned and
 * hi signed. A nibble is both a small signed byte (against lo) and an unsigned one (against hi), so a 64-byte vector
 * of nibbles, four blocks (a quad), takes four byte multiply-adds, a shift and an add: half the instructions of the
 * int16 route, which is what bounds that route where the weights stream from memory. The second level's int8 codes
 * take two. */

/* Bytes per quad of activation codes: lo of elements 0..15 of each of the quad's four blocks (16 bytes each, in
 * block order), lo of elements 16..31, hi of 0..15, hi of 16..31. That is the order in which the quad's 64 bytes of
 * nibbles come out by a mask (element j of a block) and by a shift and a mask (element j + 16): lanes 4b..4b + 3 of
 * every product belong to block b. */
#define QUAD_BYTES 256

/* x [K] -> codes as bytes in quads, d and s as quantize_row16's. A last partial quad's missing blocks are left as
 * they are: their weights are read as zeros (q4_vnni_rows). */
static void quantize_row_quads(const float *x, int64_t K, uint8_t *q, float *d, float *s, float levels) {
    const int64_t groups = K / QK;
    for (int64_t b = 0; b < groups; b++) {
        __m512i c0, c1;
        quantize_group(x + b * QK, 0, levels, &c0, &c1, d + b, s + b);
        uint8_t *dst = q + (b / 4) * QUAD_BYTES + (b % 4) * 16;
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(c0)); /* low bytes */
        _mm_storeu_si128((__m128i *)(dst + 64), _mm512_cvtepi32_epi8(c1));
        _mm_storeu_si128((__m128i *)(dst + 128), _mm512_cvtepi32_epi8(_mm512_srai_epi32(c0, 8))); /* high bytes */
        _mm_storeu_si128((__m128i *)(dst + 192), _mm512_cvtepi32_epi8(_mm512_srai_epi32(c1, 8)));
    }
}

/* One quad of Q4 weight bytes v against the quad's activation bytes a, times its four scales (sc: 4 floats, one per
 * block, spread to four lanes each), into acc. The first level (`second` 0): lo unsigned against the nibbles, the
 * nibbles unsigned against hi, 256 hi + lo; the second level's int8 codes (each its lo byte, signed): the nibbles
 * unsigned against them, two byte multiply-adds. */
static inline __attribute__((always_inline)) __m512 quad_into(__m512i v, const uint8_t *a, const float *sc,
                                                              __m512 acc, const int second) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i w0 = _mm512_and_si512(v, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 64);
    __m512i sum;
    if (second) {
        sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w0, a0), w1, a1);
    } else {
        const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, a0, w0), a1, w1);
        const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w0, _mm512_loadu_si512(a + 128)), w1,
                                               _mm512_loadu_si512(a + 192));
        sum = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
    }
    const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sc)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
}

static inline __m256 fold_ps(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Activation rows per pass over a weight row in q4_vnni_rows and q8_rows_vnni: one, as nt_block_matmul gives them
 * single rows (two and more take block_rows16, in gemm.c). With four (each row's four accumulators' worth of
 * registers beside the weight's) they ran small batches before that kernel. */
#define VNNI_ROWS 1

/* out[(r0 + i) * ldo + n] for activation rows r0 + i, i < R (R <= VNNI_ROWS), and n in [n0, n1), one weight row at a
 * time (see tile), from both levels of each activation row in quads (code row 2r: row r's first level, 2r + 1 its
 * second; `stride` bytes apart; x->d, x->s per block and code row). Each quad of weight bytes is loaded and unpacked
 * once for the R rows. A row's sums are the same operations in the same order whatever R and the rows beside it,
 * so its result is the same bits alone or in a batch. A last partial quad of a row is read through a byte mask:
 * nothing past the weight is read, the missing blocks' nibbles are zeros (so are their products, whatever their
 * activation bytes) and their scales are zeros. */
static inline __attribute__((always_inline)) void q4_vnni_rows(const int kind, const int R, const uint8_t *xq,
                                                                int64_t stride, const quantized_rows *x, int64_t r0,
                                                                int64_t K, const void *qs, const void *wd,
                                                                const void *wm, int64_t n0, int64_t n1, float *out,
                                                                int64_t ldo) {
    const int64_t groups = K / QK, whole = groups / 4, row_bytes = K / 2;
    const __mmask64 tail = ((__mmask64)1 << (16 * (groups % 4))) - 1;
    float scale[2 * VNNI_ROWS][MAX_GROUPS + 4];
    offset_sum offset[VNNI_ROWS];
    const uint8_t *a[2 * VNNI_ROWS];
    for (int j = 0; j < 2 * R; j++) {
        memset(scale[j] + groups, 0, 4 * sizeof(float)); /* the last quad's missing blocks */
        a[j] = xq + (2 * r0 + j) * stride;
    }
    for (int64_t n = n0; n < n1; n++) {
        for (int i = 0; i < R; i++)
            offset[i] = level_scales(kind, x, 2 * (r0 + i), groups, wd, wm, n, scale[2 * i], scale[2 * i + 1]);
        for (int64_t b = 0; b < row_bytes; b += 64) /* as tile() does */
            _mm_prefetch((const char *)qs + (n + 2) * row_bytes + b, _MM_HINT_T0);
        const uint8_t *w = (const uint8_t *)qs + n * row_bytes;
        __m512 acc[2 * VNNI_ROWS];
        for (int j = 0; j < 2 * R; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < whole; g++) {
            const __m512i v = _mm512_loadu_si512(w + g * 64);
            for (int j = 0; j < 2 * R; j++)
                acc[j] = quad_into(v, a[j] + g * QUAD_BYTES, scale[j] + 4 * g, acc[j], j & 1);
        }
        if (groups % 4) {
            const __m512i v = _mm512_maskz_loadu_epi8(tail, w + whole * 64);
            for (int j = 0; j < 2 * R; j++)
                acc[j] = quad_into(v, a[j] + whole * QUAD_BYTES, scale[j] + 4 * whole, acc[j], j & 1);
        }
        for (int i = 0; i < R; i++)
            out[(r0 + i) * ldo + n] =
                hsum_ps(_mm256_add_ps(fold_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1])), offset[i]));
    }
}

/* nt_block_matmul for Q4 weights (NT_Q4 or NT_Q4_F32) and a few activation rows: levels [2M, K] (split_levels). */
static int q4_vnni(int kind, const float *levels, int64_t M, int64_t K, int64_t N, const void *qs, const void *d,
                   const void *m, float *out, int64_t ldo, int threads) {
    const int64_t groups = K / QK, quads = (groups + 3) / 4, stride = quads * QUAD_BYTES;
    quantized_rows xq = {NULL, NULL, NULL, malloc((size_t)(2 * M * (stride + 2 * groups * 4)) + 64)};
    if (!xq.block) return -1;
    uint8_t *codes = (uint8_t *)xq.block;
    xq.d = (float *)(codes + 2 * M * stride);
    xq.s = xq.d + 2 * M * groups;
    for (int64_t r = 0; r < 2 * M; r++)
        quantize_row_quads(levels + r * K, K, codes + r * stride, xq.d + r * groups, xq.s + r * groups,
                          level_codes(r));
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
        for (int64_t r0 = 0; r0 < M; r0++) {
            if (kind == NT_Q4_F32) q4_vnni_rows(NT_Q4_F32, 1, codes, stride, &xq, r0, K, qs, d, m, n0, n1, out, ldo);
            else q4_vnni_rows(NT_Q4, 1, codes, stride, &xq, r0, K, qs, d, m, n0, n1, out, ldo);
        }
    }
    free(xq.block);
    return 0;
}
#endif

#ifdef NT_VNNI512
/* The 16 sums of a block's vpdpwssd (lane i: its elements 2i and 2i + 1) times the block's scale (Q8 in halves:
 * lanes 0-7 the first half's, 8-15 the second's), into acc. */
static inline __attribute__((always_inline)) __m512 q8_block_vnni(const int halves, const int8_t *w, const int16_t *a,
                                                                  const float *sc, __m512 acc) {
    const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                          _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)),
                                          _mm512_loadu_si512(a));
    const __m512 scale = halves ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[0]), _mm512_set1_ps(sc[1]))
                                : _mm512_set1_ps(sc[0]);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
}

/* One activation row (its two levels: rows 0 and 1 of x) against int8 weights (NT_Q8 or NT_Q8_HALVES), the
 * int16 codes of both in vpdpwssd: a block of 32 is one 512-bit load of the activations, one widening load of the
 * weights and one multiply-add of pairs, where the AVX2 route takes two of each; a chain per level. The same integer
 * sums as that route. Against it, alternating in one process (medians of 10 rounds): Gemma 3's Q8_0 head streamed
 * 1.12x (0.82-1.63x), its int8 projections at one row 1.04x. Four weight rows at a time (as Q4 then had, see
 * tile) was 7% faster in cache but 2.3x slower streamed, the int16 route's tiles too. */
static inline __attribute__((always_inline)) void q8_rows_vnni(const int kind, const int R, const quantized_rows *x,
                                                                int64_t r0, int64_t K, const int8_t *qs,
                                                                const void *wd, int64_t n0, int64_t n1, float *out,
                                                                int64_t ldo) {
    const int64_t groups = K / QK, halves = kind == NT_Q8_HALVES, per = halves ? 2 : 1;
    float scale[2 * VNNI_ROWS][2 * MAX_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        for (int i = 0; i < R; i++)
            level_scales(kind, x, 2 * (r0 + i), groups, wd, NULL, n, scale[2 * i], scale[2 * i + 1]);
        for (int64_t b = 0; b < K; b += 64) _mm_prefetch((const char *)qs + (n + 2) * K + b, _MM_HINT_T0);
        const int8_t *w = qs + n * K;
        __m512 acc[2 * VNNI_ROWS];
        for (int j = 0; j < 2 * R; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++)
            for (int j = 0; j < 2 * R; j++)
                acc[j] = q8_block_vnni(halves, w + g * QK, x->q + (2 * r0 + j) * K + g * QK, scale[j] + g * per,
                                       acc[j]);
        for (int i = 0; i < R; i++)
            out[(r0 + i) * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
    }
}
#endif

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times a block-quantized weight [N, K]^T, the activations
 * in two levels of int16 codes (split_levels); the weight in block format `kind` (nt_format, nt.h).
 * Returns 0, or -1 for an unknown kind, K not a multiple of 32 (or too large), or no memory. */
int nt_block_matmul(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                    const void *d, const void *m, float *out, int64_t ldo, int threads) {
    if (!KNOWN_KIND(kind) || K % QK || K / QK > MAX_GROUPS) return -1;
#ifdef NT_VNNI512
    /* Two rows and more: the GEMM's bits (block_rows16), each row's the same in any batch of two or more, and
     * 1.5-2.1x the one-row kernels below (then four rows a pass) at 4-16 rows over whole models' projections and
     * head. At one row those stay: decode at batch 1 on block_rows16 was 1.01x on SmolLM2 but 0.82x on Gemma 3
     * (medians of 16 alternating rounds). */
    if (M > 1) return block_rows16(kind, x, M, K, ldx, N, qs, d, m, out, ldo, threads);
#endif
    float *levels = malloc((size_t)(2 * M * K) * sizeof(float) + 64);
    if (!levels) return -1;
    split_levels(x, M, K, ldx, levels);
#ifdef NT_VNNI512
    /* One row (decode at batch 1; more rows take block_rows16 above): against the AVX2 tiles below 1.2-1.6x
     * (one thread, SmolLM2's 576 x 1536 and Gemma 3's 640 x 2048 in each block format, Zen 5). */
    if (IS_Q4(kind)) {
        const int status = q4_vnni(kind, levels, M, K, N, qs, d, m, out, ldo, threads);
        free(levels);
        return status;
    }
#endif
    quantized_rows xq;
    const int status = quantize_rows(levels, 2 * M, K, K, IS_Q4(kind), &xq);
    free(levels);
    if (status) return -1;
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
#ifdef NT_VNNI512
        if (!IS_Q4(kind)) { /* as Q4 above, a row at a time */
            for (int64_t r0 = 0; r0 < M; r0++) {
                if (kind == NT_Q8) q8_rows_vnni(NT_Q8, 1, &xq, r0, K, (const int8_t *)qs, d, n0, n1, out, ldo);
                else q8_rows_vnni(NT_Q8_HALVES, 1, &xq, r0, K, (const int8_t *)qs, d, n0, n1, out, ldo);
            }
            continue;
        }
#endif
        for (int64_t r0 = 0; r0 < 2 * M; r0 += TILE) { /* rows of codes, both levels of TILE / 2 activation rows */
#define NT_TILE(T)                                                                                                   \
    if (kind == NT_Q4) tile(NT_Q4, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);                                       \
    else if (kind == NT_Q4_F32) tile(NT_Q4_F32, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);                          \
    else if (kind == NT_Q8) tile(NT_Q8, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);                                  \
    else tile(NT_Q8_HALVES, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);
            if (2 * M - r0 < TILE) { NT_TILE(2) }
            else { NT_TILE(TILE) }
#undef NT_TILE
        }
    }
    free(xq.block);
    return 0;
}
