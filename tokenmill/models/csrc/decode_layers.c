/* Every decoder layer of a decode step (one new token per sequence) in one call (CPU, fp32
 * activations, quantised weights).
 *
 * Why this exists: at batch 1 a 30-layer step of SmolLM2 is 120 matmuls reading 66 MB of 4-bit
 * blocks (~4 ms here) and, between them, ~500 calls from Python (norms, RoPE, cache writes,
 * attention, residual adds) at ~10 µs each: more time than the matmuls. Here the step's layers run inside
 * one OpenMP parallel region, on the same kernel bodies the layer-by-layer path calls
 * (team.h), in the same order, so its results are bitwise those of that path.
 *
 * A layer (Llama's: pre-norm attention, then a gated SiLU MLP, each added to the residual):
 *   h = rms_norm(x) · input_norm;  qkv = h · Wqkvᵀ;  RoPE on q and k;  k, v -> cache slots
 *   x += attention(q, cache) · Woᵀ
 *   h = rms_norm(x) · post_attention_norm;  x += (silu(h · Wgateᵀ) · (h · Wupᵀ)) · Wdownᵀ
 * and its variants: each head of q and k RMS-normalised before RoPE (Qwen3, Gemma 3); norms
 * scaling by (1 + w) (Gemma); a GELU gate (Gemma); each sublayer's output normalised before its
 * residual add, so four norms a layer (Gemma 3: post_attention_norm is then the attention
 * output's, ffn_norm the MLP input's and post_ffn_norm the MLP output's); layers turning by a
 * table of their own (Gemma 3's sliding layers use the local RoPE base).
 *
 * Layouts: x [S, hidden] (updated in place); cos/sin [S, rotary]; slots [S]; block_tables
 * [S, max_blocks], context_lens [S] (int64, the new token included), as paged_attention.c.
 */
#include <stdint.h>
#include <string.h>

#include "team.h"
#include "vec8.h"

typedef struct {
    const float *input_norm, *post_attention_norm;
    const float *q_norm, *k_norm;           /* per-head norms, or NULL */
    const float *ffn_norm, *post_ffn_norm;  /* Gemma 3's sandwich norms, or NULL */
    QuantLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;   /* [blocks, block_size, kv_heads, head_dim], fp32 or (kv_half) fp16 */
    int64_t window;            /* sliding window, 0 for none */
    int local_rope;            /* turns by the local table */
} DecodeLayer;

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, rotary, intermediate, block_size, max_blocks;
    float eps, attention_scale;
    float norm_offset;  /* 1 where norms scale by (1 + w) */
    int activation;     /* SILU or GELU_TANH (team.h) */
    float q_scale;      /* queries multiplied by it after RoPE (Gemma 3's query_pre_attn_scalar) */
    int kv_half;        /* the caches hold fp16 */
} DecodeShape;

/* The queries of the S qkv rows times q_scale, in place (as the layer-by-layer path does, rather
 * than folding it into the attention scale: the same roundings). */
static void scale_queries(float *qkv, int64_t qkv_dim, int S, const DecodeShape *d) {
    const int64_t q_dim = (int64_t)d->heads * d->head_dim;
#pragma omp for schedule(static)
    for (int s = 0; s < S; s++)
        for (int64_t i = 0; i < q_dim; i++) qkv[s * qkv_dim + i] = qkv[s * qkv_dim + i] * d->q_scale;
}

/* Each head of q and k in the S qkv rows normalised in place. */
static void head_norms(const DecodeLayer *layer, const DecodeShape *d, float *qkv, int64_t qkv_dim, int S) {
    const int heads = d->heads + d->kv_heads;
#pragma omp for schedule(static)
    for (int i = 0; i < S * heads; i++) {
        const int h = i % heads;
        float *v = qkv + (i / heads) * qkv_dim + (int64_t)h * d->head_dim;
        rms_norm_row(v, h < d->heads ? layer->q_norm : layer->k_norm, v, d->head_dim, d->eps, d->norm_offset);
    }
}

/* x += rms_norm(y) · w, row by row (a sublayer's output normalised, then added). */
static void add_normed(float *x, const float *y, const float *w, float *scratch, int S, const DecodeShape *d) {
#pragma omp for schedule(static)
    for (int s = 0; s < S; s++) {
        float *row = scratch + (int64_t)s * d->hidden, *xs = x + (int64_t)s * d->hidden;
        rms_norm_row(y + (int64_t)s * d->hidden, w, row, d->hidden, d->eps, d->norm_offset);
        for (int k = 0; k < d->hidden; k++) xs[k] = xs[k] + row[k];
    }
}

/* The new tokens' K and V (after q and k in each qkv row) into their cache slots. */
static void write_kv(const DecodeLayer *layer, const DecodeShape *d, const float *qkv, int64_t qkv_dim,
                     const int64_t *slots, int S) {
    const int64_t kv_dim = (int64_t)d->kv_heads * d->head_dim, q_dim = (int64_t)d->heads * d->head_dim;
#pragma omp for schedule(static)
    for (int s = 0; s < S; s++) {
        const float *row = qkv + s * qkv_dim + q_dim;
        if (!d->kv_half) {
            memcpy((float *)layer->k_cache + slots[s] * kv_dim, row, sizeof(float) * kv_dim);
            memcpy((float *)layer->v_cache + slots[s] * kv_dim, row + kv_dim, sizeof(float) * kv_dim);
            continue;
        }
        uint16_t *k = (uint16_t *)layer->k_cache + slots[s] * kv_dim;
        uint16_t *v = (uint16_t *)layer->v_cache + slots[s] * kv_dim;
        for (int64_t i = 0; i < kv_dim; i += 8) {  /* head_dim is a multiple of 8 */
            store_half8(k + i, LOAD(row + i));
            store_half8(v + i, LOAD(row + kv_dim + i));
        }
    }
}

/* Returns 0; -1 when a context is empty or longer than its block table, -3 when out of memory.
 * cos_local/sin_local: the local layers' table (NULL where no layer has one). */
int decode_layers(const DecodeLayer *layers, const DecodeShape *d, float *x, int S, const float *cos_t,
                  const float *sin_t, const float *cos_local, const float *sin_local, const int64_t *slots,
                  const int64_t *block_tables, const int64_t *context_lens, int num_threads) {
    const int H = d->hidden, D = d->head_dim, I = d->intermediate;
    const int64_t qkv_dim = (int64_t)(d->heads + 2 * d->kv_heads) * D, attn_dim = (int64_t)d->heads * D;
    /* Buffers: h [S, H], qkv, attention output, gate_up [S, 2I], act [S, I], a sublayer's output
     * and its norm [S, H] each, then the matmuls' quantised activations (K is at most
     * max(H, I, attn_dim)). */
    const size_t floats = (size_t)S * (3 * (size_t)H + qkv_dim + attn_dim + 3 * (size_t)I);
    int widest = H > I ? H : I;
    if (attn_dim > widest) widest = (int)attn_dim;
    float *h = (float *)thread_scratch(sizeof(float) * floats + quant_linear_scratch_bytes(S, widest));
    if (!h) return -3;
    float *qkv = h + (size_t)S * H, *attn = qkv + S * qkv_dim, *gate_up = attn + S * attn_dim;
    float *act = gate_up + (size_t)S * 2 * I, *out = act + (size_t)S * I, *normed = out + (size_t)S * H;
    int8_t *xq = (int8_t *)(normed + (size_t)S * H);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    for (int l = 0; l < d->num_layers; l++) {
        const DecodeLayer *layer = &layers[l];
        const int sandwich = layer->post_ffn_norm != NULL;
        rms_norm_team(x, layer->input_norm, h, S, H, d->eps, d->norm_offset);
        quant_linear_team(&layer->qkv, h, qkv, S, 0, xq);
        if (layer->q_norm) head_norms(layer, d, qkv, qkv_dim, S);
        rope_team(qkv, layer->local_rope ? cos_local : cos_t, layer->local_rope ? sin_local : sin_t, S,
                  d->heads + d->kv_heads, D, d->rotary, qkv_dim);
        if (d->q_scale != 1.f) scale_queries(qkv, qkv_dim, S, d);
        write_kv(layer, d, qkv, qkv_dim, slots, S);
        paged_attention_team(qkv, qkv_dim, layer->k_cache, layer->v_cache, block_tables, context_lens, attn,
                             attn_dim, S, d->kv_heads, d->heads / d->kv_heads, D, d->block_size,
                             d->max_blocks, d->attention_scale, layer->window, d->kv_half, &failed);
        if (sandwich) {
            quant_linear_team(&layer->o, attn, out, S, 0, xq);
            add_normed(x, out, layer->post_attention_norm, normed, S, d);
        } else {
            quant_linear_team(&layer->o, attn, x, S, 1, xq);
        }
        rms_norm_team(x, sandwich ? layer->ffn_norm : layer->post_attention_norm, h, S, H, d->eps, d->norm_offset);
        quant_linear_team(&layer->gate_up, h, gate_up, S, 0, xq);
        gated_activation_team(gate_up, act, S, I, d->activation);
        if (sandwich) {
            quant_linear_team(&layer->down, act, out, S, 0, xq);
            add_normed(x, out, layer->post_ffn_norm, normed, S, d);
        } else {
            quant_linear_team(&layer->down, act, x, S, 1, xq);
        }
    }
    return failed ? -1 : 0;
}
