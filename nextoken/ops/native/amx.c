/* The GEMM over block weights on AMX-INT8 tiles, where the CPU has them (Sapphire Rapids and later Xeons): one
 * instruction multiplies a tile of 16 activation rows by a tile of 16 weight rows, 16 x 16 x 32 byte products, where
 * a 512-bit vpdpbusd does 64. Its sums are exact, so the route keeps the VNNI GEMM's bits: the exact route's codes
 * (both levels, as int16) are 256 hi + lo, two planes of bytes (hi signed, lo unsigned) through tdpbssd and tdpbusd,
 * their int32 sums combined as 256 hi + lo, which is the int16 product's sum; int8 activation codes are one plane.
 * Every byte product is signed by the instruction itself (weights as signed bytes: Q4's codes 0..15 and int8 codes
 * alike), so no bias is taken out. From each scale group's int32 sums on, the float work is gemm_tile's operation for
 * operation (a multiply-add by the product of the scales, Q4's offset one more, the outlier columns in order, then
 * the two levels added), so a row's numbers do not depend on the route (tests/unit/test_amx.py holds them to the
 * VNNI route bit for bit, on the tiles emulated by emulate_amx.h where the CPU has none). Off unless asked for
 * (nt_amx; NEXTOKEN_AMX=1): on Sapphire Rapids it measured slower than the VNNI GEMM, since every group's sums leave
 * the tiles to be scaled (docs/design-cpu.md).
 *
 * The weights come as gemm_widen's byte panels: [K / 4][16 rows][4 codes] is the layout of a tile's second operand
 * (K / 4 rows of 16 columns of 4 bytes), so a scale group of 32 codes (16 for Q8 in halves) is one tile of 8 (4) rows
 * at its offset, 64 bytes apart. The activations are planes of bytes [rows][K]: a group is a tile of up to 16 rows at
 * its column, K bytes apart. Each group's product goes to a tile of int32 sums of its own, stored and scaled in
 * AVX-512 as the VNNI route scales its sums. */
#define _GNU_SOURCE
#include "internal.h"

#ifdef NT_AMX
#include <sys/syscall.h>
#include <unistd.h>

#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux 5.16: ask for an extended state component for the process */
#endif
#define XFEATURE_XTILEDATA 18 /* the tiles' data */

static int amx_granted = -1; /* the kernel's answer for this process; -1 until asked */
static int amx_enabled = 0;  /* the route is taken: off until asked for (nt_amx; NEXTOKEN_AMX=1) */

/* Linux hands out the tiles' 8 KB of state only to a process that asks for it (the first tile instruction of one
 * that did not raises SIGILL). */
static int amx_request(void) {
    if (amx_granted < 0) {
#ifdef NT_EMULATE_AMX
        amx_granted = 1;
#else
        amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
    }
    return amx_granted;
}

NT_INTERNAL int amx_on(void) { return amx_enabled; }

NT_INTERNAL int amx_cpu(void) {
#ifdef NT_EMULATE_AMX
    return 0;
#else
    return 1;
#endif
}

int nt_amx(int want) {
    if (want >= 0) amx_enabled = want && amx_request();
    return amx_enabled;
}

/* The tile configuration (palette 1): tiles 0 and 1 the activations' planes (R rows of a group's gk bytes: lo; hi,
 * the second level's or the byte codes), 2 and 3 the two panels' codes (gk / 4 rows of 64 bytes), 4 and 5 the sums
 * of hi (or of the second level's or the byte codes) against each panel, 6 and 7 those of lo (R rows of 16 int32). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static void amx_configure(int R, int gk) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t == 2 || t == 3 ? gk / 4 : R);
        c.colsb[t] = (uint16_t)(t < 2 ? gk : 64);
    }
    _tile_loadconfig(&c);
}

/* One plane's group of codes (rows `stride` bytes apart from `src`, into tile `a`) against both panels' codes (tiles
 * 2 and 3) by the product `dp`, the sums in tiles c0 and c1, stored to to[0] and to[1]. Tiles are the instructions'
 * immediates: literal numbers only. */
#define AMX_PLANE(dp, a, c0, c1, src, stride, to)                                                                    \
    do {                                                                                                             \
        _tile_zero(c0);                                                                                              \
        _tile_zero(c1);                                                                                              \
        _tile_loadd(a, src, stride);                                                                                 \
        dp(c0, a, 2);                                                                                                \
        dp(c1, a, 3);                                                                                                \
        _tile_stored(c0, (to)[0], 64);                                                                               \
        _tile_stored(c1, (to)[1], 64);                                                                               \
    } while (0)

/* out rows of code rows [0, M) and columns n0..n0 + cols - 1 (cols <= 32), from planes ([M][K] bytes: int8 codes;
 * the exact route's, M even, code rows 2r and 2r + 1 the levels of out row r: its lo plane, then its hi plane, a
 * second level's int8 codes in the lo plane), the code rows' scales xd and Q4 sums xs [M][groups], (bytes) the
 * outlier values xo [M][nout], and the panels p (gemm_widen's bytes). The exact route takes a tile of up to 16
 * activation rows a plane, its rows 2K bytes apart: the first level's hi (signed) and lo (unsigned) planes, then the
 * second level's codes (signed), three tile products per panel where a tile of both levels' int16 codes took four
 * for half the rows. */
NT_INTERNAL void amx_rows(int kind, int bytes, const uint8_t *planes, const float *xd, const float *xs, int64_t M,
                          int64_t K, const gemm_panels *p, float *out, int64_t ldo, int64_t n0, int64_t cols,
                          const float *xo, int64_t nout) {
    const int64_t groups = K / QK, halves = kind == NT_Q8_HALVES, sg = halves ? 2 * groups : groups;
    const int gk = halves ? 16 : 32;
    const int64_t rows = bytes ? M : M / 2, stride = bytes ? K : 2 * K; /* activation rows, and theirs apart */
    const uint8_t *lo = planes, *hi = bytes ? planes : planes + M * K;
    const uint8_t *w0 = (const uint8_t *)p->codes[0], *w1 = (const uint8_t *)p->codes[1];
    /* hi (or the byte codes) x panel 0, x panel 1; lo x 0, x 1; the second level x 0, x 1 */
    int32_t sums[6][16][16] __attribute__((aligned(64)));
    __m512 f[32][2]; /* by row of codes */
    int shape = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int R = rows - r0 < 16 ? (int)(rows - r0) : 16;
        const int64_t first = bytes ? r0 : 2 * r0; /* the tile's first row of codes */
        if (R != shape) amx_configure(R, gk), shape = R;
        for (int t = 0; t < (bytes ? R : 2 * R); t++) f[t][0] = f[t][1] = _mm512_setzero_ps();
        for (int64_t s = 0; s < sg; s++) {
            const int64_t g = halves ? s / 2 : s;
            _tile_loadd(2, w0 + s * gk * 16, 64);
            _tile_loadd(3, w1 + s * gk * 16, 64);
            AMX_PLANE(_tile_dpbssd, 1, 4, 5, hi + first * K + s * gk, stride, sums); /* hi: signed; or bytes */
            if (!bytes) {
                AMX_PLANE(_tile_dpbusd, 0, 6, 7, lo + first * K + s * gk, stride, sums + 2); /* lo: unsigned */
                AMX_PLANE(_tile_dpbssd, 1, 4, 5, lo + (first + 1) * K + s * gk, stride, sums + 4); /* second */
            }
            const panel_group pg = panel_group_at(kind, p, s); /* its bias unused: tiles take signed bytes */
            for (int t = 0; t < R; t++)
                for (int level = 0; level < (bytes ? 1 : 2); level++) {
                    const int u = bytes ? t : 2 * t + level; /* the tile's row of codes */
                    const __m512 dx = _mm512_set1_ps(xd[(first + u) * groups + g]);
                    const __m512 sx = IS_Q4(kind) ? _mm512_set1_ps(xs[(first + u) * groups + g]) : _mm512_setzero_ps();
                    for (int h = 0; h < 2; h++) {
                        __m512i a = _mm512_load_si512(sums[level ? 4 + h : h][t]); /* hi or bytes; second */
                        if (!bytes && !level) /* 256 hi + lo */
                            a = _mm512_add_epi32(_mm512_slli_epi32(a, 8), _mm512_load_si512(sums[2 + h][t]));
                        f[u][h] = scale_group(f[u][h], a, pg.d[h], dx, IS_Q4(kind), pg.m[h], sx);
                    }
                }
        }
        tile_out(bytes, bytes ? R : 2 * R, f, p, xo, nout, first, out, ldo, n0, cols);
    }
    _tile_release();
}
#undef AMX_PLANE

#else
int nt_amx(int want) {
    (void)want;
    return 0;
}
#endif
