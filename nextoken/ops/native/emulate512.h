/* AVX-512 (F, BW, VL, VNNI) emulated on any x86-64 CPU, for tests: the kernels built with -DNT_EMULATE_AVX512 run
 * its AVX-512 routes through SIMDe's portable implementations of the intrinsics (Debian's libsimde-dev), and the
 * few that SIMDe 0.7 lacks written out below, so that the routes a CPU without AVX-512 never takes are tested there
 * too (tests/unit/test_native.py). Results follow the instructions' definitions; nothing here is meant for speed. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#include <string.h>

#ifndef __mmask16
#define __mmask16 simde__mmask16
#define __mmask64 simde__mmask64
#endif
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif
#ifndef _MM_FROUND_TO_NEG_INF
#define _MM_FROUND_TO_NEG_INF SIMDE_MM_FROUND_TO_NEG_INF
#endif

typedef union { simde__m512 v; float f[16]; } nt_e512;
typedef union { simde__m512i v; int32_t i[16]; int8_t b[64]; uint8_t u[64]; } nt_e512i;

static inline float nt_e_cvtsh_ss(uint16_t h) {
    return simde_mm_cvtss_f32(simde_mm_cvtph_ps(simde_mm_set1_epi16((int16_t)h)));
}
static inline uint16_t nt_e_cvtss_sh(float f) {
    return (uint16_t)simde_mm_extract_epi16(simde_mm_cvtps_ph(simde_mm_set1_ps(f), 0), 0);
}
static inline simde__m128i nt_e512_cvtepi32_epi8(simde__m512i a) {
    nt_e512i x = {a};
    int8_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (int8_t)x.i[i];
    return simde_mm_loadu_si128(r);
}
static inline simde__m512 nt_e512_cvtepi32_ps(simde__m512i a) {
    nt_e512i x = {a};
    nt_e512 r;
    for (int i = 0; i < 16; i++) r.f[i] = (float)x.i[i];
    return r.v;
}
static inline simde__m512i nt_e512_cvtps_epi32(simde__m512 a) {
    nt_e512 x = {a};
    nt_e512i r;
    for (int i = 0; i < 16; i++) {
        const float f = nearbyintf(x.f[i]);
        r.i[i] = f >= -2147483648.0f && f < 2147483648.0f ? (int32_t)f : INT32_MIN;
    }
    return r.v;
}
static inline void nt_e512_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 a) {
    nt_e512 x = {a};
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) memcpy((float *)p + i, &x.f[i], sizeof(float));
}
static inline simde__m512 nt_e512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    nt_e512 r;
    for (int i = 0; i < 16; i++) {
        r.f[i] = 0.0f;
        if (k >> i & 1) memcpy(&r.f[i], (const float *)p + i, sizeof(float));
    }
    return r.v;
}
static inline simde__m512i nt_e512_maskz_loadu_epi8(simde__mmask64 k, const void *p) {
    nt_e512i r;
    for (int i = 0; i < 64; i++) r.u[i] = k >> i & 1 ? ((const uint8_t *)p)[i] : 0;
    return r.v;
}
static inline int32_t nt_e512_reduce_add_epi32(simde__m512i a) {
    nt_e512i x = {a};
    uint32_t s = 0;
    for (int i = 0; i < 16; i++) s += (uint32_t)x.i[i];
    return (int32_t)s;
}
static inline float nt_e512_reduce_add_ps(simde__m512 a) { /* pairwise, as the halving sequence does */
    nt_e512 x = {a};
    for (int n = 8; n >= 1; n /= 2)
        for (int i = 0; i < n; i++) x.f[i] += x.f[i + n];
    return x.f[0];
}
static inline float nt_e512_reduce_max_ps(simde__m512 a) {
    nt_e512 x = {a};
    float m = x.f[0];
    for (int i = 1; i < 16; i++) m = x.f[i] > m ? x.f[i] : m;
    return m;
}
static inline simde__m512 nt_e512_shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {
    nt_e512 x = {a}, y = {b}, r;
    for (int l = 0; l < 4; l++)
        memcpy(&r.f[4 * l], (l < 2 ? x.f : y.f) + 4 * (imm >> (2 * l) & 3), 4 * sizeof(float));
    return r.v;
}
static inline simde__m512d nt_e512_cvtps_pd(simde__m256 a) {
    float f[8];
    double d[8];
    simde_mm256_storeu_ps(f, a);
    for (int i = 0; i < 8; i++) d[i] = f[i];
    return simde_mm512_loadu_pd(d);
}
static inline simde__m512i nt_e512_srai_epi32(simde__m512i a, int imm) {
    nt_e512i x = {a};
    for (int i = 0; i < 16; i++) x.i[i] = imm > 31 ? (x.i[i] < 0 ? -1 : 0) : x.i[i] >> imm;
    return x.v;
}

static inline simde__m512 nt_e512_cvtph_ps(simde__m256i a) {
    uint16_t h[16];
    float f[16];
    simde_mm256_storeu_si256(h, a);
    for (int i = 0; i < 16; i++) f[i] = nt_e_cvtsh_ss(h[i]);
    return simde_mm512_loadu_ps(f);
}
static inline simde__m256i nt_e256_maskz_loadu_epi16(simde__mmask16 k, const void *p) {
    uint16_t r[16];
    for (int i = 0; i < 16; i++) {
        r[i] = 0;
        if (k >> i & 1) memcpy(&r[i], (const uint16_t *)p + i, sizeof(uint16_t));
    }
    return simde_mm256_loadu_si256(r);
}
static inline simde__m512i nt_e512_widen8(simde__m128i a, int is_signed) { /* 16 bytes to 32-bit lanes */
    uint8_t b[16];
    nt_e512i r;
    simde_mm_storeu_si128(b, a);
    for (int i = 0; i < 16; i++) r.i[i] = is_signed ? (int8_t)b[i] : b[i];
    return r.v;
}
static inline simde__m512d nt_e512_roundscale_pd(simde__m512d a, int imm) { /* whole numbers (scale 0) */
    double d[8];
    simde_mm512_storeu_pd(d, a);
    for (int i = 0; i < 8; i++)
        d[i] = (imm & 3) == 0 ? nearbyint(d[i]) : (imm & 3) == 1 ? floor(d[i]) : (imm & 3) == 2 ? ceil(d[i]) : trunc(d[i]);
    return simde_mm512_loadu_pd(d);
}
#define _cvtsh_ss(h) nt_e_cvtsh_ss(h)
#undef _mm512_roundscale_pd
#define _mm512_roundscale_pd(a, imm) nt_e512_roundscale_pd(a, imm)
#define _mm512_cvtepi8_epi32(a) nt_e512_widen8(a, 1)
#define _mm512_cvtepu8_epi32(a) nt_e512_widen8(a, 0)
#define _mm512_cvtph_ps(a) nt_e512_cvtph_ps(a)
#define _mm256_maskz_loadu_epi16(k, p) nt_e256_maskz_loadu_epi16(k, p)
#define _cvtss_sh(f, rounding) nt_e_cvtss_sh(f)
#define _mm512_cvtepi32_epi8(a) nt_e512_cvtepi32_epi8(a)
#define _mm512_cvtepi32_ps(a) nt_e512_cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) nt_e512_cvtps_epi32(a)
#define _mm512_mask_storeu_ps(p, k, a) nt_e512_mask_storeu_ps(p, k, a)
#define _mm512_maskz_loadu_ps(k, p) nt_e512_maskz_loadu_ps(k, p)
#define _mm512_maskz_loadu_epi8(k, p) nt_e512_maskz_loadu_epi8(k, p)
#define _mm512_reduce_add_epi32(a) nt_e512_reduce_add_epi32(a)
#define _mm512_reduce_add_ps(a) nt_e512_reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) nt_e512_reduce_max_ps(a)
#define _mm512_shuffle_f32x4(a, b, imm) nt_e512_shuffle_f32x4(a, b, imm)
#define _mm512_srai_epi32(a, imm) nt_e512_srai_epi32(a, imm)
#define _mm512_cvtps_pd(a) nt_e512_cvtps_pd(a)
/* SIMDe 0.7's compress.h undefines this alias where it means to redefine the _ps one */
#undef _mm512_mask_compressstoreu_pd
#define _mm512_mask_compressstoreu_pd(p, k, a) simde_mm512_mask_compressstoreu_pd(p, k, a)
