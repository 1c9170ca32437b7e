/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * Why this exists: with only PyTorch ops, decode attention has to gather every sequence's
 * blocks into a dense tensor (read + write the whole context) before SDPA reads it again. On a
 * memory-bound CPU that triple traffic cost more than all linear layers at batch 64. Here each
 * K and V row is read from memory once per (sequence, KV head) and loaded and widened once for up
 * to four of the query heads that share it (GQA), attended in the same pass. (One head at a time,
 * re-reading the row from cache, left a batch-64 SmolLM2 step's attention compute-bound: 29 ms
 * for its 413 MB of K/V, 20 ms now.)
 *
 * Few sequences (batch 1-2) leave threads idle: Gemma 3 270M has one KV head, so one thread
 * attended a whole 2,048-token context alone. Then each context is split into parts attended as
 * tasks of their own and merged by their scores' maxima and totals (split_context, combine_parts),
 * and where that still leaves threads idle (a context too short to split), the KV head's query
 * heads are split between tasks, each reading the shared K/V rows.
 *
 * Layouts (all contiguous; q and out fp32, the caches fp32 or, with kv_half, fp16):
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

#include <omp.h>

#include "team.h"
#include "vec8.h"

typedef struct {
    const char *k_cache, *v_cache;  /* this KV head's first element in the caches */
    const int64_t *table;
    int64_t row_bytes, block_bytes, start, len;  /* strides in bytes: the elements are 2 or 4 */
    int block_size;
} Context;

static inline const char *row(const Context *c, const char *cache, int64_t pos) {
    return cache + c->table[pos / c->block_size] * c->block_bytes + (pos % c->block_size) * c->row_bytes;
}

/* First position past pos's block, capped at the context's end. */
static inline int64_t block_end(const Context *c, int64_t pos) {
    const int64_t end = (pos / c->block_size + 1) * c->block_size;
    return end < c->len ? end : c->len;
}

/* Query heads attended together: they share each K and V row they read (loaded and widened once). */
enum { MAX_JOINT_HEADS = 4 };

/* One head's slice of the rows of the block from `pos` on (a block's first position, or len),
 * requested ahead: a context's next block is anywhere in the cache, where the hardware
 * prefetcher finds it only after the first misses. */
static inline void prefetch_block(const Context *c, const char *cache, int64_t pos, int64_t head_bytes) {
    if (pos >= c->len) return;
    const char *r = row(c, cache, pos);
    for (const int64_t end = block_end(c, pos); pos < end; pos++, r += c->row_bytes)
        for (int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(r + b, 0, 2);
}

/* A query head's attention over part of its context, before the division by the weights' total:
 * parts of one context are combined by their top scores and totals (combine_parts). */
typedef struct {
    float max, total;
} Partial;

/* The scores of `keys` positions from row k on, for gc query heads (qv [gc][n8]): written to
 * scores[g * stride + j] (position j, head g). */
static inline __attribute__((always_inline)) void score_keys(const Context *c, const char *k, const vec8 *qv, int n8,
                                                             int gc, int keys, float scale, int half, float *scores,
                                                             int64_t stride) {
    vec8 part[8] = {{0}};
    for (int i = 0; i < n8; i++)
        for (int j = 0; j < keys; j++) {
            const vec8 kv = load_kv(k + j * c->row_bytes, 8 * i, half);
            for (int g = 0; g < gc; g++) part[j * gc + g] += qv[g * n8 + i] * kv;
        }
    const vec8 s8 = sum8x8(part) * scale;
    for (int j = 0; j < keys; j++)
        for (int g = 0; g < gc; g++) scores[g * stride + j] = s8[j * gc + g];
}

/* acc[g][first .. first + width) += Σ weights[g * stride + p] · V row p, over `rows` rows from v. */
static inline __attribute__((always_inline)) void weigh_rows(const Context *c, const char *v, int64_t rows,
                                                             const float *weights, int64_t stride, int gc, int n8,
                                                             int first, int width, int half, vec8 *acc) {
    vec8 a[16];
    for (int g = 0; g < gc; g++)
        for (int i = 0; i < width; i++) a[g * width + i] = acc[g * n8 + first + i];
    for (int64_t p = 0; p < rows; p++, v += c->row_bytes)
        for (int i = 0; i < width; i++) {
            const vec8 vv = load_kv(v, 8 * (first + i), half);
            for (int g = 0; g < gc; g++) a[g * width + i] += weights[g * stride + p] * vv;
        }
    for (int g = 0; g < gc; g++)
        for (int i = 0; i < width; i++) acc[g * n8 + first + i] = a[g * width + i];
}

/* `gc` query heads of one KV head (queries `q`, D floats apart) over positions [c->start, c->len):
 * scores, softmax, weighted sum of V into out (heads `out_stride` floats apart), divided by the
 * weights' total when `normalise`; each head's Partial into `result`. D is a multiple of 8, at
 * most 256. `scores` holds gc * (len - start) floats. D, gc and `half` (fp16 caches) are
 * compile-time constants of each specialisation below: the inner loops unroll, their
 * accumulators (part, a) stay in registers, the queries and outputs (qv, acc) in L1. */
static inline __attribute__((always_inline)) void attend_heads(const Context *c, const float *q, int D, int gc,
                                                               float scale, float *scores, float *out,
                                                               int64_t out_stride, int normalise, int half,
                                                               Partial *result) {
    const int n8 = D / 8;
    const int64_t n = c->len - c->start;
    if (n <= 0) {  /* an empty part of a split context */
        for (int g = 0; g < gc; g++) {
            for (int i = 0; i < n8; i++) *(vec8u *)(out + g * out_stride + 8 * i) = (vec8){0};
            result[g] = (Partial){-INFINITY, 0.f};
        }
        return;
    }
    vec8 qv[MAX_JOINT_HEADS * 32], acc[MAX_JOINT_HEADS * 32];  /* [gc][n8]: in L1 */
    for (int g = 0; g < gc; g++)
        for (int i = 0; i < n8; i++) qv[g * n8 + i] = LOAD(q + g * D + 8 * i);
    /* Scores, `keys` positions at a time: keys * gc dot products (at most 8) in flight, reduced
     * by one sum8x8. Walk block by block: no division per position. */
    const int keys = 8 / gc;
    for (int64_t pos = c->start; pos < c->len;) {
        const char *k = row(c, c->k_cache, pos);
        const int64_t end = block_end(c, pos);
        prefetch_block(c, c->k_cache, end, D * (half ? 2 : 4));
        for (; pos + keys <= end; pos += keys, k += keys * c->row_bytes)
            score_keys(c, k, qv, n8, gc, keys, scale, half, scores + pos - c->start, n);
        for (; pos < end; pos++, k += c->row_bytes) score_keys(c, k, qv, n8, gc, 1, scale, half, scores + pos - c->start, n);
    }
    for (int g = 0; g < gc; g++) {  /* softmax numerators, and their maximum and total */
        float *s = scores + g * n;
        vec8 max8 = (vec8){0} - INFINITY;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) max8 = select8(LOAD(s + j) > max8, LOAD(s + j), max8);
        float top = -INFINITY;
        for (int i = 0; i < 8; i++) top = max8[i] > top ? max8[i] : top;
        for (; j < n; j++) top = s[j] > top ? s[j] : top;
        vec8 total8 = {0};
        for (j = 0; j + 8 <= n; j += 8) {
            const vec8 e = exp8(LOAD(s + j) - top);
            *(vec8u *)(s + j) = e;
            total8 += e;
        }
        float total = sum8(total8);
        for (; j < n; j++) {
            s[j] = expf(s[j] - top);
            total += s[j];
        }
        result[g] = (Partial){top, total};
    }
    /* Weighted V: a block's rows at a time, `cols` vectors of each head's output in registers. */
    const int cols = gc == 1 ? 16 : gc == 2 ? 8 : 4;
    for (int i = 0; i < gc * n8; i++) acc[i] = (vec8){0};
    for (int64_t pos = c->start; pos < c->len;) {
        const char *v = row(c, c->v_cache, pos);
        const int64_t end = block_end(c, pos);
        prefetch_block(c, c->v_cache, end, D * (half ? 2 : 4));
        int first = 0;
        for (; first + cols <= n8; first += cols) weigh_rows(c, v, end - pos, scores + pos - c->start, n, gc, n8, first, cols, half, acc);
        for (; first < n8; first++) weigh_rows(c, v, end - pos, scores + pos - c->start, n, gc, n8, first, 1, half, acc);
        pos = end;
    }
    for (int g = 0; g < gc; g++) {
        const float inv = normalise ? 1.0f / result[g].total : 1.0f;
        for (int i = 0; i < n8; i++) *(vec8u *)(out + g * out_stride + 8 * i) = acc[g * n8 + i] * inv;
    }
}

typedef void (*AttendFn)(const Context *c, const float *q, int D, float scale, float *scores, float *out,
                         int64_t out_stride, int normalise, Partial *result);

/* attend_heads specialised by head_dim (64, 128, 256, any: DIM is then D), cache element and
 * number of joint heads. */
#define ATTEND(NAME, DIM, HALF, GC)                                                                       \
    static void NAME(const Context *c, const float *q, int D, float scale, float *s, float *o,            \
                     int64_t out_stride, int normalise, Partial *r) {                                     \
        (void)D;                                                                                          \
        attend_heads(c, q, DIM, GC, scale, s, o, out_stride, normalise, HALF, r);                         \
    }
#define ATTEND_HEADS(NAME, DIM, HALF) \
    ATTEND(NAME##_1, DIM, HALF, 1) ATTEND(NAME##_2, DIM, HALF, 2) ATTEND(NAME##_3, DIM, HALF, 3) ATTEND(NAME##_4, DIM, HALF, 4)
ATTEND_HEADS(attend_64, 64, 0)
ATTEND_HEADS(attend_128, 128, 0)
ATTEND_HEADS(attend_256, 256, 0)
ATTEND_HEADS(attend_any, D, 0)
ATTEND_HEADS(attend_64_half, 64, 1)
ATTEND_HEADS(attend_128_half, 128, 1)
ATTEND_HEADS(attend_256_half, 256, 1)
ATTEND_HEADS(attend_any_half, D, 1)
#define HEADS(NAME) {NAME##_1, NAME##_2, NAME##_3, NAME##_4}
static const AttendFn ATTEND_FNS[2][4][MAX_JOINT_HEADS] = {
    {HEADS(attend_64), HEADS(attend_128), HEADS(attend_256), HEADS(attend_any)},
    {HEADS(attend_64_half), HEADS(attend_128_half), HEADS(attend_256_half), HEADS(attend_any_half)},
};

static AttendFn attend_fn(int D, int gc, int half) {
    const int dim = D == 64 ? 0 : D == 128 ? 1 : D == 256 ? 2 : 3;
    return ATTEND_FNS[half][dim][gc - 1];
}

/* Positions [start, len) of a sequence's context: the last `window` when there is one. */
static inline int64_t context_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* A context split in parts of at least this many keys: shorter ones cost more in combining and
 * scheduling than they gain in balance. */
enum { MIN_PART_KEYS = 256, TASKS_PER_THREAD = 4 };

/* Parts each (sequence, KV head) item's context is split into, and their length in keys (a whole
 * number of blocks): 1 when the items alone keep every thread busy (a batch), more when they are
 * too few (batch 1: Gemma 3 has one KV head, SmolLM2 three, for two or more threads). */
static int split_context(const int64_t *context_lens, int num_seqs, int num_kv_heads, int block_size,
                         int64_t window, int64_t *part_keys) {
    const int64_t items = (int64_t)num_seqs * num_kv_heads, wanted = (int64_t)TASKS_PER_THREAD * omp_get_num_threads();
    int64_t longest = 0;
    for (int s = 0; s < num_seqs && items < wanted; s++) {
        const int64_t n = context_lens[s] - context_start(context_lens[s], window);
        longest = n > longest ? n : longest;
    }
    int64_t parts = items < wanted ? (wanted + items - 1) / items : 1;
    const int64_t most = longest / MIN_PART_KEYS;
    parts = parts < most ? parts : (most > 1 ? most : 1);
    const int64_t keys = (longest + parts - 1) / parts;
    *part_keys = (keys + block_size - 1) / block_size * block_size;
    return parts > 1 ? (int)((longest + *part_keys - 1) / *part_keys) : 1;
}

/* The parts of one query head's context, each written by attend(normalise = 0) as D floats of
 * weighted V followed by its Partial, merged into out. */
static void combine_parts(const float *parts_out, int parts, int D, float *out) {
    const int64_t stride = D + 2;
    float top = -INFINITY, total = 0.f;
    for (int p = 0; p < parts; p++) top = parts_out[p * stride + D] > top ? parts_out[p * stride + D] : top;
    for (int i = 0; i < D; i++) out[i] = 0.f;
    for (int p = 0; p < parts; p++) {
        const float *part = parts_out + p * stride;
        if (part[D + 1] == 0.f) continue;  /* empty: beyond this sequence's context */
        const float w = expf(part[D] - top);
        total += w * part[D + 1];
        for (int i = 0; i < D; i++) out[i] += w * part[i];
    }
    const float inv = 1.0f / total;
    for (int i = 0; i < D; i++) out[i] *= inv;
}

/* The team's share of (sequence, KV head, part of its context) tasks: each task's query heads run
 * back to back while the K/V rows they share are still in cache. Split contexts go through a
 * buffer shared by the team, merged once every part is done. */
void paged_attention_team(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                          const int64_t *block_tables, const int64_t *context_lens, float *out,
                          int64_t out_stride, int num_seqs, int num_kv_heads, int group, int head_dim,
                          int block_size, int max_blocks, float scale, int64_t window, int kv_half, int *failed) {
    int64_t part_keys = 0;
    const int parts = split_context(context_lens, num_seqs, num_kv_heads, block_size, window, &part_keys);
    const int64_t items = (int64_t)num_seqs * num_kv_heads, part_stride = head_dim + 2;
    float *part_results = NULL;
    if (parts > 1) {
#pragma omp single copyprivate(part_results)
        part_results = (float *)malloc(sizeof(float) * items * parts * group * part_stride);
        if (part_results == NULL) {
#pragma omp atomic write
            *failed = 1;
            return;  /* every thread sees the same NULL: none waits at a barrier the others skip */
        }
    }
    /* Query heads a task attends: all the KV head's, unless the tasks are fewer than the threads. */
    const int64_t threads = omp_get_num_threads(), kv_tasks = items * parts;
    const int head_chunks = kv_tasks >= threads ? 1 : (int)(group < threads / kv_tasks ? group : threads / kv_tasks);
    const int chunk_heads = (group + head_chunks - 1) / head_chunks;
    float *scores = NULL;
    int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < kv_tasks * head_chunks; task++) {
        const int64_t item = task / head_chunks / parts, seq = item / num_kv_heads;
        const int kv_head = (int)(item % num_kv_heads), part = (int)(task / head_chunks % parts);
        const int first_head = (int)(task % head_chunks) * chunk_heads;
        const int last_head = first_head + chunk_heads < group ? first_head + chunk_heads : group;
        const int64_t len = context_lens[seq], start = context_start(len, window);
        const int64_t first = parts > 1 ? start + part * part_keys : start;
        const int64_t last = parts > 1 && first + part_keys < len ? first + part_keys : len;
        if (MAX_JOINT_HEADS * (last - first) > capacity) {
            free(scores);
            capacity = MAX_JOINT_HEADS * (last - first);
            scores = (float *)malloc(sizeof(float) * capacity);
        }
        if ((scores == NULL && last > first) || len <= 0 || len > (int64_t)max_blocks * block_size) {
#pragma omp atomic write
            *failed = 1;
            capacity = 0;
            continue;
        }
        const int64_t element = kv_half ? 2 : 4, row_bytes = element * num_kv_heads * head_dim;
        const Context c = {
            (const char *)k_cache + element * kv_head * head_dim, (const char *)v_cache + element * kv_head * head_dim,
            block_tables + seq * max_blocks, row_bytes, block_size * row_bytes, first, last, block_size,
        };
        for (int g = first_head; g < last_head; g += MAX_JOINT_HEADS) {
            const int gc = last_head - g < MAX_JOINT_HEADS ? last_head - g : MAX_JOINT_HEADS;
            const int64_t head = (int64_t)(kv_head * group + g) * head_dim;
            const float *qh = q + seq * q_stride + head;
            Partial r[MAX_JOINT_HEADS];
            if (parts == 1) {
                attend_fn(head_dim, gc, kv_half)(&c, qh, head_dim, scale, scores, out + seq * out_stride + head,
                                                 head_dim, 1, r);
                continue;
            }
            float *slot = part_results + ((item * group + g) * parts + part) * part_stride;
            attend_fn(head_dim, gc, kv_half)(&c, qh, head_dim, scale, scores, slot, parts * part_stride, 0, r);
            for (int i = 0; i < gc; i++) {
                slot[i * parts * part_stride + head_dim] = r[i].max;
                slot[i * parts * part_stride + head_dim + 1] = r[i].total;
            }
        }
    }
    free(scores);
    if (parts == 1) return;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < items * group; h++) {
        const int64_t seq = h / (num_kv_heads * group), head = h % (num_kv_heads * group);
        combine_parts(part_results + h * parts * part_stride, parts, head_dim, out + seq * out_stride + head * head_dim);
    }
#pragma omp single nowait
    free(part_results);
}

/* Returns 0 on success; -1 for an empty context, one longer than its block table, a head_dim
 * that is not a multiple of 8 up to 256, or a failed scratch allocation. kv_half: the caches hold
 * fp16. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int num_seqs, int num_kv_heads, int group, int head_dim,
                           int block_size, int max_blocks, float scale, int64_t window,
                           int kv_half, int num_threads) {
    if (head_dim % 8 != 0 || head_dim > 256) return -1;
    const int64_t stride = (int64_t)num_kv_heads * group * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    paged_attention_team(q, stride, k_cache, v_cache, block_tables, context_lens, out, stride, num_seqs,
                         num_kv_heads, group, head_dim, block_size, max_blocks, scale, window, kv_half, &failed);
    return failed ? -1 : 0;
}
