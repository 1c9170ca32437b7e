/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * Why this exists: with only PyTorch ops, decode attention has to gather every sequence's
 * blocks into a dense tensor (read + write the whole context) before SDPA reads it again. On a
 * memory-bound CPU that triple traffic cost more than all linear layers at batch 64. Here each
 * K and V row is read from memory once per (sequence, KV head); the query heads that share the
 * KV head (GQA) re-read it from cache.
 *
 * Layouts (all contiguous, fp32):
 *   q, out           [num_seqs, num_kv_heads * group, head_dim] (the team body takes row strides)
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_seqs, max_blocks]   (int64)
 *   context_lens     [num_seqs]               (int64; positions [start, len) are attended)
 * window > 0 limits attention to the last `window` positions (Mistral's sliding window).
 *
 * GCC/Clang vector extensions (8 floats, vec8.h) instead of intrinsics: the same source compiles
 * to AVX2/AVX-512 with -march=native and to plain SSE or NEON elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "team.h"
#include "vec8.h"

static inline vec8 dot_partial(const vec8 *qv, const float *k, int n8) {
    vec8 s0 = {0}, s1 = {0};  /* two chains: the FMA latency is hidden */
    int i = 0;
    for (; i + 1 < n8; i += 2) {
        s0 += qv[i] * LOAD(k + 8 * i);
        s1 += qv[i + 1] * LOAD(k + 8 * i + 8);
    }
    if (i < n8) s0 += qv[i] * LOAD(k + 8 * i);
    return s0 + s1;
}

typedef struct {
    const float *k_cache, *v_cache;
    const int64_t *table;
    int64_t row_stride, block_stride, start, len;
    int block_size;
} Context;

static inline const float *row(const Context *c, const float *cache, int64_t pos) {
    return cache + c->table[pos / c->block_size] * c->block_stride + (pos % c->block_size) * c->row_stride;
}

/* First position past pos's block, capped at the context's end. */
static inline int64_t block_end(const Context *c, int64_t pos) {
    const int64_t end = (pos / c->block_size + 1) * c->block_size;
    return end < c->len ? end : c->len;
}

/* One query head over the context: scores, softmax, weighted sum of V. D is a multiple of 8;
 * with a compile-time D (the specialisations below) the query and the output live in registers. */
static inline void attend_head(const Context *c, const float *q, int D, float scale,
                               float *scores, float *out) {
    vec8 qv[32], acc[32];  /* head_dim <= 256 */
    const int n8 = D / 8;
    for (int i = 0; i < n8; i++) qv[i] = LOAD(q + 8 * i);
    vec8 max8 = (vec8){0} - INFINITY;
    float max_score = -INFINITY;
    /* Walk block by block: no division per position (64-bit idiv costs ~40+ cycles). */
    for (int64_t pos = c->start; pos < c->len;) {
        const float *k = row(c, c->k_cache, pos);
        const int64_t end = block_end(c, pos);
        for (; pos + 8 <= end; pos += 8, k += 8 * c->row_stride) {
            vec8 partial[8];
            for (int j = 0; j < 8; j++) partial[j] = dot_partial(qv, k + j * c->row_stride, n8);
            const vec8 s8 = sum8x8(partial) * scale;
            *(vec8u *)(scores + pos - c->start) = s8;
            max8 = select8(s8 > max8, s8, max8);
        }
        for (; pos < end; pos++, k += c->row_stride) {
            const float score = sum8(dot_partial(qv, k, n8)) * scale;
            scores[pos - c->start] = score;
            if (score > max_score) max_score = score;
        }
    }
    for (int i = 0; i < 8; i++) max_score = max8[i] > max_score ? max8[i] : max_score;
    const int64_t n = c->len - c->start;
    vec8 total8 = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const vec8 e = exp8(LOAD(scores + j) - max_score);
        *(vec8u *)(scores + j) = e;
        total8 += e;
    }
    float total = sum8(total8);
    for (; j < n; j++) {
        scores[j] = expf(scores[j] - max_score);
        total += scores[j];
    }
    for (int i = 0; i < n8; i++) acc[i] = (vec8){0};
    for (int64_t pos = c->start; pos < c->len;) {
        const float *v = row(c, c->v_cache, pos);
        const int64_t end = block_end(c, pos);
        for (; pos < end; pos++, v += c->row_stride) {
            const float w = scores[pos - c->start];
            for (int i = 0; i < n8; i++) acc[i] += w * LOAD(v + 8 * i);
        }
    }
    const float inv = 1.0f / total;
    for (int i = 0; i < n8; i++) *(vec8u *)(out + 8 * i) = acc[i] * inv;
}

static void attend_64(const Context *c, const float *q, float scale, float *s, float *o) {
    attend_head(c, q, 64, scale, s, o);
}
static void attend_128(const Context *c, const float *q, float scale, float *s, float *o) {
    attend_head(c, q, 128, scale, s, o);
}
static void attend_any(const Context *c, const float *q, int D, float scale, float *s, float *o) {
    attend_head(c, q, D, scale, s, o);
}

/* The team's share of (sequence, KV head) items, each a task: its query heads run back to back
 * while the K/V rows they share are still in cache. */
void paged_attention_team(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *context_lens, float *out,
                          int64_t out_stride, int num_seqs, int num_kv_heads, int group, int head_dim,
                          int block_size, int max_blocks, float scale, int64_t window, int *failed) {
    float *scores = NULL;
    int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int64_t seq = item / num_kv_heads;
        const int kv_head = (int)(item % num_kv_heads);
        const int64_t len = context_lens[seq];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        if (len - start > capacity) {
            free(scores);
            capacity = len - start;
            scores = (float *)malloc(sizeof(float) * capacity);
        }
        if (scores == NULL || len <= 0 || len > (int64_t)max_blocks * block_size) {
#pragma omp atomic write
            *failed = 1;
            capacity = 0;
            continue;
        }
        const Context c = {
            k_cache + (int64_t)kv_head * head_dim, v_cache + (int64_t)kv_head * head_dim,
            block_tables + seq * max_blocks, (int64_t)num_kv_heads * head_dim,
            (int64_t)block_size * num_kv_heads * head_dim, start, len, block_size,
        };
        for (int g = 0; g < group; g++) {
            const int64_t head = (int64_t)(kv_head * group + g) * head_dim;
            const float *qh = q + seq * q_stride + head;
            float *oh = out + seq * out_stride + head;
            if (head_dim == 64) attend_64(&c, qh, scale, scores, oh);
            else if (head_dim == 128) attend_128(&c, qh, scale, scores, oh);
            else attend_any(&c, qh, head_dim, scale, scores, oh);
        }
    }
    free(scores);
}

/* Returns 0 on success; -1 for an empty context, one longer than its block table, a head_dim
 * that is not a multiple of 8 up to 256, or a failed scratch allocation. */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int num_seqs, int num_kv_heads, int group, int head_dim,
                           int block_size, int max_blocks, float scale, int64_t window,
                           int num_threads) {
    if (head_dim % 8 != 0 || head_dim > 256) return -1;
    const int64_t stride = (int64_t)num_kv_heads * group * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    paged_attention_team(q, stride, k_cache, v_cache, block_tables, context_lens, out, stride, num_seqs,
                         num_kv_heads, group, head_dim, block_size, max_blocks, scale, window, &failed);
    return failed ? -1 : 0;
}
