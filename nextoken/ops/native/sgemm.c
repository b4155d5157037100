/* fp32 products: a GEMM over weights packed in panels of 16 columns, for batches bound by compute, and a row-major
 * product whose every output is the same bits whatever the batch or thread count. */
#include "internal.h"

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
void panel_product(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panel, float *out,
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

/* panel [K][16] = rows [16][K] transposed (K a multiple of 8 on AVX2). */
void to_panel(const float *rows, int64_t K, float *panel) {
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
 * (any nt_format), dequantized as nt_block_gemm does: the panels straight from the blocks,
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
