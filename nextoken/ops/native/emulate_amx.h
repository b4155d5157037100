/* AMX-INT8 tiles emulated in plain C, for tests: the build with -DNT_EMULATE_AMX (beside NT_EMULATE_AVX512) runs the
 * AMX route (amx.c) on any x86-64 CPU, so that its packing and tiling are held to the VNNI route's bits everywhere,
 * and a CPU with AMX runs the same source on the real instructions. The eight tiles are per thread, as the hardware's
 * are; a tile configuration is checked as the instructions check it (palette 1, at most 16 rows of at most 64 bytes,
 * the products' shapes agreeing), and an instruction the hardware would refuse with #UD aborts instead. Operand order
 * is the intrinsics': _tile_dpbssd(dst, a, b) adds a (rows x K bytes) times b (K / 4 rows x 4 N bytes) into dst. */
#ifndef NT_EMULATE_AMX_H
#define NT_EMULATE_AMX_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} nt_amx_state;

static _Thread_local nt_amx_state nt_amx_tiles;

static inline void nt_amx_fault(const char *what) {
    fprintf(stderr, "emulated AMX: %s (the hardware raises #UD)\n", what);
    abort();
}

static inline void nt_amx_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    if (c[0] != 1) nt_amx_fault("palette other than 1");
    if (c[1] != 0) nt_amx_fault("start_row other than 0");
    for (int i = 2; i < 16; i++)
        if (c[i]) nt_amx_fault("reserved configuration bytes set");
    for (int t = 0; t < 16; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        const uint8_t rows = c[48 + t];
        if (t >= 8 ? colsb || rows : colsb > 64 || rows > 16 || (!colsb != !rows))
            nt_amx_fault("tile shape out of range");
        if (t < 8) nt_amx_tiles.colsb[t] = colsb, nt_amx_tiles.rows[t] = rows;
    }
    memset(nt_amx_tiles.data, 0, sizeof nt_amx_tiles.data);
    nt_amx_tiles.configured = 1;
}

static inline void nt_amx_release(void) { memset(&nt_amx_tiles, 0, sizeof nt_amx_tiles); }

static inline void nt_amx_check(int t) {
    if (!nt_amx_tiles.configured || t < 0 || t > 7 || !nt_amx_tiles.rows[t]) nt_amx_fault("unconfigured tile");
}

static inline void nt_amx_zero(int t) {
    nt_amx_check(t);
    memset(nt_amx_tiles.data[t], 0, sizeof nt_amx_tiles.data[t]);
}

/* Rows beyond the configured ones and bytes beyond colsb read as zeros, as the hardware keeps them. */
static inline void nt_amx_loadd(int t, const void *base, int64_t stride) {
    nt_amx_check(t);
    memset(nt_amx_tiles.data[t], 0, sizeof nt_amx_tiles.data[t]);
    for (int r = 0; r < nt_amx_tiles.rows[t]; r++)
        memcpy(nt_amx_tiles.data[t][r], (const uint8_t *)base + r * stride, nt_amx_tiles.colsb[t]);
}

static inline void nt_amx_stored(int t, void *base, int64_t stride) {
    nt_amx_check(t);
    for (int r = 0; r < nt_amx_tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, nt_amx_tiles.data[t][r], nt_amx_tiles.colsb[t]);
}

/* dst[m][n] += sum over k, i < 4 of a[m][4k + i] * b[k][4n + i], each byte signed or not as the instruction says. */
static inline void nt_amx_dp(int dst, int a, int b, int a_signed, int b_signed) {
    nt_amx_check(dst), nt_amx_check(a), nt_amx_check(b);
    const nt_amx_state *s = &nt_amx_tiles;
    if (s->colsb[a] % 4 || s->colsb[dst] % 4 || s->colsb[a] / 4 != s->rows[b] || s->colsb[dst] != s->colsb[b] ||
        s->rows[dst] != s->rows[a])
        nt_amx_fault("product shapes disagree");
    for (int m = 0; m < s->rows[dst]; m++)
        for (int n = 0; n < s->colsb[dst] / 4; n++) {
            int32_t sum;
            memcpy(&sum, nt_amx_tiles.data[dst][m] + 4 * n, 4);
            for (int k = 0; k < s->colsb[a]; k++) {
                const uint8_t x = s->data[a][m][k], w = s->data[b][k / 4][4 * n + k % 4];
                sum = (int32_t)((uint32_t)sum + (uint32_t)((a_signed ? (int32_t)(int8_t)x : (int32_t)x) *
                                                           (b_signed ? (int32_t)(int8_t)w : (int32_t)w)));
            }
            memcpy(nt_amx_tiles.data[dst][m] + 4 * n, &sum, 4);
        }
}

/* immintrin.h (which SIMDe includes) defines some of these names whatever the target */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#define _tile_loadconfig(config) nt_amx_loadconfig(config)
#define _tile_release() nt_amx_release()
#define _tile_zero(t) nt_amx_zero(t)
#define _tile_loadd(t, base, stride) nt_amx_loadd(t, base, stride)
#define _tile_stored(t, base, stride) nt_amx_stored(t, base, stride)
#define _tile_dpbssd(dst, a, b) nt_amx_dp(dst, a, b, 1, 1)
#define _tile_dpbsud(dst, a, b) nt_amx_dp(dst, a, b, 1, 0)
#define _tile_dpbusd(dst, a, b) nt_amx_dp(dst, a, b, 0, 1)
#define _tile_dpbuud(dst, a, b) nt_amx_dp(dst, a, b, 0, 0)

#endif
