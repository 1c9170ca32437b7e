/* Prefill attention straight from the paged KV cache: each request's new tokens attend causally
 * (and within a sliding window, where the layer has one) to its context, flash-attention style.
 *
 * Why this exists: gathering a request's blocks into a dense tensor and calling SDPA with a
 * boolean mask computes every (query, key) pair the mask then throws away (in query chunks, a
 * sliding layer's band still came out ~1.3x its area) and copies the context and the mask once
 * more. Here a tile of queries visits only the key blocks its causal/window bounds reach.
 *
 * A task is (request, KV head, tile of queries): the tile's rows are every query head of the KV
 * head's group for up to QUERY_TILE queries, ROWS (32) in all, held transposed (one row a vector
 * lane) so a key's scores, the running maxima and the softmax weights of all rows are vectors. Per
 * KEY_STEP keys: S = Q·Kᵀ with K rows read where they lie in the cache (broadcast), the online
 * softmax update, then O += P·V, O also transposed ([D][ROWS], in L1/L2). Rows past the tile's
 * last query are padding: masked everywhere, never written.
 *
 * Layouts: q and out rows of the flat token batch, q_stride and out_stride floats apart, heads of
 * head_dim floats side by side; caches [blocks, block_size, kv_heads, head_dim], fp32 or (kv_half)
 * fp16, whose rows are converted KEY_STEP at a time for the whole tile; per request: its first
 * row in the batch, its number of new tokens (the last of its context) and its context length,
 * and its block table (max_blocks int64 each).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "team.h"
#include "vec8.h"

enum { ROWS = 32, VECS = ROWS / 8, KEY_STEP = 4 };

typedef struct {
    const char *k, *v;       /* this KV head's column of the caches */
    const int64_t *table;
    int64_t row_bytes;       /* between positions within a block */
    int64_t block_bytes;
    int block_size, half;    /* half: fp16 elements, else fp32 */
} Cache;

/* Walks a context's positions in order, a block at a time: no division per position (64-bit
 * division costs ~40 cycles, as much as a 64-wide dot product). */
typedef struct {
    int64_t block;
    int offset;
} Cursor;

/* The K and V rows of the next `keys` positions as floats (the first one's again for the rest of
 * KEY_STEP): where they lie in an fp32 cache; from an fp16 one, converted into buf (2·KEY_STEP·D). */
static inline void next_rows(const Cache *c, Cursor *at, int keys, int D, float *buf, const float *k[KEY_STEP],
                             const float *v[KEY_STEP]) {
    for (int j = 0; j < KEY_STEP; j++) {
        if (j >= keys) {
            k[j] = k[0], v[j] = v[0];
            continue;
        }
        const int64_t row = c->table[at->block] * c->block_bytes + at->offset * c->row_bytes;
        if (c->half) {
            const uint16_t *kh = (const uint16_t *)(c->k + row), *vh = (const uint16_t *)(c->v + row);
            float *kf = buf + 2 * j * D, *vf = kf + D;
            for (int d = 0; d < D; d += 8) {
                *(vec8u *)(kf + d) = load_half8(kh + d);
                *(vec8u *)(vf + d) = load_half8(vh + d);
            }
            k[j] = kf, v[j] = vf;
        } else {
            k[j] = (const float *)(c->k + row), v[j] = (const float *)(c->v + row);
        }
        if (++at->offset == c->block_size) at->block++, at->offset = 0;
    }
}

/* The tile's ROWS query positions as vectors: row r is query r / group (-1 for padding rows). */
static void row_positions(vec8 *pos, int64_t first_pos, int queries, int group) {
    for (int r = 0; r < ROWS; r++) {
        const int qi = r / group;
        pos[r / 8][r % 8] = qi < queries ? (float)(first_pos + qi) : -1.0f;
    }
}

/* Scores of the KEY_STEP keys k at positions key.. for the tile's rows, masked to -inf outside
 * each row's (pos - window, pos]. qt is [D][ROWS]. */
static inline void scores(const float *const k[KEY_STEP], const float *qt, int D, int64_t key, int keys,
                          const vec8 *pos, int64_t window, vec8 s[KEY_STEP][VECS]) {
    for (int j = 0; j < KEY_STEP; j++)
        for (int v = 0; v < VECS; v++) s[j][v] = (vec8){0};
    for (int d = 0; d < D; d++) {
        const vec8 *qd = (const vec8 *)(qt + (int64_t)d * ROWS);
        for (int j = 0; j < KEY_STEP; j++) {
            const float kd = k[j][d];
            for (int v = 0; v < VECS; v++) s[j][v] += qd[v] * kd;
        }
    }
    for (int j = 0; j < KEY_STEP; j++) {
        const float kp = (float)(key + j);
        for (int v = 0; v < VECS; v++) {
            vec8i out = (vec8i)(pos[v] < kp);
            if (window > 0) out |= (vec8i)(pos[v] - (float)window >= kp);
            if (j >= keys) out = (vec8i){0} - 1;
            s[j][v] = select8(out, (vec8){0} - INFINITY, s[j][v]);
        }
    }
}

/* One tile: rows of qt [D][ROWS] against keys [lo, hi), into ot [D][ROWS] (normalised); rows_buf
 * holds 2·KEY_STEP·D floats. */
static void attend_tile(const Cache *c, const float *qt, float *ot, float *rows_buf, int D, int64_t lo, int64_t hi,
                        const vec8 *pos, int64_t window) {
    vec8 top[VECS], total[VECS];
    for (int v = 0; v < VECS; v++) top[v] = (vec8){0} - INFINITY, total[v] = (vec8){0};
    for (int64_t i = 0; i < (int64_t)D * VECS; i++) ((vec8 *)ot)[i] = (vec8){0};
    Cursor at = {lo / c->block_size, (int)(lo % c->block_size)};
    for (int64_t key = lo; key < hi; key += KEY_STEP) {
        const int keys = hi - key < KEY_STEP ? (int)(hi - key) : KEY_STEP;
        const float *kr[KEY_STEP], *vr[KEY_STEP];
        next_rows(c, &at, keys, D, rows_buf, kr, vr);
        vec8 s[KEY_STEP][VECS], scale[VECS];
        scores(kr, qt, D, key, keys, pos, window, s);
        for (int v = 0; v < VECS; v++) {
            vec8 m = top[v];
            for (int j = 0; j < KEY_STEP; j++) m = select8(s[j][v] > m, s[j][v], m);
            const vec8i seen = (vec8i)(m > (vec8){0} - INFINITY);  /* a row with no key yet keeps -inf */
            scale[v] = select8(seen, exp8(select8(seen, top[v] - m, (vec8){0})), (vec8){0} + 1.0f);
            vec8 sum = (vec8){0};
            for (int j = 0; j < KEY_STEP; j++) {
                const vec8i in = (vec8i)(s[j][v] > (vec8){0} - INFINITY);
                s[j][v] = select8(in, exp8(select8(in, s[j][v] - m, (vec8){0})), (vec8){0});
                sum += s[j][v];
            }
            total[v] = total[v] * scale[v] + sum;
            top[v] = m;
        }
        for (int d = 0; d < D; d++) {
            vec8 *od = (vec8 *)(ot + (int64_t)d * ROWS);
            for (int v = 0; v < VECS; v++) {
                vec8 acc = od[v] * scale[v];
                for (int j = 0; j < KEY_STEP; j++) acc += s[j][v] * vr[j][d];
                od[v] = acc;
            }
        }
    }
    for (int v = 0; v < VECS; v++) total[v] = select8((vec8i)(total[v] > 0), 1.0f / total[v], (vec8){0});
    for (int d = 0; d < D; d++)
        for (int v = 0; v < VECS; v++) ((vec8 *)(ot + (int64_t)d * ROWS))[v] *= total[v];
}

/* A request's tasks: a tile of queries for each KV head. */
static inline int64_t request_tasks(int64_t num_new, int queries_per_tile, int num_kv_heads) {
    return num_kv_heads * ((num_new + queries_per_tile - 1) / queries_per_tile);
}

/* Returns 0, or -1 for a group too large for a tile, a request whose context is shorter than its
 * new tokens or longer than its block table, or a failed scratch allocation. */
int paged_prefill_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                            const void *k_cache, const void *v_cache, const int64_t *first_rows,
                            const int64_t *num_new,
                            const int64_t *context_lens, const int64_t *block_tables, int num_requests,
                            int max_blocks, int num_kv_heads, int group, int head_dim, int block_size,
                            float scale, int64_t window, int kv_half, int num_threads) {
    if (group > ROWS || head_dim % 8 != 0) return -1;
    for (int i = 0; i < num_requests; i++)
        if (num_new[i] < 1 || context_lens[i] < num_new[i] || context_lens[i] > (int64_t)max_blocks * block_size)
            return -1;
    const int queries_per_tile = ROWS / group;
    int64_t tasks = 0;
    for (int i = 0; i < num_requests; i++) tasks += request_tasks(num_new[i], queries_per_tile, num_kv_heads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* qt and ot [D][ROWS], then the converted rows of an fp16 cache */
        float *qt = (float *)thread_scratch(sizeof(float) * 2 * (size_t)head_dim * (ROWS + KEY_STEP));
        if (qt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (qt == NULL) continue;
            /* Find the task's request (few requests a step: a walk is cheaper than a table). */
            int i = 0;
            int64_t t = task, tiles = 0;
            for (;; i++) {
                tiles = request_tasks(num_new[i], queries_per_tile, num_kv_heads);
                if (t < tiles) break;
                t -= tiles;
            }
            const int64_t per_head = tiles / num_kv_heads;
            const int kv_head = (int)(t / per_head);
            const int64_t q0 = (t % per_head) * queries_per_tile;  /* the tile's first new token */
            const int queries = num_new[i] - q0 < queries_per_tile ? (int)(num_new[i] - q0) : queries_per_tile;
            const int64_t first_pos = context_lens[i] - num_new[i] + q0, last_pos = first_pos + queries - 1;
            const int64_t element = kv_half ? 2 : 4, row_bytes = element * num_kv_heads * head_dim;
            const Cache c = {(const char *)k_cache + element * kv_head * head_dim,
                             (const char *)v_cache + element * kv_head * head_dim,
                             block_tables + (int64_t)i * max_blocks, row_bytes, block_size * row_bytes, block_size,
                             kv_half};
            float *ot = qt + (size_t)head_dim * ROWS, *rows_buf = ot + (size_t)head_dim * ROWS;
            for (int r = 0; r < ROWS; r++) {
                const int qi = r / group;
                const int64_t head = (int64_t)(kv_head * group + r % group) * head_dim;
                const float *src = q + (first_rows[i] + q0 + qi) * q_stride + head;
                for (int d = 0; d < head_dim; d++) qt[(int64_t)d * ROWS + r] = qi < queries ? src[d] * scale : 0.f;
            }
            vec8 pos[VECS];
            row_positions(pos, first_pos, queries, group);
            const int64_t lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
            attend_tile(&c, qt, ot, rows_buf, head_dim, lo, last_pos + 1, pos, window);
            for (int r = 0; r < queries * group; r++) {
                const int64_t head = (int64_t)(kv_head * group + r % group) * head_dim;
                float *dst = out + (first_rows[i] + q0 + r / group) * out_stride + head;
                for (int d = 0; d < head_dim; d++) dst[d] = ot[(int64_t)d * ROWS + r];
            }
        }
    }
    return failed ? -1 : 0;
}
