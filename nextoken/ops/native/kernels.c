/* CPU kernels for decode-sized work: block-quantized matrix products, RMSNorm and paged decode attention.
 *
 * Weights are GGML-style blocks along the input dimension (formats at nt_block_matmul); activations are quantized
 * on the fly to int16 blocks of 32, so every block product is integer multiply-adds with AVX2.
 *
 * Compiled at first use with the machine's own instruction set (see __init__.py). Without AVX2 the same results come
 * from plain C loops (integer sums are exact; only the order of the float accumulation differs).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(NT_EMULATE_AVX512) /* tests: the AVX-512 routes on any x86-64 CPU (emulate512.h) */
#include "emulate512.h"
#define NT_AVX2 1
#define NT_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define NT_VNNI512 1 /* one-row Q4 products by byte multiply-adds (q4_vnni) */
#endif
#endif

#define QK 32
/* The weight formats (kind) of the block products: see nt_block_matmul. */
#define IS_Q4(kind) ((kind) == 4 || (kind) == 5)
#define KNOWN_KIND(kind) (IS_Q4(kind) || (kind) == 6 || (kind) == 8)

/* ---------------------------------------------------------------- fp16 */

static inline float half_to_float(uint16_t h) {
#ifdef NT_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

int nt_has_avx2(void) {
#ifdef NT_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Frees the calling thread's OpenMP workers; its next parallel region starts new ones. libgomp keeps a pool of
 * workers for every thread that starts regions, and once its threads outnumber the CPUs it parks them between
 * regions instead of letting them spin: a decode step's few hundred short regions then took 2.5x as long. A thread
 * that is done stepping for now calls this, so that another one can step at full speed. */
void nt_release_threads(void) {
#ifdef _OPENMP
    omp_pause_resource_all(omp_pause_soft);
#endif
}

int nt_has_vnni512(void) {
#ifdef NT_VNNI512
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------- activation quantization */

/* Where element j (0..31) of a block sits among the block's 32 stored activation codes for Q4 weights: the even
 * elements of each half, then the odd ones, [0 2 .. 14 | 16 18 .. 30 | 1 3 .. 15 | 17 19 .. 31]. Read as two vectors
 * of 16 int16 (A, B), those are the orders in which a Q4 block's nibbles come out of a 128-bit lane by a shift and a
 * mask per 32-bit word (unpack_q4), with no widening shuffle. int8 weights keep the natural order. */
static inline int64_t code_at(int64_t j) { return (j & 1) * 16 + (j >> 4) * 8 + ((j & 15) >> 1); }

/* Where element j of block b goes in a row of `groups` blocks of activation codes for Q4 weights. Blocks are taken
 * in pairs (b, b + 1 for even b): the 32 bytes of a pair's nibbles, read as 16 int16 words, hold in word w < 8 the
 * elements 2w, 2w + 16, 2w + 1 and 2w + 17 of the pair's first block (one per nibble, low to high), in words 8..15
 * the same of its second. A shift and a mask per nibble (pair_into) make four vectors of them; the pair's 64 codes
 * are stored as the four matching vectors, [k][16], k = 0..3 for the nibbles, first block's 8 then second's. A last
 * unpaired block keeps code_at. */
static inline int64_t q4_position(int64_t b, int64_t j, int64_t groups) {
    if ((b | 1) >= groups) return b * QK + code_at(j);
    const int64_t nibble = (j >> 4) + 2 * (j & 1);
    return (b & ~(int64_t)1) * QK + nibble * 16 + (b & 1) * 8 + ((j & 15) >> 1);
}

#ifdef NT_AVX2
/* A block's 32 int16 codes (from 4 vectors of int32) as two vectors: elements 0..15 and 16..31 (natural), or, for
 * Q4, each half's even elements in its low 128 bits and its odd ones in the high 128 bits. */
static inline void pack_block(const __m256i c[4], int q4_order, __m256i *lo, __m256i *hi) {
    /* packs: per 128-bit lane, [c0 lane | c1 lane]: elements 0-3 8-11 | 4-7 12-15 */
    const __m256i a = _mm256_packs_epi32(c[0], c[1]), b = _mm256_packs_epi32(c[2], c[3]);
    if (!q4_order) {
        *lo = _mm256_permute4x64_epi64(a, 0xD8);
        *hi = _mm256_permute4x64_epi64(b, 0xD8);
        return;
    }
    /* per lane, even words to the low 8 bytes: [0 2 8 10 | 1 3 9 11], [4 6 12 14 | 5 7 13 15]; then 32-bit words in
     * the order 0 4 1 5 2 6 3 7: evens 0..14, odds 1..15 */
    const __m256i even_odd = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    *lo = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a, even_odd), order);
    *hi = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(b, even_odd), order);
}
#endif

/* x [K] -> int16 codes (in q4_position order where `q4_order`), per block: d = absmax / 32767, s = d * sum(codes).
 * Rounding error under 2e-5 of the block's largest value: below fp32 matmul's own noise at these sizes, far below
 * bf16's. Codes round to nearest, ties to even, in both paths. */
static void quantize_row16(const float *x, int64_t K, int16_t *q, float *d, float *s, int q4_order) {
    const int64_t groups = K / QK;
#ifdef NT_AVX2
    __m256i prev_lo = _mm256_setzero_si256(), prev_hi = prev_lo; /* the first block of a pair, until its second */
    for (int64_t b = 0; b < groups; b++) {
        const float *xb = x + b * QK;
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float db = max / 32767.0f, inv = max > 0 ? 32767.0f / max : 0.0f;
        __m256i c[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))); /* nearest, ties to even */
            total = _mm256_add_epi32(total, c[i]);
        }
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
        d[b] = db;
        s[b] = db * (float)_mm_cvtsi128_si32(t4);
        __m256i lo, hi;
        pack_block(c, q4_order, &lo, &hi);
        __m256i *dst = (__m256i *)(q + (b & ~(int64_t)1) * QK);
        if (!q4_order || (b | 1) >= groups) { /* natural, or an unpaired Q4 block: code_at */
            _mm256_storeu_si256((__m256i *)(q + b * QK),
                                q4_order ? _mm256_permute2x128_si256(lo, hi, 0x20) : lo);
            _mm256_storeu_si256((__m256i *)(q + b * QK) + 1,
                                q4_order ? _mm256_permute2x128_si256(lo, hi, 0x31) : hi);
        } else if (b & 1) { /* a pair: per nibble k, the first block's 8 codes then the second's */
            _mm256_storeu_si256(dst, _mm256_permute2x128_si256(prev_lo, lo, 0x20));
            _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(prev_hi, hi, 0x20));
            _mm256_storeu_si256(dst + 2, _mm256_permute2x128_si256(prev_lo, lo, 0x31));
            _mm256_storeu_si256(dst + 3, _mm256_permute2x128_si256(prev_hi, hi, 0x31));
        } else {
            prev_lo = lo, prev_hi = hi;
        }
    }
#else
    for (int64_t b = 0; b < groups; b++) {
        const float *xb = x + b * QK;
        float max = 0.0f;
        for (int i = 0; i < QK; i++) max = fabsf(xb[i]) > max ? fabsf(xb[i]) : max;
        const float db = max / 32767.0f, inv = max > 0 ? 32767.0f / max : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int16_t code = (int16_t)nearbyintf(xb[i] * inv);
            q[q4_order ? q4_position(b, i, groups) : b * QK + i] = code;
            sum += code;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
#endif
}

typedef struct {
    int16_t *q; /* codes [M, K] */
    float *d, *s;
    void *block;
} quantized_rows;

static int quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int q4_order, quantized_rows *out) {
    const int64_t groups = K / QK;
    out->block = malloc((size_t)(M * K * 2 + 2 * M * groups * (int64_t)sizeof(float)) + 64);
    if (!out->block) return -1;
    out->d = (float *)out->block;
    out->s = out->d + M * groups;
    out->q = (int16_t *)(out->s + M * groups);
    for (int64_t r = 0; r < M; r++)
        quantize_row16(x + r * ldx, K, out->q + r * K, out->d + r * groups, out->s + r * groups, q4_order);
    return 0;
}

/* The block products take each activation row in two levels of int16 codes per block of 32, x = d1 q1 + d2 q2: the
 * codes of the row itself (quantize_row16's, d1 = absmax / 32767), then those of what they leave, x - d1 q1 (at most
 * d1 / 2). In one level a block holding one large value leaves its small values few significant bits: every value
 * is off by up to 1 / 65534 of the block's largest, which moved SmolLM2's teacher-forced log-probabilities by 3.5e-3
 * and Gemma 3's by 1.6e-3 against fp32 activations. Two levels keep each value within 2^-31 of its block's largest
 * (with the remainder's own fp32 rounding, 2^-24 of the value): an fp32 matmul's precision. The kernels take the
 * levels as two rows of codes each and sum each pair's products into one output.
 * rows [2M, K]: row 2r is x's row r, row 2r + 1 its remainder after the first level (quantize_row16's rounding: the
 * same products and the same rounding to nearest, ties to even). */
static void split_levels(const float *x, int64_t M, int64_t K, int64_t ldx, float *rows) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        float *first = rows + 2 * r * K, *rest = first + K;
        memcpy(first, xr, (size_t)K * sizeof(float));
        for (int64_t b = 0; b < K; b += QK) {
            float max = 0.0f;
            for (int i = 0; i < QK; i++) max = fabsf(xr[b + i]) > max ? fabsf(xr[b + i]) : max;
            const float db = max / 32767.0f, inv = max > 0 ? 32767.0f / max : 0.0f;
            for (int i = 0; i < QK; i++) rest[b + i] = xr[b + i] - nearbyintf(xr[b + i] * inv) * db;
        }
    }
}

#ifdef NT_AVX2
static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Cephes' constants: the clamp, log2(e), ln 2 in two parts, and the polynomial's coefficients, highest first. */
static const float EXP_MAX = 88.3762626647949f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                   EXP_LN2_LO = -2.12194440e-4f;
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

/* e^x for 8 lanes, within 2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, then
 * 2^n through the exponent bits). Inputs are clamped to +-88.376, where e^x is near fp32's largest and smallest
 * normal numbers (far enough for the softmax and the gated activations that use it); NaN stays NaN. */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), _mm256_max_ps(_mm256_set1_ps(-EXP_MAX), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int c = 1; c < 6; c++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[c]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two factors, so that n = 128 (x near 88.7) still has an exponent field */
    const __m256i e = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(e, 1);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

#ifdef NT_VNNI512
/* exp_ps on 16 lanes, the power of two applied by vscalefps (exact, no exponent-field arithmetic). */
static inline __m512 exp512_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), _mm512_max_ps(_mm512_set1_ps(-EXP_MAX), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int c = 1; c < 6; c++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[c]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif

/* ------------------------------------------------------------ block scales */

#define TILE 4          /* activation rows of one tile */
#define MAX_GROUPS 1024 /* blocks per row: input sizes up to 32768 */

#ifdef NT_AVX2
/* 8 block scales from h at g: fp16, or fp32 where `f32`. */
static inline __m256 scales_at(const void *h, int f32, int64_t g) {
    return f32 ? _mm256_loadu_ps((const float *)h + g)
               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)h + g)));
}

/* block_scales over whole vectors, for groups >= 8: a last partial vector is the row's last 8 groups, its lanes
 * already counted masked out of the sum (its products are the same values again), so nothing is read past the row
 * and no scalar tail runs. Returns the sum's 8 partial sums. */
static inline __m256 block_scales8(const void *h, int f32, const float *x, const float *y, int64_t groups,
                                   float *prod) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        const __m256 hv = scales_at(h, f32, g);
        if (prod) _mm256_storeu_ps(prod + g, _mm256_mul_ps(hv, _mm256_loadu_ps(x + g)));
        if (y) acc = _mm256_fmadd_ps(hv, _mm256_loadu_ps(y + g), acc);
    }
    if (g < groups) {
        const int64_t at = groups - 8;
        const __m256 hv = scales_at(h, f32, at);
        if (prod) _mm256_storeu_ps(prod + at, _mm256_mul_ps(hv, _mm256_loadu_ps(x + at)));
        if (y) {
            const __m256 fresh = _mm256_castsi256_ps(_mm256_cmpgt_epi32( /* lanes at + lane >= g */
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)(g - at) - 1)));
            acc = _mm256_fmadd_ps(_mm256_and_ps(hv, fresh), _mm256_loadu_ps(y + at), acc);
        }
    }
    return acc;
}
#endif

/* prod[g] = h[g] * x[g] for block scales h (fp16, or fp32 where `f32`); returns sum of h[g] * y[g] when y is given,
 * in one fixed order. */
static inline float block_scales(const void *h, int f32, const float *x, const float *y, int64_t groups,
                                 float *prod) {
#ifdef NT_AVX2
    if (groups >= 8) {
        const __m256 acc = block_scales8(h, f32, x, y, groups, prod);
        return y ? hsum_ps(acc) : 0.0f;
    }
#endif
    float dot = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const float hv = f32 ? ((const float *)h)[g] : half_to_float(((const uint16_t *)h)[g]);
        if (prod) prod[g] = hv * x[g];
        if (y) dot += hv * y[g];
    }
    return dot;
}

/* ------------------------------------------------------ block products */

/* Weights in the formats of nt_block_matmul (kind) against activations in two levels of int16 codes per 32 values
 * (split_levels): weights are widened to int16, so each block is two 16-bit multiply-add instructions per row of
 * codes, and the result is within fp32 rounding of an fp32 matmul over the dequantized weight.
 * Per weight row, the products of weight and activation block scales are formed first (vectorized), so the inner
 * loop is integer products and one multiply-add per block. Inlined for each constant number of activation rows T, so
 * that the accumulators stay in registers. */
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

/* Scales for weight row n and activation row r: scale[g] = d_w[g] * d_x[g] (kind 6: per half block, [2g], [2g + 1]);
 * returns the row's Q4 offset term sum_g m[g] * s_x[g] (0 for the int8 kinds). */
static inline float row_scales(int kind, const quantized_rows *x, int64_t r, int64_t groups, const void *wd,
                               const void *wm, int64_t n, float *scale) {
    const float *xd = x->d + r * groups;
    if (kind == 6) {
        const float *d = (const float *)wd + n * 2 * groups;
        for (int64_t g = 0; g < groups; g++) {
            scale[2 * g] = d[2 * g] * xd[g];
            scale[2 * g + 1] = d[2 * g + 1] * xd[g];
        }
        return 0.0f;
    }
    const int f32 = kind == 5, bytes = f32 ? 4 : 2;
    block_scales((const uint8_t *)wd + n * groups * bytes, f32, xd, NULL, groups, scale);
    return IS_Q4(kind) ? block_scales((const uint8_t *)wm + n * groups * bytes, f32, NULL, x->s + r * groups, groups,
                                      NULL)
                       : 0.0f;
}

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
    const int64_t groups = K / QK, halves = kind == 6 ? 2 : 1;
    float scale[TILE][2 * MAX_GROUPS], offset[TILE];
    for (int64_t n = n0; n < n1; n++) {
        for (int i = 0; i < T; i++) offset[i] = row_scales(kind, x, r0 + i, groups, wd, wm, n, scale[i]);
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
            out[((r0 + i) >> 1) * ldo + n] = hsum_ps(sum) + (offset[i] + offset[i + 1]);
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
            if (i & 1) out[((r0 + i) >> 1) * ldo + n] += acc + offset[i]; /* the second level */
            else out[((r0 + i) >> 1) * ldo + n] = acc + offset[i];
        }
#endif
    }
}

/* Split weight rows across threads in chunks of 16 (whole cache lines of output for every thread). */
#define ROW_CHUNK 16

#ifdef NT_VNNI512
/* ------------------------------------------ one-row Q4 products, AVX-512 VNNI */

/* With AVX-512 VNNI, one activation row meets Q4 weights through vpdpbusd, which multiplies unsigned bytes by signed
 * bytes and adds each four products into a 32-bit lane. The activations keep their int16 codes (the same codes as
 * quantize_row16, so the sums are the same integers), split into bytes: c = 256 hi + lo, lo 0..255 unsigned and hi
 * signed. A nibble is both a small signed byte (against lo) and an unsigned one (against hi), so a 64-byte vector of
 * nibbles, four blocks (a quad), takes four byte multiply-adds, a shift and an add: half the instructions of the
 * int16 route, which is what bounds that route where the weights stream from memory. */

/* Bytes per quad of activation codes: lo of elements 0..15 of each of the quad's four blocks (16 bytes each, in
 * block order), lo of elements 16..31, hi of 0..15, hi of 16..31. That is the order in which the quad's 64 bytes of
 * nibbles come out by a mask (element j of a block) and by a shift and a mask (element j + 16): lanes 4b..4b + 3 of
 * every product belong to block b. */
#define QUAD_BYTES 256

/* One group of 32 values (those whose bit of `skip` is set read as zeros) -> int32 codes of values 0..15 (c0) and
 * 16..31 (c1) in -levels..levels, rounded to nearest, ties to even; d = absmax / levels, s = d * the codes' sum. */
static inline void quantize_group(const float *x, uint32_t skip, float levels, __m512i *c0, __m512i *c1, float *d,
                                  float *s) {
    const __m512 v0 = _mm512_maskz_loadu_ps((__mmask16)~skip, x);
    const __m512 v1 = _mm512_maskz_loadu_ps((__mmask16)~(skip >> 16), x + 16);
    const float max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = max > 0 ? levels / max : 0.0f;
    *c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    *c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    *d = max / levels;
    *s = *d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(*c0, *c1));
}

/* x [K] -> codes as bytes in quads, d and s as quantize_row16's. A last partial quad's missing blocks are left as
 * they are: their weights are read as zeros (q4_vnni_rows). */
static void quantize_row_quads(const float *x, int64_t K, uint8_t *q, float *d, float *s) {
    const int64_t groups = K / QK;
    for (int64_t b = 0; b < groups; b++) {
        __m512i c0, c1;
        quantize_group(x + b * QK, 0, 32767.0f, &c0, &c1, d + b, s + b);
        uint8_t *dst = q + (b / 4) * QUAD_BYTES + (b % 4) * 16;
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(c0)); /* low bytes */
        _mm_storeu_si128((__m128i *)(dst + 64), _mm512_cvtepi32_epi8(c1));
        _mm_storeu_si128((__m128i *)(dst + 128), _mm512_cvtepi32_epi8(_mm512_srai_epi32(c0, 8))); /* high bytes */
        _mm_storeu_si128((__m128i *)(dst + 192), _mm512_cvtepi32_epi8(_mm512_srai_epi32(c1, 8)));
    }
}

/* One quad of Q4 weight bytes v against the quad's activation bytes a, times its four scales (sc: 4 floats, one per
 * block, spread to four lanes each), into acc. */
static inline __attribute__((always_inline)) __m512 quad_into(__m512i v, const uint8_t *a, const float *sc,
                                                              __m512 acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i w0 = _mm512_and_si512(v, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(a), w0),
                                           _mm512_loadu_si512(a + 64), w1);
    const __m512i hi = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(a + 128)), w1, _mm512_loadu_si512(a + 192));
    const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sc)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8))), scale, acc);
}

static inline __m256 fold_ps(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* out[n] for n in [n0, n1), one weight row at a time (see tile), from both levels of one activation row in quads
 * (level 1's quads, then level 2's; x->d, x->s per block, level 1's then level 2's). A last partial quad of a row is
 * read through a byte mask: nothing past the weight is read, the missing blocks' nibbles are zeros (so are their
 * products, whatever their activation bytes) and their scales are zeros. */
static inline __attribute__((always_inline)) void q4_vnni_rows(const int kind, const uint8_t *xq,
                                                                const quantized_rows *x, int64_t K, const void *qs,
                                                                const void *wd, const void *wm, int64_t n0,
                                                                int64_t n1, float *out) {
    const int64_t groups = K / QK, whole = groups / 4, quads = (groups + 3) / 4, row_bytes = K / 2;
    const __mmask64 tail = ((__mmask64)1 << (16 * (groups % 4))) - 1;
    float scale[2][MAX_GROUPS + 4];
    memset(scale[0] + groups, 0, 4 * sizeof(float)); /* the last quad's missing blocks */
    memset(scale[1] + groups, 0, 4 * sizeof(float));
    const uint8_t *second = xq + quads * QUAD_BYTES;
    for (int64_t n = n0; n < n1; n++) {
        const float offset = row_scales(kind, x, 0, groups, wd, wm, n, scale[0]) +
                             row_scales(kind, x, 1, groups, wd, wm, n, scale[1]);
        for (int64_t b = 0; b < row_bytes; b += 64) /* as tile() does */
            _mm_prefetch((const char *)qs + (n + 2) * row_bytes + b, _MM_HINT_T0);
        const uint8_t *w = (const uint8_t *)qs + n * row_bytes;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int64_t g = 0; g < whole; g++) {
            const __m512i v = _mm512_loadu_si512(w + g * 64);
            acc0 = quad_into(v, xq + g * QUAD_BYTES, scale[0] + 4 * g, acc0);
            acc1 = quad_into(v, second + g * QUAD_BYTES, scale[1] + 4 * g, acc1);
        }
        if (groups % 4) {
            const __m512i v = _mm512_maskz_loadu_epi8(tail, w + whole * 64);
            acc0 = quad_into(v, xq + whole * QUAD_BYTES, scale[0] + 4 * whole, acc0);
            acc1 = quad_into(v, second + whole * QUAD_BYTES, scale[1] + 4 * whole, acc1);
        }
        out[n] = hsum_ps(fold_ps(_mm512_add_ps(acc0, acc1))) + offset;
    }
}

/* nt_block_matmul for one activation row and Q4 weights (kind 4 or 5): levels [2, K] (split_levels). */
static int q4_vnni(int kind, const float *levels, int64_t K, int64_t N, const void *qs, const void *d, const void *m,
                   float *out, int threads) {
    const int64_t groups = K / QK, quads = (groups + 3) / 4;
    quantized_rows xq = {NULL, NULL, NULL, malloc((size_t)(2 * quads * QUAD_BYTES + 4 * groups * 4) + 64)};
    if (!xq.block) return -1;
    uint8_t *codes = (uint8_t *)xq.block;
    xq.d = (float *)(codes + 2 * quads * QUAD_BYTES);
    xq.s = xq.d + 2 * groups;
    quantize_row_quads(levels, K, codes, xq.d, xq.s);
    quantize_row_quads(levels + K, K, codes + quads * QUAD_BYTES, xq.d + groups, xq.s + groups);
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
        if (kind == 5) q4_vnni_rows(5, codes, &xq, K, qs, d, m, n0, n1, out);
        else q4_vnni_rows(4, codes, &xq, K, qs, d, m, n0, n1, out);
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

/* One activation row (its two levels: rows 0 and 1 of x) against int8 weights (kind 8, or 6: Q8 in halves), the
 * int16 codes of both in vpdpwssd: a block of 32 is one 512-bit load of the activations, one widening load of the
 * weights and one multiply-add of pairs, where the AVX2 route takes two of each; a chain per level. The same integer
 * sums as that route. Against it, alternating in one process (medians of 10 rounds): Gemma 3's Q8_0 head streamed
 * 1.12x (0.82-1.63x), its int8 projections at one row 1.04x. Four weight rows at a time (as Q4 then had, see
 * tile) was 7% faster in cache but 2.3x slower streamed, the int16 route's tiles too. */
static inline __attribute__((always_inline)) void q8_rows_vnni(const int kind, const quantized_rows *x, int64_t K,
                                                                const int8_t *qs, const void *wd, int64_t n0,
                                                                int64_t n1, float *out) {
    const int64_t groups = K / QK, halves = kind == 6, per = halves ? 2 : 1;
    float scale[2][2 * MAX_GROUPS];
    const int16_t *a0 = x->q, *a1 = x->q + K;
    for (int64_t n = n0; n < n1; n++) {
        row_scales(kind, x, 0, groups, wd, NULL, n, scale[0]);
        row_scales(kind, x, 1, groups, wd, NULL, n, scale[1]);
        for (int64_t b = 0; b < K; b += 64) _mm_prefetch((const char *)qs + (n + 2) * K + b, _MM_HINT_T0);
        const int8_t *w = qs + n * K;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            acc0 = q8_block_vnni(halves, w + g * QK, a0 + g * QK, scale[0] + g * per, acc0);
            acc1 = q8_block_vnni(halves, w + g * QK, a1 + g * QK, scale[1] + g * per, acc1);
        }
        out[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}
#endif

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times a block-quantized weight [N, K]^T, the activations
 * in two levels of int16 codes (split_levels). Weight formats (kind):
 *   4 (Q4): qs uint8 [N, K / 2] nibbles, d and m fp16 [N, K / 32]; w = d * q + m. Byte j of a block holds element j
 *     in its low nibble and element j + 16 in its high one (GGML's order). Holds Q4_0 and Q4_1 blocks exactly.
 *   5 (Q4 with fp32 scales): as 4, d and m fp32. Holds Q4_K blocks exactly: their 32-value sub-blocks' scales and
 *     offsets, d * sc and dmin * mn (an fp16 times a 6-bit integer), need up to 17 bits.
 *   8 (Q8): qs int8 [N, K], d fp16 [N, K / 32]; w = d * q.
 *   6 (Q8 in halves): qs int8 [N, K], d fp32 [N, K / 16]; w = d * q. Holds a Q6_K block exactly (its 16-value
 *     sub-blocks' scales, d * sc, need more bits than fp16 has; codes -32..31).
 * Returns 0, or -1 for an unknown kind, K not a multiple of 32 (or too large), or no memory. */
int nt_block_matmul(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                    const void *d, const void *m, float *out, int64_t ldo, int threads) {
    if (!KNOWN_KIND(kind) || K % QK || K / QK > MAX_GROUPS) return -1;
    float *levels = malloc((size_t)(2 * M * K) * sizeof(float) + 64);
    if (!levels) return -1;
    split_levels(x, M, K, ldx, levels);
#ifdef NT_VNNI512
    if (IS_Q4(kind) && M == 1) {
        const int status = q4_vnni(kind, levels, K, N, qs, d, m, out, threads);
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
        if (!IS_Q4(kind) && M == 1) {
            if (kind == 8) q8_rows_vnni(8, &xq, K, (const int8_t *)qs, d, n0, n1, out);
            else q8_rows_vnni(6, &xq, K, (const int8_t *)qs, d, n0, n1, out);
            continue;
        }
#endif
        for (int64_t r0 = 0; r0 < 2 * M; r0 += TILE) { /* rows of codes, both levels of TILE / 2 activation rows */
#define NT_TILE(T)                                                                             \
    if (kind == 4) tile(4, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);                          \
    else if (kind == 5) tile(5, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);                     \
    else if (kind == 8) tile(8, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);                     \
    else tile(6, &xq, r0, T, K, qs, d, m, n0, n1, out, ldo);
            if (2 * M - r0 < TILE) { NT_TILE(2) }
            else { NT_TILE(TILE) }
#undef NT_TILE
        }
    }
    free(xq.block);
    return 0;
}

/* ------------------------------------------------------------ fp32 GEMM */

/* Products of many rows are bound by compute. There fp32 multiply-adds over a dense copy of the weight beat the
 * block kernels, which widen and scale every block. torch's GEMM runs these skinny shapes (16 to 64 rows, a few
 * hundred to a few thousand columns) at 60-110 GFLOP/s on 2 AVX2 cores. This one reaches 120-170 there.
 *
 * The weight is packed once into panels of 16 output columns, [ceil(N / 16)][K][16] (zeros past N). A 6-row by
 * 16-column tile of the output is 12 accumulators of 8 lanes. Each step along K loads two panel vectors and
 * broadcasts one value of each of the 6 rows: 8 loads for 12 multiply-adds. The threads split the panels between
 * them; each panel is read from L2 by every row tile of x. */
#define SG_ROWS 6
#define SG_COLS 16

/* Floats of a packed [N, K] weight. */
int64_t nt_sgemm_packed_size(int64_t N, int64_t K) { return (N + SG_COLS - 1) / SG_COLS * SG_COLS * K; }

/* 6 rows of x (pointers; repeated where the tile has fewer) by one panel, into `cols` columns of each listed output
 * row (null: a padding row, not stored). */
static void sgemm_tile(const float *const *a, const float *panel, int64_t K, float *const *c, int64_t cols) {
#ifdef NT_AVX2
    /* named accumulators: as an array, gcc stores them to the stack on every step */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(panel + k * SG_COLS), b1 = _mm256_loadu_ps(panel + k * SG_COLS + 8);
        __m256 v = _mm256_broadcast_ss(a0 + k);
        c00 = _mm256_fmadd_ps(v, b0, c00), c01 = _mm256_fmadd_ps(v, b1, c01);
        v = _mm256_broadcast_ss(a1 + k);
        c10 = _mm256_fmadd_ps(v, b0, c10), c11 = _mm256_fmadd_ps(v, b1, c11);
        v = _mm256_broadcast_ss(a2 + k);
        c20 = _mm256_fmadd_ps(v, b0, c20), c21 = _mm256_fmadd_ps(v, b1, c21);
        v = _mm256_broadcast_ss(a3 + k);
        c30 = _mm256_fmadd_ps(v, b0, c30), c31 = _mm256_fmadd_ps(v, b1, c31);
        v = _mm256_broadcast_ss(a4 + k);
        c40 = _mm256_fmadd_ps(v, b0, c40), c41 = _mm256_fmadd_ps(v, b1, c41);
        v = _mm256_broadcast_ss(a5 + k);
        c50 = _mm256_fmadd_ps(v, b0, c50), c51 = _mm256_fmadd_ps(v, b1, c51);
    }
    float t[SG_ROWS][SG_COLS];
    _mm256_storeu_ps(t[0], c00), _mm256_storeu_ps(t[0] + 8, c01), _mm256_storeu_ps(t[1], c10);
    _mm256_storeu_ps(t[1] + 8, c11), _mm256_storeu_ps(t[2], c20), _mm256_storeu_ps(t[2] + 8, c21);
    _mm256_storeu_ps(t[3], c30), _mm256_storeu_ps(t[3] + 8, c31), _mm256_storeu_ps(t[4], c40);
    _mm256_storeu_ps(t[4] + 8, c41), _mm256_storeu_ps(t[5], c50), _mm256_storeu_ps(t[5] + 8, c51);
#else
    float t[SG_ROWS][SG_COLS] = {{0}};
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < SG_ROWS; i++)
            for (int j = 0; j < SG_COLS; j++) t[i][j] += a[i][k] * panel[k * SG_COLS + j];
#endif
    for (int i = 0; i < SG_ROWS; i++)
        if (c[i]) memcpy(c[i], t[i], (size_t)cols * sizeof(float));
}

/* Every 6-row tile of x [M, K] by one panel, into `cols` columns of out [M, ...] from its first. */
static void panel_product(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panel, float *out,
                          int64_t ldo, int64_t cols) {
    for (int64_t r0 = 0; r0 < M; r0 += SG_ROWS) {
        const float *a[SG_ROWS];
        float *c[SG_ROWS];
        for (int64_t i = 0; i < SG_ROWS; i++) {
            const int real = r0 + i < M;
            a[i] = x + (real ? r0 + i : r0) * ldx;
            c[i] = real ? out + (r0 + i) * ldo : NULL;
        }
        sgemm_tile(a, panel, K, c, cols);
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ w^T, for w [N, K] packed by nt_sgemm_pack. */
void nt_sgemm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *packed, int64_t N, float *out,
              int64_t ldo, int threads) {
    const int64_t panels = (N + SG_COLS - 1) / SG_COLS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; p++)
        panel_product(x, M, K, ldx, packed + p * SG_COLS * K, out + p * SG_COLS, ldo,
                      N - p * SG_COLS < SG_COLS ? N - p * SG_COLS : SG_COLS);
}

/* ------------------------------------------------- fp32 products, row-major weight */

/* out [M, N] = x [M, K] @ w^T for a row-major fp32 w [N, K] (row stride ldw), every output as one fixed sequence of
 * operations: products k = l, l + 8, l + 16, ... multiply-added in order into lane l (fused, one rounding each), the
 * tail past the last whole 8 into lanes 0.. the same way, then the 8 lanes summed as ((0 + 4) + (2 + 6)) + ((1 + 5)
 * + (3 + 7)). Which rows share a tile, how the threads split the outputs (whole weight rows each) and which
 * instruction set runs it change nothing: the result is the same bits for any thread count, any batch the row sits
 * in, and on every build (the portable one through fmaf). That is what makes the fp32 route repeatable, which a
 * vendor BLAS does not promise (its split of K may follow the thread count, and its kernels the data's alignment).
 * Tiles of 4 rows by 2 weight rows: 8 accumulators, 6 loads per 8 multiply-adds. */
#define RM_ROWS 4
#define RM_COLS 2

static inline float lanes_sum(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static void rowmajor_tile(const float *const *a, int64_t nr, const float *const *w, int64_t nc, int64_t K,
                          float *const *c) {
    float acc[RM_ROWS][RM_COLS][8];
    int64_t k = 0;
#ifdef NT_AVX2
    __m256 v[RM_ROWS][RM_COLS];
    for (int i = 0; i < RM_ROWS; i++)
        for (int j = 0; j < RM_COLS; j++) v[i][j] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 b[RM_COLS];
        for (int j = 0; j < RM_COLS; j++) b[j] = _mm256_loadu_ps(w[j] + k);
        for (int i = 0; i < RM_ROWS; i++) {
            const __m256 x = _mm256_loadu_ps(a[i] + k);
            for (int j = 0; j < RM_COLS; j++) v[i][j] = _mm256_fmadd_ps(x, b[j], v[i][j]);
        }
    }
    for (int i = 0; i < RM_ROWS; i++)
        for (int j = 0; j < RM_COLS; j++) _mm256_storeu_ps(acc[i][j], v[i][j]);
#else
    memset(acc, 0, sizeof(acc));
    for (; k + 8 <= K; k += 8)
        for (int i = 0; i < RM_ROWS; i++)
            for (int j = 0; j < RM_COLS; j++)
                for (int l = 0; l < 8; l++) acc[i][j][l] = fmaf(a[i][k + l], w[j][k + l], acc[i][j][l]);
#endif
    for (int64_t l = 0; k + l < K; l++)
        for (int i = 0; i < RM_ROWS; i++)
            for (int j = 0; j < RM_COLS; j++) acc[i][j][l] = fmaf(a[i][k + l], w[j][k + l], acc[i][j][l]);
    for (int64_t i = 0; i < nr; i++)
        for (int64_t j = 0; j < nc; j++) c[i][j] = lanes_sum(acc[i][j]);
}

void nt_matmul_rowmajor(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                        float *out, int64_t ldo, int threads) {
    const int64_t pairs = (N + RM_COLS - 1) / RM_COLS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && pairs > 1 && M * N * K > 65536)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t n0 = p * RM_COLS, nc = N - n0 < RM_COLS ? N - n0 : RM_COLS;
        const float *wr[RM_COLS];
        for (int j = 0; j < RM_COLS; j++) wr[j] = w + (n0 + (j < nc ? j : 0)) * ldw; /* repeated: not stored */
        for (int64_t r0 = 0; r0 < M; r0 += RM_ROWS) {
            const int64_t nr = M - r0 < RM_ROWS ? M - r0 : RM_ROWS;
            const float *a[RM_ROWS];
            float *c[RM_ROWS];
            for (int i = 0; i < RM_ROWS; i++) {
                a[i] = x + (r0 + (i < nr ? i : 0)) * ldx;
                c[i] = out + (r0 + (i < nr ? i : 0)) * ldo + n0;
            }
            rowmajor_tile(a, nr, wr, nc, K, c);
        }
    }
}

/* Row n of a block-quantized weight (kind 4, 5, 8 or 6; see nt_block_matmul) as fp32: d * q (+ m). */
static void dequantize_row(int kind, const void *qs, const void *wd, const void *wm, int64_t n, int64_t K,
                           float *dst) {
    const int64_t groups = K / QK;
    if (IS_Q4(kind)) {
        const uint8_t *q = (const uint8_t *)qs + n * (K / 2);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = n * groups + g;
            const float d = kind == 5 ? ((const float *)wd)[at] : half_to_float(((const uint16_t *)wd)[at]);
            const float m = kind == 5 ? ((const float *)wm)[at] : half_to_float(((const uint16_t *)wm)[at]);
            for (int i = 0; i < QK / 2; i++) {
                dst[g * QK + i] = d * (float)(q[g * QK / 2 + i] & 0x0F) + m;
                dst[g * QK + QK / 2 + i] = d * (float)(q[g * QK / 2 + i] >> 4) + m;
            }
        }
    } else {
        const int8_t *q = (const int8_t *)qs + n * K;
        const int64_t size = kind == 6 ? QK / 2 : QK; /* values per scale */
        for (int64_t g = 0; g < K / size; g++) {
            const float d = kind == 6 ? ((const float *)wd)[n * 2 * groups + g]
                                      : half_to_float(((const uint16_t *)wd)[n * groups + g]);
#pragma omp simd
            for (int64_t i = 0; i < size; i++) dst[g * size + i] = d * (float)q[g * size + i];
        }
    }
}

/* panel [K][16] = rows [16][K] transposed (K a multiple of 8 on AVX2). */
static void to_panel(const float *rows, int64_t K, float *panel) {
    int64_t k = 0;
#ifdef NT_AVX2
    for (; k + 8 <= K; k += 8)
        for (int half = 0; half < 2; half++) { /* rows 0-7, then 8-15: an 8 x 8 transpose each */
            const float *r = rows + half * 8 * K + k;
            const __m256 r0 = _mm256_loadu_ps(r), r1 = _mm256_loadu_ps(r + K), r2 = _mm256_loadu_ps(r + 2 * K),
                         r3 = _mm256_loadu_ps(r + 3 * K), r4 = _mm256_loadu_ps(r + 4 * K),
                         r5 = _mm256_loadu_ps(r + 5 * K), r6 = _mm256_loadu_ps(r + 6 * K),
                         r7 = _mm256_loadu_ps(r + 7 * K);
            const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
                         t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
                         t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                         u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                         u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *p = panel + k * SG_COLS + half * 8;
            _mm256_storeu_ps(p + 0 * SG_COLS, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(p + 1 * SG_COLS, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(p + 2 * SG_COLS, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(p + 3 * SG_COLS, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(p + 4 * SG_COLS, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(p + 5 * SG_COLS, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(p + 6 * SG_COLS, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(p + 7 * SG_COLS, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
#endif
    for (; k < K; k++)
        for (int j = 0; j < SG_COLS; j++) panel[k * SG_COLS + j] = rows[j * K + k];
}

/* packed = w [N, K] as panels (see above): whole panels transposed from w's rows in place, the last one through a
 * zero-padded copy. */
void nt_sgemm_pack(const float *w, int64_t N, int64_t K, float *packed, int threads) {
    const int64_t panels = (N + SG_COLS - 1) / SG_COLS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * SG_COLS;
        if (n0 + SG_COLS <= N) {
            to_panel(w + n0 * K, K, packed + n0 * K);
            continue;
        }
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < SG_COLS; j++)
                packed[n0 * K + k * SG_COLS + j] = n0 + j < N ? w[(n0 + j) * K + k] : 0.0f;
    }
}

/* Rows first..first+N-1 of a packed weight (nt_sgemm_pack's panels, K values a row) from N block-quantized rows
 * (kind 4, 5, 6 or 8; see nt_block_matmul), dequantized as nt_block_gemm does: the panels straight from the blocks,
 * with no dense fp32 copy on the way. Rows of a panel outside [first, first + N) are left as they are (another
 * part's, or padding the caller zeroes). Returns 0, or -1 for an unknown kind, K not a multiple of 32, or no
 * memory. */
int nt_sgemm_pack_blocks(int kind, const void *qs, const void *d, const void *m, int64_t N, int64_t K,
                         float *packed, int64_t first, int threads) {
    if (!KNOWN_KIND(kind) || K % QK || first < 0 || N < 0) return -1;
    const int64_t p0 = first / SG_COLS, p1 = (first + N + SG_COLS - 1) / SG_COLS;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && p1 - p0 > 1)
    {
        float *rows = malloc((size_t)(SG_COLS * K) * sizeof(float));
        if (!rows) failed = 1;
#pragma omp for schedule(static)
        for (int64_t p = p0; p < p1; p++) {
            if (!rows) continue;
            const int64_t r0 = p * SG_COLS;
            float *panel = packed + r0 * K;
            if (r0 >= first && r0 + SG_COLS <= first + N) { /* a whole panel of this part's rows */
                for (int64_t j = 0; j < SG_COLS; j++)
                    dequantize_row(kind, qs, d, m, r0 + j - first, K, rows + j * K);
                to_panel(rows, K, panel);
                continue;
            }
            for (int64_t j = 0; j < SG_COLS; j++) { /* a panel shared with a neighbouring part or the padding */
                const int64_t n = r0 + j - first;
                if (n < 0 || n >= N) continue;
                dequantize_row(kind, qs, d, m, n, K, rows);
                for (int64_t k = 0; k < K; k++) panel[k * SG_COLS + j] = rows[k];
            }
        }
        free(rows);
    }
    return failed ? -1 : 0;
}

#ifdef NT_VNNI512
/* ------------------------------------------- int16 GEMM over block weights, AVX-512 VNNI */

/* Products of many rows bound by compute, with the block kernels' precision at twice the fp32 GEMM's rate: the
 * activations' int16 codes per 32 values (quantize_row16) meet the weights' exact integer codes widened to int16 in
 * vpdpwssd, 32 products a vector where an fp32 FMA does 16; each scale group's int32 sums take one float multiply-
 * add by the product of the two scales (and Q4's offset one more). The weights are widened per thread, 32 rows at a
 * time, into two panels of [K / 2][16 rows][2] int16 (a 32-bit lane holds a pair of codes of one row, in the order
 * of ig_pair_order), with their scales as [groups][16]: every row tile of x then runs over them. The widening is a
 * 16 x 16 transpose of 32-bit lanes of the codes as stored, then shifts and masks (Gemma 3's head, one row: 15.7 ->
 * 13.3 ms; Q4 8192 x 640: 0.32 -> 0.23 ms; than transposing the codes once widened). */

#define IG_ROWS 6 /* activation rows of a tile: 12 int32 and 12 float accumulators, two weight vectors */
/* With it, projections keep no fp32 panels (quant_linear.py): it is faster than the fp32 GEMM over them for every
 * batch past the block kernels.
 * widening the weights, 16 x 16 int32 transposes of the unpacked codes, costs less than the products it saves from
 * 12 rows (SmolLM2's 30 layers' projections, ms, block kernels / fp32 panels / int16: 12 rows 18.4 / 15.8 / 13.2,
 * 32 rows 43.9 / 37.9 / 25.1, 128 rows 168.5 / 142.9 / 83.4, 512 rows 819 / 555 / 337). The LM head has no
 * panels: its blocks take it from 16 rows (ms: 16 rows 5.6 vs 8.1 for the fp32 GEMM over dequantized rows, 64 rows
 * 12.8 vs 20.2).
 * Byte activations (absmax / 127 per 32, vpdpbusd on the head's own int8 codes, 64 products a vector) ran Gemma 3's
 * head at 64 rows in 53 against 77 ms, but even with each row's 32 best logits recomputed exactly they moved
 * teacher-forced top-5 log-probabilities by up to 0.07 (KL 5e-4): the error of the many near-best tokens shifts the
 * normalizer. So the head keeps int16 unless int8 activations are asked for (nt_block_gemm8, its outlier columns
 * in fp32: the head's logits 3 times closer, Gemma 3's mean error 0.049 -> 0.016, at 64 rows 62 against 83 ms). */

/* Batches under this many rows widen with the next panel's rows requested ahead: a panel's loads, 16 rows apart,
 * each wait on memory, as the hardware prefetchers do not follow them (Gemma 3's 262k-row head at 64 rows: 89 ->
 * 75 ms; its blocks' projections at 16 and 64 rows 4% and 2% faster; at 512 rows, where a panel's products take 8
 * times as long, no faster). */
#define IG_PREFETCH_ROWS 128

/* A thread's two panels of 16 weight rows each: their codes as the GEMM takes them (int16 pairs, or bytes) and their
 * scales. */
typedef struct {
    void *codes[2];              /* int16: [K / 2][16 rows][2]; bytes: [K / 4][16 rows][4] */
    float *scale[2], *offset[2]; /* [scale groups][16] (Q8 in halves: per 16 values), Q4's m [K / 32][16] */
    int32_t *bias[2];            /* bytes of int8 codes: [scale groups][16], -128 times each row's codes' sum */
    float *outlier[2];           /* bytes: the weights of the activations' outlier columns, [outliers][16] */
} gemm_panels;

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

/* The order of activation codes that matches the pairs the weights widen into (gemm_widen), per 32 codes. A 32-bit
 * lane of a byte transpose holds four neighbouring bytes of a row, and 16-bit shifts and masks of it give pairs of
 * every other one as int16: int8 codes 4q..4q + 3 give the pairs (4q, 4q + 2), (4q + 1, 4q + 3); Q4 bytes
 * 4j..4j + 3 of a block hold codes 4j.. (low nibbles) and 4j + 16.. (high), so a block's pairs are (4j, 4j + 2),
 * (4j + 1, 4j + 3), (4j + 16, 4j + 18), (4j + 17, 4j + 19) for j = 0..3. Rows of K codes, K a multiple of 32. */
static __m512i ig_pair_order(int kind) {
    int16_t at[32];
    for (int i = 0; i < 32; i++)
        at[i] = (int16_t)(IS_Q4(kind) ? 4 * (i / 8) + (i / 2) % 2 + 16 * ((i / 4) % 2) + 2 * (i % 2)
                                    : 4 * (i / 4) + (i / 2) % 2 + 2 * (i % 2)); /* code of pair i / 2, item i % 2 */
    return _mm512_loadu_si512(at); /* for vpermw: slot i takes code at[i] */
}

/* Activation columns that byte codes would flatten: where one column of x runs far above the others (RMSNorm
 * weights and the gated MLP's products put a few such columns in every model), the absmax / 127 step of its group
 * leaves the other 31 values a few levels, or none. The OUTLIER_MAX columns whose largest magnitude over the rows
 * most exceeds OUTLIER_RATIO times the median column's are taken out of the codes and multiplied in fp32 instead,
 * by their weights dequantized as each panel is widened (the decomposition of LLM.int8()). Teacher-forced through
 * prefill against fp32, byte codes alone: SmolLM2 98.2%, KL 2.6e-3; Gemma 3 98.6%, 1.4e-3. With 8 outlier columns
 * 8.5e-4 / 4.3e-4; with 16 6.9e-4 / 3.3e-4 (99.2% / 99.5%); with 32 (ratio 2) 5.6e-4 / 2.8e-4. */
#define OUTLIER_MAX 16
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

/* Weight rows n0..n0 + 31 (those from N on as zeros) of a block weight into p. Both routes transpose 16 rows' bytes
 * as stored, 4 to a 32-bit lane: int8 codes 4q..4q + 3 in lane q, a Q4 group's low nibbles 4j..4j + 3 and high
 * ones 4j + 16.. in lane j. int16 panels (`bytes` 0) widen those by shifts and masks into the pairs of
 * ig_pair_order; byte panels keep them, in natural order, with each scale group's bias. */
static void gemm_widen(int kind, int bytes, const void *qs, const void *d, const void *m, int64_t n0, int64_t N,
                       int64_t K, const gemm_panels *p, int prefetch, const int32_t *outliers, int64_t nout) {
    const int64_t groups = K / QK, sg = kind == 6 ? 2 * groups : groups, per = kind == 6 ? 4 : 8;
    if (prefetch) { /* the next panel's rows into L2 */
        const int64_t row_bytes = IS_Q4(kind) ? K / 2 : K;
        const int64_t end = (n0 + 64 < N ? n0 + 64 : N) * row_bytes;
        for (int64_t b = (n0 + 32) * row_bytes; b < end; b += 64) _mm_prefetch((const char *)qs + b, _MM_HINT_T1);
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F), low = _mm512_set1_epi16(0x00FF), ones = _mm512_set1_epi8(1);
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
                    if (!bytes) {
                        _mm512_storeu_si512(vecs + c / 2 + 2 * q, _mm512_srai_epi16(_mm512_slli_epi16(r[q], 8), 8));
                        _mm512_storeu_si512(vecs + c / 2 + 2 * q + 1, _mm512_srai_epi16(r[q], 8));
                        continue;
                    }
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
                    if (bytes) {
                        __m512i *dst = vecs + (g0 + u / 4) * 8 + u % 4;
                        _mm512_storeu_si512(dst, lo);
                        _mm512_storeu_si512(dst + 4, hi);
                    } else {
                        __m512i *dst = vecs + g0 * 16 + 4 * u;
                        _mm512_storeu_si512(dst, _mm512_and_si512(lo, low));
                        _mm512_storeu_si512(dst + 1, _mm512_srli_epi16(lo, 8));
                        _mm512_storeu_si512(dst + 2, _mm512_and_si512(hi, low));
                        _mm512_storeu_si512(dst + 3, _mm512_srli_epi16(hi, 8));
                    }
                }
            }
        }
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = n0 + 16 * h + i;
            for (int64_t g = 0; g < sg; g++) {
                float scale = 0.0f;
                if (n < N)
                    scale = kind == 6 || kind == 5 ? ((const float *)d)[n * sg + g]
                                                   : half_to_float(((const uint16_t *)d)[n * groups + g]);
                p->scale[h][g * 16 + i] = scale;
            }
            if (IS_Q4(kind))
                for (int64_t g = 0; g < groups; g++)
                    p->offset[h][g * 16 + i] = n >= N ? 0.0f
                                               : kind == 5 ? ((const float *)m)[n * groups + g]
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
            const __m512 scale = _mm512_loadu_ps(p->scale[h] + (kind == 6 ? c / 16 : g) * 16);
            __m512 w = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q));
            if (IS_Q4(kind)) w = _mm512_add_ps(w, _mm512_loadu_ps(p->offset[h] + g * 16));
            _mm512_storeu_ps(p->outlier[h] + j * 16, w);
        }
    }
}

/* out rows r0..r0 + T - 1 (int16 codes: rows r0 / 2..(r0 + T) / 2 - 1, each from two rows of codes, its levels),
 * columns n0..n0 + cols - 1 (cols <= 32) = those rows of x (activation codes `codes`, [M, K], int16 or bytes, with
 * their scales xd and Q4 sums xs per group) by the panels. Either way a step takes 4
 * bytes of each row's codes against a 64-byte vector of each panel: a pair of int16 codes in vpdpwssd, or 4 byte
 * codes in vpdpbusd (Q4's codes the unsigned side; int8 codes against the activations plus 128, from the bias). */
static inline __attribute__((always_inline)) void gemm_tile(int kind, int bytes, const int T, const void *codes,
                                                            const float *xd, const float *xs, int64_t r0, int64_t K,
                                                            const gemm_panels *p, float *out, int64_t ldo,
                                                            int64_t n0, int64_t cols, const float *xo,
                                                            int64_t nout) {
    const int64_t groups = K / QK, sg = kind == 6 ? 2 * groups : groups;
    const int64_t row_bytes = bytes ? K : 2 * K, steps = (kind == 6 ? 16 : 32) / (bytes ? 4 : 2); /* per group */
    __m512 f[IG_ROWS][2];
    for (int t = 0; t < T; t++) f[t][0] = f[t][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < sg; s++) {
        const int64_t g = kind == 6 ? s / 2 : s; /* the activations' scale group */
        __m512i a[IG_ROWS][2];
        const int biased = bytes && !IS_Q4(kind);
        const __m512i b0 = biased ? _mm512_loadu_si512(p->bias[0] + s * 16) : _mm512_setzero_si512();
        const __m512i b1 = biased ? _mm512_loadu_si512(p->bias[1] + s * 16) : _mm512_setzero_si512();
        for (int t = 0; t < T; t++) a[t][0] = b0, a[t][1] = b1;
        const uint8_t *w0 = (const uint8_t *)p->codes[0] + s * steps * 64;
        const uint8_t *w1 = (const uint8_t *)p->codes[1] + s * steps * 64;
        const uint8_t *xr = (const uint8_t *)codes + r0 * row_bytes + s * steps * 4;
        /* Unrolled, the accumulators stay in their registers (otherwise copied each pass: 3-6% of a model's
         * projections at 64 and 512 rows). */
#pragma GCC unroll 16
        for (int64_t k = 0; k < steps; k++) {
            const __m512i v0 = _mm512_loadu_si512(w0 + k * 64), v1 = _mm512_loadu_si512(w1 + k * 64);
            for (int t = 0; t < T; t++) {
                int32_t four;
                memcpy(&four, xr + t * row_bytes + 4 * k, 4);
                const __m512i x4 = _mm512_set1_epi32(four);
                if (!bytes) {
                    a[t][0] = _mm512_dpwssd_epi32(a[t][0], v0, x4);
                    a[t][1] = _mm512_dpwssd_epi32(a[t][1], v1, x4);
                } else if (IS_Q4(kind)) {
                    a[t][0] = _mm512_dpbusd_epi32(a[t][0], v0, x4);
                    a[t][1] = _mm512_dpbusd_epi32(a[t][1], v1, x4);
                } else {
                    a[t][0] = _mm512_dpbusd_epi32(a[t][0], x4, v0);
                    a[t][1] = _mm512_dpbusd_epi32(a[t][1], x4, v1);
                }
            }
        }
        const __m512 d0 = _mm512_loadu_ps(p->scale[0] + s * 16), d1 = _mm512_loadu_ps(p->scale[1] + s * 16);
        for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(xd[(r0 + t) * groups + g]);
            f[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t][0]), _mm512_mul_ps(d0, dx), f[t][0]);
            f[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t][1]), _mm512_mul_ps(d1, dx), f[t][1]);
        }
        if (IS_Q4(kind)) {
            const __m512 m0 = _mm512_loadu_ps(p->offset[0] + s * 16), m1 = _mm512_loadu_ps(p->offset[1] + s * 16);
            for (int t = 0; t < T; t++) {
                const __m512 sx = _mm512_set1_ps(xs[(r0 + t) * groups + g]);
                f[t][0] = _mm512_fmadd_ps(m0, sx, f[t][0]);
                f[t][1] = _mm512_fmadd_ps(m1, sx, f[t][1]);
            }
        }
    }
    for (int64_t j = 0; j < nout; j++) { /* the outlier columns (bytes), in fp32 */
        const __m512 w0 = _mm512_loadu_ps(p->outlier[0] + j * 16), w1 = _mm512_loadu_ps(p->outlier[1] + j * 16);
        for (int t = 0; t < T; t++) {
            const __m512 v = _mm512_set1_ps(xo[(r0 + t) * nout + j]);
            f[t][0] = _mm512_fmadd_ps(v, w0, f[t][0]);
            f[t][1] = _mm512_fmadd_ps(v, w1, f[t][1]);
        }
    }
    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    if (!bytes) { /* int16 codes: rows r0 + t and r0 + t + 1 are the two levels of activation row (r0 + t) / 2 */
        for (int t = 0; t < T; t += 2) {
            float *o = out + ((r0 + t) >> 1) * ldo + n0;
            _mm512_mask_storeu_ps(o, k0, _mm512_add_ps(f[t][0], f[t + 1][0]));
            _mm512_mask_storeu_ps(o + 16, k1, _mm512_add_ps(f[t][1], f[t + 1][1]));
        }
        return;
    }
    for (int t = 0; t < T; t++) {
        _mm512_mask_storeu_ps(out + (r0 + t) * ldo + n0, k0, f[t][0]);
        _mm512_mask_storeu_ps(out + (r0 + t) * ldo + n0 + 16, k1, f[t][1]);
    }
}

static inline __attribute__((always_inline)) void gemm_rows(int kind, int bytes, const void *codes, const float *xd,
                                                            const float *xs, int64_t M, int64_t K,
                                                            const gemm_panels *p, float *out, int64_t ldo,
                                                            int64_t n0, int64_t cols, const float *xo,
                                                            int64_t nout) {
    int64_t r0 = 0;
    for (; r0 + IG_ROWS <= M; r0 += IG_ROWS)
        gemm_tile(kind, bytes, IG_ROWS, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout);
    switch (M - r0) { /* int16 codes: M is even, so is what is left */
    case 1: if (bytes) gemm_tile(kind, 1, 1, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 2: gemm_tile(kind, bytes, 2, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 3: if (bytes) gemm_tile(kind, 1, 3, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 4: gemm_tile(kind, bytes, 4, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    case 5: if (bytes) gemm_tile(kind, 1, 5, codes, xd, xs, r0, K, p, out, ldo, n0, cols, xo, nout); break;
    default: break;
    }
}

/* block_gemm_codes (below) over M rows of x as they are (int16: M rows of codes, both levels of M / 2 rows of out). */
static int block_gemm_rows(int kind, int bytes, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                           const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads) {
    const int64_t groups = K / QK, sg = kind == 6 ? 2 * groups : groups, width = bytes ? 1 : 2;
    int32_t outliers[OUTLIER_MAX];
    int64_t nout = 0;
    const int64_t team = threads > 1 && M > 1 ? threads : 1;
    void *rows = malloc((size_t)(M * K * width + (2 * M * groups + M * OUTLIER_MAX) * (int64_t)sizeof(float) +
                                 groups * (int64_t)sizeof(uint32_t) +
                                 (bytes ? (team + 2) * K * (int64_t)sizeof(float) : 0)) + 64);
    if (!rows) return -1;
    float *xd = (float *)rows, *xs = xd + M * groups, *xo = xs + M * groups; /* xo [M][nout]: outlier values */
    uint32_t *skip = (uint32_t *)(xo + M * OUTLIER_MAX); /* per group, the outlier columns' bits */
    float *colmax = (float *)(skip + groups); /* bytes: [team + 2][K], each thread's maxima, then all's */
    void *codes = bytes ? (void *)(colmax + (team + 2) * K) : (void *)colmax;
    memset(skip, 0, (size_t)groups * sizeof(uint32_t));
    const __m512i order = bytes ? _mm512_setzero_si512() : ig_pair_order(kind);
#pragma omp parallel num_threads(threads) if (team > 1)
    {
        if (bytes) { /* the columns' largest magnitudes, each thread over the rows it then quantizes (static) */
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
                quantize_row8(x + r * ldx, K, (int8_t *)codes + r * K, xd + r * groups, xs + r * groups, !IS_Q4(kind),
                              nout ? skip : NULL);
                for (int64_t j = 0; j < nout; j++) xo[r * nout + j] = x[r * ldx + outliers[j]];
                continue;
            }
            int16_t *q = (int16_t *)codes + r * K;
            quantize_row16(x + r * ldx, K, q, xd + r * groups, xs + r * groups, 0);
            for (int64_t i = 0; i < K; i += 32)
                _mm512_storeu_si512(q + i, _mm512_permutexvar_epi16(order, _mm512_loadu_si512(q + i)));
        }
    }
    const int64_t pairs_of_panels = (N + 31) / 32;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && pairs_of_panels > 1)
    {
        gemm_panels p;
        void *block = malloc((size_t)(2 * 16 * K * width + (3 * 2 * sg + 2 * OUTLIER_MAX) * 16 * 4) + 64);
        if (!block) failed = 1;
        else {
            p.codes[0] = block, p.codes[1] = (uint8_t *)block + 16 * K * width;
            p.scale[0] = (float *)((uint8_t *)p.codes[1] + 16 * K * width), p.scale[1] = p.scale[0] + sg * 16;
            p.offset[0] = p.scale[1] + sg * 16, p.offset[1] = p.offset[0] + sg * 16;
            p.bias[0] = (int32_t *)(p.offset[1] + sg * 16), p.bias[1] = p.bias[0] + sg * 16;
            p.outlier[0] = (float *)(p.bias[1] + sg * 16), p.outlier[1] = p.outlier[0] + OUTLIER_MAX * 16;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < pairs_of_panels; c++) {
            if (!block) continue;
            const int64_t n0 = c * 32, cols = N - n0 < 32 ? N - n0 : 32;
            gemm_widen(kind, bytes, qs, d, m, n0, N, K, &p, M < IG_PREFETCH_ROWS, outliers, nout);
#define NT_GEMM_ROWS(B)                                                                                   \
    if (kind == 4) gemm_rows(4, B, codes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);                \
    else if (kind == 5) gemm_rows(5, B, codes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);           \
    else if (kind == 8) gemm_rows(8, B, codes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);           \
    else gemm_rows(6, B, codes, xd, xs, M, K, &p, out, ldo, n0, cols, xo, nout);
            if (bytes) { NT_GEMM_ROWS(1) } else { NT_GEMM_ROWS(0) }
#undef NT_GEMM_ROWS
        }
        free(block);
    }
    free(rows);
    return failed ? -1 : 0;
}

/* The GEMM over block weights, with int16 activation codes in two levels (split_levels) or (`bytes`) int8 ones,
 * these without the outlier columns (outlier_columns), whose products are added in fp32. */
static int block_gemm_codes(int kind, int bytes, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                            const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads) {
    if (!bytes) { /* the levels as rows of their own, each pair summed into one output row by gemm_tile */
        float *levels = malloc((size_t)(2 * M * K) * sizeof(float) + 64);
        if (!levels) return -1;
        split_levels(x, M, K, ldx, levels);
        x = levels, M *= 2, ldx = K;
    }
    const int status = block_gemm_rows(kind, bytes, x, M, K, ldx, N, qs, d, m, out, ldo, threads);
    if (!bytes) free((void *)x);
    return status;
}
#endif

/* nt_block_matmul's product through a GEMM, for batches bound by compute: with AVX-512 VNNI the int16 one
 * (block_gemm_codes), else the fp32 one: each thread dequantizes 16 weight rows at a time into a panel of its own (a
 * few percent of the multiply-adds at 64 rows) and runs every row tile of x over it. Either way no fp32 copy of the
 * weight is kept. Returns 0, or -1 as nt_block_matmul. */
int nt_block_gemm(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                  const void *d, const void *m, float *out, int64_t ldo, int threads) {
    if (!KNOWN_KIND(kind) || K % QK) return -1;
#ifdef NT_VNNI512
    return block_gemm_codes(kind, 0, x, M, K, ldx, N, qs, d, m, out, ldo, threads);
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
 * their real prefill activations, 1.47-1.53x the int16 route's rate (SmolLM2, Gemma 3; codes alone 1.56-1.66x), at
 * 64 rows 1.33x. The activations' step is absmax / 127 per 32 values where int16 codes keep it 258 times finer:
 * teacher-forced top-1 agreement with the reference 99.2% for SmolLM2 and 98.9% for Gemma 3, KL 6.8e-4 / 3.6e-4,
 * where int16 gives 100% (transformers in bf16: 98.4% / 97.8%, KL 1.4e-3 / 5.6e-4). Elsewhere the same as
 * nt_block_gemm. */
int nt_block_gemm8(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                   const void *d, const void *m, float *out, int64_t ldo, int threads) {
#ifdef NT_VNNI512
    if (!KNOWN_KIND(kind) || K % QK) return -1;
    return block_gemm_codes(kind, 1, x, M, K, ldx, N, qs, d, m, out, ldo, threads);
#else
    return nt_block_gemm(kind, x, M, K, ldx, N, qs, d, m, out, ldo, threads);
#endif
}

/* ------------------------------------------------------------ file blocks */

/* n Q8_0 blocks (34 bytes: fp16 d, 32 int8 codes) -> codes [n * 32] and d [n] (the fp16 bits as stored): a strided
 * copy, split across threads. */
void nt_unpack_q8_0(const uint8_t *raw, int64_t n, int8_t *codes, uint16_t *d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 4096)
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *block = raw + b * 34;
        memcpy(&d[b], block, 2);
        memcpy(codes + b * QK, block + 2, QK);
    }
}

/* n Q5_0 blocks (22 bytes: fp16 d, a 32-bit mask of the codes' fifth bits (bit j for element j), 16 bytes of nibbles:
 * element j the low nibble of byte j, element j + 16 the high one) -> int8 codes q - 16 in -16..15 [n * 32] and d
 * [n] (fp16 bits): w = d * code. */
void nt_unpack_q5_0(const uint8_t *raw, int64_t n, int8_t *codes, uint16_t *d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 4096)
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *block = raw + b * 22;
        uint32_t high;
        memcpy(&d[b], block, 2);
        memcpy(&high, block + 2, 4);
        int8_t *out = codes + b * QK;
        for (int j = 0; j < QK / 2; j++) {
            const uint8_t byte = block[6 + j];
            out[j] = (int8_t)(((byte & 0x0F) | (((high >> j) & 1) << 4)) - 16);
            out[j + QK / 2] = (int8_t)(((byte >> 4) | (((high >> (j + QK / 2)) & 1) << 4)) - 16);
        }
    }
}

/* ------------------------------------------------------------ measurement */

typedef uint64_t __attribute__((may_alias, aligned(1))) any_word;

/* The XOR of every 64-bit word of n buffers (ptrs[i], sizes[i] bytes; a tail under 8 bytes is left out), each
 * buffer split between the threads in contiguous parts, as the block products split their weight rows, in one
 * parallel region (no thread waits for another between buffers). It only reads: its time is the floor that memory
 * bandwidth puts under one pass over those bytes (benchmarks/roofline.py). */
uint64_t nt_stream_read(const void *const *ptrs, const int64_t *sizes, int64_t n, int threads) {
    uint64_t all = 0;
#pragma omp parallel num_threads(threads) reduction(^ : all) if (threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
#else
        const int64_t t = 0, parts = 1;
#endif
        uint64_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            const any_word *p = (const any_word *)ptrs[i];
            const int64_t words = sizes[i] / 8;
            for (int64_t w = words * t / parts, end = words * (t + 1) / parts; w < end; w++) acc ^= p[w];
        }
        all ^= acc;
    }
    return all;
}

/* ------------------------------------------------------------ token rows */

/* out [n, K] = rows ids[0..n) of a Q8 table: int8 codes [vocab, K] times fp32 scales [vocab, K / 32] (one rounding,
 * as the file's dequantization). Returns -1 for an id outside [0, vocab). */
int nt_embed_q8(const int8_t *codes, const float *scales, int64_t vocab, int64_t K, const int64_t *ids, int64_t n,
                float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int8_t *c = codes + ids[i] * K;
        const float *d = scales + ids[i] * (K / QK);
        for (int64_t g = 0; g < K / QK; g++)
#pragma omp simd
            for (int j = 0; j < QK; j++) out[i * K + g * QK + j] = (float)c[g * QK + j] * d[g];
    }
    return 0;
}

/* ----------------------------------------------------------------- RMSNorm */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, over M rows of K; with `residual`, first x[r] += residual[r] (in
 * place: the updated residual stream stays in x). */
void nt_rms_norm(float *x, const float *residual, const float *w, float *out, int64_t M, int64_t K, float eps) {
    for (int64_t r = 0; r < M; r++) {
        float *xr = x + r * K;
        float *o = out + r * K;
        if (residual) {
            const float *rr = residual + r * K;
            for (int64_t i = 0; i < K; i++) xr[i] += rr[i];
        }
        float ss = 0.0f; /* in vector lanes: one chain of K dependent adds took 4 cycles an element */
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < K; i++) ss += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(ss / (float)K + eps);
        for (int64_t i = 0; i < K; i++) o[i] = xr[i] * scale * w[i];
    }
}

/* ------------------------------------------------------- decode attention */

#define ATT_GROUP 32 /* positions attend8 takes at a time: their rows as pointers (or converted), scores per head */

/* Key/value rows of a paged cache [num_blocks, block_size, kv_heads, head_dim] stored as fp32 (0), bf16 (1) or int8
 * (2, with fp16 scales [num_blocks, block_size, kv_heads, head_dim / 32]). */
typedef struct {
    const void *data;
    const uint16_t *scales;
    int kind;
} kv_store;

/* n values of a narrow cache from element `at` on, as fp32 (int8: n and at multiples of 32). */
static inline void load_row(const kv_store *s, int64_t at, int64_t n, float *dst) {
    if (s->kind == 1) {
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

typedef struct {
    void *k, *v;
    uint16_t *k_scales, *v_scales; /* int8 only */
    int64_t kind, block_size;       /* kind: 0 fp32, 1 bf16, 2 int8 */
} nt_cache;

/* Cache row of each position in [first, len) of a sequence whose blocks are `table` (in units of one kv head's
 * values: position p's kv heads start at at[p - first] * D). */
static void cache_rows(const int64_t *table, int64_t bs, int64_t kv_heads, int64_t first, int64_t len, int64_t *at) {
    for (int64_t b = first / bs, p = first; p < len; b++) /* a block at a time: no division per position */
        for (const int64_t end = (b + 1) * bs < len ? (b + 1) * bs : len; p < end; p++)
            at[p - first] = (table[b] * bs + p - b * bs) * kv_heads;
}

/* A token's kv heads (kv_heads * D values from element `at`) as fp32: in place for an fp32 cache, else into row. */
static inline const float *token_kv(const kv_store *s, int64_t at, int64_t width, float *row) {
    if (s->kind == 0) return (const float *)s->data + at;
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
static inline void prefetch_tokens(const kv_store *s, const int64_t *at, int64_t from, int64_t to, int64_t count,
                                   int64_t D, int64_t width) {
    const int64_t size = s->kind == 0 ? 4 : s->kind == 1 ? 2 : 1;
    for (int64_t j = from; j < to && j < count; j++) {
        const char *p = (const char *)s->data + at[j] * D * size;
        for (int64_t b = 0; b < width * size; b += 64) _mm_prefetch(p + b, _MM_HINT_T2);
    }
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
 * while one is computed. */
static void attend8(const float *q, float *out, float *max, float *sum, int64_t heads, int64_t h0,
                    const kv_store *ks, const kv_store *vs, int64_t rep, int64_t D, int64_t width, int64_t count,
                    float scale, float *scores, float *row, const int64_t *at) {
    const float *rows[ATT_GROUP], *heads_at[8];
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < count; j0 += ATT_GROUP) {
        const int64_t ng = count - j0 < ATT_GROUP ? count - j0 : ATT_GROUP;
        prefetch_tokens(ks, at, j0 + ATT_GROUP, j0 + 2 * ATT_GROUP, count, D, width);
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(ks, at[j0 + i] * D, width, row + i * width);
        for (int64_t i = ng; i < (ng + 7) / 8 * 8; i++) rows[i] = rows[0]; /* a last partial eight: scores unused */
        for (int64_t h = 0; h < heads; h++) {
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
        prefetch_tokens(vs, at, j0 + ATT_GROUP, j0 + 2 * ATT_GROUP, count, D, width);
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(vs, at[j0 + i] * D, width, row + i * width);
        for (int64_t h = 0; h < heads; h++) {
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
 * is computed. */
#define ATT16 16
static void attend16(const float *q, float *out, float *max, float *sum, int64_t heads, int64_t h0,
                     const kv_store *ks, const kv_store *vs, int64_t rep, int64_t D, int64_t width, int64_t count,
                     float scale, float *scores, float *row, const int64_t *at) {
    const float *rows[ATT16];
    const __m512 sv = _mm512_set1_ps(scale);
    /* A short context's values are requested during the keys' pass, so that they are on their way when it ends
     * (64 contexts of 192 tokens: 6% faster); a long one's would leave L2 before their pass. */
    const int early_values = count * width * (ks->kind == 0 ? 4 : ks->kind == 1 ? 2 : 1) <= (256 << 10);
    for (int64_t j0 = 0; j0 < count; j0 += ATT16) {
        const int64_t ng = count - j0 < ATT16 ? count - j0 : ATT16;
        prefetch_tokens(ks, at, j0 + ATT16, j0 + 2 * ATT16, count, D, width);
        if (early_values) prefetch_tokens(vs, at, j0, j0 + ATT16, count, D, width);
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(ks, at[j0 + i] * D, width, row + i * width);
        for (int64_t i = ng; i < ATT16; i++) rows[i] = rows[0]; /* a last partial group: scores unused */
        for (int64_t h = 0; h < heads; h++) {
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
        prefetch_tokens(vs, at, j0 + ATT16, j0 + 2 * ATT16, count, D, width);
        for (int64_t i = 0; i < ng; i++) rows[i] = token_kv(vs, at[j0 + i] * D, width, row + i * width);
        for (int64_t h = 0; h < heads; h++) {
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
static int decode_attention(const float *q, float *out, int64_t n, const int64_t *rows, const int64_t *seq_lens,
                            const int64_t *tables, const int64_t *table_rows, int64_t table_stride,
                            const nt_cache *c, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                            int64_t window, int threads) {
    if (c->kind == 2 && D % QK) return -1;
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

/* ------------------------------------------------------ fused decoder layers */

static inline uint16_t float_to_half(float f) {
#ifdef NT_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xFF) - 127 + 15;
    uint32_t man = x & 0x7FFFFF;
    if (((x >> 23) & 0xFF) == 0xFF) return (uint16_t)(sign | 0x7C00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7C00);
    if (exp <= 0) { /* subnormal or zero: shift in the implicit bit, round to nearest even */
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        const int shift = 14 - exp;
        uint32_t h = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (man >> 13);
    const uint32_t rest = man & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* may carry into the exponent: still correct */
    return (uint16_t)(sign | h);
#endif
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

/* Store one token's K or V row (kv_heads * D values) at cache row `at` (= slot * kv_heads). */
static void store_row(void *data, uint16_t *scales, int64_t kind, int64_t at, const float *src, int64_t n) {
    if (kind == 0) {
        memcpy((float *)data + at, src, (size_t)n * sizeof(float));
    } else if (kind == 1) {
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

typedef struct {
    int64_t kind, n, k; /* see nt_block_matmul */
    const void *qs, *d;
    const void *m;
} nt_part;

/* A projection as up to 4 stacked parts (rows of the output), each in its own format: a fused QKV projection whose
 * V comes from 6-bit blocks while Q and K come from 4-bit ones. `panels`: the whole fp32 weight packed by
 * nt_sgemm_pack, for products of many rows (null: the block kernels take every product). */
typedef struct {
    int64_t num_parts, n;
    nt_part parts[4];
    const float *panels;
    int64_t int8_activations; /* products of many rows over the blocks by nt_block_gemm8 */
} nt_matrix;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, window; /* window 0: none */
    float eps, scale;
    int64_t activation; /* 0: silu, 1: gelu (tanh) */
    int64_t rope_interleaved, rope_dim, rope_table; /* rope_table: which (cos, sin) pair of the call */
    /* Norms: before attention and the MLP (required); of their outputs and of q and k per head (optional). */
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm, *q_norm, *k_norm;
    nt_matrix qkv, o, gate_up, down;
} nt_layer;

/* Rows of src (n of width floats, ld apart) into a cache's slots (kind as nt_cache; width = kv heads x head size),
 * the rows split across threads. */
void nt_store_rows(void *data, uint16_t *scales, int64_t kind, const int64_t *slots, const float *src, int64_t n,
                   int64_t width, int64_t ld, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 1)
    for (int64_t t = 0; t < n; t++) store_row(data, scales, kind, slots[t] * width, src + t * ld, width);
}

/* out [M, n] = x [M, k] @ W^T: from `gemm_rows` rows on (bound by compute there) a GEMM, the fp32 one over the
 * panels where the matrix has them, else the one over the blocks (nt_block_gemm: int16 with AVX-512 VNNI, where
 * projections keep no panels); fewer rows take the block kernels (bound by the bytes of the weight). */
static int matmul(const nt_matrix *w, const float *x, int64_t M, float *out, int threads, int64_t gemm_rows) {
    const int gemm = M >= gemm_rows;
    if (gemm && w->panels) {
        nt_sgemm(x, M, w->parts[0].k, w->parts[0].k, w->panels, w->n, out, w->n, threads);
        return 0;
    }
    int status = 0;
    for (int64_t i = 0, at = 0; i < w->num_parts; at += w->parts[i].n, i++) {
        const nt_part *p = &w->parts[i];
        status |= (!gemm ? nt_block_matmul : w->int8_activations ? nt_block_gemm8 : nt_block_gemm)(
            (int)p->kind, x, M, p->k, p->k, p->n, p->qs, p->d, p->m, out + at, w->n, threads);
    }
    return status;
}

static void rope(float *x, int64_t heads, int64_t D, const nt_layer *L, const float *cos, const float *sin) {
    const int64_t pairs = L->rope_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * D;
        for (int64_t i = 0; i < pairs; i++) {
            float *a = L->rope_interleaved ? v + 2 * i : v + i;
            float *b = L->rope_interleaved ? v + 2 * i + 1 : v + i + pairs;
            const float x0 = *a, x1 = *b;
            *a = x0 * cos[i] - x1 * sin[i];
            *b = x1 * cos[i] + x0 * sin[i];
        }
    }
}

/* 0.5 x (1 + tanh(t)), t = sqrt(2 / pi) (x + 0.044715 x^3), written as x / (1 + e^-2t): the same function, without
 * the cancellation of 1 + tanh(t) where tanh(t) is near -1. */
static inline float gelu_tanh(float x) {
    return x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* a[i] = act(g[i]) * u[i] over n values: silu (0) or gelu with tanh (1), the torch modules' functions (gelu in its
 * sigmoid form, see gelu_tanh). */
void nt_gated(int64_t activation, const float *g, const float *u, float *a, int64_t n) {
    int64_t i = 0;
#ifdef NT_VNNI512
    for (; i + 16 <= n; i += 16) { /* as the AVX2 loop below, 16 lanes at a time */
        const __m512 x = _mm512_loadu_ps(g + i), up = _mm512_loadu_ps(u + i);
        __m512 z = x;
        if (activation == 1) {
            const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            z = _mm512_mul_ps(_mm512_set1_ps(2 * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
        }
        const __m512 y = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512_ps(_mm512_sub_ps(_mm512_setzero_ps(), z))));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(y, up));
    }
#endif
#ifdef NT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i), up = _mm256_loadu_ps(u + i);
        /* silu: x / (1 + e^-x). gelu: 0.5 x (1 + tanh(t)) = x / (1 + e^-2t), the same form (no cancellation where
         * tanh(t) is near -1). */
        __m256 z = x;
        if (activation == 1) {
            const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            z = _mm256_mul_ps(_mm256_set1_ps(2 * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
        }
        const __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(y, up));
    }
#endif
    for (; i < n; i++) a[i] = (activation == 0 ? g[i] / (1.0f + expf(-g[i])) : gelu_tanh(g[i])) * u[i];
}

/* Rows of [gate | up] (2F values each) -> act(gate) * up [M, F], the rows split across threads. */
void nt_gated_rows(int64_t activation, const float *gate_up, int64_t M, int64_t F, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t t = 0; t < M; t++) nt_gated(activation, gate_up + t * 2 * F, gate_up + t * 2 * F + F, out + t * F, F);
}

/* nt_rms_norm over M rows, the rows split across threads. */
void nt_norm_rows(float *x, const float *residual, const float *w, float *out, int64_t M, int64_t K, float eps,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++)
        nt_rms_norm(x + r * K, residual ? residual + r * K : NULL, w, out + r * K, 1, K, eps);
}

int nt_prefill_attention(const float *q, const float *k, const float *v, float *out, int64_t T, int64_t S, int64_t H,
                         int64_t KVH, int64_t D, float scale, int64_t window, int threads);

/* Attention of a batch whose sequence s owns tokens [query_start[s], query_start[s + 1]), the last of its seq_lens[s]
 * positions (already in the cache): q, out [tokens, H, D]. Sequences of one new token through decode_attention
 * together; longer chunks through the prefill kernel over their whole context, gathered from the cache as fp32 (as
 * the module path gathers it). */
static int chunk_attention(const float *q, float *out, const int64_t *query_start, int64_t num_seqs,
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
            if (c->kind == 0) {
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

/* Floats of scratch that nt_decode_layers needs for M tokens: four buffers of M rows of the widest activation. */
int64_t nt_decode_scratch(const nt_layer *layers, int64_t num_layers, int64_t M) {
    int64_t widest = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const nt_layer *L = &layers[l];
        const int64_t sizes[] = {L->hidden, L->qkv.n, L->heads * L->head_dim, L->gate_up.n};
        for (int i = 0; i < 4; i++) widest = sizes[i] > widest ? sizes[i] : widest;
    }
    return 4 * M * widest;
}

/* Runs `num_layers` decoder blocks over M new tokens: x [M, hidden] is the residual stream, updated in place.
 * positions, slots (cache slot of each new token) [M]. With query_start null, token t is the one new token of
 * sequence t (a decode step: seq_lens [M], block tables [M, table_stride]); else sequence s of num_seqs owns tokens
 * [query_start[s], query_start[s + 1]) (seq_lens [num_seqs], block tables [num_seqs, table_stride]), and a chunk of
 * several tokens attends through the prefill kernel (chunk_attention: AVX-512 only; elsewhere -1). rope_tables:
 * (cos, sin) pointers, each [positions, rope_dim / 2]; scratch: at least nt_decode_scratch() floats; gemm_rows: from
 * how many rows products take a GEMM (see matmul); final_norm: the model's last RMSNorm, applied to x in place
 * after the last block (null: none). Returns 0, or -1 when a size is unsupported or memory runs out. */
int nt_decode_layers(float *x, int64_t M, const int64_t *positions, const int64_t *slots, const int64_t *seq_lens,
                     const int64_t *tables, int64_t table_stride, const int64_t *query_start, int64_t num_seqs,
                     const nt_layer *layers, const nt_cache *caches, int64_t num_layers,
                     const float *const *rope_tables, float *scratch, int64_t gemm_rows, const float *final_norm,
                     float final_eps, int threads) {
    const int64_t rows = nt_decode_scratch(layers, num_layers, M) / 4;
    float *h = scratch, *big = h + rows, *att = big + rows, *tmp = att + rows;
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const nt_layer *L = &layers[l];
        const nt_cache *c = &caches[l];
        const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, hid = L->hidden;
        const int64_t qkv_n = L->qkv.n;
        /* attention */
        nt_norm_rows(x, NULL, L->attn_in_norm, h, M, hid, L->eps, threads);
        status |= matmul(&L->qkv, h, M, big, threads, gemm_rows);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
        for (int64_t t = 0; t < M; t++) {
            float *row = big + t * qkv_n; /* q heads, k heads, v heads */
            if (L->q_norm) nt_rms_norm(row, NULL, L->q_norm, row, H, D, L->eps);
            if (L->k_norm) nt_rms_norm(row + H * D, NULL, L->k_norm, row + H * D, KVH, D, L->eps);
            const int64_t half = L->rope_dim / 2;
            const float *cos = rope_tables[2 * L->rope_table] + positions[t] * half;
            const float *sin = rope_tables[2 * L->rope_table + 1] + positions[t] * half;
            rope(row, H + KVH, D, L, cos, sin);
            const int64_t at = slots[t] * KVH * D;
            store_row(c->k, c->k_scales, c->kind, at, row + H * D, KVH * D);
            store_row(c->v, c->v_scales, c->kind, at, row + (H + KVH) * D, KVH * D);
            memcpy(att + t * H * D, row, (size_t)(H * D) * sizeof(float)); /* q, contiguous per token */
        }
        if (query_start)
            status |= chunk_attention(att, tmp, query_start, num_seqs, seq_lens, tables, table_stride, c, H, KVH, D,
                                      L->scale, L->window, threads);
        else
            status |= decode_attention(att, tmp, M, NULL, seq_lens, tables, NULL, table_stride, c, H, KVH, D, L->scale,
                                       L->window, threads);
        status |= matmul(&L->o, tmp, M, h, threads, gemm_rows);
        if (L->attn_out_norm) nt_norm_rows(h, NULL, L->attn_out_norm, h, M, hid, L->eps, threads);
        /* MLP */
        nt_norm_rows(x, h, L->mlp_in_norm, h, M, hid, L->eps, threads);
        status |= matmul(&L->gate_up, h, M, big, threads, gemm_rows);
        const int64_t F = L->ffn;
        nt_gated_rows(L->activation, big, M, F, att, threads);
        status |= matmul(&L->down, att, M, h, threads, gemm_rows);
        if (L->mlp_out_norm) nt_norm_rows(h, NULL, L->mlp_out_norm, h, M, hid, L->eps, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
        for (int64_t t = 0; t < M; t++)
            for (int64_t i = 0; i < hid; i++) x[t * hid + i] += h[t * hid + i];
    }
    if (final_norm && num_layers > 0 && !status)
        nt_norm_rows(x, NULL, final_norm, x, M, layers[num_layers - 1].hidden, final_eps, threads);
    return status ? -1 : 0;
}

/* ------------------------------------------------------- a whole decode step */

/* The index of v [n]'s first largest value, a NaN counting as largest (its first one), as torch's and numpy's
 * argmax: the largest value (or that there is a NaN) in one pass, then the first place that holds it. */
static int64_t argmax_row(const float *v, int64_t n) {
    int nan = 0;
    float best = -INFINITY;
    int64_t i = 0;
#ifdef NT_VNNI512
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, x);
    }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(top);
#endif
    for (; i < n; i++) {
        if (v[i] != v[i]) nan = 1;
        else if (v[i] > best) best = v[i];
    }
    i = 0;
#ifdef NT_VNNI512
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(x, _mm512_set1_ps(best), _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (nan ? v[i] != v[i] : v[i] == best) return i;
    return 0;
}

/* ------------------------------------------------------- sampling */

#define SAMPLE_BLOCK 1024 /* the draw's first level: sums of this many probabilities */
/* Below this, e^x is 0 for the draw: as in fp32's softmax (the vector exps clamp there to a subnormal instead), so a
 * masked (-inf) logit can never be drawn. */
#define EXP_UNDERFLOW -87.33654f

/* e[i] = exp((l[i] - top) * inv_t) for a row of n, and the sums of each SAMPLE_BLOCK of them (double); returns the
 * row's total. */
static double exp_row(const float *l, int64_t n, float top, float inv_t, float *e, double *sums) {
    double total = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += SAMPLE_BLOCK) {
        const int64_t b1 = b0 + SAMPLE_BLOCK < n ? b0 + SAMPLE_BLOCK : n;
        int64_t i = b0;
        double sum = 0.0;
#ifdef NT_VNNI512
        const __m512 t = _mm512_set1_ps(top), s = _mm512_set1_ps(inv_t), low = _mm512_set1_ps(EXP_UNDERFLOW);
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= b1; i += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(l + i), t), s);
            const __m512 x = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, low, _CMP_GE_OQ), exp512_ps(y));
            _mm512_storeu_ps(e + i, x);
            acc = _mm512_add_ps(acc, x);
        }
        sum = _mm512_reduce_add_ps(acc);
#elif defined(NT_AVX2)
        const __m256 t = _mm256_set1_ps(top), s = _mm256_set1_ps(inv_t), low = _mm256_set1_ps(EXP_UNDERFLOW);
        for (; i + 8 <= b1; i += 8) {
            const __m256 y = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), t), s);
            const __m256 x = _mm256_and_ps(_mm256_cmp_ps(y, low, _CMP_GE_OQ), exp_ps(y));
            _mm256_storeu_ps(e + i, x);
            float lanes[8];
            _mm256_storeu_ps(lanes, x);
            for (int k = 0; k < 8; k++) sum += lanes[k];
        }
#endif
        for (; i < b1; i++) {
            const float y = (l[i] - top) * inv_t;
            sum += e[i] = y >= EXP_UNDERFLOW ? expf(y) : 0.0f;
        }
        sums[b0 / SAMPLE_BLOCK] = sum;
        total += sum;
    }
    return total;
}

/* The index among w [n] (weights >= 0, `sums` their SAMPLE_BLOCK sums) whose running sum first exceeds u * total:
 * the block from the sums, then a running sum within it (double); never an entry of weight 0. */
static int64_t draw_index(const float *w, int64_t n, const double *sums, double total, double u) {
    const double target = u * total;
    double before = 0.0;
    int64_t b0 = 0;
    for (; b0 + SAMPLE_BLOCK < n && before + sums[b0 / SAMPLE_BLOCK] <= target; b0 += SAMPLE_BLOCK)
        before += sums[b0 / SAMPLE_BLOCK];
    const int64_t b1 = b0 + SAMPLE_BLOCK < n ? b0 + SAMPLE_BLOCK : n;
    double acc = before;
    for (int64_t i = b0; i < b1; i++) {
        acc += w[i];
        if (acc > target && w[i] > 0) return i;
    }
    for (int64_t i = n - 1; i > 0; i--) /* rounding left the target past the sum: the last possible entry */
        if (w[i] > 0) return i;
    return 0;
}

typedef struct {
    float s;
    int32_t id;
} scored;

static int by_score(const void *a, const void *b) { /* descending, then by id */
    const scored *x = a, *y = b;
    return x->s > y->s ? -1 : x->s < y->s ? 1 : (x->id > y->id) - (x->id < y->id);
}

/* One row's draw (the Python sampler's stages 3-7, see engine/sampler.py): temperature, top-k (0: none), top-p
 * (1: none) over the top-k row, min-p (0: none), then the token at u of the filtered distribution. Scratch: e and
 * vals n floats, ids n ints, cand n entries, sums n / SAMPLE_BLOCK + 1 doubles. */
static float row_max(const float *l, int64_t n) {
    float top = -INFINITY;
    int64_t i = 0;
#ifdef NT_VNNI512
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(l + i));
    top = _mm512_reduce_max_ps(m);
#endif
    for (; i < n; i++) top = l[i] > top ? l[i] : top;
    return top;
}

/* The entries of e [n] at or above `cut` into cand (in index order); returns how many, their sum into *mass. */
static int64_t gather_candidates(const float *e, int64_t n, float cut, scored *cand, float *vals, int32_t *ids,
                                 double *mass) {
    int64_t m = 0, i = 0;
    double total = 0.0;
#ifdef NT_VNNI512
    const __m512 c = _mm512_set1_ps(cut);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, step)) {
        const __m512 x = _mm512_loadu_ps(e + i);
        const __mmask16 k = _mm512_cmp_ps_mask(x, c, _CMP_GE_OQ);
        if (!k) continue;
        _mm512_mask_compressstoreu_ps(vals + m, k, x);
        _mm512_mask_compressstoreu_epi32(ids + m, k, at);
        acc = _mm512_mask_add_ps(acc, k, acc, x);
        m += __builtin_popcount(k);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++)
        if (e[i] >= cut) vals[m] = e[i], ids[m] = (int32_t)i, m++, total += e[i];
    for (int64_t j = 0; j < m; j++) cand[j].s = vals[j], cand[j].id = ids[j];
    *mass = total;
    return m;
}

static int64_t sample_row(const float *l, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                          double u, float *e, double *sums, scored *cand, float *vals, int32_t *ids) {
    const float top = row_max(l, n);
    const float inv_t = 1.0f / temperature;
    const double z = exp_row(l, n, top, inv_t, e, sums);
    const int by_k = top_k > 0 && top_k < n, by_p = top_p < 1.0f, by_min = min_p > 0.0f;
    if (!by_k && !by_p && !by_min) return draw_index(e, n, sums, z, u); /* in vocabulary order */
    /* Candidates: the tokens within a factor of the best, widened until they hold the filtered row. */
    const float floor_p = by_min ? min_p : 0.0f;
    float cut = floor_p > 1e-2f ? floor_p : 1e-2f; /* most rows' filters keep tokens within 100x of the best */
    int64_t m = 0;
    for (;;) {
        double mass = 0.0;
        m = gather_candidates(e, n, cut, cand, vals, ids, &mass);
        int enough = 1; /* min-p alone, or with top-k only: the min-p set holds every token kept */
        if (by_k && (by_p || !by_min))
            enough = m >= top_k; /* the whole top-k: what top-p normalizes over, or what is kept */
        else if (by_p)
            enough = mass >= top_p * z || cut <= floor_p; /* the nucleus, or all min-p keeps of it */
        if (enough || cut == 0.0f) break;
        const float next = cut * 1e-3f; /* wider, down to min-p's cut first, then to every token */
        cut = cut > floor_p && next < floor_p ? floor_p : next < 1e-30f ? 0.0f : next;
    }
    qsort(cand, (size_t)m, sizeof(scored), by_score);
    if (by_k && m > top_k) m = top_k;
    double zp = z; /* top-p's normalization: the top-k row, or the whole row */
    if (by_k) {
        zp = 0.0;
        for (int64_t j = 0; j < m; j++) zp += cand[j].s;
    }
    int64_t keep = m;
    if (by_p) {
        double cum = 0.0;
        for (keep = 0; keep < m && (keep == 0 || cum < top_p * zp); keep++) cum += cand[keep].s;
    }
    if (by_min) /* below min_p times the best: at the end of the order */
        while (keep > 1 && cand[keep - 1].s < min_p * cand[0].s) keep--;
    float *w = e; /* the kept weights in order, over the row's buffer, and their block sums */
    double total = 0.0;
    for (int64_t j = 0; j < keep; j++) {
        if (j % SAMPLE_BLOCK == 0) sums[j / SAMPLE_BLOCK] = 0.0;
        w[j] = cand[j].s;
        sums[j / SAMPLE_BLOCK] += w[j];
        total += w[j];
    }
    return cand[draw_index(w, keep, sums, total, u)].id;
}

/* Per row r of logits [M, N] (row stride ld), the token drawn at uniforms[r] in [0, 1) after temperature[r],
 * top_k[r], top_p[r] and min_p[r] (sample_row), into out[r]; rows split across threads. Returns -1 without memory. */
int nt_sample_rows(const float *logits, int64_t M, int64_t N, int64_t ld, const float *temperature,
                   const int64_t *top_k, const float *top_p, const float *min_p, const double *uniforms,
                   int64_t *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && M > 1)
    {
        float *e = malloc((size_t)N * 2 * sizeof(float)), *vals = e ? e + N : NULL;
        int32_t *ids = malloc((size_t)N * sizeof(int32_t));
        double *sums = malloc((size_t)(N / SAMPLE_BLOCK + 1) * sizeof(double));
        scored *cand = malloc((size_t)N * sizeof(scored));
        const int ok = e && ids && sums && cand;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < M; r++)
            if (ok)
                out[r] = sample_row(logits + r * ld, N, temperature[r], top_k[r], top_p[r], min_p[r], uniforms[r], e,
                                    sums, cand, vals, ids);
        free(e), free(ids), free(sums), free(cand);
    }
    return failed ? -1 : 0;
}

/* out[r] = the index of row r's first largest value (argmax_row), for M rows of N (row stride ld). */
void nt_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ld, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++) out[r] = argmax_row(x + r * ld, N);
}

/* What a decode step reads besides its tokens: the decoder (nt_decode_layers' arguments), buffers kept between
 * steps, the token table (Q8 blocks, times embed_scale) and the LM head (int8 blocks of `head_kind`, 8 or 6). */
typedef struct {
    const nt_layer *layers;
    const nt_cache *caches;
    int64_t num_layers;
    const float *const *rope_tables;
    float *scratch;            /* nt_decode_scratch() floats for max_rows */
    float *x;                  /* [max_rows, hidden]: the residual stream */
    int64_t max_rows;
    int64_t gemm_rows;
    const float *final_norm;
    float final_eps;
    float embed_scale;
    const int8_t *embed_codes; /* [vocab, hidden] */
    const float *embed_scales; /* [vocab, hidden / 32] */
    int64_t vocab;
    int64_t head_kind;
    const int8_t *head_qs; /* [head_rows, hidden] */
    const void *head_d;
    int64_t head_rows;
    int64_t head_gemm_rows; /* rows from which the head takes the GEMM over its blocks */
    int64_t head_int8_activations;
    int64_t threads;
} nt_step;

/* One decode step of M sequences (one new token each) in one call: the token rows from the table, every decoder
 * block with the final norm (nt_decode_layers), and the LM head into logits [M, head_rows] (row stride ldl); with
 * `argmax`, each row's argmax_row there. ints: token ids, positions, cache slots and context lengths [M] each, then
 * the block tables [M, table_stride]. Returns 0; -1 when M exceeds the buffers or a kernel fails; -2 for a token id
 * outside the table. */
int nt_decode_step(const nt_step *s, const int64_t *ints, int64_t M, int64_t table_stride, float *logits,
                   int64_t ldl, int64_t *argmax) {
    if (M < 1 || M > s->max_rows || s->num_layers < 1) return -1;
    const int64_t hidden = s->layers[0].hidden;
    const int64_t *ids = ints, *positions = ints + M, *slots = ints + 2 * M, *seq_lens = ints + 3 * M;
    if (nt_embed_q8(s->embed_codes, s->embed_scales, s->vocab, hidden, ids, M, s->x)) return -2;
    if (s->embed_scale != 1.0f)
        for (int64_t i = 0; i < M * hidden; i++) s->x[i] *= s->embed_scale;
    const int threads = (int)s->threads;
    if (nt_decode_layers(s->x, M, positions, slots, seq_lens, ints + 4 * M, table_stride, NULL, M, s->layers,
                         s->caches, s->num_layers, s->rope_tables, s->scratch, s->gemm_rows, s->final_norm,
                         s->final_eps, threads))
        return -1;
    const int kind = (int)s->head_kind;
    int status;
    if (M >= s->head_gemm_rows)
        status = (s->head_int8_activations ? nt_block_gemm8 : nt_block_gemm)(
            kind, s->x, M, hidden, hidden, s->head_rows, s->head_qs, s->head_d, NULL, logits, ldl, threads);
    else
        status = nt_block_matmul(kind, s->x, M, hidden, hidden, s->head_rows, s->head_qs, s->head_d, NULL, logits,
                                 ldl, threads);
    if (status) return -1;
    if (argmax) nt_argmax_rows(logits, M, s->head_rows, ldl, argmax, threads);
    return 0;
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
