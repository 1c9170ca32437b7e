/* Bidirectional attention over packed sequences (the encoder's, models/encoder.py): every token of
 * a sequence attends to every token of its own sequence, read in place from the fused q/k/v rows.
 *
 * Why this exists: SDPA wants [batch, heads, longest, head_dim], so the packed rows were scattered
 * into a zero-padded copy, transposed, attended with a padding mask and gathered back; for the
 * short inputs of an embedding job that layout cost as much as the attention itself. Here nothing
 * is copied but a tile's own queries, and no padded key is visited.
 *
 * A task is (sequence, head, tile of up to ROWS queries). The tile's queries are held transposed
 * ([D][ROWS], one query a vector lane, pre-scaled), so each key's scores for the whole tile are
 * vectors: all of the sequence's scores first ([L][ROWS], in L1/L2 up to the 512 positions of a
 * BERT), then their softmax, then O = P·V into [D][ROWS], normalised and written back per query.
 *
 * Layouts: qkv rows of 3·heads·head_dim floats (q, then k, then v, heads side by side), out rows
 * of heads·head_dim; starts[i] .. starts[i + 1] are sequence i's rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "team.h"
#include "vec8.h"

#ifndef ENCODER_ROWS
#define ENCODER_ROWS 16 /* queries a tile: fewer wasted lanes on short inputs, more reuse of K on long */
#endif
enum { ROWS = ENCODER_ROWS, VECS = ROWS / 8, KEY_STEP = 4 };

/* s[j] = q·k_j for keys [0, L) of one head, KEY_STEP keys at a time to reuse each query load. */
static void tile_scores(const float *qt, const float *k, int64_t stride, int L, int D, vec8 *s) {
    for (int j0 = 0; j0 < L; j0 += KEY_STEP) {
        const int keys = L - j0 < KEY_STEP ? L - j0 : KEY_STEP;
        vec8 acc[KEY_STEP][VECS] = {{{0}}};
        for (int d = 0; d < D; d++) {
            const vec8 *qd = (const vec8 *)(qt + (int64_t)d * ROWS);
            for (int j = 0; j < keys; j++) {
                const float kd = k[(j0 + j) * stride + d];
                for (int v = 0; v < VECS; v++) acc[j][v] += qd[v] * kd;
            }
        }
        for (int j = 0; j < keys; j++)
            for (int v = 0; v < VECS; v++) s[(int64_t)(j0 + j) * VECS + v] = acc[j][v];
    }
}

/* The scores turned into softmax weights in place; the rows' sums of weights, inverted, in inv. */
static void tile_softmax(vec8 *s, int L, vec8 *inv) {
    for (int v = 0; v < VECS; v++) {
        vec8 m = s[v];
        for (int j = 1; j < L; j++) m = select8(s[j * VECS + v] > m, s[j * VECS + v], m);
        vec8 total = (vec8){0};
        for (int j = 0; j < L; j++) {
            s[j * VECS + v] = exp8(s[j * VECS + v] - m);
            total += s[j * VECS + v];
        }
        inv[v] = 1.0f / total;
    }
}

/* ot[d] = Σ_j p_j · v_j[d], KEY_STEP keys at a time. */
static void tile_values(const vec8 *p, const float *vrows, int64_t stride, int L, int D, float *ot) {
    for (int64_t i = 0; i < (int64_t)D * VECS; i++) ((vec8 *)ot)[i] = (vec8){0};
    for (int j0 = 0; j0 < L; j0 += KEY_STEP) {
        const int keys = L - j0 < KEY_STEP ? L - j0 : KEY_STEP;
        for (int d = 0; d < D; d++) {
            vec8 *od = (vec8 *)(ot + (int64_t)d * ROWS);
            for (int v = 0; v < VECS; v++) {
                vec8 acc = od[v];
                for (int j = 0; j < keys; j++) acc += p[(int64_t)(j0 + j) * VECS + v] * vrows[(j0 + j) * stride + d];
                od[v] = acc;
            }
        }
    }
}

static inline int64_t tiles_of(int64_t length) { return (length + ROWS - 1) / ROWS; }

/* The sequence whose tasks hold `task`: first_task is ascending, first_task[0] = 0. */
static int sequence_of(const int64_t *first_task, int num_seqs, int64_t task) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_task[mid] <= task) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Returns 0, or -1 for a head_dim that is not a multiple of 8, an empty sequence, or a failed
 * scratch allocation. */
int encoder_attention(const float *qkv, float *out, const int64_t *starts, int num_seqs, int heads, int head_dim,
                      float scale, int num_threads) {
    if (head_dim % 8 != 0 || num_seqs < 1) return -1;
    int64_t *first_task = (int64_t *)malloc(sizeof(int64_t) * ((size_t)num_seqs + 1)), longest = 0;
    if (first_task == NULL) return -1;
    first_task[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int64_t length = starts[i + 1] - starts[i];
        if (length < 1) {
            free(first_task);
            return -1;
        }
        first_task[i + 1] = first_task[i] + heads * tiles_of(length);
        longest = length > longest ? length : longest;
    }
    const int64_t tasks = first_task[num_seqs], width = (int64_t)heads * head_dim, stride = 3 * width;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* qt and ot [D][ROWS], then the scores [longest][ROWS] */
        float *qt = (float *)thread_scratch(sizeof(float) * ((size_t)2 * head_dim + (size_t)longest) * ROWS);
        if (qt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (qt == NULL) continue;
            const int i = sequence_of(first_task, num_seqs, task);
            const int64_t t = task - first_task[i];
            const int L = (int)(starts[i + 1] - starts[i]);
            const int head = (int)(t / tiles_of(L)), q0 = (int)(t % tiles_of(L)) * ROWS;
            const int queries = L - q0 < ROWS ? L - q0 : ROWS;
            const float *rows = qkv + starts[i] * stride + (int64_t)head * head_dim;
            float *ot = qt + (size_t)head_dim * ROWS;
            vec8 *s = (vec8 *)(ot + (size_t)head_dim * ROWS), inv[VECS];
            for (int r = 0; r < ROWS; r++)
                for (int d = 0; d < head_dim; d++)
                    qt[(int64_t)d * ROWS + r] = r < queries ? rows[(q0 + r) * stride + d] * scale : 0.f;
            tile_scores(qt, rows + width, stride, L, head_dim, s);
            tile_softmax(s, L, inv);
            tile_values(s, rows + 2 * width, stride, L, head_dim, ot);
            for (int r = 0; r < queries; r++) {
                float *dst = out + (starts[i] + q0 + r) * width + (int64_t)head * head_dim;
                const float norm = inv[r / 8][r % 8];
                for (int d = 0; d < head_dim; d++) dst[d] = ot[(int64_t)d * ROWS + r] * norm;
            }
        }
    }
    free(first_task);
    return failed ? -1 : 0;
}
