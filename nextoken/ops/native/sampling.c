/* Picking tokens from logits: each row's argmax, and the sampler's draw after temperature, top-k, top-p and min-p. */
#include "internal.h"

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
    if (!(top > -INFINITY)) return argmax_row(l, n); /* nothing can be drawn (every logit -inf, or a NaN): token 0 */
    const float inv_t = 1.0f / temperature;
    const double z = exp_row(l, n, top, inv_t, e, sums);
    const int by_k = top_k > 0 && top_k < n, by_p = top_p < 1.0f, by_min = min_p > 0.0f;
    if (!by_k && !by_p && !by_min) return draw_index(e, n, sums, z, u); /* in vocabulary order */
    /* Candidates: the tokens within a factor of the best, widened until they hold the filtered row. */
    const float floor_p = by_min ? min_p : 0.0f;
    /* Most rows' filters keep tokens within 100x of the best; min-p without top-p keeps exactly its own set. */
    float cut = by_min && !by_p ? floor_p : floor_p > 1e-2f ? floor_p : 1e-2f;
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
