/* What the library was built for, its threads, a pass that only reads memory, and the layout of its interface
 * (nt_layout: the Python mirrors of nt.h's structs and enums are held to it). */
#include <stddef.h>

#include "internal.h"

int nt_isa(void) {
#if defined(NT_VNNI512)
    return NT_ISA_AVX512_VNNI;
#elif defined(NT_AVX2)
    return NT_ISA_AVX2;
#else
    return NT_ISA_PORTABLE;
#endif
}

int nt_has_avx2(void) { return nt_isa() >= NT_ISA_AVX2; }

int nt_has_vnni512(void) { return nt_isa() >= NT_ISA_AVX512_VNNI; }

/* Frees the calling thread's OpenMP workers; its next parallel region starts new ones. libgomp keeps a pool of
 * workers for every thread that starts regions, and once its threads outnumber the CPUs it parks them between
 * regions instead of letting them spin: a decode step's few hundred short regions then took 2.5x as long. A thread
 * that is done stepping for now calls this, so that another one can step at full speed. */
void nt_release_threads(void) {
#ifdef _OPENMP
    omp_pause_resource_all(omp_pause_soft);
#endif
}

/* ------------------------------------------------------------ measurement */

typedef uint64_t __attribute__((may_alias, aligned(1))) any_word;

/* The XOR of every 64-bit word of n buffers (ptrs[i], sizes[i] bytes; a tail under 8 bytes is left out), each
 * buffer split between the threads in contiguous parts, as the block products split their weight rows, in one
 * parallel region (no thread waits for another between buffers). It only reads: its time is the floor that memory
 * bandwidth puts under one pass over those bytes (benchmarks/roofline.py). */
uint64_t nt_stream_read(const void *const *ptrs, const int64_t *sizes, int64_t n, int threads) {
    uint64_t all = 0;
#pragma omp parallel num_threads(threads) reduction(^ : all) if (threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
#else
        const int64_t t = 0, parts = 1;
#endif
        uint64_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            const any_word *p = (const any_word *)ptrs[i];
            const int64_t words = sizes[i] / 8;
            for (int64_t w = words * t / parts, end = words * (t + 1) / parts; w < end; w++) acc ^= p[w];
        }
        all ^= acc;
    }
    return all;
}

/* ------------------------------------------------------------ layout */

/* The interface's layout as this compiler lays it out: what the ctypes mirrors in __init__.py must match. */
const nt_layout_entry *nt_layout(void) {
    static const nt_layout_entry entries[] = {
        {"sizeof nt_cache", sizeof(nt_cache)},
        {"nt_cache.k", offsetof(nt_cache, k)},
        {"nt_cache.v", offsetof(nt_cache, v)},
        {"nt_cache.k_scales", offsetof(nt_cache, k_scales)},
        {"nt_cache.v_scales", offsetof(nt_cache, v_scales)},
        {"nt_cache.kind", offsetof(nt_cache, kind)},
        {"nt_cache.block_size", offsetof(nt_cache, block_size)},
        {"sizeof nt_part", sizeof(nt_part)},
        {"nt_part.kind", offsetof(nt_part, kind)},
        {"nt_part.n", offsetof(nt_part, n)},
        {"nt_part.k", offsetof(nt_part, k)},
        {"nt_part.qs", offsetof(nt_part, qs)},
        {"nt_part.d", offsetof(nt_part, d)},
        {"nt_part.m", offsetof(nt_part, m)},
        {"sizeof nt_matrix", sizeof(nt_matrix)},
        {"nt_matrix.num_parts", offsetof(nt_matrix, num_parts)},
        {"nt_matrix.n", offsetof(nt_matrix, n)},
        {"nt_matrix.parts", offsetof(nt_matrix, parts)},
        {"nt_matrix.int8_activations", offsetof(nt_matrix, int8_activations)},
        {"nt_matrix.outliers", offsetof(nt_matrix, outliers)},
        {"nt_matrix.num_outliers", offsetof(nt_matrix, num_outliers)},
        {"sizeof nt_layer", sizeof(nt_layer)},
        {"nt_layer.hidden", offsetof(nt_layer, hidden)},
        {"nt_layer.heads", offsetof(nt_layer, heads)},
        {"nt_layer.kv_heads", offsetof(nt_layer, kv_heads)},
        {"nt_layer.head_dim", offsetof(nt_layer, head_dim)},
        {"nt_layer.ffn", offsetof(nt_layer, ffn)},
        {"nt_layer.window", offsetof(nt_layer, window)},
        {"nt_layer.eps", offsetof(nt_layer, eps)},
        {"nt_layer.scale", offsetof(nt_layer, scale)},
        {"nt_layer.activation", offsetof(nt_layer, activation)},
        {"nt_layer.rope_interleaved", offsetof(nt_layer, rope_interleaved)},
        {"nt_layer.rope_dim", offsetof(nt_layer, rope_dim)},
        {"nt_layer.rope_table", offsetof(nt_layer, rope_table)},
        {"nt_layer.attn_in_norm", offsetof(nt_layer, attn_in_norm)},
        {"nt_layer.attn_out_norm", offsetof(nt_layer, attn_out_norm)},
        {"nt_layer.mlp_in_norm", offsetof(nt_layer, mlp_in_norm)},
        {"nt_layer.mlp_out_norm", offsetof(nt_layer, mlp_out_norm)},
        {"nt_layer.q_norm", offsetof(nt_layer, q_norm)},
        {"nt_layer.k_norm", offsetof(nt_layer, k_norm)},
        {"nt_layer.qkv_bias", offsetof(nt_layer, qkv_bias)},
        {"nt_layer.qkv", offsetof(nt_layer, qkv)},
        {"nt_layer.o", offsetof(nt_layer, o)},
        {"nt_layer.gate_up", offsetof(nt_layer, gate_up)},
        {"nt_layer.down", offsetof(nt_layer, down)},
        {"sizeof nt_step", sizeof(nt_step)},
        {"nt_step.layers", offsetof(nt_step, layers)},
        {"nt_step.caches", offsetof(nt_step, caches)},
        {"nt_step.num_layers", offsetof(nt_step, num_layers)},
        {"nt_step.rope_tables", offsetof(nt_step, rope_tables)},
        {"nt_step.scratch", offsetof(nt_step, scratch)},
        {"nt_step.x", offsetof(nt_step, x)},
        {"nt_step.max_rows", offsetof(nt_step, max_rows)},
        {"nt_step.gemm_rows", offsetof(nt_step, gemm_rows)},
        {"nt_step.final_norm", offsetof(nt_step, final_norm)},
        {"nt_step.final_eps", offsetof(nt_step, final_eps)},
        {"nt_step.embed_scale", offsetof(nt_step, embed_scale)},
        {"nt_step.embed_codes", offsetof(nt_step, embed_codes)},
        {"nt_step.embed_scales", offsetof(nt_step, embed_scales)},
        {"nt_step.vocab", offsetof(nt_step, vocab)},
        {"nt_step.head_kind", offsetof(nt_step, head_kind)},
        {"nt_step.head_qs", offsetof(nt_step, head_qs)},
        {"nt_step.head_d", offsetof(nt_step, head_d)},
        {"nt_step.head_rows", offsetof(nt_step, head_rows)},
        {"nt_step.head_gemm_rows", offsetof(nt_step, head_gemm_rows)},
        {"nt_step.head_int8_activations", offsetof(nt_step, head_int8_activations)},
        {"nt_step.head_outliers", offsetof(nt_step, head_outliers)},
        {"nt_step.head_num_outliers", offsetof(nt_step, head_num_outliers)},
        {"nt_step.threads", offsetof(nt_step, threads)},
        {"nt_step.profile", offsetof(nt_step, profile)},
        {"sizeof nt_layout_entry", sizeof(nt_layout_entry)},
        {"NT_Q4", NT_Q4},
        {"NT_Q4_F32", NT_Q4_F32},
        {"NT_Q8_HALVES", NT_Q8_HALVES},
        {"NT_Q8", NT_Q8},
        {"NT_KV_F32", NT_KV_F32},
        {"NT_KV_BF16", NT_KV_BF16},
        {"NT_KV_INT8", NT_KV_INT8},
        {"NT_SILU", NT_SILU},
        {"NT_GELU_TANH", NT_GELU_TANH},
        {"NT_ISA_PORTABLE", NT_ISA_PORTABLE},
        {"NT_ISA_AVX2", NT_ISA_AVX2},
        {"NT_ISA_AVX512_VNNI", NT_ISA_AVX512_VNNI},
        {"NT_PROFILE_START", NT_PROFILE_START},
        {"NT_PROFILE_EMBEDDING", NT_PROFILE_EMBEDDING},
        {"NT_PROFILE_BLOCKS", NT_PROFILE_BLOCKS},
        {"NT_PROFILE_HEAD", NT_PROFILE_HEAD},
        {"NT_PROFILE_ARGMAX", NT_PROFILE_ARGMAX},
        {"NT_PROFILE_LAYERS", NT_PROFILE_LAYERS},
        {"NT_LAYER_ATTENTION", NT_LAYER_ATTENTION},
        {"NT_LAYER_MLP", NT_LAYER_MLP},
        {"NT_LAYER_BLOCK", NT_LAYER_BLOCK},
        {"NT_LAYER_TIMES", NT_LAYER_TIMES},
        {"NT_MAX_PARTS", NT_MAX_PARTS},
        {"NT_OUTLIER_MAX", NT_OUTLIER_MAX},
        {NULL, 0},
    };
    return entries;
}
