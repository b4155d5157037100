/* Every decoder block of a step in one call (nt_decode_layers), and the whole step with the token table and the LM
 * head (nt_decode_step), each timing its stages into a profile where the caller hands one (a tracer). */
#define _POSIX_C_SOURCE 199309L /* clock_gettime and CLOCK_MONOTONIC under -std=c11 */
#include <time.h>

#include "internal.h"

/* A CLOCK_MONOTONIC reading in seconds, for profiles (Python's time.perf_counter reads the same clock on Linux). */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* out [M, n] = x [M, k] @ W^T: from `gemm_rows` rows on (bound by compute there) the GEMM over the blocks
 * (nt_block_gemm: int16 with AVX-512 VNNI, else fp32 over panels dequantized as it goes); fewer rows take the block
 * kernels (bound by the weight's bytes). */
static int matmul(const nt_matrix *w, const float *x, int64_t M, float *out, int threads, int64_t gemm_rows) {
    const int fixed = w->int8_activations && w->num_outliers >= 0; /* nt_matrix: every product on nt_block_gemm8 */
    const int gemm = M >= gemm_rows || fixed;
    int status = 0;
    for (int64_t i = 0, at = 0; i < w->num_parts; at += w->parts[i].n, i++) {
        const nt_part *p = &w->parts[i];
        if (gemm && w->int8_activations)
            status |= nt_block_gemm8((int)p->kind, x, M, p->k, p->k, p->n, p->qs, p->d, p->m, out + at, w->n,
                                     threads, w->outliers, w->num_outliers);
        else
            status |= (gemm ? nt_block_gemm : nt_block_matmul)((int)p->kind, x, M, p->k, p->k, p->n, p->qs, p->d,
                                                               p->m, out + at, w->n, threads);
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
 * after the last block (null: none); profile: null, or a profile (nt_profile_slot) whose per-layer times and
 * NT_PROFILE_BLOCKS reading this call writes. Returns 0, or -1 when a size is unsupported or memory runs out. */
int nt_decode_layers(float *x, int64_t M, const int64_t *positions, const int64_t *slots, const int64_t *seq_lens,
                     const int64_t *tables, int64_t table_stride, const int64_t *query_start, int64_t num_seqs,
                     const nt_layer *layers, const nt_cache *caches, int64_t num_layers,
                     const float *const *rope_tables, float *scratch, int64_t gemm_rows, const float *final_norm,
                     float final_eps, int threads, double *profile) {
    const int64_t rows = nt_decode_scratch(layers, num_layers, M) / 4;
    float *h = scratch, *big = h + rows, *att = big + rows, *tmp = att + rows;
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const nt_layer *L = &layers[l];
        const nt_cache *c = &caches[l];
        const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, hid = L->hidden;
        const int64_t qkv_n = L->qkv.n;
        double *times = profile ? profile + NT_PROFILE_LAYERS + l * NT_LAYER_TIMES : NULL;
        double block_start = 0.0, start = 0.0;
        if (times) block_start = now();
        /* attention */
        nt_norm_rows(x, NULL, L->attn_in_norm, h, M, hid, L->eps, threads);
        if (times) start = now();
        status |= matmul(&L->qkv, h, M, big, threads, gemm_rows);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
        for (int64_t t = 0; t < M; t++) {
            float *row = big + t * qkv_n; /* q heads, k heads, v heads */
            if (L->qkv_bias)
                for (int64_t j = 0; j < qkv_n; j++) row[j] += L->qkv_bias[j];
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
        if (times) times[NT_LAYER_ATTENTION] = now() - start;
        if (L->attn_out_norm) nt_norm_rows(h, NULL, L->attn_out_norm, h, M, hid, L->eps, threads);
        /* MLP */
        nt_norm_rows(x, h, L->mlp_in_norm, h, M, hid, L->eps, threads);
        if (times) start = now();
        status |= matmul(&L->gate_up, h, M, big, threads, gemm_rows);
        const int64_t F = L->ffn;
        nt_gated_rows(L->activation, big, M, F, att, threads);
        status |= matmul(&L->down, att, M, h, threads, gemm_rows);
        if (times) times[NT_LAYER_MLP] = now() - start;
        if (L->mlp_out_norm) nt_norm_rows(h, NULL, L->mlp_out_norm, h, M, hid, L->eps, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
        for (int64_t t = 0; t < M; t++)
            for (int64_t i = 0; i < hid; i++) x[t * hid + i] += h[t * hid + i];
        if (times) times[NT_LAYER_BLOCK] = now() - block_start;
    }
    if (profile) profile[NT_PROFILE_BLOCKS] = now();
    if (final_norm && num_layers > 0 && !status)
        nt_norm_rows(x, NULL, final_norm, x, M, layers[num_layers - 1].hidden, final_eps, threads);
    return status ? -1 : 0;
}

/* One decode step of M sequences (one new token each) in one call: the token rows from the table, every decoder
 * block with the final norm (nt_decode_layers), and the LM head into logits [M, head_rows] (row stride ldl); with
 * `argmax`, each row's argmax_row there; with s->profile, each stage timed into it (nt_profile_slot). ints: token
 * ids, positions, cache slots and context lengths [M] each, then the block tables [M, table_stride]. Returns 0; -1
 * when M exceeds the buffers or a kernel fails; -2 for a token id outside the table. */
int nt_decode_step(const nt_step *s, const int64_t *ints, int64_t M, int64_t table_stride, float *logits,
                   int64_t ldl, int64_t *argmax) {
    double *profile = s->profile;
    if (profile) profile[NT_PROFILE_START] = now();
    if (M < 1 || M > s->max_rows || s->num_layers < 1) return -1;
    const int64_t hidden = s->layers[0].hidden;
    const int64_t *ids = ints, *positions = ints + M, *slots = ints + 2 * M, *seq_lens = ints + 3 * M;
    if (nt_embed_q8(s->embed_codes, s->embed_scales, s->vocab, hidden, ids, M, s->x)) return -2;
    if (s->embed_scale != 1.0f)
        for (int64_t i = 0; i < M * hidden; i++) s->x[i] *= s->embed_scale;
    if (profile) profile[NT_PROFILE_EMBEDDING] = now();
    const int threads = (int)s->threads;
    if (nt_decode_layers(s->x, M, positions, slots, seq_lens, ints + 4 * M, table_stride, NULL, M, s->layers,
                         s->caches, s->num_layers, s->rope_tables, s->scratch, s->gemm_rows, s->final_norm,
                         s->final_eps, threads, profile))
        return -1;
    const int kind = (int)s->head_kind;
    int status;
    if (s->head_int8_activations && (M >= s->head_gemm_rows || s->head_num_outliers >= 0))
        status = nt_block_gemm8(kind, s->x, M, hidden, hidden, s->head_rows, s->head_qs, s->head_d, NULL, logits,
                                ldl, threads, s->head_outliers, s->head_num_outliers);
    else if (M >= s->head_gemm_rows)
        status = nt_block_gemm(kind, s->x, M, hidden, hidden, s->head_rows, s->head_qs, s->head_d, NULL, logits,
                               ldl, threads);
    else
        status = nt_block_matmul(kind, s->x, M, hidden, hidden, s->head_rows, s->head_qs, s->head_d, NULL, logits,
                                 ldl, threads);
    if (status) return -1;
    if (profile) profile[NT_PROFILE_HEAD] = now();
    if (argmax) nt_argmax_rows(logits, M, s->head_rows, ldl, argmax, threads);
    if (profile) profile[NT_PROFILE_ARGMAX] = now();
    return 0;
}
