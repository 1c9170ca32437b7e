/* The kernels' bodies, callable by every thread of an OpenMP team.
 *
 * Each exported kernel is a parallel region around one of these. A body splits its loops with
 * orphaned `omp for` and ends on that loop's barrier, so several bodies can run back to back
 * inside one parallel region (decode_layers.c runs a whole decode step that way) or alone, on
 * one thread, outside any region.
 */
#ifndef TOKENMILL_TEAM_H
#define TOKENMILL_TEAM_H
#include <stddef.h>
#include <stdint.h>

/* How a quantised layer's block scales and minimums are held (layouts in quant_gemm.c). */
enum { SCALES_F32 = 0, SCALES_F16 = 1, SCALES_SUPER_BLOCKS = 2 };
#define SUPER_BLOCK 256 /* SCALES_SUPER_BLOCKS: k values a super-block's factor covers */
/* k values one block value covers: 6-bit layers (Q6_K's) have a scale per half block of 16 */
#define SUB_BLOCK(bits) ((bits) == 6 ? 16 : 32)
/* SCALES_SUPER_BLOCKS, per 8-column group: 8 fp16 factors, then a multiple for each of the
 * super-block's sub-blocks × 8 columns (u8 at 4 bits, int8 at 6): 80 bytes, or 144 */
#define SUPER_BLOCK_BYTES(bits) (16 + 8 * (SUPER_BLOCK / SUB_BLOCK(bits)))
#define Q4_OFFSET 8  /* a 4-bit layer without minimums (Q4_0's): value = scale · (q - 8) */
#define Q6_OFFSET 32 /* 6 bits (Q6_K's): value = scale · (q - 32), q in [0, 63] */

/* A linear layer with quantised weights (layouts in quant_gemm.c): scale and min as scale_format
 * says; min is NULL at 5, 6 and 8 bits and for 4-bit blocks without minimums (Q4_0's), bias NULL
 * when there is none. `next`: a part stacked after this one along N, in a format of its own (a
 * fused q/k/v whose v is Q6_K and q, k Q4_K), its outputs the columns after this one's; NULL for
 * none. */
typedef struct QuantLinear {
    int bits, out_features, in_features, scale_format;
    const void *weight, *scale, *min;
    const float *bias;
    const struct QuantLinear *next;
} QuantLinear;

/* y = x · Wᵀ + bias for x [M, K], y [M, every part's out_features]; accumulate: y += x · Wᵀ + bias
 * instead. `scratch` holds
 * quant_linear_scratch_bytes(M, K) bytes, shared by the team. */
void quant_linear_team(const QuantLinear *layer, const float *x, float *y, int M, int accumulate,
                       int8_t *scratch);
size_t quant_linear_scratch_bytes(int M, int K);

/* A buffer of at least `bytes` for the calling thread, kept for its next call; NULL when out of
 * memory. */
int8_t *thread_scratch(size_t bytes);

void rms_norm_team(const float *x, const float *w, float *y, int M, int K, float eps, float offset);
void rope_team(float *x, const float *cos_t, const float *sin_t, int T, int H, int D, int R,
               int64_t row_stride);
enum { SILU = 0, GELU_TANH = 1 };  /* gated_activation_team's act */
void gated_activation_team(const float *gate_up, float *out, int T, int I, int act);
/* One row of rms_norm_team (x and y may be the same: in place). */
void rms_norm_row(const float *x, const float *w, float *y, int K, float eps, float offset);

/* q rows `q_stride` floats apart, out rows `out_stride` apart; the caches hold fp16 when kv_half,
 * else fp32; *failed is set (never cleared) when a context is empty or longer than its block
 * table, or scratch cannot be allocated. */
void paged_attention_team(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                          const int64_t *block_tables, const int64_t *context_lens, float *out,
                          int64_t out_stride, int num_seqs, int num_kv_heads, int group, int head_dim,
                          int block_size, int max_blocks, float scale, int64_t window, int kv_half, int *failed);
#endif
