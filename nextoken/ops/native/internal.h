/* What the kernels' units share and keep from the interface: the instruction sets this build targets, block sizes,
 * conversions, vector helpers, and the functions one unit calls in another. Nothing here is exported. */
#ifndef NT_INTERNAL_H
#define NT_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "nt.h"

/* The instruction sets: NT_AVX2 (AVX2, FMA and F16C), NT_VNNI512 (AVX-512 F, BW, VL and VNNI on top). Without AVX2
 * the same results come from plain C loops (integer sums are exact; only the order of float accumulation differs).
 * NT_EMULATE_AVX512 (tests only) runs the AVX-512 routes on any x86-64 CPU through emulate512.h. */
#if defined(NT_EMULATE_AVX512)
#include "emulate512.h"
#define NT_AVX2 1
#define NT_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define NT_VNNI512 1
#endif
#endif
/* NT_AMX: AMX-INT8 tiles on top of NT_VNNI512 (amx.c), where the compiler targets them (-march=native on a CPU that
 * has them); used once the kernel grants the process the tile state. NT_EMULATE_AMX (tests only, with
 * NT_EMULATE_AVX512) runs that route through emulate_amx.h, off until asked for (nt_amx). */
#if defined(NT_VNNI512) && defined(NT_EMULATE_AMX)
#include "emulate_amx.h"
#define NT_AMX 1
#elif defined(NT_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define NT_AMX 1
#endif

#define NT_INTERNAL __attribute__((visibility("hidden")))

#define QK 32           /* values per block of a weight's codes, and of the activations' codes */
#define MAX_GROUPS 1024 /* blocks per row of the block products: input sizes up to 32768 */
#define SG_COLS 16      /* output columns per panel of a packed fp32 weight (sgemm.c) */
#define ROW_CHUNK 16    /* weight rows per task of the block products: whole cache lines of output per thread */

#define IS_Q4(kind) ((kind) == NT_Q4 || (kind) == NT_Q4_F32)
#define KNOWN_KIND(kind) (IS_Q4(kind) || (kind) == NT_Q8_HALVES || (kind) == NT_Q8)

/* ------------------------------------------------------------ conversions */

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

#ifdef NT_AVX2
static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Cephes' constants: the clamp, log2(e), ln 2 in two parts, and the polynomial's coefficients, highest first. */
#define EXP_MAX 88.3762626647949f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* e^x for 8 lanes, within 2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, then
 * 2^n through the exponent bits). Inputs are clamped to +-88.376, where e^x is near fp32's largest and smallest
 * normal numbers (far enough for the softmax and the gated activations that use it); NaN stays NaN. */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), _mm256_max_ps(_mm256_set1_ps(-EXP_MAX), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
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
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif

#ifdef NT_VNNI512
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
#endif

/* ------------------------------------------------------------ activation codes (formats.c) */


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

typedef struct {
    int16_t *q; /* codes [M, K] */
    float *d, *s;
    void *block;
} quantized_rows;

/* ------------------------------------------------------------ across units */

#ifdef NT_VNNI512
/* A thread's two panels of 16 weight rows each, for the GEMM over block weights (gemm.c, amx.c): their codes as
 * bytes and their scales. */
typedef struct {
    void *codes[2];              /* [K / 4][16 rows][4] */
    float *scale[2], *offset[2]; /* [scale groups][16] (Q8 in halves: per 16 values), Q4's m [K / 32][16] */
    int32_t *bias[2];            /* int8 codes: [scale groups][16], -128 times each row's codes' sum */
    float *outlier[2];           /* int8 activations: the weights of their outlier columns, [outliers][16] */
} gemm_panels;

/* The float work of every route with the GEMM's bits, shared so that their results cannot drift apart (gemm_tile,
 * few_group, amx_rows): one scale group's exact int32 sums of a row of codes against 16 weight rows into its float
 * accumulator, by one multiply-add by the product of the weights' scales dw and the row's scale dx (broadcast), and
 * for Q4 weights one more, their offsets mw by the row's code sum sx (broadcast). */
static inline __attribute__((always_inline)) __m512 scale_group(__m512 f, __m512i sums, __m512 dw, __m512 dx, int q4,
                                                                __m512 mw, __m512 sx) {
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, dx), f);
    return q4 ? _mm512_fmadd_ps(mw, sx, f) : f;
}

/* Scale group s of a thread's two panels as every GEMM route meets it: each panel's weight scales d, Q4's offsets m
 * (else zeros) and, for int8 weight codes, the bias that sums against activations plus 128 start from (else zeros). */
typedef struct {
    __m512 d[2], m[2];
    __m512i bias[2];
} panel_group;

static inline __attribute__((always_inline)) panel_group panel_group_at(int kind, const gemm_panels *p, int64_t s) {
    panel_group g;
    for (int h = 0; h < 2; h++) {
        g.d[h] = _mm512_loadu_ps(p->scale[h] + s * 16);
        g.m[h] = IS_Q4(kind) ? _mm512_loadu_ps(p->offset[h] + s * 16) : _mm512_setzero_ps();
        g.bias[h] = IS_Q4(kind) ? _mm512_setzero_si512() : _mm512_loadu_si512(p->bias[h] + s * 16);
    }
    return g;
}

/* A GEMM tile's outputs, rows r0..r0 + T - 1 of codes by columns n0..n0 + cols - 1 (cols <= 32), from its float
 * accumulators f (every scale group done): (bytes) the outlier columns' fp32 products added, values xo [rows][nout],
 * then stored; the exact route's codes: rows r0 + t and r0 + t + 1 (r0 and T even) are the two levels of out row
 * (r0 + t) / 2, added. */
static inline __attribute__((always_inline)) void tile_out(int bytes, int T, __m512 (*f)[2], const gemm_panels *p,
                                                           const float *xo, int64_t nout, int64_t r0, float *out,
                                                           int64_t ldo, int64_t n0, int64_t cols) {
    for (int64_t j = 0; j < nout; j++) {
        const __m512 w0 = _mm512_loadu_ps(p->outlier[0] + j * 16), w1 = _mm512_loadu_ps(p->outlier[1] + j * 16);
        for (int t = 0; t < T; t++) {
            const __m512 v = _mm512_set1_ps(xo[(r0 + t) * nout + j]);
            f[t][0] = _mm512_fmadd_ps(v, w0, f[t][0]);
            f[t][1] = _mm512_fmadd_ps(v, w1, f[t][1]);
        }
    }
    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int t = 0; t < T; t += bytes ? 1 : 2) {
        float *o = out + (bytes ? r0 + t : (r0 + t) >> 1) * ldo + n0;
        _mm512_mask_storeu_ps(o, k0, bytes ? f[t][0] : _mm512_add_ps(f[t][0], f[t + 1][0]));
        _mm512_mask_storeu_ps(o + 16, k1, bytes ? f[t][1] : _mm512_add_ps(f[t][1], f[t + 1][1]));
    }
}
#endif
#ifdef NT_AMX
/* amx.c */
NT_INTERNAL int amx_on(void);
/* built for a CPU that has the tiles (the real instructions, not their emulation), whether or not they are used */
NT_INTERNAL int amx_cpu(void);
NT_INTERNAL void amx_rows(int kind, int bytes, const uint8_t *planes, const float *xd, const float *xs, int64_t M,
                          int64_t K, const gemm_panels *p, float *out, int64_t ldo, int64_t n0, int64_t cols,
                          const float *xo, int64_t nout);
#endif

/* formats.c */
/* The code range of each level of activation codes (split_levels): the first level's int16 codes, the second's int8
 * ones (in int16 storage where a kernel takes them as int16). Rows of codes alternate: 2r the first level of
 * activation row r, 2r + 1 its second. */
#define LEVEL1_CODES 32767.0f
#define LEVEL2_CODES 127.0f
static inline float level_codes(int64_t code_row) { return code_row & 1 ? LEVEL2_CODES : LEVEL1_CODES; }
NT_INTERNAL int quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int q4_order, quantized_rows *out);
NT_INTERNAL void split_levels(const float *x, int64_t M, int64_t K, int64_t ldx, float *rows);
#ifdef NT_VNNI512
/* gemm.c */
NT_INTERNAL int block_rows16(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N,
                             const void *qs, const void *d, const void *m, float *out, int64_t ldo, int threads);
#endif
NT_INTERNAL void dequantize_row(int kind, const void *qs, const void *wd, const void *wm, int64_t n, int64_t K,
                                float *dst);
/* sgemm.c */
NT_INTERNAL void to_panel(const float *rows, int64_t K, float *panel);
NT_INTERNAL void panel_product(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panel, float *out,
                               int64_t ldo, int64_t cols);
/* attention.c */
NT_INTERNAL void store_row(void *data, uint16_t *scales, int64_t kind, int64_t at, const float *src, int64_t n);
NT_INTERNAL int decode_attention(const float *q, float *out, int64_t n, const int64_t *rows, const int64_t *seq_lens,
                                 const int64_t *tables, const int64_t *table_rows, int64_t table_stride,
                                 const nt_cache *c, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                                 int64_t window, int threads);
NT_INTERNAL int chunk_attention(const float *q, float *out, const int64_t *query_start, int64_t num_seqs,
                                const int64_t *seq_lens, const int64_t *tables, int64_t table_stride,
                                const nt_cache *c, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window,
                                int threads);

#endif
