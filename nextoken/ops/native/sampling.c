/* Picking tokens from logits: each row's argmax, and the sampler's draw after temperature, top-k, top-p and min-p as
 * engine/sampler.py defines it. The draw is exact arithmetic: every build here (AVX-512, AVX2, plain C) and the torch
 * route (ops/sampling.py) give the same token for the same row, parameters and uniform. */
#include "internal.h"

#ifdef __FAST_MATH__
#error "sampling.c rounds each fp64 operation of the draw's weights on its own: build it without -ffast-math"
#endif

/* ------------------------------------------------------- a whole decode step */

/* v [n]'s largest value, NaNs aside, and in *nan whether it holds one. */
static float row_top(const float *v, int64_t n, int *nan) {
    int found = 0;
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
    found = unordered != 0;
    best = _mm512_reduce_max_ps(top);
#elif defined(NT_AVX2)
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, x);
    }
    found = _mm256_movemask_ps(unordered) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
#endif
    for (; i < n; i++) {
        if (v[i] != v[i]) found = 1;
        else if (v[i] > best) best = v[i];
    }
    *nan = found;
    return best;
}

/* The index of v [n]'s first largest value, a NaN counting as largest (its first one), as torch's and numpy's
 * argmax: the largest value (or that there is a NaN), then the first place that holds it. */
static int64_t argmax_row(const float *v, int64_t n) {
    int nan = 0;
    const float best = row_top(v, n, &nan);
    int64_t i = 0;
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

/* ------------------------------------------------------- the draw */

/* Per token, x = (l - top) * (1 / T) in fp64 and the weight w = floor(E(x) 2^Q), an integer of at most 2^Q (units
 * of 2^-Q), 0 below DRAW_CUT. E is one fixed sequence of fp64 operations, each rounded on its own: this unit is built
 * with -ffp-contract=off (build.py), so no multiply and add fuse, and the vector lanes, the scalar code and torch's
 * elementwise ops compute the same bits. A row's weights sum to at most N 2^Q <= 2^53: every sum is exact, in any
 * order. */
#define DRAW_CUT -24.0   /* e^-24 < 2^-34 / 1.5: below it E(x) 2^34 < 1 by a margin far past E's error */
#define DRAW_BITS 34     /* Q for vocabularies up to 2^19; one less per doubling past that */
#define WALK_BLOCK 1024  /* the draw's walk passes whole blocks of weights by their sums */
#define DRAW_LOG2E 0x1.71547652b82fep+0
#define DRAW_LN2_HI 0x1.62e42ffp-1 /* ln 2 to 29 significant bits: n * DRAW_LN2_HI is exact */
#define DRAW_LN2_LO -0x1.718432a1b0e26p-35
#define DRAW_BIAS 0x1.80000000003ffp+52 /* 1.5 * 2^52 + 1023: n + this holds n + 1023 in its low mantissa bits */
/* 1/11!, 1/10!, ..., 1/2!, 1, 1: Taylor's polynomial for e^r by Horner, highest first (under 1e-14 for
 * |r| <= ln2 / 2) */
#define DRAW_TERMS 12
static const double DRAW_TAYLOR[DRAW_TERMS] = {
    0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16,
    0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,  0x1.5555555555555p-5,
    0x1.5555555555555p-3,  0x1p-1,                1.0,                   1.0};

/* E(x) for DRAW_CUT <= x <= 0: n = x log2(e) rounded to nearest (ties to even), r = x - n ln 2 in two steps, then
 * p(r) 2^n with 2^n made from its exponent bits (n >= -35: a normal number). */
static double draw_exp(double x) {
    const double n = nearbyint(x * DRAW_LOG2E);
    const double r = (x - n * DRAW_LN2_HI) - n * DRAW_LN2_LO;
    double p = DRAW_TAYLOR[0];
    for (int k = 1; k < DRAW_TERMS; k++) p = p * r + DRAW_TAYLOR[k];
    const uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
    double power;
    memcpy(&power, &bits, sizeof power);
    return p * power;
}

/* fp64 lanes for the weights: 8 with AVX-512, 4 with AVX2; each operation one IEEE rounding, as in draw_exp. */
#ifdef NT_VNNI512
typedef __m512d lanes_t;
#define LANES 8
#define L_SET _mm512_set1_pd
#define L_LOAD _mm512_loadu_pd
#define L_STORE _mm512_storeu_pd
#define L_FLOATS(p) _mm512_cvtps_pd(_mm256_loadu_ps(p)) /* LANES fp32 values, widened (exactly) */
#define L_ADD _mm512_add_pd
#define L_SUB _mm512_sub_pd
#define L_MUL _mm512_mul_pd
#define L_MAX _mm512_max_pd
#define L_ROUND _mm512_roundscale_pd
#define L_POW2(n, bias) _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(_mm512_add_pd(n, bias)), 52))
#elif defined(NT_AVX2)
typedef __m256d lanes_t;
#define LANES 4
#define L_SET _mm256_set1_pd
#define L_LOAD _mm256_loadu_pd
#define L_STORE _mm256_storeu_pd
#define L_FLOATS(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define L_ADD _mm256_add_pd
#define L_SUB _mm256_sub_pd
#define L_MUL _mm256_mul_pd
#define L_MAX _mm256_max_pd
#define L_ROUND _mm256_round_pd
#define L_POW2(n, bias) _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(_mm256_add_pd(n, bias)), 52))
#endif
#define DRAW_GROUP 4 /* vectors of weights in flight: each a chain of some 30 dependent operations, interleaved */
#define GROUP_TOKENS (DRAW_GROUP * LANES)

#ifdef LANES
/* q[j] = floor(E(x[j]) 2^Q) for DRAW_GROUP vectors of x in [DRAW_CUT, 0]: draw_exp's operations on every lane, the
 * two exact scalings by 2^n and 2^Q in one by 2^(n + Q), made from its bits (n + DRAW_BIAS + Q, `bias`, holds
 * n + Q + 1023 in its low bits). */
static inline void draw_group(const lanes_t *x, lanes_t bias, lanes_t *q) {
    lanes_t n[DRAW_GROUP], r[DRAW_GROUP], p[DRAW_GROUP];
    for (int j = 0; j < DRAW_GROUP; j++) {
        n[j] = L_ROUND(L_MUL(x[j], L_SET(DRAW_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r[j] = L_SUB(L_SUB(x[j], L_MUL(n[j], L_SET(DRAW_LN2_HI))), L_MUL(n[j], L_SET(DRAW_LN2_LO)));
        p[j] = L_SET(DRAW_TAYLOR[0]);
    }
    for (int k = 1; k < DRAW_TERMS; k++)
        for (int j = 0; j < DRAW_GROUP; j++) p[j] = L_ADD(L_MUL(p[j], r[j]), L_SET(DRAW_TAYLOR[k]));
    for (int j = 0; j < DRAW_GROUP; j++)
        q[j] = L_ROUND(L_MUL(p[j], L_POW2(n[j], bias)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

/* The sum of v's lanes: exact, as every sum of weights. */
static inline double lanes_sum(lanes_t v) {
    double lanes[LANES], total = 0.0;
    L_STORE(lanes, v);
    for (int k = 0; k < LANES; k++) total += lanes[k];
    return total;
}

/* Whether any of the GROUP_TOKENS logits from l is at least `skip`. */
static inline int group_reaches(const float *l, float skip) {
#ifdef NT_VNNI512
    const __m512 s = _mm512_set1_ps(skip);
    return (_mm512_cmp_ps_mask(_mm512_loadu_ps(l), s, _CMP_GE_OQ) |
            _mm512_cmp_ps_mask(_mm512_loadu_ps(l + 16), s, _CMP_GE_OQ)) != 0;
#else
    const __m256 s = _mm256_set1_ps(skip);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(l), s, _CMP_GE_OQ),
                                           _mm256_cmp_ps(_mm256_loadu_ps(l + 8), s, _CMP_GE_OQ))) != 0;
#endif
}
#endif

/* Q for rows of n tokens: n weights of at most 2^Q sum to at most 2^53, which fp64 holds exactly. */
static int draw_bits(int64_t n) {
    int q = DRAW_BITS;
    while (q > 0 && n > (int64_t)1 << (53 - q)) q--;
    return q;
}

/* A float below which every logit has x < cut (x never falls as the logit grows, so the check at it holds for all
 * below), near top - (|cut| + 1/2) T; -inf where there is none. Logits below it need no fp64 work. */
static float draw_skip_below(float top, double temperature, double inv_t, double cut) {
    float t = (float)((double)top + (cut - 0.5) * temperature);
    for (int tries = 0; tries < 4 && t > -INFINITY; tries++) {
        if (((double)t - (double)top) * inv_t < cut) return t;
        t = nextafterf(t, -INFINITY);
    }
    return -INFINITY;
}

/* Every token's weight into w [n]; returns their sum. The vector lanes take whole groups of tokens, skipping those
 * whose logits all lie below draw_skip_below's (x below DRAW_CUT), and weigh x below DRAW_CUT as x = DRAW_CUT:
 * E(-24) 2^34 < 0.65 floors to 0, the definition's weight there. One thread: splitting a lone row would halve this
 * with a second core free, but where that core is busy a parallel region waits a scheduler tick (9 ms against
 * 0.2 ms, measured on a shared 2-core VM). */
static double row_weights(const float *l, int64_t n, float top, double temperature, double inv_t, int bits,
                          double *w) {
    const float skip = draw_skip_below(top, temperature, inv_t, DRAW_CUT);
    double total = 0.0;
    int64_t i = 0;
#ifdef LANES
    const lanes_t vt = L_SET((double)top), vs = L_SET(inv_t), low = L_SET(DRAW_CUT), bias = L_SET(DRAW_BIAS + bits);
    lanes_t acc = L_SET(0.0);
    for (; i + GROUP_TOKENS <= n; i += GROUP_TOKENS) {
        if (!group_reaches(l + i, skip)) {
            for (int j = 0; j < DRAW_GROUP; j++) L_STORE(w + i + j * LANES, L_SET(0.0));
            continue;
        }
        lanes_t x[DRAW_GROUP], q[DRAW_GROUP];
        for (int j = 0; j < DRAW_GROUP; j++) x[j] = L_MAX(L_MUL(L_SUB(L_FLOATS(l + i + j * LANES), vt), vs), low);
        draw_group(x, bias, q);
        for (int j = 0; j < DRAW_GROUP; j++) L_STORE(w + i + j * LANES, q[j]), acc = L_ADD(acc, q[j]);
    }
    total = lanes_sum(acc);
#endif
    const double unit = ldexp(1.0, bits);
    for (; i < n; i++) {
        const double x = ((double)l[i] - (double)top) * inv_t;
        total += w[i] = l[i] >= skip && x >= DRAW_CUT ? floor(draw_exp(x) * unit) : 0.0;
    }
    return total;
}

/* w[i] = floor(E(x[i]) 2^bits) for x [n] in [DRAW_CUT, 0] (w may be x); returns their sum. */
static double draw_weights(const double *x, int64_t n, int bits, double *w) {
    const double unit = ldexp(1.0, bits);
    double total = 0.0;
    int64_t i = 0;
#ifdef LANES
    lanes_t acc = L_SET(0.0);
    for (; i + GROUP_TOKENS <= n; i += GROUP_TOKENS) {
        lanes_t v[DRAW_GROUP], q[DRAW_GROUP];
        for (int j = 0; j < DRAW_GROUP; j++) v[j] = L_LOAD(x + i + j * LANES);
        draw_group(v, L_SET(DRAW_BIAS + bits), q);
        for (int j = 0; j < DRAW_GROUP; j++) L_STORE(w + i + j * LANES, q[j]), acc = L_ADD(acc, q[j]);
    }
    total = lanes_sum(acc);
#endif
    for (; i < n; i++) total += w[i] = floor(draw_exp(x[i]) * unit);
    return total;
}

/* The sum of the WALK_BLOCK weights from w (exact). */
static double block_sum(const double *w) {
#ifdef LANES
    lanes_t acc = L_SET(0.0);
    for (int i = 0; i < WALK_BLOCK; i += LANES) acc = L_ADD(acc, L_LOAD(w + i));
    return lanes_sum(acc);
#else
    double total = 0.0;
    for (int i = 0; i < WALK_BLOCK; i++) total += w[i];
    return total;
#endif
}

/* The first index of w [m] whose running sum exceeds target (below the sum of all): whole blocks passed by their
 * sums, then one weight at a time. Never one of weight 0: its running sum is the one before it. */
static int64_t draw_walk(const double *w, int64_t m, double target) {
    double before = 0.0;
    int64_t b = 0;
    for (; b + WALK_BLOCK < m; b += WALK_BLOCK) {
        const double block = block_sum(w + b);
        if (before + block > target) break;
        before += block;
    }
    for (int64_t i = b; i < m; i++)
        if ((before += w[i]) > target) return i;
    return m - 1; /* not reached: the target is below the total */
}

/* The tokens of l [n] with x >= cut, in id order: their x into cx, their ids into cid (n + 16 entries each: the
 * vector stores write past the count); returns how many. */
static int64_t draw_candidates(const float *l, int64_t n, float top, double temperature, double inv_t, double cut,
                               double *cx, int32_t *cid) {
    const float skip = draw_skip_below(top, temperature, inv_t, cut);
    const double t = (double)top;
    int64_t m = 0, i = 0;
#ifdef NT_VNNI512
    const __m512 below = _mm512_set1_ps(skip);
    const __m512d vt = _mm512_set1_pd(t), s = _mm512_set1_pd(inv_t), c = _mm512_set1_pd(cut);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, step)) {
        const unsigned k = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + i), below, _CMP_GE_OQ);
        for (int h = 0; h < 16; h += 8) {
            if (!((k >> h) & 0xFF)) continue;
            const __m512d x = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(l + i + h)), vt), s);
            const __mmask8 kx = _mm512_cmp_pd_mask(x, c, _CMP_GE_OQ);
            /* whole vectors, packed in registers (a compressing store is slow on some CPUs): past the count, scratch */
            _mm512_storeu_pd(cx + m, _mm512_maskz_compress_pd(kx, x));
            _mm512_storeu_si512(cid + m, _mm512_maskz_compress_epi32((__mmask16)((unsigned)kx << h), at));
            m += __builtin_popcount(kx);
        }
    }
#elif defined(NT_AVX2)
    const __m256 below = _mm256_set1_ps(skip);
    const __m256d vt = _mm256_set1_pd(t), s = _mm256_set1_pd(inv_t), c = _mm256_set1_pd(cut);
    for (; i + 8 <= n; i += 8) {
        const int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + i), below, _CMP_GE_OQ));
        for (int h = 0; h < 8; h += 4) {
            if (!((k >> h) & 0xF)) continue;
            const __m256d x = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(l + i + h)), vt), s);
            const int kx = _mm256_movemask_pd(_mm256_cmp_pd(x, c, _CMP_GE_OQ));
            double lanes[4];
            _mm256_storeu_pd(lanes, x);
            for (int b = 0; b < 4; b++) /* every lane stored, only those kept counted: no branch to mispredict */
                cx[m] = lanes[b], cid[m] = (int32_t)(i + h + b), m += kx >> b & 1;
        }
    }
#endif
    for (; i < n; i++) {
        if (!(l[i] >= skip)) continue;
        const double x = ((double)l[i] - t) * inv_t;
        if (x >= cut) cx[m] = x, cid[m] = (int32_t)i, m++;
    }
    return m;
}

typedef struct {
    double x, w;
    int32_t id;
} ranked;

static int by_rank(const void *a, const void *b) { /* the row's order: x descending, then id */
    const ranked *p = a, *q = b;
    return p->x > q->x ? -1 : p->x < q->x ? 1 : (p->id > q->id) - (p->id < q->id);
}

/* Reorders r [m] so that its first k (0 < k < m) are the row's first k (by_rank), in no particular order:
 * quickselect, the pivot a median of three. */
static void select_first(ranked *r, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        const ranked *a = &r[lo], *b = &r[mid], *c = &r[hi];
        const ranked pivot = by_rank(a, b) < 0 ? (by_rank(b, c) < 0 ? *b : by_rank(a, c) < 0 ? *c : *a)
                                               : (by_rank(a, c) < 0 ? *a : by_rank(b, c) < 0 ? *c : *b);
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (by_rank(&r[i], &pivot) < 0) i++;
            while (by_rank(&r[j], &pivot) > 0) j--;
            if (i <= j) {
                const ranked t = r[i];
                r[i++] = r[j], r[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

#define SORT_BELOW 32 /* ranges this short are sorted and scanned rather than partitioned */

/* Top-p's kept count over r [m] (the top-k set in any order, its weights known): L, the fewest first tokens in the
 * row's order whose weight reaches `bound` (1 at least; m where none do), r reordered so that r[0..L) are they, in no
 * particular order. A quickselect weighted by the tokens' weights: no sort of the whole set, sums exact. */
static int64_t nucleus(ranked *r, int64_t m, double bound) {
    int64_t lo = 0, hi = m; /* L lies in (lo, hi]; `before` is the weight of r[0..lo), below the bound */
    double before = 0.0;
    while (hi - lo > SORT_BELOW) {
        const int64_t mid = lo + (hi - lo) / 2, last = hi - 1;
        const int64_t pick = by_rank(&r[lo], &r[mid]) < 0
                                 ? (by_rank(&r[mid], &r[last]) < 0 ? mid : by_rank(&r[lo], &r[last]) < 0 ? last : lo)
                                 : (by_rank(&r[lo], &r[last]) < 0 ? lo : by_rank(&r[mid], &r[last]) < 0 ? last : mid);
        ranked t = r[pick];
        r[pick] = r[last], r[last] = t;
        int64_t a = lo; /* those before the pivot to the front */
        double mass = 0.0;
        for (int64_t j = lo; j < last; j++)
            if (by_rank(&r[j], &r[last]) < 0) {
                t = r[j], r[j] = r[a], r[a] = t;
                mass += r[a++].w;
            }
        t = r[a], r[a] = r[last], r[last] = t; /* the pivot at a: its place in the order */
        if (a >= 1 && before + mass >= bound) hi = a;
        else if (before + mass + r[a].w >= bound) return a + 1;
        else before += mass + r[a].w, lo = a + 1;
    }
    qsort(r + lo, (size_t)(hi - lo), sizeof *r, by_rank);
    for (int64_t j = lo; j < hi; j++)
        if ((before += r[j].w) >= bound) return j + 1;
    return hi;
}

static int by_id(const void *a, const void *b) {
    const ranked *p = a, *q = b;
    return (p->id > q->id) - (p->id < q->id);
}

typedef struct {
    double *x;   /* [N + 16]: candidates' x, in id order */
    double *w;   /* [N]: every token's weight, or the top-k set's */
    int32_t *id; /* [N + 16]: the candidates' tokens */
    ranked *r;   /* [N]: the ranked prefix of the row */
} draw_scratch;

/* Widening cuts on x for the ranked prefix: 1e-2, 1e-5 and 1e-8 of the best token's weight. */
static const double RANK_CUTS[] = {-4.605170185988091, -11.512925464970229, -18.420680743952367};

/* A row's filters as the draw applies them (engine/sampler.py's definition): temperature, top-k (0: none), top-p
 * (1: none) over the top-k set, min-p (0: none). */
typedef struct {
    float top;
    double temperature, inv_t, top_p, least, cut;
    int64_t top_k; /* 0 unless it ranks the row */
    int bits, by_p, by_min;
} draw_plan;

/* The row's plan; 0 where it has nothing to weigh (a NaN, no finite largest logit, no finite positive 1 / T): it
 * draws its argmax. */
static int plan_row(const float *l, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                    draw_plan *p) {
    int nan = 0;
    p->top = row_top(l, n, &nan);
    p->temperature = temperature, p->inv_t = 1.0 / temperature;
    if (nan || !(fabsf(p->top) < INFINITY) || !(p->inv_t > 0.0 && p->inv_t < INFINITY)) return 0;
    p->top_k = top_k > 0 && top_k < n ? top_k : 0;
    p->top_p = top_p, p->by_p = top_p < 1.0, p->by_min = min_p > 0.0;
    p->bits = draw_bits(n);
    p->least = p->by_min ? ldexp(min_p, p->bits) : 0.0; /* w >= min_p, in units of 2^-Q */
    /* min-p without top-p needs no weight that min-p drops: those of x below log(min_p) by a margin no error of E
     * bridges */
    p->cut = DRAW_CUT;
    if (p->by_min && !p->by_p && log(min_p) - 0.01 > p->cut) p->cut = log(min_p) - 0.01;
    return 1;
}

/* The tokens a ranked row keeps (top-k or top-p ranks it): the tokens above a cut on x (the first in the row's
 * order), the cut widened until they hold the top-k set or top-p's nucleus (at the last, every token of weight above
 * 0); then top-k, top-p and min-p. Into s->r [0, kept), in no particular order; returns kept, their weights' sum into
 * *sum. With top-k only the top-k set is weighed; top-p alone weighs the whole row first (it normalizes over it). */
static int64_t ranked_keep(const float *l, int64_t n, const draw_plan *p, const draw_scratch *s, double *sum) {
    const float top = p->top;
    const double temperature = p->temperature, inv_t = p->inv_t, top_p = p->top_p, least = p->least, cut = p->cut;
    const int64_t top_k = p->top_k;
    const int bits = p->bits, by_k = top_k > 0, by_p = p->by_p;
    const size_t num_cuts = sizeof RANK_CUTS / sizeof *RANK_CUTS;
    ranked *r = s->r;
    /* what top-p normalizes over: the whole row's weight, or the top-k set's (below) */
    double total = by_k ? 0.0 : row_weights(l, n, top, temperature, inv_t, bits, s->w);
    int64_t m = 0;
    for (size_t step = 0;; step++) {
        const double at_least = step < num_cuts && RANK_CUTS[step] > cut ? RANK_CUTS[step] : cut;
        m = draw_candidates(l, n, top, temperature, inv_t, at_least, s->x, s->id);
        double mass = 0.0;
        for (int64_t j = 0; j < m; j++) {
            r[j] = (ranked){s->x[j], by_k ? 0.0 : s->w[s->id[j]], s->id[j]};
            mass += r[j].w;
        }
        if (at_least == cut || (by_k ? m >= top_k : mass >= top_p * total)) break;
    }
    /* the top-k set (what lies past the ranked tokens weighs 0), then top-p's nucleus of it: the tokens whose weight
     * before them is below p times the set's, the first always; neither needs the set in order */
    const int64_t mk = by_k && m > top_k ? top_k : m;
    if (mk < m) select_first(r, m, mk);
    if (by_k) {
        for (int64_t j = 0; j < mk; j++) s->w[j] = r[j].x;
        total = draw_weights(s->w, mk, bits, s->w);
        for (int64_t j = 0; j < mk; j++) r[j].w = s->w[j];
    }
    const int64_t keep = by_p ? nucleus(r, mk, top_p * total) : mk;
    int64_t kept = 0;
    *sum = 0.0;
    for (int64_t j = 0; j < keep; j++)
        if (r[j].w > 0.0 && r[j].w >= least) *sum += (r[kept++] = r[j]).w;
    return kept;
}

/* The draw where top-k or top-p ranks the row: ranked_keep's tokens, then the walk in id order. */
static int64_t ranked_draw(const float *l, int64_t n, const draw_plan *p, double u, const draw_scratch *s) {
    double sum;
    const int64_t kept = ranked_keep(l, n, p, s, &sum);
    ranked *r = s->r;
    const double target = u * sum;
    if (kept * 16 <= n) { /* few: in id order by a sort */
        qsort(r, (size_t)kept, sizeof *r, by_id);
        double before = 0.0;
        for (int64_t j = 0; j < kept; j++)
            if ((before += r[j].w) > target) return r[j].id;
        return r[kept - 1].id; /* not reached */
    }
    memset(s->w, 0, (size_t)n * sizeof *s->w); /* many: their weights in place in the row */
    for (int64_t j = 0; j < kept; j++) s->w[r[j].id] = r[j].w;
    return draw_walk(s->w, n, target);
}

/* A row that min-p alone filters: its candidates (x at or above p's cut, in id order) into s->id [0, m) with their
 * weights in s->w, 0 for those below min-p; returns m, the weights' sum into *total. */
static int64_t min_p_keep(const float *l, int64_t n, const draw_plan *p, const draw_scratch *s, double *total) {
    const int64_t m = draw_candidates(l, n, p->top, p->temperature, p->inv_t, p->cut, s->x, s->id);
    draw_weights(s->x, m, p->bits, s->w);
    *total = 0.0;
    for (int64_t j = 0; j < m; j++) *total += s->w[j] = s->w[j] >= p->least ? s->w[j] : 0.0;
    return m;
}

/* One row's draw: the token at u in [0, 1) of the kept weights in id order. */
static int64_t sample_row(const float *l, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                          double u, const draw_scratch *s) {
    draw_plan p;
    if (!plan_row(l, n, temperature, top_k, top_p, min_p, &p)) return argmax_row(l, n);
    if (p.top_k || p.by_p)
        return ranked_draw(l, n, &p, u, s);
    if (p.by_min) { /* its own tokens, gathered: min-p keeps few */
        double total;
        const int64_t m = min_p_keep(l, n, &p, s, &total);
        return s->id[draw_walk(s->w, m, u * total)];
    }
    return draw_walk(s->w, n, u * row_weights(l, n, p.top, p.temperature, p.inv_t, p.bits, s->w));
}

/* One row's kept weights into w [n] (units of 2^-Q, 0 for every token the filters drop): what sample_row draws
 * from, normalized by their sum; a row with nothing to weigh weighs 1 at its argmax. */
static void keep_row(const float *l, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                     const draw_scratch *s, double *w) {
    draw_plan p;
    if (!plan_row(l, n, temperature, top_k, top_p, min_p, &p)) {
        memset(w, 0, (size_t)n * sizeof *w);
        w[argmax_row(l, n)] = 1.0;
        return;
    }
    if (p.top_k || p.by_p) {
        double sum;
        const int64_t kept = ranked_keep(l, n, &p, s, &sum);
        memset(w, 0, (size_t)n * sizeof *w);
        for (int64_t j = 0; j < kept; j++) w[s->r[j].id] = s->r[j].w;
        return;
    }
    if (p.by_min) {
        double total;
        const int64_t m = min_p_keep(l, n, &p, s, &total);
        memset(w, 0, (size_t)n * sizeof *w);
        for (int64_t j = 0; j < m; j++) w[s->id[j]] = s->w[j];
        return;
    }
    row_weights(l, n, p.top, p.temperature, p.inv_t, p.bits, w);
}

/* Per row r of logits [M, N] (row stride ld, N < 2^31) after temperature[r], top_k[r], top_p[r] and min_p[r]: the
 * token drawn at uniforms[r] in [0, 1) into tokens[r] (sample_row), or, where `weights` is given, the kept weights
 * into weights [M, N] (row stride ldw; keep_row); rows split across threads, each with its scratch. Returns -1
 * without memory. */
static int draw_rows(const float *logits, int64_t M, int64_t N, int64_t ld, const double *temperature,
                     const int64_t *top_k, const double *top_p, const double *min_p, const double *uniforms,
                     int64_t *tokens, double *weights, int64_t ldw, int threads) {
    if (N > INT32_MAX) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && M > 1)
    {
        draw_scratch s = {malloc((size_t)(N + 16) * sizeof(double)), malloc((size_t)N * sizeof(double)),
                          malloc((size_t)(N + 16) * sizeof(int32_t)), malloc((size_t)N * sizeof(ranked))};
        const int ok = s.x && s.w && s.id && s.r;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < M; r++) {
            if (!ok) continue;
            const float *l = logits + r * ld;
            if (weights) keep_row(l, N, temperature[r], top_k[r], top_p[r], min_p[r], &s, weights + r * ldw);
            else tokens[r] = sample_row(l, N, temperature[r], top_k[r], top_p[r], min_p[r], uniforms[r], &s);
        }
        free(s.x), free(s.w), free(s.id), free(s.r);
    }
    return failed ? -1 : 0;
}

/* Per row r of logits [M, N] (row stride ld, N < 2^31), the token drawn at uniforms[r] in [0, 1) after
 * temperature[r], top_k[r], top_p[r] and min_p[r] (sample_row), into out[r]. Returns -1 without memory. */
int nt_sample_rows(const float *logits, int64_t M, int64_t N, int64_t ld, const double *temperature,
                   const int64_t *top_k, const double *top_p, const double *min_p, const double *uniforms,
                   int64_t *out, int threads) {
    return draw_rows(logits, M, N, ld, temperature, top_k, top_p, min_p, uniforms, out, NULL, 0, threads);
}

/* Per row r of logits [M, N], the weights its draw takes (keep_row: units of 2^-Q, 0 where dropped) into out [M, N]
 * (row stride ldo). Returns -1 without memory. */
int nt_kept_weights(const float *logits, int64_t M, int64_t N, int64_t ld, const double *temperature,
                    const int64_t *top_k, const double *top_p, const double *min_p, double *out, int64_t ldo,
                    int threads) {
    return draw_rows(logits, M, N, ld, temperature, top_k, top_p, min_p, NULL, NULL, out, ldo, threads);
}

/* out[r] = the index of row r's first largest value (argmax_row), for M rows of N (row stride ld). */
void nt_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ld, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++) out[r] = argmax_row(x + r * ld, N);
}

/* A grammar's masks (engine/grammar.py): for k < M, row rows[k] of logits (row stride ld, N entries) gets -inf
 * wherever bit j of mask k (words 32-bit words, bit j % 32 of word j / 32, little-endian bit order, as llguidance
 * writes them) is 0, and past the mask's 32 * words entries. A whole word at once where it is all ones or all
 * zeros, the usual case in a grammar's mask. */
void nt_mask_rows(float *logits, int64_t M, int64_t N, int64_t ld, const int64_t *rows, const uint32_t *masks,
                  int64_t words) {
    for (int64_t k = 0; k < M; k++) {
        float *x = logits + rows[k] * ld;
        const uint32_t *bits = masks + k * words;
        for (int64_t w = 0; w < words && 32 * w < N; w++) {
            uint32_t b = bits[w];
            int64_t base = 32 * w, end = base + 32 < N ? base + 32 : N;
            if (b == 0xFFFFFFFFu)
                continue;
            for (int64_t j = base; j < end; j++)
                if (!((b >> (j - base)) & 1u))
                    x[j] = -INFINITY;
        }
        for (int64_t j = 32 * words; j < N; j++)
            x[j] = -INFINITY;
    }
}
