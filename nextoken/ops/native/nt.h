/* nextoken's CPU kernels: the library's whole interface.
 *
 * The units, one concern each: formats.c (block formats: activation codes, unpacking a file's blocks, dequantizing a
 * row), matmul.c (block products of one to a few rows), sgemm.c and gemm.c (GEMMs for batches bound by compute),
 * attention.c (paged decode attention, prefill attention, the KV cache's stores), norms.c (RMSNorm and gated
 * activations), sampling.c (argmax and the sampler's draw), decode.c (every decoder block of a step, or the whole
 * step), runtime.c (instruction sets, threads, this interface's layout). What they share and keep to themselves is in
 * internal.h.
 *
 * Python reads the library through ctypes (__init__.py): every struct below is mirrored there, and the test of
 * `nt_layout` holds the mirrors to the compiler's own sizes and offsets. Matrices are row-major fp32 unless stated;
 * `ld*` are row strides in elements; `threads` is the OpenMP thread count of the call. Functions returning int return
 * 0, or -1 for unsupported sizes or no memory (-2 where stated).
 */
#ifndef NT_H
#define NT_H

#include <stdint.h>

#define NT_API __attribute__((visibility("default")))

/* ------------------------------------------------------------ named values */

/* Block formats of quantized weights, along the input dimension (K) of a weight [N, K]:
 *   NT_Q4: codes uint8 [N, K / 2], two nibbles a byte (byte j of a block of 32 holds element j in its low nibble and
 *     element j + 16 in its high one, GGML's order); d and m fp16 [N, K / 32]; w = d * q + m. Holds Q4_0 and Q4_1.
 *   NT_Q4_F32: as NT_Q4, d and m fp32. Holds Q4_K exactly (its 32-value sub-blocks' d * sc and dmin * mn need up to
 *     17 bits).
 *   NT_Q8_HALVES: codes int8 [N, K], d fp32 [N, K / 16]; w = d * q. Holds Q6_K exactly (codes -32..31).
 *   NT_Q8: codes int8 [N, K], d fp16 [N, K / 32]; w = d * q. */
typedef enum { NT_Q4 = 4, NT_Q4_F32 = 5, NT_Q8_HALVES = 6, NT_Q8 = 8 } nt_format;

/* Storage of a paged KV cache [num_blocks, block_size, kv_heads, head_dim]: fp32, bf16, or int8 codes with fp16
 * scales [num_blocks, block_size, kv_heads, head_dim / 32] (scale absmax / 127, codes round(x / scale)). */
typedef enum { NT_KV_F32 = 0, NT_KV_BF16 = 1, NT_KV_INT8 = 2 } nt_kv_kind;

/* Gated activations, act(gate) * up. */
typedef enum { NT_SILU = 0, NT_GELU_TANH = 1 } nt_activation;

/* The instruction sets the library was built for (nt_isa): plain C, AVX2 with FMA and F16C, or AVX-512 (F, BW, VL)
 * with VNNI on top. */
typedef enum { NT_ISA_PORTABLE = 0, NT_ISA_AVX2 = 1, NT_ISA_AVX512_VNNI = 2 } nt_isa_level;

/* A fused call's profile, where its caller hands one (null: nothing is timed; one test per layer): doubles indexed
 * by these slots. The first NT_PROFILE_LAYERS hold CLOCK_MONOTONIC readings in seconds, taken where each stage of
 * nt_decode_step ends (nt_decode_layers writes NT_PROFILE_BLOCKS, after the last block and before the final norm);
 * from NT_PROFILE_LAYERS on, NT_LAYER_TIMES values per layer (nt_layer_time). */
typedef enum {
    NT_PROFILE_START = 0,     /* the step begins */
    NT_PROFILE_EMBEDDING = 1, /* the token rows are in the residual stream */
    NT_PROFILE_BLOCKS = 2,    /* the last block is done */
    NT_PROFILE_HEAD = 3,      /* the final norm and the LM head are done */
    NT_PROFILE_ARGMAX = 4,    /* the rows' argmax is done (the same reading as NT_PROFILE_HEAD without one) */
    NT_PROFILE_LAYERS = 5     /* where the per-layer values begin */
} nt_profile_slot;

/* A layer's values in a profile, seconds of: attention (the QKV projection through the output projection, as the
 * modules' SelfAttention), the MLP (the gate and up projection through the down projection, as GatedMLP), and the
 * whole block (its norms and the residual add included). */
typedef enum { NT_LAYER_ATTENTION = 0, NT_LAYER_MLP = 1, NT_LAYER_BLOCK = 2, NT_LAYER_TIMES = 3 } nt_layer_time;

/* ------------------------------------------------------------ structs */

/* One layer's paged K/V. */
typedef struct {
    void *k, *v;
    uint16_t *k_scales, *v_scales; /* NT_KV_INT8 only */
    int64_t kind, block_size;      /* kind: nt_kv_kind */
} nt_cache;

/* Rows of a projection in one block format. */
typedef struct {
    int64_t kind, n, k; /* kind: nt_format; n rows of k inputs */
    const void *qs, *d;
    const void *m;
} nt_part;

#define NT_MAX_PARTS 4

/* A projection as up to NT_MAX_PARTS stacked parts (rows of the output), each in its own format: a fused QKV
 * projection whose V comes from 6-bit blocks while Q and K come from 4-bit ones. */
typedef struct {
    int64_t num_parts, n;
    nt_part parts[NT_MAX_PARTS];
    int64_t int8_activations; /* products of many rows over the blocks by nt_block_gemm8 */
    /* int8 activations' outlier columns, fixed (ascending, at most NT_OUTLIER_MAX): every product then takes
     * nt_block_gemm8 with them, whatever its rows, so that a row's numbers do not depend on its batch. num_outliers
     * -1: chosen over each product's rows, and few rows take the block kernels. */
    const int32_t *outliers;
    int64_t num_outliers;
} nt_matrix;

/* One decoder block's shape, weights and norms. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, window; /* window 0: none */
    float eps, scale;
    int64_t activation;                             /* nt_activation */
    int64_t rope_interleaved, rope_dim, rope_table; /* rope_table: which (cos, sin) pair of the call */
    /* Norms: before attention and the MLP (required); of their outputs and of q and k per head (optional). */
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm, *q_norm, *k_norm;
    const float *qkv_bias; /* [qkv.n], added to the QKV projection's rows (optional) */
    nt_matrix qkv, o, gate_up, down;
} nt_layer;

/* What a decode step reads besides its tokens: the decoder (nt_decode_layers' arguments), buffers kept between
 * steps, the token table (Q8 blocks, times embed_scale) and the LM head (int8 blocks of `head_kind`). */
typedef struct {
    const nt_layer *layers;
    const nt_cache *caches;
    int64_t num_layers;
    const float *const *rope_tables;
    float *scratch; /* nt_decode_scratch() floats for max_rows */
    float *x;       /* [max_rows, hidden]: the residual stream */
    int64_t max_rows;
    int64_t gemm_rows;
    const float *final_norm;
    float final_eps;
    float embed_scale;
    const int8_t *embed_codes; /* [vocab, hidden] */
    const float *embed_scales; /* [vocab, hidden / 32] */
    int64_t vocab;
    int64_t head_kind; /* NT_Q8 or NT_Q8_HALVES */
    const int8_t *head_qs; /* [head_rows, hidden] */
    const void *head_d;
    int64_t head_rows;
    int64_t head_gemm_rows; /* rows from which the head takes the GEMM over its blocks */
    int64_t head_int8_activations;
    const int32_t *head_outliers; /* as nt_matrix's outliers, for the head */
    int64_t head_num_outliers;
    int64_t threads;
    double *profile; /* null, or a profile of NT_PROFILE_LAYERS + NT_LAYER_TIMES * num_layers doubles */
} nt_step;

/* One entry of the interface's layout: "sizeof nt_layer", "nt_layer.qkv" (a field's offset) or "NT_Q4" (an enum's
 * value). */
typedef struct {
    const char *name;
    int64_t value;
} nt_layout_entry;

/* ------------------------------------------------------------ runtime.c */

NT_API int nt_isa(void); /* nt_isa_level */
NT_API int nt_has_avx2(void);
NT_API int nt_has_vnni512(void);
/* The GEMM over block weights on AMX-INT8 tiles (amx.c): want 1 takes that route where the build has it and the
 * kernel grants the tiles, 0 leaves it (for the VNNI one, the same bits), -1 asks; returns whether it is taken. Off
 * until asked: on Sapphire Rapids the VNNI route measured the faster (docs/design-cpu.md). */
NT_API int nt_amx(int want);
NT_API void nt_release_threads(void);
/* Every struct's size and fields' offsets and every enum's value, ended by a null name. */
NT_API const nt_layout_entry *nt_layout(void);
NT_API uint64_t nt_stream_read(const void *const *ptrs, const int64_t *sizes, int64_t n, int threads);

/* ------------------------------------------------------------ formats.c */

NT_API void nt_unpack_q8_0(const uint8_t *raw, int64_t n, int8_t *codes, uint16_t *d, int threads);
NT_API void nt_unpack_q5_0(const uint8_t *raw, int64_t n, int8_t *codes, uint16_t *d, int threads);
NT_API int nt_embed_q8(const int8_t *codes, const float *scales, int64_t vocab, int64_t K, const int64_t *ids,
                       int64_t n, float *out);

/* ------------------------------------------------------------ matmul.c, sgemm.c, gemm.c */

/* out [M, N] = x [M, K] @ W^T for W [N, K] in block format `kind` (qs, d, m as nt_format describes). */
NT_API int nt_block_matmul(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                           const void *d, const void *m, float *out, int64_t ldo, int threads);
NT_API int nt_block_gemm(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                         const void *d, const void *m, float *out, int64_t ldo, int threads);
/* int8 activations' outlier columns (nt_block_gemm8) per product at most */
#define NT_OUTLIER_MAX 16
NT_API int nt_block_gemm8(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const void *qs,
                          const void *d, const void *m, float *out, int64_t ldo, int threads,
                          const int32_t *outliers, int64_t num_outliers);
NT_API int64_t nt_sgemm_packed_size(int64_t N, int64_t K);
NT_API void nt_sgemm_pack(const float *w, int64_t N, int64_t K, float *packed, int threads);
NT_API int nt_sgemm_pack_blocks(int kind, const void *qs, const void *d, const void *m, int64_t N, int64_t K,
                                float *packed, int64_t first, int threads);
NT_API void nt_sgemm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *packed, int64_t N, float *out,
                     int64_t ldo, int threads);
NT_API void nt_matmul_rowmajor(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N,
                               int64_t ldw, float *out, int64_t ldo, int threads);

/* ------------------------------------------------------------ attention.c */

NT_API int nt_decode_attention(const float *q, float *out, int64_t n, const int64_t *rows, const int64_t *seq_lens,
                               const int64_t *tables, const int64_t *table_rows, int64_t table_stride, void *k,
                               void *v, uint16_t *k_scales, uint16_t *v_scales, int kind, int64_t block_size,
                               int64_t heads, int64_t kv_heads, int64_t D, float scale, int64_t window, int threads);
NT_API int nt_prefill_attention(const float *q, const float *k, const float *v, float *out, int64_t T, int64_t S,
                                int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, int threads);
NT_API void nt_store_rows(void *data, uint16_t *scales, int64_t kind, const int64_t *slots, const float *src,
                          int64_t n, int64_t width, int64_t ld, int threads);

/* ------------------------------------------------------------ norms.c */

NT_API void nt_rms_norm(float *x, const float *residual, const float *w, float *out, int64_t M, int64_t K,
                        float eps);
NT_API void nt_norm_rows(float *x, const float *residual, const float *w, float *out, int64_t M, int64_t K,
                         float eps, int threads);
NT_API void nt_gated(int64_t activation, const float *g, const float *u, float *a, int64_t n);
NT_API void nt_gated_rows(int64_t activation, const float *gate_up, int64_t M, int64_t F, float *out, int threads);

/* ------------------------------------------------------------ sampling.c */

NT_API void nt_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ld, int64_t *out, int threads);
NT_API int nt_sample_rows(const float *logits, int64_t M, int64_t N, int64_t ld, const double *temperature,
                          const int64_t *top_k, const double *top_p, const double *min_p, const double *uniforms,
                          int64_t *out, int threads);
NT_API int nt_kept_weights(const float *logits, int64_t M, int64_t N, int64_t ld, const double *temperature,
                           const int64_t *top_k, const double *top_p, const double *min_p, double *out, int64_t ldo,
                           int threads);
NT_API void nt_mask_rows(float *logits, int64_t M, int64_t N, int64_t ld, const int64_t *rows, const uint32_t *masks,
                         int64_t words);

/* ------------------------------------------------------------ decode.c */

NT_API int64_t nt_decode_scratch(const nt_layer *layers, int64_t num_layers, int64_t M);
NT_API int nt_decode_layers(float *x, int64_t M, const int64_t *positions, const int64_t *slots,
                            const int64_t *seq_lens, const int64_t *tables, int64_t table_stride,
                            const int64_t *query_start, int64_t num_seqs, const nt_layer *layers,
                            const nt_cache *caches, int64_t num_layers, const float *const *rope_tables,
                            float *scratch, int64_t gemm_rows, const float *final_norm, float final_eps,
                            int threads, double *profile);
NT_API int nt_decode_step(const nt_step *s, const int64_t *ints, int64_t M, int64_t table_stride, float *logits,
                          int64_t ldl, int64_t *argmax);

#endif
