/* Norms and activations: RMSNorm (with the residual add) and the gated activations of the MLP. */
#include "internal.h"

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

/* 0.5 x (1 + tanh(t)), t = sqrt(2 / pi) (x + 0.044715 x^3), written as x / (1 + e^-2t): the same function, without
 * the cancellation of 1 + tanh(t) where tanh(t) is near -1. */
static inline float gelu_tanh(float x) {
    return x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* a[i] = act(g[i]) * u[i] over n values: NT_SILU or NT_GELU_TANH, the torch modules' functions (gelu in its
 * sigmoid form, see gelu_tanh). */
void nt_gated(int64_t activation, const float *g, const float *u, float *a, int64_t n) {
    int64_t i = 0;
#ifdef NT_VNNI512
    for (; i + 16 <= n; i += 16) { /* as the AVX2 loop below, 16 lanes at a time */
        const __m512 x = _mm512_loadu_ps(g + i), up = _mm512_loadu_ps(u + i);
        __m512 z = x;
        if (activation == NT_GELU_TANH) {
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
        if (activation == NT_GELU_TANH) {
            const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            z = _mm256_mul_ps(_mm256_set1_ps(2 * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
        }
        const __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(y, up));
    }
#endif
    for (; i < n; i++) a[i] = (activation == NT_SILU ? g[i] / (1.0f + expf(-g[i])) : gelu_tanh(g[i])) * u[i];
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
