/* Block formats: activations as codes per block of 32 (int16, and int8 for a second level), a weight row's blocks as
 * fp32, a file's Q8_0 and Q5_0 blocks unpacked into codes and scales, rows of a Q8 token table. */
#include "internal.h"

/* ------------------------------------------------- activation quantization */

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

/* x [K] -> int16 codes in -levels..levels (in q4_position order where `q4_order`), per block: d = absmax / levels,
 * s = d * sum(codes). Codes round to nearest, ties to even, in both paths. */
static void quantize_row16(const float *x, int64_t K, int16_t *q, float *d, float *s, int q4_order, float levels) {
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
        const float db = max / levels, inv = max > 0 ? levels / max : 0.0f;
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
        const float db = max / levels, inv = max > 0 ? levels / max : 0.0f;
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

/* split_levels' rows x [M, K] (M even) as rows of int16 codes, each level in its range (level_codes). */
int quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int q4_order, quantized_rows *out) {
    const int64_t groups = K / QK;
    out->block = malloc((size_t)(M * K * 2 + 2 * M * groups * (int64_t)sizeof(float)) + 64);
    if (!out->block) return -1;
    out->d = (float *)out->block;
    out->s = out->d + M * groups;
    out->q = (int16_t *)(out->s + M * groups);
    for (int64_t r = 0; r < M; r++)
        quantize_row16(x + r * ldx, K, out->q + r * K, out->d + r * groups, out->s + r * groups, q4_order,
                       level_codes(r));
    return 0;
}

/* The block products take each activation row in two levels of codes per block of 32, x = d1 q1 + d2 q2: the int16
 * codes of the row itself (quantize_row16's, d1 = absmax / 32767), then int8 codes of what they leave, x - d1 q1 (at
 * most d1 / 2, so d2 <= d1 / 254). In one level a block holding one large value leaves its small values few
 * significant bits: every value is off by up to 1 / 65534 of the block's largest, which moved SmolLM2's
 * teacher-forced log-probabilities by 3.5e-3 and Gemma 3's by 1.6e-3 against fp32 activations. Two levels keep each
 * value within d2 / 2 <= 2^-24 of its block's largest (with the remainder's own fp32 rounding): fp32's precision for
 * a block's largest values, while one a thousand times below its block's largest keeps about 14 significant bits
 * (int16 codes in both levels kept 2^-31, 21 bits there; the models' reference prompts measured the same either way,
 * docs/exactness.md). The second level's codes are int8 because the AVX-512 kernels take it as one plane of bytes
 * where int16 codes are two (256 hi + lo): three byte multiply-adds per four values of a row instead of four. The
 * kernels take the levels as two rows of codes each and sum each pair's products into one output.
 * rows [2M, K]: row 2r is x's row r, row 2r + 1 its remainder after the first level (quantize_row16's rounding: the
 * same products and the same rounding to nearest, ties to even). */
void split_levels(const float *x, int64_t M, int64_t K, int64_t ldx, float *rows) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        float *first = rows + 2 * r * K, *rest = first + K;
        memcpy(first, xr, (size_t)K * sizeof(float));
        for (int64_t b = 0; b < K; b += QK) {
            float max = 0.0f;
            for (int i = 0; i < QK; i++) max = fabsf(xr[b + i]) > max ? fabsf(xr[b + i]) : max;
            const float db = max / LEVEL1_CODES, inv = max > 0 ? LEVEL1_CODES / max : 0.0f;
            for (int i = 0; i < QK; i++) rest[b + i] = xr[b + i] - nearbyintf(xr[b + i] * inv) * db;
        }
    }
}

/* Row n of a block-quantized weight (any nt_format) as fp32: d * q (+ m), a product and a sum each rounded (the
 * vectors' operations are the scalar ones lane by lane: the same values on every build). */
void dequantize_row(int kind, const void *qs, const void *wd, const void *wm, int64_t n, int64_t K,
                           float *dst) {
    const int64_t groups = K / QK;
    if (IS_Q4(kind)) {
        const uint8_t *q = (const uint8_t *)qs + n * (K / 2);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = n * groups + g;
            const float d = kind == NT_Q4_F32 ? ((const float *)wd)[at] : half_to_float(((const uint16_t *)wd)[at]);
            const float m = kind == NT_Q4_F32 ? ((const float *)wm)[at] : half_to_float(((const uint16_t *)wm)[at]);
#ifdef NT_AVX2
            /* element i the low nibble of byte i, element i + 16 its high one: 8 values per vector */
            const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
            const __m128i v = _mm_loadu_si128((const __m128i *)(q + g * QK / 2)), low = _mm_set1_epi8(0x0F);
            const __m128i nib[2] = {_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)};
            for (int h = 0; h < 2; h++)
                for (int e = 0; e < 2; e++) {
                    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e ? _mm_srli_si128(nib[h], 8) : nib[h]));
                    _mm256_storeu_ps(dst + g * QK + h * 16 + e * 8, _mm256_add_ps(_mm256_mul_ps(dv, c), mv));
                }
#else
            for (int i = 0; i < QK / 2; i++) {
                dst[g * QK + i] = d * (float)(q[g * QK / 2 + i] & 0x0F) + m;
                dst[g * QK + QK / 2 + i] = d * (float)(q[g * QK / 2 + i] >> 4) + m;
            }
#endif
        }
    } else {
        const int8_t *q = (const int8_t *)qs + n * K;
        const int64_t size = kind == NT_Q8_HALVES ? QK / 2 : QK; /* values per scale */
        for (int64_t g = 0; g < K / size; g++) {
            const float d = kind == NT_Q8_HALVES ? ((const float *)wd)[n * 2 * groups + g]
                                      : half_to_float(((const uint16_t *)wd)[n * groups + g]);
#ifdef NT_AVX2
            const __m256 dv = _mm256_set1_ps(d);
            for (int64_t i = 0; i < size; i += 8) {
                const __m128i c = _mm_loadl_epi64((const __m128i *)(q + g * size + i));
                _mm256_storeu_ps(dst + g * size + i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c))));
            }
#else
            for (int64_t i = 0; i < size; i++) dst[g * size + i] = d * (float)q[g * size + i];
#endif
        }
    }
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
